"""Analyses of context-mixing maps (Kobayashi et al. 2024, §5-6): contextualization change, FF-amp, the norm
of the FF output against what the residual connection bypasses, and LN's weights against the FF output.

The per-sentence functions here are pure tensor math; :mod:`lenscope.sweeps.mixing_study` runs them over a dataset.
"""

from __future__ import annotations

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
    a, b = a.double().flatten(), b.double().flatten()
    a, b = a - a.mean(), b - b.mean()
    den = (a.pow(2).sum() * b.pow(2).sum()).sqrt()
    return float((a * b).sum() / den) if den > 0 else float("nan")


def _cells(m: Tensor, lower: bool) -> Tensor:
    if not lower:
        return m.flatten()
    i, j = torch.tril_indices(m.shape[-2], m.shape[-1])
    return m[..., i, j].flatten()


def contextualization_change(before: Tensor, after: Tensor, lower: bool = False) -> float:
    """``1 - Spearman rho`` between two ``(pos, src)`` maps, flattened (the paper's measure of how much a
    component changes the contextualization). ``lower``: only the lower triangle with the diagonal, for causal
    models whose upper triangle is zero in every map."""
    return 1.0 - spearman(_cells(before, lower), _cells(after, lower))


def column_normalize(m: Tensor) -> Tensor:
    """Each column divided by its sum (columns that sum to zero stay zero)."""
    s = m.sum(-2, keepdim=True)
    return torch.where(s > 0, m / s.clamp_min(1e-30), torch.zeros_like(m))


def ff_amp(pre_ff: Tensor, post_ff: Tensor) -> Tensor:
    """FF-amp (§5.2): the post-FF map minus the pre-FF map, each normalised so every column sums to one.
    Positive cells are token pairs whose mixing the feed-forward block amplified."""
    return column_normalize(post_ff.double()) - column_normalize(pre_ff.double())


def top_pairs(amp: Tensor, k: int = 5) -> list[tuple[int, int, float]]:
    """The ``k`` largest cells of an FF-amp map, same-position pairs excluded: ``(i, j, value)``."""
    m = amp.clone()
    m.fill_diagonal_(float("-inf"))
    vals, idx = torch.topk(m.flatten(), min(k, m.numel() - m.shape[0]))
    n = m.shape[1]
    return [(int(t) // n, int(t) % n, float(v)) for v, t in zip(vals, idx) if torch.isfinite(v)]


# pairs of scopes compared by contextualization change: consecutive scopes, and pre-FF against each later one
def scope_pairs(placement: str) -> list[tuple[str, str]]:
    if placement == "post":
        chain = ["attn", "atb", "atbff", "atbffres", "atbffresln"]
        pre = "atb"
        later = ["atbff", "atbffres", "atbffresln"]
    else:
        chain = ["attn", "atb", "atbln", "atblnff", "atblnffres", "atblnffres_nextln"]
        pre = "atbln"
        later = ["atblnff", "atblnffres", "atblnffres_nextln"]
    pairs = list(zip(chain[:-1], chain[1:]))
    pairs += [(pre, s) for s in later if (pre, s) not in pairs]
    return pairs


def pre_post_ff(placement: str) -> tuple[str, str]:
    """The scopes just before and just after the feed-forward block."""
    return ("atb", "atbff") if placement == "post" else ("atbln", "atblnff")
