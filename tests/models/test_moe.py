"""Mixtures of experts: the experts' weighted outputs add up to the real block, the engine's MoE sites (router
logits, routing weights, every expert's units and output), their edits and gradients, and what is refused.

The references are transformers' own modules: each expert's output is read by calling the model's experts module
with that one expert chosen at weight 1 for every token, the routing from the model's router module."""

from __future__ import annotations

import pytest
import torch

from lenscope.errors import NotApplicableError, UnsupportedModelError
from lenscope.models.families import family_for
from lenscope.models.runtime.engine import Edit, capture, run
from lenscope.models.weights.moe import MoE
from tests.conftest import DECODERS, get_model
from tests.tolerances import assert_derivative, logit_diff_scale, moe_rounding, pass_rounding

MOE = [n for n in DECODERS if isinstance(get_model(f"tiny:{n}").anatomy.layers[0].mlp, MoE)]
IDS = torch.tensor([[5, 17, 3, 42, 9, 11, 7, 30, 2]])


def test_the_moe_families_are_covered():
    # every mixture-of-experts family lenscope reads (README's table: mixtral, qwen3_moe, olmoe, gpt_oss) runs
    # every test below: a family whose tiny model stopped being read as a mixture would drop out silently
    assert set(MOE) == {"mixtral", "qwen3-moe", "olmoe", "gpt-oss"}


def real_expert_outputs(lm, layer, x):
    """Each expert's unweighted output ``(token, expert, d_model)`` on ``x (token, d_model)``, computed by the real
    model's experts module (transformers' code) with that expert chosen at weight 1 for every token."""
    ex = family_for(lm.model).hooks(lm.model).layers[layer].experts
    E = lm.anatomy.layers[layer].mlp.n_experts
    outs = []
    for e in range(E):
        idx = torch.full((x.shape[0], 1), e, dtype=torch.long)
        outs.append(ex(x, idx, torch.ones(x.shape[0], 1, dtype=x.dtype)))
    return torch.stack(outs, 1)


@pytest.mark.parametrize("family", MOE)
def test_experts_sum_to_the_real_block(family):
    """``expert_out`` (the Anatomy's math) equals each chosen expert's real output times its real routing weight;
    the experts add up to the real block's output; unchosen experts write nothing."""
    lm = get_model(f"tiny:{family}")
    A = lm.anatomy
    for layer in range(A.n_layers):
        moe = A.layers[layer].mlp
        cap = capture(lm, IDS, [(n, layer) for n in ("ln_mlp.out", "expert_out", "mlp_out", "routing_weights",
                                                     "router_logits")])
        x, w = cap["ln_mlp.out", layer][0], cap["routing_weights", layer][0]
        out, real = cap["expert_out", layer][0], cap["mlp_out", layer][0]
        P, E = x.shape[0], moe.n_experts
        assert out.shape == (P, E, A.d_model) and w.shape == (P, E)
        # the router: top_k experts per token, weights from the model's router module
        _, scores, idx = family_for(lm.model).hooks(lm.model).layers[layer].router(x)
        want_w = torch.zeros(P, E).scatter(1, idx, scores)
        torch.testing.assert_close(w, want_w)
        assert ((w > 0).sum(1) == moe.top_k).all()
        torch.testing.assert_close(moe.routing(cap["router_logits", layer][0]), w, atol=1e-6, rtol=1e-6)
        # each expert: the real module's output times the weight; 0 where not chosen
        ref = real_expert_outputs(lm, layer, x) * w[..., None]
        scale = float(real.pow(2).mean().sqrt())
        torch.testing.assert_close(out, ref, atol=1e-6 * scale, rtol=1e-5)
        assert float(out[w == 0].abs().max()) == 0.0
        # the sum is the real block, within two evaluations' rounding of the experts (tests/tolerances.py: the
        # sizes summed through each expert's three matmuls, and the k experts' sum)
        err, bound = (out.sum(1) - real).abs(), moe_rounding(moe, x, w)
        assert bool((err <= bound).all()), f"{float((err / bound).max()):.3g} times the rounding bound"
        # and the Anatomy's own forms agree
        torch.testing.assert_close(moe.expert_outputs(x, w), out, atol=1e-6 * scale, rtol=1e-5)
        torch.testing.assert_close(moe(x, w), real, atol=1e-6 * scale, rtol=1e-5)
        torch.testing.assert_close(moe(x), real, atol=1e-6 * scale, rtol=1e-5)  # its own routing: the same choice


