"""Knowledge neurons: batched IG equals a step-by-step loop with plain hooks; completeness; suppress/amplify
equal forward passes with those units edited by hand; random control."""

import pytest
import torch

from lenscope.errors import InputError
from lenscope.interventions import KnowledgeNeurons, knowledge_neurons, neuron_attributions, run
from lenscope.models.families import family_for
from lenscope.models.loading.load import encode, resolve_token

from ..conftest import get_model
from ..tolerances import assert_same_ints

PROMPT = "The capital of France is"


def _expert_units(ex, x, e):
    """Expert ``e``'s hidden units on ``x (token, d_model)`` from the transformers experts module's own weights and
    activation (Mixtral / Qwen3-MoE / OLMoE: ``[gate; up]`` rows; GPT-OSS: interleaved, with biases and its clamped
    unit ``_apply_gate``)."""
    if hasattr(ex, "act_fn"):
        gate, up = torch.nn.functional.linear(x, ex.gate_up_proj[e]).chunk(2, dim=-1)
        return ex.act_fn(gate) * up
    return ex._apply_gate(x @ ex.gate_up_proj[e] + ex.gate_up_proj_bias[e])


def _expert_down(ex, h, e):
    if hasattr(ex, "act_fn"):
        return torch.nn.functional.linear(h, ex.down_proj[e])
    return h @ ex.down_proj[e] + ex.down_proj_bias[e]


def _hidden_hook(lm, layer, fn):
    """``(module, kind, hook)`` applying ``fn`` to block ``layer``'s hidden units ``(pos, units)``: the input of the
    down projection; a mixture of experts: every expert's units side by side (0 where the router did not choose the
    expert), the experts module's output recomputed here from them with the router's choice and weights."""
    lh = family_for(lm.model).hooks(lm.model).layers[layer]
    if lh.experts is None:
        def pre(m, a):
            x = a[0]
            return (fn(x.reshape(-1, x.shape[-1])).reshape(x.shape),)  # (pos, d_mlp): one row
        return lh.mlp_out, "pre", pre

    def post(mod, args, out):
        x, idx, w = args[:3]
        E = lm.anatomy.layers[layer].mlp.n_experts
        H = torch.stack([_expert_units(mod, x, e) for e in range(E)], 1)  # (token, expert, d_mlp)
        weights = torch.zeros(x.shape[0], E, dtype=w.dtype).scatter(1, idx, w)
        H = H * (weights > 0)[..., None]
        H = fn(H.reshape(x.shape[0], -1)).reshape(H.shape)
        return sum(weights[:, e, None] * _expert_down(mod, H[:, e], e) for e in range(E))
    return lh.experts, "post", post


def _hidden_hook_prob(lm, ids, layer, fn):
    """P(' capital') at the last token with ``fn`` applied to layer's hidden units (input of the down projection),
    reshaped to (pos, d_mlp); hooks written here."""
    mod, kind, f = _hidden_hook(lm, layer, fn)
    h = mod.register_forward_pre_hook(f) if kind == "pre" else mod.register_forward_hook(f)
    try:
        kw = {"use_cache": False}
        logits = lm.model(input_ids=ids[None], **kw).logits
    finally:
        h.remove()
    return logits[0, -1].softmax(-1)[resolve_token(lm, " capital")]


def test_batched_ig_equals_loop(tiny_decoder):
    lm = tiny_decoder
    ids = encode(lm, PROMPT)
    tid, steps = resolve_token(lm, " capital"), 5
    attr, comp = neuron_attributions(lm, ids, tid, ids.numel() - 1, steps=steps, batch_size=7)
    _, got = run(lm, ids[None], capture=[("mlp_hidden", j) for j in range(lm.anatomy.n_layers)])
    for layer in range(lm.anatomy.n_layers):
        h = got[("mlp_hidden", layer)][0, -1]
        total = torch.zeros_like(h)
        for k in range(1, steps + 1):
            v = ((k / steps) * h).clone().requires_grad_(True)

            def put(x, v=v):
                x = x.clone()
                x[-1] = v
                return x

            p = _hidden_hook_prob(lm, ids, layer, put)
            (g,) = torch.autograd.grad(p, v)
            total += g
        ref = h * total / steps
        assert torch.allclose(attr[layer], ref, atol=1e-7, rtol=1e-4), (attr[layer] - ref).abs().max()
        with torch.no_grad():
            def zero(x):
                x = x.clone()
                x[-1] = 0
                return x

            p0 = _hidden_hook_prob(lm, ids, layer, zero)
            p1 = _hidden_hook_prob(lm, ids, layer, lambda x: x)
        assert float(comp[layer]) == pytest.approx(float(p1 - p0), abs=1e-7)


