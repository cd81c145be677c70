"""Tolerances derived from the computation, never tuned to one CPU (issue 29).

torch picks its CPU kernels by the CPU (``ATEN_CPU_CAPABILITY=default|avx2|avx512``) and so does MKL for the
matmuls (``MKL_ENABLE_INSTRUCTIONS``; an AMD CPU gets other ones, and some are not even the same for another batch
size): each rounds float32 differently. A float32 result is therefore compared with an exact (float64) or another
float32 evaluation within a multiple of ``u = 2^-24`` (float32's unit roundoff) times the scale of what was summed
or cancelled to produce it, not within a fixed absolute number. ``./dev test`` runs the numerical suites on a
second kernel level to show that these bounds hold there too.
"""

from __future__ import annotations

import math

import torch

U32 = 2.0**-24  # float32's unit roundoff


def pass_rounding(lm) -> float:
    """The relative rounding of one float32 pass (forward or backward) through ``lm``, as a multiple of the size
    of the terms summed into a result: every block's matmuls (attention's four, the MLP's two or three) round to
    a few u relative to what they multiply, and another kernel or batch shape may round each differently; we
    allow 16 u per block and 16 u for the embedding and the unembedding together. Measured on the tiny models
    (batched vs single runs with MKL's AVX2 kernels, ATEN default/avx2/avx512): at most 6.5 u of the scales
    used below, i.e. 7x inside this for two blocks."""
    return 16 * U32 * (lm.anatomy.n_layers + 1)


def logit_diff_scale(lm, ids: torch.Tensor, target: int, foil: int | None = None, position: int = -1) -> float:
    """The size of the sum that makes ``logit[target] - logit[foil]`` at ``position`` of ``ids (pos,)``:
    ``sum_i |x_i| |W_U[i, target] - W_U[i, foil]|`` with ``x`` the features that multiply the unembedding (plus
    the bias difference). A float32 logit difference is off by at most about :func:`pass_rounding` times this."""
    import lenscope
    from lenscope.models.readout import Readout

    ro = Readout.from_anatomy(lm.anatomy)
    x = ro.features(lenscope.trace(lm, ids).final_resid[position].float())
    w = ro.W_U[:, target].float() - (ro.W_U[:, foil].float() if foil is not None else 0.0)
    b = 0.0
    if ro.b_U is not None:
        b = abs(float(ro.b_U[target] - (ro.b_U[foil] if foil is not None else 0.0)))
    return float((x.abs() * w.abs()).sum()) + b


def kl_tol(vocab: int, logits_max: float = 0.0) -> float:
    """|float32 KL - exact KL| for distributions over ``vocab`` tokens whose logits are at most ``logits_max`` in
    size. However a KL is formed (``sum p (log p - log q)``, or ``sum p log p - p . z + lse(z)``), it is a small
    difference of a few sums over the vocabulary (an entropy, a cross-entropy, ``p . z``, a log-partition), each at
    most ``ln V + 2 max|z|`` in size. Each entry is rounded to about u relative and a pairwise sum of V entries adds
    at most ``log2(V)`` u relative to the sum of their sizes: (log2 V + 2) u (ln V + 2 max|z|) in all. Measured: a
    KL of 0 (the output state) came out at 0.09 of this, whichever kernels ran."""
    return (math.log2(vocab) + 2) * U32 * (math.log(vocab) + 2 * logits_max)



