"""Lean traces: attention probabilities recomputed per layer, and the copies the model passes on shared."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lenscope.errors import InputError
from lenscope.mixing.alti import mixing_matrices
from lenscope.models.runtime.trace import (
    RecomputedLogits,
    RecomputedMLP,
    RecomputedNorm,
    RecomputedProbs,
    prefix_trace,
    recompute_probs,
    trace,
)
from lenscope.models.runtime.verify import verify

from ..conftest import get_model
from ..tolerances import assert_same_computation, assert_same_ints

TEXT = "The cat sat on the mat because it was warm, and the dog watched it from the door."


def _tensors(tr):
    out = {}
    for f in dataclasses.fields(tr):
        v = getattr(tr, f.name)
        if isinstance(v, dict):
            out |= {f"{f.name}.{k}": t for k, t in v.items() if isinstance(t, torch.Tensor)}
        elif isinstance(v, torch.Tensor):
            out[f.name] = v
    return out


def _field(tr, key):
    name, _, slot = key.partition(".")
    return getattr(tr, name)[slot] if slot else getattr(tr, name)


def test_lean_trace_equals_full_trace(tiny):
    full = trace(tiny, TEXT, pattern="keep")
    lean = trace(tiny, TEXT, pattern="recompute")
    assert isinstance(full.pattern, torch.Tensor) and isinstance(lean.pattern, RecomputedProbs)
    a, b = _tensors(full), _tensors(lean)
    assert a.pop("pattern") is full.pattern and a.pop("mlp_pre", None) is full.mlp_pre
    a.pop("mlp_up", None)
    # a mixture of experts: no pre-activations, the routing captured by both (small)
    assert (full.mlp_pre is None) == (lean.mlp_pre is None) == (full.routing_weights is not None)
    if tiny.anatomy.causal:  # ran with the last position's logits only; the others recomputed by the readout
        assert isinstance(lean.logits, RecomputedLogits) and a.pop("logits") is full.logits
        assert lean.logits.shape == full.logits.shape and lean.logits.dtype == full.logits.dtype
        torch.testing.assert_close(lean.logits[-1], full.logits[-1], atol=1e-6, rtol=1e-6)  # the model's own
        torch.testing.assert_close(lean.logits.materialize(), full.logits, atol=2e-5, rtol=1e-5)
        rows = torch.tensor([1, len(full.tokens) - 1])
        torch.testing.assert_close(lean.logits[rows], full.logits[rows], atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(lean.logits[2:5, 7], full.logits[2:5, 7], atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(lean.logits[3, :9], full.logits[3, :9], atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(lean.logits.argmax(-1), full.logits.argmax(-1))
        cut = prefix_trace(lean, 4).logits
        torch.testing.assert_close(cut[-1], full.logits[3], atol=2e-5, rtol=1e-5)
    recomputed = {k for k in a if isinstance(_field(lean, k), RecomputedNorm)}
    for k in recomputed:  # a block norm's output (Gemma's attn_write / mlp_write too, Granite's scaled writes),
        # recomputed from its input
        got, want = _field(lean, k), a.pop(k)
        assert got.shape == want.shape
        for l in range(full.n_layers):
            torch.testing.assert_close(got[l], want[l], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.narrow(1, 0, 3)[-1], want[-1, :3], atol=1e-5, rtol=1e-5)
    assert recomputed or tiny.anatomy.placement == "post"
    assert a.keys() <= b.keys()
    for k in a:  # every capture the lean trace shares instead of keeping is bitwise the one the model passed on
        assert_same_computation(a[k], b[k], why=f"the capture the model passed on, shared ({k})")
    # the shared copies: the residual stream is one stack
    assert lean.resid_post.untyped_storage().data_ptr() == lean.resid_pre.untyped_storage().data_ptr()
    assert_same_computation(lean.resid_post[:-1], lean.resid_pre[1:],
                            why="one stack: each block's output is the next one's input")
    # recomputed probabilities: what the model computed, up to float error
    P = lean.pattern
    assert P.shape == full.pattern.shape and P.dtype == torch.float32 and P.device == full.pattern.device
    L = full.n_layers
    for l in range(L):
        torch.testing.assert_close(P[l], full.pattern[l], atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(P[-1], full.pattern[L - 1], atol=2e-6, rtol=1e-5)
    rows = torch.tensor([0, 3, 5])
    torch.testing.assert_close(P[1][:, rows], full.pattern[1][:, rows], atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(P[1, 0], full.pattern[1, 0], atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(P[torch.tensor(1)], full.pattern[1], atol=2e-6, rtol=1e-5)
    # anything else materialises the whole tensor
    torch.testing.assert_close(P.materialize(), full.pattern, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(P[:, 0], full.pattern[:, 0], atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(P.sum(-1), full.pattern.sum(-1), atol=1e-5, rtol=1e-5)
    assert bool(torch.isfinite(P).all())
    assert len(P) == L and P.dim() == P.ndim == 4 and P.size(2) == len(full.tokens)
    # the MLP's pre-activations, recomputed from its input
    if full.mlp_pre is None:  # a mixture of experts
        assert full.mlp_up is None and lean.mlp_up is None
        assert_same_computation(lean.routing_weights, full.routing_weights, why="the same capture, lean or full")
        assert_same_computation(lean.router_logits, full.router_logits, why="the same capture, lean or full")
    else:
        assert isinstance(lean.mlp_pre, RecomputedMLP) and lean.mlp_pre.shape == full.mlp_pre.shape
    assert (lean.mlp_up is None) == (full.mlp_up is None)
    for name in () if full.mlp_pre is None else ("mlp_pre", "mlp_up") if full.mlp_up is not None else ("mlp_pre",):
        want, got = getattr(full, name), getattr(lean, name)
        for l in range(L):
            torch.testing.assert_close(got[l], want[l], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got[:, 2], want[:, 2], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.narrow(1, 0, 4)[0], want[0, :4], atol=1e-5, rtol=1e-5)
    assert verify(tiny, tr=lean).ok


def test_lean_prefix_and_mixing(tiny_decoder):
    full = trace(tiny_decoder, TEXT, pattern="keep")
    lean = trace(tiny_decoder, TEXT, pattern="recompute")
    n = len(full.tokens) - 4
    pf, pl = prefix_trace(full, n), prefix_trace(lean, n)
    assert pl.pattern.shape == pf.pattern.shape
    if pf.mlp_pre is None:  # a mixture of experts: the routing is cut with the positions
        experts = full.routing_weights.shape[-1]
        assert pl.routing_weights.shape == pf.routing_weights.shape == (full.n_layers, n, experts)
        torch.testing.assert_close(pl.routing_weights, full.routing_weights[:, :n])
    else:
        assert pl.mlp_pre.shape == pf.mlp_pre.shape
        torch.testing.assert_close(pl.mlp_pre[1], pf.mlp_pre[1], atol=1e-5, rtol=1e-5)
    for l in range(full.n_layers):
        torch.testing.assert_close(pl.pattern[l], pf.pattern[l], atol=2e-6, rtol=1e-5)
    half = lean.pattern.narrow(2, 0, n)  # rows cut first, keys still whole
    assert half.shape[2:] == (n, len(full.tokens))
    torch.testing.assert_close(half[0], full.pattern[0, :, :n], atol=2e-6, rtol=1e-5)
    A = tiny_decoder.anatomy
    m_full, m_lean = mixing_matrices(A, pf, "alti"), mixing_matrices(A, pl, "alti")
    torch.testing.assert_close(m_lean.contributions, m_full.contributions, atol=1e-5, rtol=1e-4)
    assert m_lean.completeness_error < 1e-5


def test_auto_recomputes_only_long_float32_inputs(monkeypatch):
    lm = get_model("tiny:llama")
    n = 20
    assert not recompute_probs(lm, n)
    assert recompute_probs(lm, n, "recompute") and not recompute_probs(lm, n, "keep")
    import lenscope.models.runtime.trace as trace_module

    monkeypatch.setattr(trace_module, "KEEP_BYTES", 1000)
    assert recompute_probs(lm, n)
    tr = trace(lm, list(range(5, 5 + n)))
    assert isinstance(tr.pattern, RecomputedProbs)
    assert not recompute_probs(lm, n, "keep")
    smollm2_like = 4 * (30 * 9 * 1024 * 1024 + 30 * 1024 * 1536 * 2 + 1023 * 49152)
    assert smollm2_like > trace_module.KEEP_BYTES  # ALTI-Logit's 1,024 tokens on smollm2 get a lean trace
    assert trace_module.lean_bytes(lm, n) == 4 * (lm.anatomy.n_layers * lm.anatomy.layers[0].attn.n_heads * n * n
                                                  + lm.anatomy.n_layers * n * lm.anatomy.layers[0].mlp.d_mlp * 2
                                                  + (n - 1) * lm.anatomy.vocab_size)
    with pytest.raises(InputError, match="pattern must be"):
        recompute_probs(lm, n, "lazy")


def _held_bytes(tr) -> int:
    seen, total = set(), 0
    for t in _tensors(tr).values():
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def test_lean_trace_holds_less(tiny_decoder):
    """A lean trace keeps no (pos, src) probabilities, no d_mlp pre-activations, no logits but the last row, and
    one stack of the residual stream: on a 60-token text it holds a fraction of the full trace's bytes."""
    ids = list(range(3, 63))
    full, lean = trace(tiny_decoder, ids, pattern="keep"), trace(tiny_decoder, ids, pattern="recompute")
    A = tiny_decoder.anatomy
    d, n, L = A.d_model, len(ids), A.n_layers
    assert _held_bytes(lean) < _held_bytes(full) - 4 * L * n * (n + d)  # at least the probabilities and one copy
    # what a lean trace holds: the residual stack (with the final norm's input), resid_mid, attn_out, mlp_out,
    # the final norm's output and the last row of logits (a mixture of experts: its router logits and routing too)
    moe = full.routing_weights is not None
    per_pos = 4 * ((L + 1) + 3 * L + 1) * d + (8 * L * full.routing_weights.shape[-1] if moe else 0)
    assert _held_bytes(lean) <= per_pos * n + 4 * A.vocab_size + 4096


