"""Path patching against brute force: the direct effect on the logits recomputed from two Traces and the
Anatomy; sender -> receiver head checked with plain hooks on the real model's q/k/v projections, located per family
in this file (not through lenscope's engine)."""

import pytest
import torch

import lenscope
from lenscope.errors import InputError
from lenscope.interventions import path_patching, run
from lenscope.models.loading.load import encode, resolve_token

from ..conftest import get_model, module_output, with_module_output
from ..tolerances import logit_diff_scale, pass_rounding

CLEAN, CORRUPT = "The capital of France is", "The capital in France is"


def _ld(logits, tid, fid):
    return float(logits[tid] - logits[fid])


@pytest.mark.parametrize("senders", ["heads", "attn", "mlp"])
def test_direct_effect_equals_brute_force(tiny_decoder, senders):
    lm = tiny_decoder
    tid, fid = resolve_token(lm, " capital"), resolve_token(lm, " of")
    res = path_patching(lm, CLEAN, CORRUPT, " capital", " of", senders=senders, batch_size=5)
    c, x = encode(lm, CLEAN), encode(lm, CORRUPT)
    tc, tx = lenscope.trace(lm, c), lenscope.trace(lm, x)
    _, heads = run(lm, torch.stack([c, x]), capture=[("head", j) for j in range(lm.anatomy.n_layers)])
    A = lm.anatomy
    final = tx.site("ln_final.in")[-1]
    L, C = res.raw.shape
    brute = torch.empty(L, C)
    for j in range(L):
        layer = A.layers[j]
        post = layer.ln_attn_out if senders != "mlp" else layer.ln_mlp_out
        for i in range(C):
            if senders == "heads":  # the attention output with head i's clean output, at the last position
                W_O = layer.attn.W_O
                dz = heads[("head", j)][0, -1, i] - heads[("head", j)][1, -1, i]
                new, old = tx.attn_out[j, -1] + dz @ W_O[i], tx.attn_out[j, -1]
            else:
                src, base = (tc.attn_out, tx.attn_out) if senders == "attn" else (tc.mlp_out, tx.mlp_out)
                new, old = (src[j, i], base[j, i]) if i == C - 1 else (base[j, -1], base[j, -1])
            delta = (post(new) - post(old)) if post is not None else (new - old)
            delta = delta * layer.residual_scale  # Granite's residual multiplier scales what a sub-layer adds
            brute[j, i] = _ld(A.logits(final + delta), tid, fid)
    assert torch.allclose(res.raw, brute, atol=2e-5), (res.raw - brute).abs().max()
    # a sender at an earlier position has no direct effect on the last position's logits: exactly 0 but for the
    # float32 rounding of the two metrics (tests/tolerances.py), over |clean - corrupted| (the shares magnify it)
    if senders != "heads":
        tol = 2 * pass_rounding(lm) * max(logit_diff_scale(lm, c, tid, fid), logit_diff_scale(lm, x, tid, fid))
        atol = tol / abs(res.clean_metric - res.corrupted_metric)
        assert torch.allclose(res.values[:, :-1], torch.zeros(L, C - 1), atol=atol)


def _blocks(lm):
    """The real model's blocks (named here, independently of lenscope's family files)."""
    m = lm.model
    for path in ("transformer.h", "gpt_neox.layers", "model.decoder.layers", "model.layers",
                 "model.language_model.layers"):  # the last: Gemma 3's multimodal wrapper
        obj = m
        try:
            for part in path.split("."):
                obj = getattr(obj, part)
        except AttributeError:
            continue
        return obj
    raise AssertionError(f"no blocks found in {type(m).__name__}")


