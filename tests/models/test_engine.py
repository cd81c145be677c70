"""The engine: every site on every family, edits, selective capture, padding, gradients, errors."""

from __future__ import annotations

import pytest
import torch

from lenscope.errors import InputError, NotApplicableError, RenamedWarning
from lenscope.models.runtime.engine import Edit, capture, run, site_key
from lenscope.models.runtime.trace import trace, trace_sites
from tests.conftest import get_model
from tests.tolerances import assert_derivative, logit_diff_scale, pass_rounding

IDS = torch.tensor([[5, 17, 3, 42, 9, 11, 7]])


def _attn_input(lm, cap, layer):
    """What attention read in block ``layer``: the normed residual (the residual itself for Post-LN)."""
    return cap[("resid_pre", layer)] if lm.anatomy.placement == "post" else cap[("ln_attn.out", layer)]


def test_site_names():
    assert site_key("resid_pre.3") == ("resid_pre", 3)
    with pytest.warns(RenamedWarning):  # the interventions' first vocabulary (tests/models/test_names.py)
        assert site_key(("resid", 2)) == ("resid_pre", 2)
    assert site_key("ln_attn.scale.0") == ("ln_attn.scale", 0)
    assert site_key("ln_final.in") == ("ln_final.in", None)
    with pytest.raises(InputError, match="unknown site"):
        site_key("resid_middle.0")
    with pytest.raises(InputError, match="needs a block index"):
        site_key("q")
    with pytest.raises(InputError, match="whole model"):
        site_key(("logits", 0))


def test_qkv_sites_are_the_projections(tiny):
    """q, k, v of every family (fused or not) equal the anatomy's projections of what attention read."""
    lm = tiny
    A = lm.anatomy
    for layer in range(A.n_layers):
        cap = capture(lm, IDS, [(n, layer) for n in ("q", "k", "v", "resid_pre", "ln_attn.out")])
        x = _attn_input(lm, cap, layer)[0]  # (pos, d)
        at = A.layers[layer].attn
        for name, W, b in (("q", at.W_Q, at.b_Q), ("k", at.W_K, at.b_K), ("v", at.W_V, at.b_V)):
            want = torch.einsum("pd,hde->phe", x, W)
            if b is not None:
                want = want + b
            got = cap[(name, layer)][0]
            assert got.shape == want.shape, name
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=f"{lm.name} {name}{layer}")


def test_head_site_composes_attn_out(tiny):
    lm = tiny
    at = lm.anatomy.layers[0].attn
    cap = capture(lm, IDS, [("head", 0), ("attn_out", 0)])
    z = cap[("head", 0)][0]  # (pos, head, d_head)
    want = torch.einsum("phe,hed->pd", z, at.W_O) + (at.b_O if at.b_O is not None else 0)
    torch.testing.assert_close(cap[("attn_out", 0)][0], want, rtol=1e-4, atol=1e-5)


def test_qkv_edits_reach_the_real_attention(tiny):
    """Adding to one head's query changes that head's pattern only; adding to a value changes the outputs of the
    heads that share it and no pattern: the fused layouts are split and written back in the right places."""
    lm = tiny
    at = lm.anatomy.layers[0].attn
    H, Hk, dh = at.n_heads, at.n_kv_heads, at.d_head
    sites = [("pattern", 0), ("head", 0), ("q", 0), ("v", 0)]
    base = capture(lm, IDS, sites)
    P = IDS.shape[1]
    g = torch.Generator().manual_seed(0)
    pos = torch.arange(P)
    rows = torch.zeros(P, dtype=torch.long)
    dq = torch.randn(P, dh, generator=g)
    _, cap = run(lm, IDS, [Edit("q", 0, rows, pos, dq, head=torch.full((P,), 1), mode="add")], capture=sites)
    torch.testing.assert_close(cap[("q", 0)][0, :, 1], base[("q", 0)][0, :, 1] + dq)
    changed = (cap[("pattern", 0)] - base[("pattern", 0)]).abs().amax(dim=(0, 2, 3))
    assert changed[1] > 1e-4, (lm.name, changed)
    # a q norm over all heads' features at once (OLMo 2, OLMoE) normalises every head's query by all of them: all
    # heads move
    others = changed[torch.arange(H) != 1]
    assert (others > 0).all() if at.qk_norm_across_heads else (others == 0).all(), (lm.name, changed)
    dv = torch.randn(P, dh, generator=g)
    _, cap = run(lm, IDS, [Edit("v", 0, rows, pos, dv, head=torch.zeros(P, dtype=torch.long), mode="add")],
                 capture=sites)
    from tests.tolerances import assert_same_computation

    assert_same_computation(cap[("pattern", 0)], base[("pattern", 0)], why="an edit of v comes after the pattern: "
                            "the same operations before it")
    moved = (cap[("head", 0)] - base[("head", 0)]).abs().amax(dim=(0, 1, 3))
    group = H // Hk
    assert (moved[:group] > 1e-5).all() and (moved[group:] == 0).all(), (lm.name, moved)