def test_recomputed_reads_like_a_tensor():
    """Operators, numpy, iteration and torch functions on the recomputed captures give the tensor's answers."""
    import numpy as np

    lm = get_model("tiny:llama")
    full, lean = trace(lm, TEXT, pattern="keep"), trace(lm, TEXT, pattern="recompute")
    P, Q = lean.pattern, full.pattern
    for got, want in [(P + 1, Q + 1), (1 - P, 1 - Q), (P * 2, Q * 2), (-P, -Q), (abs(P), Q.abs()), (P ** 2, Q ** 2),
                      (P / 2, Q / 2), (P @ Q[0, 0].T, Q @ Q[0, 0].T), (torch.stack([P[0], P[1]]), Q[:2]),
                      (torch.softmax(P, -1), torch.softmax(Q, -1)), (lean.logits.log_softmax(-1),
                                                                     full.logits.log_softmax(-1))]:
        torch.testing.assert_close(got, want, atol=5e-5, rtol=1e-5)
    assert_same_ints(P > 0.5, P.materialize() > 0.5)
    assert_same_ints(P == 0, P.materialize() == 0)
    np.testing.assert_allclose(np.asarray(P), Q.numpy(), atol=2e-6)
    layers = list(P)
    assert len(layers) == full.n_layers and all(torch.allclose(a, b, atol=2e-6) for a, b in zip(layers, Q))
    assert "RecomputedProbs(shape=" in repr(P) and hash(P) == hash(P)


def test_verify_given_a_lean_trace_checks_the_model_itself(monkeypatch):
    """A lean trace's attention probabilities are lenscope's own recomputation: verify must not compare them with
    themselves, so it captures the model's (a wrong reading of the model then still fails)."""
    lm = get_model("tiny:llama")
    lean = trace(lm, TEXT, pattern="recompute")
    import lenscope.models.runtime.verify as V

    seen = []
    real_trace = V.trace
    monkeypatch.setattr(V, "trace", lambda *a, **k: seen.append(k) or real_trace(*a, **k))
    rep = verify(lm, tr=lean)
    assert rep.ok and seen == [{"pattern": "keep"}]
    full = real_trace(lm, TEXT, pattern="keep")
    seen.clear()
    verify(lm, tr=full)
    assert seen == []  # a full trace is used as it is