@pytest.mark.parametrize("family", MOE)
def test_moe_unit_sites(family):
    """mlp_pre / mlp_up / mlp_hidden hold every expert's units side by side, 0 where a token does not use the
    expert; the hidden units are the activation of the gate times the up branch, and through W_out they give the
    experts' outputs."""
    from tests.tolerances import assert_same_computation

    lm = get_model(f"tiny:{family}")
    moe = lm.anatomy.layers[1].mlp
    E, m = moe.n_experts, moe.d_mlp
    cap = capture(lm, IDS, [(n, 1) for n in ("ln_mlp.out", "mlp_pre", "mlp_up", "mlp_hidden", "expert_out",
                                             "routing_weights")])
    x, w = cap["ln_mlp.out", 1][0], cap["routing_weights", 1][0]
    pre, up, hid = (cap[n, 1][0].reshape(-1, E, m) for n in ("mlp_pre", "mlp_up", "mlp_hidden"))
    for e in range(E):
        ex = moe.expert(e)
        g, u = x @ ex.W_gate, x @ ex.W_in
        if ex.b_gate is not None:
            g, u = g + ex.b_gate, u + ex.b_in
        used = w[:, e] > 0
        torch.testing.assert_close(pre[used, e], g[used], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(up[used, e], u[used], atol=1e-5, rtol=1e-5)
        assert_same_computation(pre[~used, e], torch.zeros_like(pre[~used, e]), why="never written: the zeros "
                                "the site was made of")
        assert not hid[~used, e].any()
        y = hid[:, e] @ ex.W_out + (ex.b_out if ex.b_out is not None else 0)
        torch.testing.assert_close(cap["expert_out", 1][0][used, e], (y * w[:, e, None])[used], atol=1e-6,
                                   rtol=1e-5)
    torch.testing.assert_close(hid, moe.experts.act_fn(pre) * moe.experts.up_fn(up))


@pytest.mark.parametrize("family", MOE)
def test_expert_edits_reach_the_model(family):
    """Zeroing one expert's output at one position equals taking it off the block's output there (an edit of
    mlp_out, the real module's site); scaling a hidden unit by 1 changes nothing; zeroing all of an expert's
    hidden units leaves only its output bias."""
    lm = get_model(f"tiny:{family}")
    moe = lm.anatomy.layers[0].mlp
    base = capture(lm, IDS, [("expert_out", 0), ("mlp_out", 0), ("routing_weights", 0), ("logits", None)])
    w = base["routing_weights", 0][0]
    p = 4
    e = int(w[p].argmax())
    one, pos = torch.tensor([0]), torch.tensor([p])
    lg, cap = run(lm, IDS, [Edit("expert_out", 0, one, pos, torch.zeros(1, lm.anatomy.d_model),
                                 head=torch.tensor([e]))], capture=[("mlp_out", 0)])
    want_out = base["mlp_out", 0][0, p] - base["expert_out", 0][0, p, e]
    torch.testing.assert_close(cap["mlp_out", 0][0, p], want_out, atol=1e-6, rtol=1e-5)
    lg2, _ = run(lm, IDS, [Edit("mlp_out", 0, one, pos, want_out[None])])
    torch.testing.assert_close(lg, lg2, atol=1e-5, rtol=1e-5)
    assert float((lg - base["logits", None]).abs().max()) > 1e-4  # the edit really changed the output
    # scaling by 1: the same numbers as the model's own run
    E, m = moe.n_experts, moe.d_mlp
    lg3, _ = run(lm, IDS, [Edit("mlp_hidden", 0, one, pos, torch.ones(1, E * m), mode="scale")])
    torch.testing.assert_close(lg3, base["logits", None], atol=1e-5, rtol=1e-6)
    # zeroing every unit of expert e at p leaves its weighted output bias
    fac = torch.ones(1, E * m)
    fac[0, e * m:(e + 1) * m] = 0
    _, cap = run(lm, IDS, [Edit("mlp_hidden", 0, one, pos, fac, mode="scale")], capture=[("expert_out", 0)])
    bias = moe.experts.b_out[e] * w[p, e] if moe.experts.b_out is not None else torch.zeros(lm.anatomy.d_model)
    torch.testing.assert_close(cap["expert_out", 0][0, p, e], bias, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("family", MOE)
def test_moe_site_gradients(family):
    """With grad=True the captured expert outputs and hidden units are nodes the output's gradient reaches: an
    expert's output has the block output's gradient where the expert is chosen; a hidden unit's gradient equals the
    finite difference of an edit."""
    lm = get_model(f"tiny:{family}")
    lg, cap = run(lm, IDS, capture=[("expert_out", 1), ("mlp_out", 1), ("mlp_hidden", 0)], grad=True)
    base = run(lm, IDS)[0]
    torch.testing.assert_close(lg, base)  # capturing with gradients changes no number
    ge, go, gh = torch.autograd.grad(lg[0, -1, 3], [cap["expert_out", 1], cap["mlp_out", 1], cap["mlp_hidden", 0]])
    E = ge.shape[2]
    torch.testing.assert_close(ge, go[:, :, None].expand(-1, -1, E, -1))
    h = cap["mlp_hidden", 0].detach()[0]
    p, u = h.shape[0] - 1, int(h[-1].abs().argmax())  # a unit of a chosen expert at the last position

    def logit(step):
        v = h[p:p + 1].clone()
        v[0, u] += step
        return float(run(lm, IDS, [Edit("mlp_hidden", 0, torch.tensor([0]), torch.tensor([p]), v)])[0][0, -1, 3])

    # central differences at two steps (tests/tolerances.assert_derivative): the step is small enough that no
    # later layer's routing switches inside it
    assert_derivative(logit, float(gh[0, p, u]), 1e-3, pass_rounding(lm) * logit_diff_scale(lm, IDS[0], 3))
    assert float(gh[0, p].abs().max()) > 0


def test_moe_refusals():
    moe = get_model("tiny:mixtral")
    one = torch.zeros(1, dtype=torch.long)
    with pytest.raises(NotApplicableError, match="captured but not edited"):
        run(moe, IDS, [Edit("routing_weights", 0, one, one, torch.zeros(1, 4))])
    dense = get_model("tiny:llama")
    for site in ("router_logits", "routing_weights", "expert_out"):
        with pytest.raises(NotApplicableError, match="only for mixture-of-experts"):
            capture(dense, IDS, [(site, 0)])


def test_unsupported_moe_variants_are_refused():
    """Qwen3-MoE with dense layers among the MoE layers: one line saying what is not supported."""
    from transformers import AutoModelForCausalLM

    from lenscope.models.families import tiny_names
    from lenscope.models.loading.tokenizer import tiny_special_ids

    cfg = tiny_names()["qwen3-moe"].tiny["qwen3-moe"](tiny_special_ids())
    cfg.mlp_only_layers = [0]
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    with pytest.raises(UnsupportedModelError, match="dense MLP layers") as err:
        family_for(model).read(model)
    assert "\n" not in str(err.value)