def test_completeness_with_many_steps():
    lm = get_model("tiny:gemma3")
    ids = encode(lm, PROMPT)
    tid = resolve_token(lm, " capital")
    attr, comp = neuron_attributions(lm, ids, tid, ids.numel() - 1, steps=200, batch_size=100)
    # a right Riemann sum converges to the integral: the layer sums approach P(h) - P(0)
    assert torch.allclose(attr.sum(1), comp, atol=2e-6 + 0.01 * float(comp.abs().max()))


def test_suppress_amplify_and_control(tiny_decoder):
    lm = tiny_decoder
    res = knowledge_neurons(lm, PROMPT, " capital", steps=5)
    ids = encode(lm, PROMPT)
    assert len(res.neurons) > 0 and len(res.control) == len(res.neurons)
    assert not ({tuple(x) for x in res.neurons.tolist()} & {tuple(x) for x in res.control.tolist()})
    assert res.neurons[:, 0].tolist() == res.control[:, 0].tolist()  # controls come from the same layers
    A = res.attributions
    assert (A[res.neurons[:, 0], res.neurons[:, 1]] >= res.threshold * float(A.max()) - 1e-12).all()
    for neurons, f, p in ((res.neurons, 0.0, res.p_suppressed), (res.neurons, 2.0, res.p_amplified),
                          (res.control, 0.0, res.p_control_suppressed)):
        hs = []
        for layer in neurons[:, 0].unique().tolist():
            units = neurons[neurons[:, 0] == layer, 1]

            def scale(x, units=units):
                x = x.clone()
                x[-1, units] *= f
                return x

            mod, kind, hook = _hidden_hook(lm, layer, scale)
            hs.append(mod.register_forward_pre_hook(hook) if kind == "pre" else mod.register_forward_hook(hook))
        try:
            with torch.no_grad():
                lg = lm.model(input_ids=ids[None], use_cache=False).logits[0, -1]
        finally:
            for h in hs:
                h.remove()
        assert p == pytest.approx(float(lg.softmax(-1)[res.target_id]), abs=1e-7)


def test_files_and_errors(tmp_path):
    lm = get_model("tiny:llama")
    res = knowledge_neurons(lm, PROMPT, steps=4, max_neurons=3)
    assert len(res.neurons) <= 3
    back = KnowledgeNeurons.load(res.save(tmp_path / "k.safetensors"))
    assert_same_ints(back.neurons, res.neurons)
    assert back.target == res.target
    d = res.to_dict()
    assert {"neurons", "p_base", "p_suppressed", "p_amplified", "p_control_suppressed"} <= set(d)
    assert len(res.to_frame()) == len(res.neurons)
    from lenscope.viz.plots import save_figure

    assert save_figure(res.plot(), tmp_path / "k.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(InputError):
        knowledge_neurons(lm, PROMPT, " capital", threshold=0)
    with pytest.raises(InputError):
        knowledge_neurons(lm, PROMPT, " capital", layers=[7])


@pytest.mark.parametrize("family", ["mixtral", "gpt-oss"])
def test_moe_neurons_are_expert_neuron_pairs(family):
    """A mixture of experts' neurons are (expert, neuron): unit e * d_mlp + i; the experts the prediction position
    does not use have attribution 0 (no units there), and the controls come from the experts it uses."""
    lm = get_model(f"tiny:{family}")
    res = knowledge_neurons(lm, PROMPT, " capital", steps=5)
    ids = encode(lm, PROMPT)
    L = lm.anatomy.n_layers
    moe = lm.anatomy.layers[0].mlp
    E, m = moe.n_experts, moe.d_mlp
    assert res.attributions.shape == (L, E * m) and res.info == {"experts": E, "d_mlp": m}
    _, cap = run(lm, ids[None], capture=[("routing_weights", j) for j in range(L)])
    for j in range(L):
        used = cap["routing_weights", j][0, -1] > 0
        per_expert = res.attributions[j].reshape(E, m)
        assert not per_expert[~used].any() and per_expert[used].abs().sum(1).min() > 0
        for layer, u in torch.cat([res.neurons, res.control]).tolist():
            if layer == j:
                assert used[u // m]
    df = res.to_frame()
    assert ((df.expert * m + df.neuron) == df.unit).all()
    d = res.to_dict()["neurons"][0]
    assert d["index"] == d["expert"] * m + d["neuron"]