def moe_sum_tol(moe, hidden: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``(pos, d_model)``: how far the sum of a mixture of experts' weighted outputs may be from the real block's
    output in float32, entry by entry. Each entry is a sum over the chosen experts (``top_k``) of down-projections
    (dot products of length ``d_ff``) of the hidden units, weighted: Higham's bound for such a sum of ``n`` products
    is ``gamma_n ~ n u`` times the sum of the absolute products, ``S = sum_e w_e (sum_j |h_e[j]| |W_out[e, j, i]| +
    |b_out[e, i]|)``, with ``n = d_ff + top_k``, whichever order or kernel each side sums in. ``hidden``: the
    ``mlp_hidden`` capture ``(pos, n_experts * d_ff)``; ``weights``: the routing weights ``(pos, n_experts)``.
    Measured on the tiny MoE families at 1 and 2 threads and ATEN default/avx2: at most 7.4 u S (gpt-oss), inside
    this by 4x or more."""
    W = moe.experts.W_out.double()  # (expert, d_ff, d_model)
    E, d_ff = W.shape[0], W.shape[1]
    h = hidden.double().reshape(hidden.shape[0], E, d_ff).abs()
    w = weights.double()
    S = torch.einsum("pe,pej,eji->pi", w, h, W.abs())
    if moe.experts.b_out is not None:
        S = S + w @ moe.experts.b_out.double().abs()
    return (d_ff + moe.top_k) * U32 * S

def assert_derivative(f, grad: float, eps: float, rounding: float) -> None:
    """``grad`` is the derivative at 0 of ``f`` (a float function of one step, run through the model), checked by
    central differences at two steps instead of a fixed relative tolerance. ``d(h) = (f(h) - f(-h)) / 2h`` is off
    from the derivative by ``C h^2`` (truncation, ``C`` = the third derivative / 6) plus at most ``rounding / h``
    (``rounding``: the error of one evaluation of ``f``, e.g. ``pass_rounding(lm) * logit_diff_scale(...)``).
    Richardson's argument: ``d(eps) - d(eps/2)`` is ``3 C (eps/2)^2`` up to their rounding, so ``d(eps/2)`` is within
    ``|d(eps) - d(eps/2)| / 3`` of the derivative up to higher orders; we allow the whole ``|d(eps) - d(eps/2)|``
    (3x for the higher orders) plus both differences' rounding. A gradient with a wrong sign, factor or entry misses
    this by far wherever the function is smooth on [-eps, eps] (no routing or other switch inside the step)."""
    d1 = (f(eps) - f(-eps)) / (2 * eps)
    d2 = (f(eps / 2) - f(-eps / 2)) / eps
    if isinstance(d2, torch.Tensor):  # many derivatives at once, entry by entry (``rounding`` may be a tensor too)
        d1, d2, grad = d1.double(), d2.double(), torch.as_tensor(grad).double()
        tol = (d1 - d2).abs() + 3 * torch.as_tensor(rounding).double() / eps
        bad = (d2 - grad).abs() > tol
        assert not bool(bad.any()), (f"finite differences (steps {eps}, {eps / 2}) against the gradient at "
                                     f"{bad.nonzero().flatten().tolist()}: {d1[bad].tolist()}, {d2[bad].tolist()} "
                                     f"against {grad[bad].tolist()} (tolerance {tol[bad].tolist()})")
        return
    tol = abs(d1 - d2) + rounding / eps + 2 * rounding / eps
    assert abs(d2 - grad) <= tol, (f"finite differences {d1:.8g} (step {eps}) and {d2:.8g} (step {eps / 2}) against "
                                   f"the gradient {grad:.8g}: off by {abs(d2 - grad):.3g} > {tol:.3g}")


def _same(a, b, path: str) -> str | None:
    """The first place where ``a`` and ``b`` differ bit for bit (None where they are identical): tensors (dtype,
    shape, values, NaN where NaN), numpy arrays, numbers and nested lists, tuples and dicts of them."""
    import numpy as np

    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = torch.as_tensor(np.asarray(a)), torch.as_tensor(np.asarray(b))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"{path}: a tensor against {type(b if isinstance(a, torch.Tensor) else a).__name__}"
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{path}: {a.dtype} {tuple(a.shape)} against {b.dtype} {tuple(b.shape)}"
        if torch.equal(a, b):
            return None
        if a.is_floating_point() or a.is_complex():
            if torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0)):
                return None
            d = (a.double() - b.double()).abs().nan_to_num(float("inf"))
            return f"{path}: differ at {int((d > 0).sum())} of {a.numel()} entries, by up to {float(d.max()):.3g}"
        return f"{path}: differ at {int((a != b).sum())} of {a.numel()} entries"
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return f"{path}: keys {sorted(map(str, set(a) ^ set(b)))} differ"
        for k in a:
            if (m := _same(a[k], b[k], f"{path}.{k}")) is not None:
                return m
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"{path}: lengths {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            if (m := _same(x, y, f"{path}[{i}]")) is not None:
                return m
        return None
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return None
    return None if (type(a) is type(b) or {type(a), type(b)} <= {int, float}) and a == b else f"{path}: {a!r} != {b!r}"


def assert_same_computation(a, b, why: str) -> None:
    """``a`` and ``b`` are bit for bit equal because they come from the same operations on the same shapes in the
    same order (``why`` says which, in a few words): the one place the suite compares floating-point results
    exactly (tests/test_ci_policy.py fails on any other exact comparison). Two different computations (another
    code path, batch shape, cache setting, thread count or process) are never compared here: they get a tolerance
    derived from the computation (the functions above)."""
    if not isinstance(why, str) or len(why.split()) < 3:
        raise ValueError("assert_same_computation: say in a few words why both sides run the same operations")
    msg = _same(a, b, "$")
    assert msg is None, f"not the same computation ({why}): {msg}"


def assert_same_ints(a, b) -> None:
    """Exact equality of integer or boolean data (token ids, indices, masks, counts): no rounding is involved, so
    no reason is needed; floating-point data is refused here (use :func:`assert_same_computation` or a tolerance)."""
    for x in (a, b):
        if isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex()):
            raise TypeError(f"assert_same_ints got a {x.dtype} tensor: floating-point results need "
                            "assert_same_computation (with why) or a tolerance")
    msg = _same(a, b, "$")
    assert msg is None, msg
