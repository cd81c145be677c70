"""Generic statistics on tensors: average ranks with ties, Spearman's and Pearson's correlations (float64), and
the bootstrap (resampling indices, percentile intervals, the interval of a mean).

Methods and applications that correlate two quantities (the mixing study, prediction depth against the loss,
causal basis extraction's fidelity) or put a bootstrap interval on a number (``eval alignment``'s means, the
injection detectors' AUROC, the steering evaluation) call these; none keeps a copy.
"""

from __future__ import annotations

import math

import numpy as np
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


# -- the bootstrap ---------------------------------------------------------------------------------------------


def resample(n: int, draws: int, rng):
    """``(draws, n)`` indices drawn uniformly with replacement, one row per bootstrap resample of ``n`` items.
    ``rng``: a NumPy ``Generator`` (``rng.integers(0, n, (draws, n))``, an array) or a seeded ``torch.Generator``
    (``torch.randint(0, n, (draws, n))``, a tensor); consecutive calls continue the generator's stream."""
    if isinstance(rng, torch.Generator):
        return torch.randint(0, n, (draws, n), generator=rng)
    return rng.integers(0, n, (draws, n))


def percentile_interval(draws, level: float = 0.95):
    """The percentile bootstrap interval of ``draws (draw, ...)``: ``(..., 2)`` holding the ``(1 - level) / 2``
    and ``(1 + level) / 2`` quantiles along the first axis (linear interpolation; a NumPy array or a tensor, as
    ``draws`` is; a tensor's quantiles in its own dtype)."""
    if isinstance(draws, Tensor):
        q = torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=draws.dtype)
        return torch.quantile(draws, q, dim=0).movedim(0, -1)
    q = np.quantile(np.asarray(draws, dtype=np.float64), [(1 - level) / 2, (1 + level) / 2], axis=0)
    return np.moveaxis(q, 0, -1)


def bootstrap_mean_ci(values, *, n_boot: int = 1000, seed: int = 0, level: float = 0.95) -> list | None:
    """Percentile bootstrap interval ``[lo, hi]`` of the mean of ``values`` (None when empty; a single value is
    both ends): ``n_boot`` resamples from ``numpy.random.default_rng(seed)``."""
    v = np.asarray(values, dtype=np.float64)
    if v.size == 0:
        return None
    if v.size == 1:
        return [float(v[0]), float(v[0])]
    means = v[resample(v.size, n_boot, np.random.default_rng(seed))].mean(1)
    lo, hi = percentile_interval(means, level)
    return [float(lo), float(hi)]


# -- the loss and KL of an edited model ------------------------------------------------------------------------


class UneditedNextToken:
    """The unedited model's next-token distributions at some positions (``logits (..., pos, vocab)``, read in
    float32), against which an edited run's logits at the same positions are measured: the next-token loss,
    ``KL(unedited || edited)`` and whether the top token agrees. What the steering evaluation's damage and the
    dictionary evaluation's splices report; the runs themselves (engine edits, splices) are their own.

    ``KL = sum p0 (log p0 - log q)`` per position, the difference taken token by token (an edited run that leaves
    the distribution as it was gives 0 exactly, where ``sum p0 log p0 - sum p0 log q`` would leave the rounding of
    two entropies); the edited log-probabilities ``log q`` are the one tensor of the edited logits' size that is
    made, overwritten in place by the products. ``logits`` without a row axis (``(pos, vocab)``) are compared
    with every row of an edited batch."""

    def __init__(self, logits: Tensor):
        self.logp = torch.log_softmax(logits.float(), -1)
        self.p = self.logp.exp()

    def nll(self, targets: Tensor) -> Tensor:
        """The unedited next-token loss ``(..., n)`` (float64) of ``targets (..., n)``, the token after each of the
        first ``n`` positions."""
        n = targets.shape[-1]
        return -self.logp[..., :n, :].gather(-1, targets[..., None])[..., 0].double()

    def compare(self, logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(nll (row, n), kl (row, pos), top1 (row, pos))`` of the edited ``logits (row, pos, vocab)``: the loss
        (float64) of ``targets`` (``(n,)`` for every row, or ``(row, n)``) after the first ``n`` positions,
        ``KL(unedited || edited)`` (float64) at every position and whether the top next token is the unedited
        one's."""
        logq = torch.log_softmax(logits.float(), -1)
        n = targets.shape[-1]
        t = targets.expand(logq.shape[0], n)[..., None]
        nll = -logq[:, :n].gather(2, t)[..., 0].double()
        top1 = logq.argmax(-1) == self.logp.argmax(-1)
        kl = logq.neg_().add_(self.logp).mul_(self.p).sum(-1).double()  # sum p0 (log p0 - log q)
        return nll, kl, top1
