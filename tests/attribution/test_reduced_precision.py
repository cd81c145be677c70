"""bfloat16 / float16 models: the decompositions compute in float32 from the reduced-precision weights, accept the
model's own rounding (``completeness_tolerance``) and report their error honestly."""

from __future__ import annotations

import pytest
import torch

import lenscope
from lenscope.mixing.maps import context_mixing
from lenscope.models.runtime.verify import completeness_tolerance

TEXT = "The capital of France is"


@pytest.mark.parametrize("anatomy_dtype", [None, "model"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_decompositions_in_reduced_precision(dtype, anatomy_dtype):
    lm = lenscope.load("tiny:llama", dtype=dtype, anatomy_dtype=anatomy_dtype)
    tol = completeness_tolerance(lm)
    eps = torch.finfo(getattr(torch, dtype)).eps
    assert tol >= 1e-3 and tol == pytest.approx(max(1e-3, 16 * eps))
    dla = lenscope.direct_logit_attribution(lm, TEXT, " capital", " of", by_head=True)
    tr = lenscope.trace(lm, TEXT)
    diff = float(tr.logits[-1, dla.target_id].float() - tr.logits[-1, dla.foil_id].float())
    assert dla.values.dtype == torch.float32 and abs(dla.total - diff) <= 4 * eps * max(1.0, abs(diff)) + 1e-3
    maps = context_mixing(lm, TEXT)  # refuses beyond the dtype's tolerance, so passing is the check
    assert max(m.completeness_error for m in maps.values()) <= tol
    for method in ("logit", "alti-logit", "alti"):
        e = lenscope.explain(lm, TEXT, None if method == "alti" else " capital", None if method == "alti" else " of",
                             method=method)
        assert e.invariant_error <= tol and torch.isfinite(e.scores).all()
    g = lenscope.explain(lm, TEXT, " capital", " of", method="grad-x-input")
    assert torch.isfinite(g.scores).all()
