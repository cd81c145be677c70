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
    from lenscope.models.weights.readout import Readout

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
    a, b = (x.item() if isinstance(x, np.generic) else x for x in (a, b))  # a numpy scalar as the Python number
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
            d[a.isnan() & b.isnan()] = 0.0  # NaN where NaN is the same
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
    # numbers of either type; strings of any str subclass (torch.__version__ is a TorchVersion, a JSON copy a str)
    kind = type(a) is type(b) or {type(a), type(b)} <= {int, float} or (isinstance(a, str) and isinstance(b, str))
    return None if kind and a == b else f"{path}: {a!r} != {b!r}"


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


def _as_ints(x, path: str):
    """``x`` as an integer tensor or a nested list of Python ints; an AssertionError naming ``path`` where it holds
    floating-point data (a float tensor or array, a Python float, even 1.0)."""
    import numpy as np

    if isinstance(x, (np.ndarray, np.generic)):
        x = torch.as_tensor(np.asarray(x))
    if isinstance(x, torch.Tensor):
        assert not (x.is_floating_point() or x.is_complex()), (
            f"{path}: {x.dtype} data is not integers: compare it with assert_same_computation (with why) or within "
            f"a tolerance derived from the computation")
        return x
    if isinstance(x, (list, tuple)):
        return [_as_ints(v, f"{path}[{i}]") for i, v in enumerate(x)]
    assert isinstance(x, (int, bool, np.integer, np.bool_)), (
        f"{path}: {x!r} ({type(x).__name__}) is not an integer: compare it with assert_same_computation (with why) "
        f"or within a tolerance derived from the computation")
    return int(x)


def _ints_differ(a, b, path: str) -> str | None:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        a, b = (torch.as_tensor(v) if not isinstance(v, torch.Tensor) else v for v in (a, b))
        if a.shape != b.shape:
            return f"{path}: shapes {tuple(a.shape)} and {tuple(b.shape)}"
        return _same(a.cpu().long(), b.cpu().long(), path)  # integers of any width compared as int64
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return f"{path}: lengths {len(a)} != {len(b)}"
        return next((m for i, (x, y) in enumerate(zip(a, b)) if (m := _ints_differ(x, y, f"{path}[{i}]"))), None)
    return None if (not isinstance(a, list) and not isinstance(b, list) and a == b) else f"{path}: {a!r} != {b!r}"


def assert_same_ints(a, b) -> None:
    """``a`` and ``b`` hold the same integers (token ids, indices, masks, counts): integer or bool tensors, numpy
    arrays, Python ints and nested lists or tuples of them, in the same shape. Integers are exact on every CPU, so
    no reason is asked; floating-point data on either side fails (it needs :func:`assert_same_computation` and its
    reason, or a tolerance)."""
    msg = _ints_differ(_as_ints(a, "a"), _as_ints(b, "b"), "$")
    assert msg is None, f"not the same integers: {msg}"


def unit_roundoff(dtype: torch.dtype) -> float:
    """``u`` of a floating-point dtype, half its machine epsilon: 2^-24 (float32, :data:`U32`), 2^-53 (float64),
    2^-8 (bfloat16), 2^-11 (float16). One correctly rounded operation is off by at most ``u`` relative."""
    return float(torch.finfo(dtype).eps) / 2


