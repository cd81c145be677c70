"""Patching without what a patch cannot change (issue 46): the reusing sweep (the base run's earlier blocks and
positions reused, the engine's ``start_at`` and key/value cache) against the full recomputation (``reuse=False``)
on every decoder family, each node kind; the engine's ``start_at``; the batch plan; the encoders' fallback."""

import pytest
import torch

from lenscope.errors import InputError
from lenscope.interventions import Edit, activation_patching, run
from lenscope.interventions.patching import patch_nodes, reuse_batches
from lenscope.models.runtime.engine import new_cache

from ..conftest import get_model
from ..tolerances import assert_same_computation, logit_diff_scale, pass_rounding

P = 12  # longer than the tiny models' sliding windows (4 to 6): a cache of earlier positions crosses them


def pair(lm, seed=1):
    """A clean prompt of ``P`` random tokens and a corrupted one with two tokens changed; target and foil ids."""
    V = min(lm.anatomy.vocab_size, 200)
    c = torch.randint(5, V, (P,), generator=torch.Generator().manual_seed(seed))
    x = c.clone()
    x[2], x[6] = (x[2] + 7) % V, (x[6] + 3) % V
    return c, x, 10, 11


def tolerance(lm, c, x, tid, fid):
    """Both sides are float32 evaluations of the same patched model, each within :func:`pass_rounding` times the
    size of the sum that makes the logit difference (a patched run's final state mixes the clean and corrupted
    runs', so the larger of their scales) of the exact value."""
    return 2 * pass_rounding(lm) * max(logit_diff_scale(lm, c, tid, fid), logit_diff_scale(lm, x, tid, fid))


def test_reusing_sweep_equals_full_recomputation(tiny_decoder):
    lm = tiny_decoder
    c, x, tid, fid = pair(lm)
    tol = tolerance(lm, c, x, tid, fid)
    for what, hp in (("resid", None), ("attn", None), ("mlp", None), ("heads", None), ("heads", 4)):
        for pos, noising in ((-1, False), (7, True)):
            kw = dict(what=what, position=pos, head_position=hp, noising=noising, batch_size=5)
            fast = activation_patching(lm, c, x, f"#{tid}", f"#{fid}", **kw)
            full = activation_patching(lm, c, x, f"#{tid}", f"#{fid}", reuse=False, **kw)
            err = float((fast.raw - full.raw).abs().max())
            assert err <= tol, (what, hp, pos, err, tol)


