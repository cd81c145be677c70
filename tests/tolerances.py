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