def test_selective_capture_keeps_only_what_is_asked(tiny):
    lm = tiny
    L = lm.anatomy.n_layers
    logits, cap = run(lm, IDS, capture=[("resid_pre", i) for i in range(L)])
    assert set(cap) == {("resid_pre", i) for i in range(L)}
    st = cap.stacked("resid_pre")
    assert st.shape == (L, 1, IDS.shape[1], lm.anatomy.d_model)
    assert st[1].data_ptr() == cap[("resid_pre", 1)].data_ptr()  # one buffer, no second copy
    full = trace(lm, IDS[0])
    torch.testing.assert_close(st[:, 0], full.resid_pre)
    assert logits is not None


def test_norm_scale_site(tiny):
    lm = tiny
    cap = capture(lm, IDS, [("ln_mlp.in", 0), ("ln_mlp.scale", 0)])
    want = lm.anatomy.layers[0].ln_mlp.scale(cap[("ln_mlp.in", 0)])
    torch.testing.assert_close(cap[("ln_mlp.scale", 0)], want)


def test_padding_is_never_read(tiny_decoder):
    """Right-padded rows: real positions equal the unpadded run, padded positions are NaN."""
    lm = tiny_decoder
    short = IDS[:, :4]
    batch = torch.cat([IDS, torch.cat([short, torch.zeros(1, 3, dtype=torch.long)], 1)])
    mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3])
    sites = [("resid_post", 1), ("pattern", 0), ("mlp_hidden", 1)]
    _, cap = run(lm, batch, capture=sites, attention_mask=mask)
    alone = capture(lm, short, sites)
    torch.testing.assert_close(cap[("resid_post", 1)][1, :4], alone[("resid_post", 1)][0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(cap[("pattern", 0)][1, :, :4, :4], alone[("pattern", 0)][0], rtol=1e-4, atol=1e-5)
    assert cap[("resid_post", 1)][1, 4:].isnan().all() and not cap[("resid_post", 1)][0].isnan().any()
    assert cap[("pattern", 0)][1, :, 4:].isnan().all()
    assert cap[("mlp_hidden", 1)][1, 4:].isnan().all()


def test_edit_set_add_scale_and_stop():
    lm = get_model("tiny:gpt2")
    d = lm.anatomy.d_model
    base = capture(lm, IDS, [("attn_out", 0), ("resid_post", 0)])
    r, p = torch.tensor([0]), torch.tensor([2])
    v = torch.ones(1, d)
    a = base[("attn_out", 0)][0, 2]
    for mode, want in (("set", v[0]), ("add", a + 1), ("scale", 2 * a)):
        vals = torch.full((1,), 2.0) if mode == "scale" else v
        _, cap = run(lm, IDS, [Edit("attn_out", 0, r, p, vals, mode=mode)], capture=[("attn_out", 0)])
        torch.testing.assert_close(cap[("attn_out", 0)][0, 2], want)
        torch.testing.assert_close(cap[("attn_out", 0)][0, 3], base[("attn_out", 0)][0, 3])
    logits, cap = run(lm, IDS, capture=[("resid_pre", 1)], stop_after=("resid_pre", 1))
    assert logits is None and ("resid_pre", 1) in cap
    torch.testing.assert_close(cap[("resid_pre", 1)], base[("resid_post", 0)])


def test_gradients_flow_through_captures():
    lm = get_model("tiny:llama")
    logits, cap = run(lm, IDS, capture=[("resid_pre", 1), ("attn_out", 1), ("q", 1)], grad=True)
    x, a = cap[("resid_pre", 1)], cap[("attn_out", 1)]
    assert x.requires_grad and a.requires_grad
    gx, ga, gq = torch.autograd.grad(logits[0, -1, 3], [x, a, cap[("q", 1)]])
    assert gx[0, -1].abs().sum() > 0 and ga[0, -1].abs().sum() > 0 and gq[0, -1].abs().sum() > 0
    assert gq[0, :-1].abs().sum() == 0  # causal: earlier queries never reach the last position
    assert gx[0, -1].sub(ga[0, -1]).abs().sum() > 0  # the residual reaches the output by more paths
    with pytest.raises(NotApplicableError, match="no gradient"):
        run(lm, IDS, capture=[("resid_mid", 0)], grad=True)
    gpt2 = get_model("tiny:gpt2")  # fused q/k/v: the leaf is written back into the projection's output
    logits, cap = run(gpt2, IDS, capture=[("k", 1)], grad=True)
    (gk,) = torch.autograd.grad(logits[0, -1, 3], cap[("k", 1)])
    assert gk[0, 0].abs().sum() > 0 and gk[0, -1].abs().sum() > 0


def test_refusals():
    gpt2 = get_model("tiny:gpt2")
    one = torch.zeros(1, dtype=torch.long)
    with pytest.raises(NotApplicableError, match="captured but not edited"):
        run(gpt2, IDS, [Edit("pattern", 0, one, one, torch.zeros(1, 7), head=one)])
    with pytest.raises(NotApplicableError, match="gated"):
        capture(gpt2, IDS, [("mlp_up", 0)])
    with pytest.raises(NotApplicableError, match="no norm 'ln_attn_out'"):
        capture(gpt2, IDS, [("ln_attn_out.in", 0)])
    with pytest.raises(InputError, match="block 9"):
        capture(gpt2, IDS, [("resid_pre", 9)])
    with pytest.raises(InputError, match="context of 128"):
        capture(gpt2, torch.zeros(1, 200, dtype=torch.long), ["resid_pre.0"])
    with pytest.raises(InputError, match="at least one"):
        run(gpt2, torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(InputError, match="token ids must lie"):
        run(gpt2, torch.tensor([[1, gpt2.anatomy.vocab_size]]))
    with pytest.raises(InputError, match="edit mode"):
        Edit("resid_pre", 0, one, one, one, mode="replace")


def test_run_options_are_one_object():
    """Issue 43: ``run``'s options are one :class:`RunOptions`; the keywords build it, and keywords given beside an
    object replace its fields."""
    from lenscope.models.runtime.engine import RunOptions
    from tests.tolerances import assert_same_computation

    gpt2 = get_model("tiny:gpt2")
    one = torch.ones(1, gpt2.anatomy.d_model)
    edit = Edit("resid_pre", 1, torch.zeros(1, dtype=torch.long), torch.tensor([2]), one, mode="add")
    mask = torch.ones(1, 7, dtype=torch.long)
    mask[0, -2:] = 0
    by_kw = run(gpt2, IDS, [edit], capture=["attn_out.0", "q.1"], attention_mask=mask, last_only=True)
    opts = RunOptions(capture=("attn_out.0", "q.1"), attention_mask=mask, last_only=True)
    by_obj = run(gpt2, IDS, [edit], options=opts)
    assert by_obj.logits.shape == (1, 1, gpt2.anatomy.vocab_size)
    assert_same_computation(by_obj.logits, by_kw.logits, why="the same pass")
    assert_same_computation(dict(by_obj.captured.items()), dict(by_kw.captured.items()), why="the same pass")
    mixed = run(gpt2, IDS, [edit], ["attn_out.0"], options=opts, logits=False)  # capture and logits replaced
    assert mixed.logits is None and set(mixed.captured) == {("attn_out", 0)}
    assert opts.logits and opts.capture == ("attn_out.0", "q.1")  # the object itself is unchanged (frozen)
    with pytest.raises(TypeError, match="graad"):
        run(gpt2, IDS, graad=True)


def test_trace_is_a_view_on_the_engine(tiny):
    lm = tiny
    tr = trace(lm, IDS[0])
    cap = capture(lm, IDS, trace_sites(lm))
    torch.testing.assert_close(tr.pattern, cap.stacked("pattern")[:, 0])
    torch.testing.assert_close(tr.resid_mid, cap.stacked("resid_mid")[:, 0])
    final_in = tr.site("ln_final.in")
    torch.testing.assert_close(tr.resid_post[-1], tr.final_resid if final_in is None else final_in)


@pytest.mark.parametrize("family", ["gpt2", "gpt-neox", "bloom"])
def test_fused_qkv_gradients_with_an_upstream_site_captured(family):
    """q/k/v split from a fused projection stay nodes of the graph when the gradient already flows into them (an
    upstream site captured with grad): their gradient equals the finite difference of an edit."""
    from tests.conftest import get_model

    lm = get_model(f"tiny:{family}")
    ids = torch.tensor([[1, 5, 2, 7]])
    lg, cap = run(lm, ids, capture=[("ln_attn.in", 0), ("q", 0), ("v", 0)], grad=True)
    gq, gv = torch.autograd.grad(lg[0, -1, 3], [cap["q", 0], cap["v", 0]])
    assert gq.abs().sum() > 0 and gv.abs().sum() > 0
    # central differences of a float32 logit at the entry with the largest gradient, at two steps
    # (tests/tolerances.assert_derivative: the truncation from the two, the rounding from pass_rounding)
    eps = 0.1
    P = ids.shape[1]
    rounding = pass_rounding(lm) * logit_diff_scale(lm, ids[0], 3)
    for site, g in (("q", gq), ("v", gv)):
        h, e = divmod(int(g[0, -1].abs().argmax()), g.shape[-1])

        def logit(step, site=site, h=h, e=e):
            v = cap[site, 0][0].detach().clone()
            v[-1, h, e] += step
            edit = Edit(site, 0, torch.zeros(P, dtype=torch.long), torch.arange(P), v)
            return float(run(lm, ids, [edit])[0][0, -1, 3])

        assert_derivative(logit, float(g[0, -1, h, e]), eps, rounding)


def test_moe_sites_exist_only_on_moe_blocks(tiny_decoder):
    """router_logits, routing_weights and expert_out on every decoder family: their shapes on a mixture of experts
    (tests/models/test_moe.py checks their values against the real block), a one-line refusal on a dense MLP."""
    from lenscope.models.weights.moe import is_moe

    lm = tiny_decoder
    sites = [("router_logits", 0), ("routing_weights", 0), ("expert_out", 0)]
    if not is_moe(lm.anatomy):
        for site in sites:
            with pytest.raises(NotApplicableError, match="only for mixture-of-experts"):
                capture(lm, IDS, [site])
        return
    E, P = lm.anatomy.layers[0].mlp.n_experts, IDS.shape[1]
    cap = capture(lm, IDS, sites + [("mlp_out", 0)])
    assert cap["router_logits", 0].shape == cap["routing_weights", 0].shape == (1, P, E)
    assert cap["expert_out", 0].shape == (1, P, E, lm.anatomy.d_model)
    torch.testing.assert_close(cap["expert_out", 0].sum(2), cap["mlp_out", 0], atol=1e-6, rtol=1e-5)


def test_a_call_edit_computes_a_site_from_the_pass():
    lm = get_model("tiny:llama")
    ids = IDS if IDS.dim() == 2 else IDS[None]
    seen = {}

    def double(x):
        seen["shape"] = tuple(x.shape)
        return x * 2

    called = run(lm, ids, edits=[Edit("mlp_out", 0, rows=None, pos=None, values=double, mode="call")])
    B, P = ids.shape
    scaled = run(lm, ids, edits=[Edit("mlp_out", 0, rows=torch.arange(B).repeat_interleave(P),
                                      pos=torch.arange(P).repeat(B), values=torch.full((B * P,), 2.0),
                                      mode="scale")])
    assert seen["shape"] == (B, P, lm.anatomy.d_model)
    from tests.tolerances import assert_same_computation

    assert_same_computation(called.logits, scaled.logits, why="x * 2 by a call or by a scale edit: one "
                            "multiplication of the same numbers")
    assert float((called.logits - run(lm, ids).logits).abs().max()) > 1e-3  # doubling the MLP moved the logits
    with pytest.raises(InputError, match="returned shape"):
        run(lm, ids, edits=[Edit("mlp_out", 0, rows=None, pos=None, values=lambda x: x[:, :1], mode="call")])
    with pytest.raises(InputError, match="function"):
        Edit("mlp_out", 0, rows=None, pos=None, values=torch.ones(3), mode="call")
    from lenscope.models.runtime.engine import new_cache

    with pytest.raises(NotApplicableError, match="cache"):
        run(lm, ids[:1], edits=[Edit("mlp_out", 0, rows=None, pos=None, values=double, mode="call")],
            past=new_cache(lm))
