"""Activation patching: the batched sweep equals one forward pass per patch (hooks written here, on the modules
the family names), exact sanity values, errors, result files."""

import pytest
import torch

from lenscope.errors import InputError
from lenscope.interventions import Edit, PatchingResult, activation_patching, run
from lenscope.models.families import family_for
from lenscope.models.loading.load import encode, resolve_token

from ..conftest import DECODERS, get_model, module_output, with_module_output
from ..tolerances import assert_same_computation, logit_diff_scale, pass_rounding

CLEAN = "The capital of France is"
CORRUPT = "The capital in France is"  # one token differs in the tiny tokenizer (checked below)


def one_patch_metric(lm, base, src_acts, what, layer, index, tid, fid, position=-1):
    """One forward pass of ``base`` with one patch, by plain hooks written for this test."""
    lh = family_for(lm.model).hooks(lm.model).layers[layer]
    H = lm.anatomy.layers[layer].attn.W_O.shape[0]

    def rep(x, value):
        shape = x.shape
        x = x.clone().reshape(1, base.numel(), shape[-1])  # OPT's MLP sees (batch * pos, d)
        if what == "heads":
            v = x.view(*x.shape[:-1], H, -1)
            v[0, :, index] = value
        else:
            x[0, index] = value
        return x.reshape(shape)

    if what == "resid":
        def pre(mod, args, kwargs):
            if args:
                return (rep(args[0], src_acts),) + args[1:], kwargs
            kwargs["hidden_states"] = rep(kwargs["hidden_states"], src_acts)
            return args, kwargs

        h = lh.block.register_forward_pre_hook(pre, with_kwargs=True)
    elif what == "heads":
        h = lh.attn_out.register_forward_pre_hook(lambda m, a: (rep(a[0], src_acts),) + a[1:])
    else:
        mod = lh.attn_out if what == "attn" else lh.mlp_out
        h = mod.register_forward_hook(lambda m, a, o: with_module_output(o, rep(module_output(o), src_acts)))
    try:
        with torch.no_grad():
            kw = {"use_cache": False} if lm.anatomy.causal else {}
            logits = lm.model(input_ids=base[None], attention_mask=torch.ones_like(base[None]), **kw).logits
    finally:
        h.remove()
    lg = logits[0, position]
    return float(lg[tid] - lg[fid])


def clean_acts(lm, ids, what):
    """Activations of the clean run, captured by plain hooks written for this test."""
    hooks = family_for(lm.model).hooks(lm.model).layers
    store = {}
    hs = []
    for i, lh in enumerate(hooks):
        if what == "resid":
            hs.append(lh.block.register_forward_pre_hook(
                lambda m, a, k, i=i: store.__setitem__(i, (a[0] if a else k["hidden_states"])[0].clone()),
                with_kwargs=True))
        elif what == "heads":
            H = lm.anatomy.layers[i].attn.W_O.shape[0]
            hs.append(lh.attn_out.register_forward_pre_hook(
                lambda m, a, i=i, H=H: store.__setitem__(i, a[0].reshape(ids.numel(), H, -1).clone())))
        else:
            mod = lh.attn_out if what == "attn" else lh.mlp_out
            hs.append(mod.register_forward_hook(
                lambda m, a, o, i=i: store.__setitem__(i, module_output(o).reshape(ids.numel(), -1).clone())))
    try:
        with torch.no_grad():
            kw = {"use_cache": False} if lm.anatomy.causal else {}
            lm.model(input_ids=ids[None], attention_mask=torch.ones_like(ids[None]), **kw)
    finally:
        for h in hs:
            h.remove()
    return store


@pytest.mark.parametrize("what", ["resid", "attn", "mlp", "heads"])
def test_batched_equals_one_at_a_time(tiny_decoder, what):
    _check_batched(tiny_decoder, what)


@pytest.mark.parametrize("what", ["resid", "heads"])
def test_encoders_batched_equals_one_at_a_time(tiny_encoder, what):
    """The same hooks work on Post-LN encoders (metric read at the masked-LM head's last position)."""
    _check_batched(tiny_encoder, what)


