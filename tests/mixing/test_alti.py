"""ALTI's own pieces: carrying rows back without the rollout, mixing matrices without it."""

from __future__ import annotations

import pytest
import torch

from lenscope.errors import InputError
from lenscope.mixing.alti import carry_back, mixing_matrices, rollout
from lenscope.models.runtime.trace import trace

from ..conftest import get_model
from ..tolerances import assert_same_computation


def _stochastic(L: int, n: int, causal: bool, gen: torch.Generator) -> torch.Tensor:
    C = torch.rand(L, n, n, generator=gen, dtype=torch.float64)
    if causal:
        C = C.tril()
    return C / C.sum(-1, keepdim=True)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("L,n,rows", [(1, 5, 1), (4, 7, 1), (6, 9, 3)])
def test_carry_back_equals_rollout(causal, L, n, rows):
    gen = torch.Generator().manual_seed(L * 100 + n + rows)
    C = _stochastic(L, n, causal, gen)
    deltas = torch.randn(L, rows, n, generator=gen, dtype=torch.float64)
    M = rollout(C)
    want = deltas.clone()
    for l in range(1, L):
        want[l] = deltas[l] @ M[l - 1]
    got = carry_back(C, deltas)
    assert got.dtype == torch.float64 and got.shape == (L, rows, n)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # mixing only redistributes: each carried row keeps its sum
    torch.testing.assert_close(got.sum(-1), deltas.sum(-1), rtol=1e-12, atol=1e-12)
    assert_same_computation(got[0], deltas[0], why="the first layer's rows, copied")


def test_carry_back_float32_contributions_and_bad_shapes():
    gen = torch.Generator().manual_seed(0)
    C = _stochastic(3, 6, True, gen)
    d = torch.randn(3, 2, 6, generator=gen)
    got = carry_back(C.float(), d)
    want = carry_back(C.float().double(), d.double())
    assert_same_computation(got, want, why="the same float64 operations: float32 input is promoted first")
    assert not d.dtype == torch.float64  # input untouched, output float64
    with pytest.raises(ValueError, match="do not match"):
        carry_back(C, torch.zeros(2, 1, 6))
    with pytest.raises(ValueError, match="do not match"):
        carry_back(C, torch.zeros(3, 1, 5))


def test_mixing_matrices_without_rollout(tmp_path):
    lm = get_model("tiny:gpt2")
    tr = trace(lm, "the cat sat on the mat and then")
    full = mixing_matrices(lm.anatomy, tr, "alti")
    lean = mixing_matrices(lm.anatomy, tr, "alti", rollout=False)
    assert lean.rollout is None
    assert_same_computation(lean.contributions, full.contributions,
                            why="the same contributions; the rollout left out after them")
    assert lean.row_sum_error <= full.row_sum_error + 1e-12
    # every position's own row carried back is the rollout: C^l M^{l-1} = M^l
    torch.testing.assert_close(carry_back(lean.contributions, lean.contributions).float(), full.rollout)
    assert "rollout" not in lean.to_frame().columns
    with pytest.raises(InputError, match="without their rollout"):
        lean.plot()
    back = type(lean).load(lean.save(tmp_path / "mm.safetensors"))
    assert back.rollout is None
    assert_same_computation(back.contributions, lean.contributions, why="saved and read back")


def _alti_float64_dense(A, tr, l):
    """The former ALTI: the (pos, src, d_model) parts in float64, ||y||_1 - ||y - part||_1, rows normalised."""
    from lenscope.mixing.alti import normalize_rows, proximity
    from lenscope.models.weights.algebra import attention_input_parts, f32, resid_mid_parts, value_writes

    dt = torch.float64
    z, _ = attention_input_parts(A.layers[l], tr, l, "sources", dt)
    writes = value_writes(A.layers[l].attn, z, True)
    n = z.shape[0]
    dec = resid_mid_parts(A, tr, l, torch.arange(n), "sources", writes=writes, dtype=dt)
    C = proximity(dec.parts, f32(tr.resid_mid[l], dt))
    return normalize_rows(C.tril() if A.causal else C)[0]


def test_float32_alti_equals_float64_dense(tiny):
    """The float32 kernel (min(u, 2a - u) per element, no difference of large norms) against the float64 dense
    formula on every family: contributions agree to ~5e-7 (measured 1.2e-7 .. 4.9e-7)."""
    from lenscope.mixing.alti import alti_layer

    tr = trace(tiny, "The cat sat on the mat because it was warm, and the dog watched it from the door. " * 2)
    A = tiny.anatomy
    for l in range(A.n_layers):
        C, err, bad = alti_layer(A, tr, l)
        ref = _alti_float64_dense(A, tr, l)
        assert C.dtype == torch.float32 and err < 1e-5
        assert float((C.double() - ref).abs().max()) < 2e-6
        C64, _, _ = alti_layer(A, tr, l, torch.float64)
        assert float((C64.double() - ref).abs().max()) < 1e-7  # float64 kernel: only the float32 output rounds


