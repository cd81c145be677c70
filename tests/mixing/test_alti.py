"""ALTI's own pieces: carrying rows back without the rollout, mixing matrices without it."""

from __future__ import annotations

import pytest
import torch

from lenscope.errors import InputError
from lenscope.mixing.alti import carry_back, mixing_matrices, rollout
from lenscope.models.trace import trace

from ..conftest import get_model


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
    assert torch.equal(got[0], deltas[0])


def test_carry_back_float32_contributions_and_bad_shapes():
    gen = torch.Generator().manual_seed(0)
    C = _stochastic(3, 6, True, gen)
    d = torch.randn(3, 2, 6, generator=gen)
    got = carry_back(C.float(), d)
    want = carry_back(C.float().double(), d.double())
    torch.testing.assert_close(got, want, rtol=0, atol=0)
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
    assert torch.equal(lean.contributions, full.contributions)
    assert lean.row_sum_error <= full.row_sum_error + 1e-12
    # every position's own row carried back is the rollout: C^l M^{l-1} = M^l
    torch.testing.assert_close(carry_back(lean.contributions, lean.contributions).float(), full.rollout)
    assert "rollout" not in lean.to_frame().columns
    with pytest.raises(InputError, match="without their rollout"):
        lean.plot()
    back = type(lean).load(lean.save(tmp_path / "mm.safetensors"))
    assert back.rollout is None and torch.equal(back.contributions, lean.contributions)