def _check_batched(lm, what):
    c, x = encode(lm, CLEAN), encode(lm, CORRUPT)
    tid, fid = resolve_token(lm, " capital"), resolve_token(lm, " of")
    res = activation_patching(lm, CLEAN, CORRUPT, " capital", " of", what=what, batch_size=5)
    acts = clean_acts(lm, c, what)
    L = lm.anatomy.n_layers
    C = res.values.shape[1]
    loop = torch.empty(L, C)
    for layer in range(L):
        for i in range(C):
            src = acts[layer][:, i] if what == "heads" else acts[layer][i]
            loop[layer, i] = one_patch_metric(lm, x, src, what, layer, i, tid, fid)
    assert torch.allclose(res.raw, loop, atol=1e-5), (res.raw - loop).abs().max()
    norm = (loop - res.corrupted_metric) / (res.clean_metric - res.corrupted_metric)
    assert torch.allclose(res.values, norm, atol=1e-5 / abs(res.clean_metric - res.corrupted_metric))
    # the unpatched metrics are the plain model's
    for ids, m in ((c, res.clean_metric), (x, res.corrupted_metric)):
        with torch.no_grad():
            kw = {"use_cache": False} if lm.anatomy.causal else {}
            lg = lm.model(input_ids=ids[None], attention_mask=torch.ones_like(ids[None]), **kw).logits[0, -1]
        assert m == pytest.approx(float(lg[tid] - lg[fid]), abs=1e-5)


def test_sanity_layer0_residual(tiny_decoder):
    """Only one token differs: restoring the residual there at layer 0 makes the input the clean one
    (share restored exactly 1); at a shared token it changes nothing (exactly 0)."""
    lm = tiny_decoder
    c, x = encode(lm, CLEAN), encode(lm, CORRUPT)
    diff = (c != x).nonzero()[:, 0].tolist()
    assert len(diff) == 1
    res = activation_patching(lm, CLEAN, CORRUPT, " capital", " of", what="resid", batch_size=8)
    d = diff[0]
    # exact in exact arithmetic; in float32 the patched run (a batch row) and the unpatched one round differently:
    # each metric is within pass_rounding x its scale (tests/tolerances.py), so a share within twice that over
    # |clean - corrupted| (here as small as 1e-3: the shares magnify rounding)
    tid, fid = resolve_token(lm, " capital"), resolve_token(lm, " of")
    tol = 2 * pass_rounding(lm) * max(logit_diff_scale(lm, c, tid, fid), logit_diff_scale(lm, x, tid, fid))
    atol = tol / abs(res.clean_metric - res.corrupted_metric)
    assert res.values[0, d] == pytest.approx(1.0, abs=atol)
    same = [p for p in range(len(c)) if p != d]
    assert torch.allclose(res.values[0, same], torch.zeros(len(same)), atol=atol)
    # noising: putting the corrupted token in the clean run gives exactly the corrupted metric (0)
    noise = activation_patching(lm, CLEAN, CORRUPT, " capital", " of", what="resid", noising=True)
    assert noise.values[0, d] == pytest.approx(0.0, abs=atol)
    assert torch.allclose(noise.values[0, same], torch.ones(len(same)), atol=atol)
    # before the differing token, a causal model's states are identical: no patch there changes anything
    assert torch.allclose(res.values[:, :d], torch.zeros(lm.anatomy.n_layers, d), atol=atol)


def test_patch_all_positions_layer0_restores_exactly(tiny_decoder):
    lm = tiny_decoder
    c, x = encode(lm, CLEAN), encode(lm, "The capital of Frace is")  # two tokens differ
    assert c.numel() == x.numel() and int((c != x).sum()) == 2
    _, got = run(lm, c[None], capture=[("resid_pre", 0)])
    P = c.numel()
    lg, _ = run(lm, x[None],
                [Edit("resid_pre", 0, torch.zeros(P, dtype=torch.long), torch.arange(P), got[("resid_pre", 0)][0])])
    lc, _ = run(lm, c[None])
    assert torch.allclose(lg[0, -1], lc[0, -1], atol=1e-5)