def test_factored_proximity_any_rows(tiny_decoder):
    """Rows in any order, some repeated, against the dense proximity; the total is the decomposition's."""
    from lenscope.mixing.alti import factored_proximity, proximity
    from lenscope.models.weights.algebra import f32, resid_mid_parts

    tr = trace(tiny_decoder, "one two three four five six seven eight nine ten eleven twelve")
    A = tiny_decoder.anatomy
    rows = torch.tensor([7, 2, 9, 2, 0])
    y = f32(tr.resid_mid[1])[rows]
    fac = resid_mid_parts(A, tr, 1, rows, "sources", factored=True)
    dense = resid_mid_parts(A, tr, 1, rows, "sources", dtype=torch.float64)
    c, total = factored_proximity(fac, y)
    torch.testing.assert_close(c.double(), proximity(dense.parts, y.double()), atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(total.double(), dense.total(), atol=1e-5, rtol=1e-5)
    causal, _ = factored_proximity(fac, y, causal=True)  # a causal row reads nothing after itself
    for r, p in enumerate(rows.tolist()):
        assert bool((causal[r, p + 1:] == 0).all())
        torch.testing.assert_close(causal[r, : p + 1], c[r, : p + 1])


@pytest.mark.slow
def test_float32_alti_on_smollm2():
    """smollm2 (30 layers, 9 heads) at 120 tokens: float32 contributions within 1e-6 of the float64 dense ones
    (measured 2.9e-7 at 256 tokens), rows exact stochastic, completeness ~1e-7."""
    from lenscope.mixing.alti import alti_layer

    lm = get_model("smollm2")
    tr = trace(lm, "In the spring of 1887 the small town by the river held its first fair, and farmers came from "
                   "every valley around to sell cattle, grain and cloth, while children watched the jugglers. " * 3)
    A = lm.anatomy
    for l in (0, 7, 15, 29):
        C, err, bad = alti_layer(A, tr, l)
        ref = _alti_float64_dense(A, tr, l)
        assert float((C.double() - ref).abs().max()) < 1e-6 and err < 1e-5 and bad == 0
        assert float((C.double().sum(-1) - 1).abs().max()) < 1e-6


def test_alti_logit_on_a_lean_trace(tiny_decoder):
    """ALTI-Logit (and the rollout row) on a lean trace, whose probabilities are recomputed per layer, equals the
    one on the full trace, and keeps its invariants."""
    from lenscope.attribution.context import alti_logit_explanation, rollout_explanation

    ids = list(range(5, 45))
    full, lean = trace(tiny_decoder, ids, pattern="keep"), trace(tiny_decoder, ids, pattern="recompute")
    for position in (-1, 20):
        a = alti_logit_explanation(tiny_decoder, ids, 7, 9, position=position, tr=full)
        b = alti_logit_explanation(tiny_decoder, ids, 7, 9, position=position, tr=lean)
        torch.testing.assert_close(b.layer_scores, a.layer_scores, atol=1e-5, rtol=1e-4)
        assert b.invariant_error < 1e-4
    r_full = rollout_explanation(tiny_decoder, ids, tr=full)
    r_lean = rollout_explanation(tiny_decoder, ids, tr=lean)
    torch.testing.assert_close(r_lean.layer_scores, r_full.layer_scores, atol=1e-5, rtol=1e-4)


def test_alti_blocks_do_not_change_results(monkeypatch):
    """One source and three rows per block, or everything in one block: the same contributions."""
    from lenscope.mixing import alti

    lm = get_model("tiny:qwen2")
    tr = trace(lm, "a b c d e f g h i j k l m n o p q r s t")
    ref, err, _ = alti.alti_layer(lm.anatomy, tr, 1)
    monkeypatch.setattr(alti, "ROW_BLOCK", 3)
    monkeypatch.setattr(alti, "BLOCK_BYTES", 1)
    small, err_small, _ = alti.alti_layer(lm.anatomy, tr, 1)
    monkeypatch.setattr(alti, "ROW_BLOCK", 10**6)
    monkeypatch.setattr(alti, "BLOCK_BYTES", 2**40)
    big, err_big, _ = alti.alti_layer(lm.anatomy, tr, 1)
    torch.testing.assert_close(small, ref, atol=1e-7, rtol=1e-6)
    torch.testing.assert_close(big, ref, atol=1e-7, rtol=1e-6)
    assert max(err, err_small, err_big) < 1e-5
