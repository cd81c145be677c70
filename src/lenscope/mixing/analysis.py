"""Analyses of context-mixing maps (Kobayashi et al. 2024, §5-6): contextualization change, FF-amp, the norm
of the FF output against what the residual connection bypasses, and LN's weights against the FF output.

The per-sentence functions here are pure tensor math; :mod:`lenscope.sweeps.mixing_study` runs them over a dataset.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..stats import spearman


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