def matmul_rounding(x: torch.Tensor, W: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """Per entry of ``x @ W + b`` ``(..., n_out)``: how far two evaluations of it may lie apart, whatever kernel,
    memory layout (a transposed view, another alignment) or summation order each used. Each entry is a sum of
    ``n = d_in + 1`` terms (the products and the bias); a sum of ``n`` terms in any order, with or without fused
    multiply-adds, is within ``gamma_n = n u / (1 - n u)`` of the exact sum relative to the sum of the terms' sizes
    (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., section 3.1; the products' own rounding is
    one more u, inside it). Two evaluations are then within ``2 gamma_n (|x| @ |W| + |b|)``: a worst case over
    every order, with ``u`` of ``x``'s dtype (a kernel's real error is a few u of the same scale)."""
    n = x.shape[-1] + 1
    u = unit_roundoff(x.dtype)
    size = x.abs() @ W.abs().to(x.dtype)
    if b is not None:
        size = size + b.abs().to(x.dtype)
    return 2 * (n * u / (1 - n * u)) * size


def moe_rounding(moe, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Per entry ``(token, d_model)``: how far two evaluations of a mixture-of-experts block's output
    ``sum_e w_e y_e(x)`` may lie apart (the model's loop over experts against the Anatomy's recomputation: other
    batch shapes of the routed tokens, other kernels, another order of the experts' sum). ``moe``: the block's
    :class:`~lenscope.models.weights.moe.MoE`; ``x (token, d_model)`` its input; ``weights (token, expert)`` the
    routing.

    An expert is three matmuls (gate ``g = x W_gate``, up ``v = x W_in``, out ``y = h W_out``) around the
    elementwise ``h = act(g) up(v)``. Each matmul's entry is off by a few u of the sum of its terms' sizes; an error
    in ``g`` or ``v`` reaches ``h`` times the slope ``|dh/dg|``, ``|dh/dv|``, and ``y`` through ``|W_out|``. To first
    order one expert's output is therefore off by a few u times

        S_e = |h| @ |W_out| + (|dh/dg| (|x| @ |W_gate| + |b_gate|) + |dh/dv| (|x| @ |W_in| + |b_in|)) @ |W_out|

    (the sizes summed into ``y``, with those summed upstream carried through), the weight multiplies it by
    ``w_e``, and adding the ``k`` chosen experts' outputs adds at most ``(k - 1) u sum_e w_e |y_e| <= (k - 1) u S``
    with ``S = sum_e w_e S_e``. We allow 16 u per expert for its matmul chain, as :func:`pass_rounding` does per
    block, plus the sum: ``(16 + k - 1) u S`` with ``u`` of ``x``'s dtype. Measured on the tiny MoE families:
    at most 1.2 u S (relative to the largest expert's output the same errors reach 120 u: the scale is what was
    summed, not what came out)."""
    import dataclasses

    u = unit_roundoff(x.dtype)
    S = torch.zeros_like(x)
    for e in range(moe.n_experts):
        t = weights[:, e] != 0
        if not bool(t.any()):
            continue
        ex, xe = moe.expert(e), x[t]
        with torch.enable_grad():
            g, v = (p.detach().requires_grad_(True) if p is not None else None for p in ex.pre(xe))
            h = ex.act_fn(g) * ex.up_fn(v) if v is not None else ex.act_fn(g)
            slopes = torch.autograd.grad(h.sum(), [g] if v is None else [g, v])  # elementwise: the slopes
        # the sizes summed into g and v: the same matmuls on |x| and the weights' and biases' absolute values
        absolute = dataclasses.replace(ex, **{n: getattr(ex, n).abs() for n in ("W_in", "b_in", "W_gate", "b_gate")
                                               if getattr(ex, n) is not None})
        sizes = [s for s in absolute.pre(xe.abs()) if s is not None]
        upstream = sum(d.abs() * s for d, s in zip(slopes, sizes))
        out = (h.detach().abs() + upstream) @ ex.W_out.abs() + (ex.b_out.abs() if ex.b_out is not None else 0)
        S[t] += out * weights[t, e, None]
    return (16 + moe.top_k - 1) * u * S


# Results of different processes (Ray workers, a resumed run) are equal only up to float rounding: a worker may
# run other kernels or another thread count (issue 18: AMD EPYC workers differed in the 8th-9th digit). They are
# compared within this stated tolerance (assert_close_nested), never byte for byte; the docs say "equal to 1e-6".
CROSS_PROCESS_REL = 1e-6
CROSS_PROCESS_ABS = 1e-6  # also covers values the records round to 7 decimals


def assert_close_nested(a, b, atol: float, rel: float = 0.0, path: str = "$") -> None:
    """``a`` and ``b`` (numbers, strings, None, tensors and nested lists, tuples and dicts of them, as a result's
    ``to_dict()`` or its JSON holds them) have the same structure, the same strings, booleans and integers, and
    floats within ``atol + rel * |b|`` (NaN where NaN): results whose floats come from two different computations
    (another batch, a resume that recomputed some of them, another process: :data:`CROSS_PROCESS_ABS`,
    :data:`CROSS_PROCESS_REL`), the tolerance derived from that computation. The assertion names the first
    differing path."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        a, b = (x.tolist() if isinstance(x, torch.Tensor) else x for x in (a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        assert set(a) == set(b), f"{path}: keys {sorted(map(str, set(a) ^ set(b)))} differ"
        for k in a:
            assert_close_nested(a[k], b[k], atol, rel, f"{path}.{k}")
        return
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        assert len(a) == len(b), f"{path}: lengths {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_close_nested(x, y, atol, rel, f"{path}[{i}]")
        return
    if isinstance(a, float) or isinstance(b, float):
        assert isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool) \
            and not isinstance(b, bool), f"{path}: {a!r} against {b!r}"
        if math.isnan(a) or math.isnan(b):
            assert math.isnan(a) and math.isnan(b), f"{path}: {a!r} != {b!r}"
            return
        assert abs(a - b) <= atol + rel * abs(b), f"{path}: {a!r} and {b!r} differ by {abs(a - b):.3g} > " \
            f"{atol:.3g} + {rel:.3g} |b|"
        return
    assert type(a) is type(b) and a == b, f"{path}: {a!r} != {b!r}"


def assert_cross_process(a, b) -> None:
    """:func:`assert_close_nested` within :data:`CROSS_PROCESS_ABS` + :data:`CROSS_PROCESS_REL` ``|b|``: the results
    of two processes (Ray workers, a resumed run) against one run."""
    assert_close_nested(a, b, CROSS_PROCESS_ABS, CROSS_PROCESS_REL)


def alignment_rounding(scores_a, scores_b, rankable=None, decimals: int | None = None) -> float:
    """How far the ``dot`` of :func:`lenscope.evaluate.metrics.alignment` may differ between two computations of
    one explanation's scores (``scores_a``, ``scores_b`` over the context; ``rankable``: the positions ranked,
    default all; ``decimals``: the scores as a record keeps them, rounded to that many decimals, each then within
    half a step of the scores the metrics were computed from). ``dot = N / D`` with ``N`` the evidence's scores
    summed and ``D = sum |s|`` over the ranked positions: with the scores apart by at most ``delta`` at ``n``
    positions, ``N`` and ``D`` move by at most ``n delta`` each, so ``dot`` (at most 1 in size) by at most
    ``2 n delta / D``; each evaluation in float64 adds ``(n + 1) u`` relative, ``2 (n + 1) u`` for both. The ranks
    (integers) must agree; they do unless two scores tie to within ``delta``."""
    a, b = (torch.as_tensor(s, dtype=torch.float64) for s in (scores_a, scores_b))
    if rankable is not None:
        a, b = a[list(rankable)], b[list(rankable)]
    n = a.numel()
    delta = float((a - b).abs().max()) if n else 0.0
    if decimals is not None:
        delta += 10.0 ** -decimals
    D = min(float(a.abs().sum()), float(b.abs().sum()))
    if D == 0.0:
        return 0.0
    return 2 * n * delta / D + 2 * (n + 1) * unit_roundoff(torch.float64)