def _proj(lm, layer, which, head):
    """(module, slice of its output's last axis) that holds head ``head``'s ``which`` projection, per family."""
    blk = _blocks(lm)[layer]
    at = lm.anatomy.layers[layer].attn
    dh, H = at.d_head, at.n_heads
    j = "qkv".index(which)
    if hasattr(blk, "attn") and hasattr(blk.attn, "c_attn"):  # GPT-2: [q | k | v], each (head, d_head)
        off = j * H * dh + head * dh
        return blk.attn.c_attn, slice(off, off + dh)
    if hasattr(blk, "attn") and hasattr(blk.attn, "q_proj"):  # GPT-J
        return getattr(blk.attn, f"{which}_proj"), slice(head * dh, (head + 1) * dh)
    cfg = lm.model.config
    if cfg.model_type == "falcon":  # per key/value head [q_1 .. q_g k v], each d_head (multi-query: one group)
        K = cfg.num_kv_heads if cfg.new_decoder_architecture else (1 if cfg.multi_query else H)
        g = H // K
        group, i = (head // g, head % g) if which == "q" else (head, g + j - 1)
        off = (group * (g + 2) + i) * dh
        return blk.self_attention.query_key_value, slice(off, off + dh)
    fused = getattr(getattr(blk, "attention", None), "query_key_value", None)  # GPT-NeoX
    fused = fused or getattr(getattr(blk, "self_attention", None), "query_key_value", None)  # BLOOM
    if fused is not None:  # per head [q k v], each d_head
        off = head * 3 * dh + j * dh
        return fused, slice(off, off + dh)
    fused = getattr(blk.self_attn, "qkv_proj", None)  # Phi-3: [q | k | v], q (head, d_head), k and v (kv_head, d_head)
    if fused is not None:
        off = (0, H * dh, (H + at.n_kv_heads) * dh)[j] + head * dh
        return fused, slice(off, off + dh)
    mod = getattr(blk.self_attn, f"{which}_proj")
    return mod, slice(head * dh, (head + 1) * dh)


def _run_with(lm, ids, hooks):
    handles = [mod.register_forward_hook(f) if kind == "post" else
               mod.register_forward_pre_hook(f, with_kwargs=kind == "pre_kw") for mod, kind, f in hooks]
    try:
        with torch.no_grad():
            return lm.model(input_ids=ids[None], use_cache=False).logits[0, -1]
    finally:
        for h in handles:
            h.remove()


def _brute_receiver(lm, c, x, sender, receiver):
    """Real forward passes with plain hooks: (1) the sender head's clean output, the sender layer's MLP frozen;
    capture the receiver layer's normed input; (2) the base run with the receiver head's q/k/v projection computed
    from that input only. A key/value head shared by a query group: (2) records the receiver head's output and
    (3) sets only it in a base run."""
    from lenscope.models.families import family_for

    hooks = family_for(lm.model).hooks(lm.model).layers
    sl, sh = sender
    rl, rh, which = receiver
    _, got = run(lm, torch.stack([c, x]), capture=[("head", sl), ("mlp_out", sl)])
    at = lm.anatomy.layers[rl].attn
    H, group = lm.anatomy.layers[sl].attn.n_heads, at.n_heads // at.n_kv_heads
    store = {}

    def patch_head(m, a):
        z = a[0].clone()
        z.view(*z.shape[:-1], H, -1)[0, :, sh] = got[("head", sl)][0, :, sh]
        return (z,)

    if "ln_attn" in hooks[rl].norms and "ln_attn" not in hooks[rl].readers:
        keep_x = (hooks[rl].norms["ln_attn"], "post", lambda m, a, o: store.__setitem__("x", o.clone()))
    else:  # no norm module of its own (OLMo 2), or one shared with the MLP (StableLM): attention's own input
        def read_x(m, a, kw):
            store["x"] = (a[0] if a else kw["hidden_states"]).clone()
        keep_x = (hooks[rl].attn, "pre_kw", read_x)
    _run_with(lm, x, [(hooks[sl].attn_out, "pre", patch_head),
                      (hooks[sl].mlp_out, "post", lambda m, a, o: with_module_output(
                          o, got[("mlp_out", sl)][1].reshape(module_output(o).shape))), keep_x])
    h_in = rh // group if which != "q" else rh
    mod, sl_ = _proj(lm, rl, which, h_in)
    busy = [False]

    def swap_once(m, a, o):  # m(store["x"]) re-enters the hook
        if busy[0]:
            return o
        busy[0] = True
        try:
            o = o.clone()
            o[..., sl_] = m(store["x"]).reshape(o.shape)[..., sl_]
            return o
        finally:
            busy[0] = False

    if which == "q" or group == 1:
        return _run_with(lm, x, [(mod, "post", swap_once)])
    dh = at.d_head

    def keep_z(m, a):
        store["z"] = a[0].reshape(*a[0].shape[:-1], -1)[..., rh * dh:(rh + 1) * dh].clone()

    def set_z(m, a):
        z = a[0].clone()
        z[..., rh * dh:(rh + 1) * dh] = store["z"]
        return (z,)

    _run_with(lm, x, [(mod, "post", swap_once), (hooks[rl].attn_out, "pre", keep_z)])
    return _run_with(lm, x, [(hooks[rl].attn_out, "pre", set_z)])


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_receiver_equals_brute_force(tiny_decoder, which):
    """Every decoder family, ALiBi (BLOOM), grouped keys/values (Llama, Qwen2, Gemma 3) and a sliding window
    (Gemma 3's block 1) included: the engine's q/k/v sites let the real attention compute the receiver."""
    lm = tiny_decoder
    tid, fid = resolve_token(lm, " capital"), resolve_token(lm, " of")
    c, x = encode(lm, CLEAN), encode(lm, CORRUPT)
    receiver = (1, 2, which)
    res = path_patching(lm, CLEAN, CORRUPT, " capital", " of", receiver=receiver, batch_size=3)
    assert torch.isnan(res.raw[1:]).all() and res.info["receiver"] == [1, 2, which]
    for h in range(res.raw.shape[1]):
        lg = _brute_receiver(lm, c, x, (0, h), receiver)
        assert float(res.raw[0, h]) == pytest.approx(_ld(lg, tid, fid), abs=2e-5), (lm.name, h)
    if which == "v":  # the effect is real: some sender moves the metric through the receiver's value
        assert (res.raw[0] - res.corrupted_metric).abs().max() > 1e-6


def test_path_errors():
    lm = get_model("tiny:llama")
    with pytest.raises(InputError, match="receiver"):
        path_patching(lm, CLEAN, CORRUPT, " capital", " of", receiver=(0, 1, "q"))
    with pytest.raises(InputError, match="'q', 'k' or 'v'"):
        path_patching(lm, CLEAN, CORRUPT, " capital", " of", receiver=(1, 1, "o"))
    with pytest.raises(InputError, match="unknown senders"):
        path_patching(lm, CLEAN, CORRUPT, " capital", " of", senders="neurons")