def test_patch_nodes_every_kind_and_prompt(tiny_decoder):
    """Several prompts (each row its own target), nodes at one position and at every position, per head and per
    key/value head, in one call: the same metrics as the full recomputation."""
    lm = tiny_decoder
    (c1, x1, tid, fid), (c2, x2, _, _) = pair(lm, 1), pair(lm, 2)
    base, src = torch.stack([c1, c2]), torch.stack([x1, x2])
    L, A = lm.anatomy.n_layers, lm.anatomy.layers[0].attn
    sites = [("resid_pre", layer) for layer in range(L)] + [(s, layer) for s in ("attn_out", "mlp_out", "head", "q",
                                                                                   "k", "v") for layer in range(L)]
    _, got = run(lm, src, capture=sites)
    source = {k: got[k] for k in sites}
    nodes = [("resid_pre", layer, p, None) for layer in range(L) for p in (0, 5, 9, 11)]
    nodes += [(s, layer, p, None) for s in ("attn_out", "mlp_out") for layer in range(L) for p in (None, 3)]
    nodes += [("head", layer, p, h) for layer in range(L) for p in (None, 6) for h in range(A.n_heads)]
    nodes += [("q", L - 1, 8, 0), ("k", 0, 4, A.n_kv_heads - 1), ("v", L - 1, 10, 0)]
    target, foil = torch.tensor([tid, fid]), torch.tensor([fid, tid])
    kw = dict(position=9, batch_size=7)
    fast = patch_nodes(lm, base, source, nodes, "logit_diff", target, foil, **kw)
    full = patch_nodes(lm, base, source, nodes, "logit_diff", target, foil, reuse=False, **kw)
    tol = 2 * max(tolerance(lm, c, x, tid, fid) for c, x in ((c1, x1), (c2, x2)))
    assert fast.shape == full.shape == (len(nodes), 2)
    assert float((fast - full).abs().max()) <= tol
    last = patch_nodes(lm, base, source, nodes[:8], "prob", tid, None, position=P - 1, last_only=True)
    ref = patch_nodes(lm, base, source, nodes[:8], "prob", tid, None, position=P - 1, last_only=True, reuse=False)
    assert float((last - ref).abs().max()) <= tol  # a probability moves by at most its logits' error


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt2", "bloom"])
def test_engine_start_at(family):
    """A run that starts at block ``l`` from the residual stream a full run had there, with or without a cache of
    the earlier positions, gives that run's logits; the skipped blocks' sites are refused."""
    lm = get_model(f"tiny:{family}")
    c, _, tid, fid = pair(lm)
    ids = c[None].repeat(2, 1)
    L = lm.anatomy.n_layers
    lg, cap = run(lm, ids, capture=[("resid_pre", layer) for layer in range(L)])
    tol = pass_rounding(lm) * float(lg.abs().max()) * lm.anatomy.d_model ** 0.5
    for layer in range(1, L):
        out, _ = run(lm, ids, start_at=layer, start=cap[("resid_pre", layer)])
        assert float((out - lg).abs().max()) <= tol
        cache = new_cache(lm)
        run(lm, ids[:, :7], past=cache, last_only=True)
        out, _ = run(lm, ids[:, 7:], past=cache, start_at=layer, start=cap[("resid_pre", layer)][:, 7:])
        assert float((out - lg[:, 7:]).abs().max()) <= tol
    start = cap[("resid_pre", 1)]
    with pytest.raises(InputError, match="starts at block 1"):
        run(lm, ids, [Edit("resid_pre", 0, torch.tensor([0]), torch.tensor([0]), start[0, :1])], start_at=1,
            start=start)
    with pytest.raises(InputError, match="starts at block 1"):
        run(lm, ids, capture=[("mlp_out", 0)], start_at=1, start=start)
    with pytest.raises(InputError, match="start_at"):
        run(lm, ids, start_at=1, start=start[:, :3])
    # the model is untouched afterwards: a plain run gives the same logits as before
    again, _ = run(lm, ids, capture=[("resid_pre", layer) for layer in range(L)])
    assert_same_computation(again, lg, "the same plain run of the same ids")


def test_reuse_batches_cover_every_row_once():
    layers = [layer for layer in range(6) for p in range(10)]
    firsts = [p for layer in range(6) for p in range(10)]
    for b, size in ((1, 8), (3, 5), (2, 64), (1, 1)):
        batches = reuse_batches(layers, firsts, b, size)
        rows = sorted(r for chunk in batches for r in chunk)
        assert rows == list(range(len(layers) * b))
        assert all(0 < len(chunk) <= size for chunk in batches)
        starts = [min(firsts[r // b] for r in chunk) for chunk in batches]
        assert starts == sorted(starts)  # one prefix cache at a time
    # a sweep's batches start late in both blocks and positions: about a quarter of the full work or less
    layers = [layer for layer in range(30) for p in range(100)]
    firsts = [p for layer in range(30) for p in range(100)]
    work = sum(len(ch) * (30 - min(layers[r] for r in ch)) * (100 - min(firsts[r] for r in ch))
               for ch in reuse_batches(layers, firsts, 1, 64))
    assert work / (3000 * 30 * 100) < 0.36
    assert reuse_batches([], [], 1, 4) == []


def test_encoders_recompute_in_full():
    """No cache and no earlier-positions rule in a bidirectional model: reuse falls back to the full
    recomputation (the same operations)."""
    lm = get_model("tiny:bert")
    c, x, tid, fid = pair(lm)
    _, got = run(lm, x[None], capture=[("resid_pre", 1)])
    nodes = [("resid_pre", 1, p, None) for p in range(P)]
    kw = dict(position=P - 1, batch_size=5)
    a = patch_nodes(lm, c[None], {("resid_pre", 1): got[("resid_pre", 1)]}, nodes, "logit_diff", tid, fid, **kw)
    b = patch_nodes(lm, c[None], {("resid_pre", 1): got[("resid_pre", 1)]}, nodes, "logit_diff", tid, fid,
                    reuse=False, **kw)
    assert_same_computation(a, b, "both the full recomputation's batches")
