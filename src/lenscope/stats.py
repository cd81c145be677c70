"""Generic statistics on tensors: average ranks with ties, Spearman's and Pearson's correlations (float64).

Methods and applications that correlate two quantities (the mixing study, prediction depth against the loss,
causal basis extraction's fidelity) call these; none keeps a copy.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def average_ranks(x: Tensor) -> Tensor:
    """Ranks 1..n of a 1-d tensor, ties sharing their average rank (as scipy's ``rankdata``)."""
    x = x.double().flatten()
    n = x.numel()
    order = torch.argsort(x, stable=True)
    xs = x[order]
    # boundaries of runs of equal values
    new = torch.ones(n, dtype=torch.bool)
    new[1:] = xs[1:] != xs[:-1]
    run = torch.cumsum(new.long(), 0) - 1  # run id of each sorted element
    counts = torch.bincount(run)
    ends = torch.cumsum(counts, 0).double()  # 1-based position of each run's last element
    avg = ends - (counts.double() - 1) / 2
    ranks = torch.empty(n, dtype=torch.float64)
    ranks[order] = avg[run]
    return ranks


def spearman(a: Tensor, b: Tensor) -> float:
    """Spearman's rank correlation with average ranks for ties (NaN when either side is constant)."""
    ra, rb = average_ranks(a), average_ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    den = (ra.pow(2).sum() * rb.pow(2).sum()).sqrt()
    return float((ra * rb).sum() / den) if den > 0 else float("nan")


def pearson(a: Tensor, b: Tensor) -> float:
    """Pearson's correlation of two tensors, flattened (NaN when either side is constant)."""
    a, b = a.double().flatten(), b.double().flatten()
    a, b = a - a.mean(), b - b.mean()
    den = (a.pow(2).sum() * b.pow(2).sum()).sqrt()
    return float((a * b).sum() / den) if den > 0 else float("nan")


def spearman_or_none(a: Tensor, b: Tensor) -> float | None:
    """:func:`spearman`, or ``None`` where it is undefined (fewer than two values, or a constant side)."""
    if a.numel() < 2:
        return None
    r = spearman(a, b)
    return r if math.isfinite(r) else None