def test_all_heads_equal_attention_output(tiny_decoder):
    """Patching every head's output at (layer, pos) is patching the attention output there."""
    lm = tiny_decoder
    c, x = encode(lm, CLEAN), encode(lm, CORRUPT)
    layer, pos = lm.anatomy.n_layers - 1, c.numel() - 1
    _, got = run(lm, c[None], capture=[("head", layer), ("attn_out", layer)])
    H = got[("head", layer)].shape[2]
    z = torch.zeros(H, dtype=torch.long)
    a, _ = run(lm, x[None], [Edit("head", layer, z, z + pos, got[("head", layer)][0, pos], head=torch.arange(H))])
    b, _ = run(lm, x[None], [Edit("attn_out", layer, z[:1], z[:1] + pos, got[("attn_out", layer)][0, pos][None])])
    assert torch.allclose(a, b, atol=1e-5)


def test_head_position_and_prob_metric():
    lm = get_model("tiny:llama")
    r = activation_patching(lm, CLEAN, CORRUPT, " capital", what="heads", metric="prob", head_position=-1)
    assert r.head_position == len(r.tokens) - 1 and r.values.shape == (2, 4)
    assert_same_computation(r.values, r.raw, why="the probability metric: values are raw, copied")
    # by plain hooks: the target's probability in the corrupted run with one head's input to the output
    # projection at the last position taken from the clean run (denoising); float32 softmax of the same passes
    tid = resolve_token(lm, " capital")
    hooks = family_for(lm.model).hooks(lm.model).layers
    c, x = encode(lm, CLEAN), encode(lm, CORRUPT)

    def prob(ids, layer=None, head=None, value=None):
        def pre(m, a):
            z = a[0].clone()
            z.view(*z.shape[:-1], 4, -1)[0, -1, head] = value
            return (z,)

        h = None if layer is None else hooks[layer].attn_out.register_forward_pre_hook(pre)
        try:
            with torch.no_grad():
                return float(lm.model(input_ids=ids[None], use_cache=False).logits[0, -1].softmax(-1)[tid])
        finally:
            if h is not None:
                h.remove()

    store = {}
    hs = [hooks[layer].attn_out.register_forward_pre_hook(lambda m, a, layer=layer: store.__setitem__(layer, a[0]))
          for layer in range(2)]
    try:
        p_clean = prob(c)
    finally:
        for h in hs:
            h.remove()
    assert r.clean_metric == pytest.approx(p_clean, rel=1e-5) and r.corrupted_metric == pytest.approx(prob(x), rel=1e-5)
    for layer in range(2):
        for head in range(4):
            want = prob(x, layer, head, store[layer].view(1, len(c), 4, -1)[0, -1, head])
            assert float(r.values[layer, head]) == pytest.approx(want, rel=1e-5), (layer, head)
    assert float(r.values.max() - r.values.min()) > 1e-3 * p_clean  # the heads differ: the check can fail


def test_errors():
    lm = get_model("tiny:gpt2")
    with pytest.raises(InputError, match="same number of tokens"):
        activation_patching(lm, CLEAN, "The capital of the Republic of France is", " capital", " of")
    with pytest.raises(InputError, match="not exactly one token"):
        activation_patching(lm, CLEAN, CORRUPT, " capital city", " of")
    with pytest.raises(InputError, match="foil"):
        activation_patching(lm, CLEAN, CORRUPT, " capital")
    with pytest.raises(InputError, match="unknown what"):
        activation_patching(lm, CLEAN, CORRUPT, " capital", " of", what="neurons")
    with pytest.raises(InputError, match="same logit difference"):
        activation_patching(lm, CLEAN, CLEAN, " capital", " of")


def test_result_save_load_frame_plot(tmp_path):
    lm = get_model("tiny:qwen2")
    r = activation_patching(lm, CLEAN, CORRUPT, " capital", " of", what="mlp")
    back = PatchingResult.load(r.save(tmp_path / "p.safetensors"))
    assert_same_computation(back.values, r.values, why="saved and read back")
    assert back.tokens == r.tokens and back.what == "mlp"
    df = r.to_frame()
    assert len(df) == r.values.numel() and set(df.columns) >= {"layer", "pos", "token", "value"}
    d = r.to_dict()
    assert_same_computation(d["values"], r.values.tolist(), why="the values, copied into the dict")
    assert d["axes"] == ["layer", "pos"]
    fig = r.plot()
    from lenscope.viz.plots import save_figure

    assert save_figure(fig, tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_decoders_listed():
    assert {"gpt2", "llama", "opt", "bloom", "gpt-neox", "gemma3", "qwen2"} <= set(DECODERS)
