"""Alignment of one explanation with the evidence, and dataset means with bootstrap intervals
(:func:`lenscope.stats.bootstrap_mean_ci`).

For scores ``s`` over the rankable tokens and the evidence set ``E`` (non-empty, not every token):

- **reciprocal rank** (Ferrando et al. 2023, after Yin & Neubig 2022): sort the tokens by score, highest
  first; ``1 / rank`` of the first evidence token. Ties are broken against the evidence (a token tied with
  the best evidence token counts as ranked before it), so a constant explanation earns no credit.
  ``rank = 1 + #{j not in E : s_j >= max_{e in E} s_e}``.
- **probes needed** (Yin & Neubig): how many tokens are probed, in that order, before the first evidence
  token: ``rank - 1``.
- **dot product** (Yin & Neubig): the explanation normalised to unit L1 norm, dotted with the binary evidence
  vector: ``sum_{e in E} s_e / sum_j |s_j|`` (in [-1, 1]; 0 for an all-zero explanation).
- the **random baseline** of the reciprocal rank (:func:`random_rr`): its expectation under a uniformly random
  ranking, which depends only on the context length and the number of evidence tokens;
- the **positional rankings** ``first`` / ``recent`` (:func:`positional_scores`), trivial reference answers.

Scores are ranked as signed values (a token that argues for the foil ranks low), as in the reference code of
Ferrando et al.
"""

from __future__ import annotations

import math

import numpy as np

from ..stats import bootstrap_mean_ci as bootstrap_ci  # the bootstrap's one home (re-exported)

METRICS = ("rr", "probes", "dot")


def alignment(scores, evidence, rankable=None) -> dict:
    """``{"rr", "probes", "dot", "rank"}`` of one explanation. ``scores`` over all context positions;
    ``evidence`` and ``rankable`` are position lists (``rankable`` defaults to all positions)."""
    s = np.asarray(scores, dtype=np.float64)
    rankable = list(range(len(s))) if rankable is None else list(rankable)
    ev = set(evidence)
    if not ev or not ev <= set(rankable):
        raise ValueError("evidence must be a non-empty subset of the rankable positions")
    r = s[rankable]
    if not np.isfinite(r).all():
        raise ValueError("the scores hold NaN or infinite values")
    is_ev = np.array([k in ev for k in rankable])
    best = r[is_ev].max()
    rank = 1 + int((r[~is_ev] >= best).sum())
    l1 = float(np.abs(r).sum())
    dot = float(r[is_ev].sum() / l1) if l1 > 0 else 0.0
    return {"rr": 1.0 / rank, "probes": rank - 1, "dot": dot, "rank": rank}


def random_rr(n: int, k: int) -> float:
    """Expected reciprocal rank of a random ranking of ``n`` tokens of which ``k`` are evidence: the first
    evidence token is at rank ``r`` with probability ``C(n - r, k - 1) / C(n, k)``."""
    if not 1 <= k <= n:
        raise ValueError("need 1 <= k <= n")
    total = math.comb(n, k)
    return sum(math.comb(n - r, k - 1) / total / r for r in range(1, n - k + 2))


def mean_ci(values, **kw) -> tuple[float | None, list | None]:
    v = [x for x in values if x is not None and not (isinstance(x, float) and math.isnan(x))]
    if not v:
        return None, None
    return float(np.mean(v)), bootstrap_ci(v, **kw)


def paired_difference(a, b, **kw) -> dict:
    """Mean of ``a - b`` over paired values and its bootstrap interval (examples resampled together)."""
    d = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    m, ci = mean_ci(d.tolist(), **kw)
    return {"mean": m, "ci": ci, "n": int(d.size)}


POSITIONAL = ("first", "recent")  # trivial rankings by position: no model computation beyond the tokenisation


def positional_scores(n: int, method: str) -> list[float]:
    """The ranking score vector of a positional method over ``n`` context positions: ``first`` scores position
    ``j`` with ``n - j`` (the earliest token first), ``recent`` with ``j + 1`` (the token nearest the prediction
    first). Both are positive, so their dot product with the evidence is the evidence's share of the total
    score; there are no ties."""
    if method == "first":
        return [float(n - j) for j in range(n)]
    if method == "recent":
        return [float(j + 1) for j in range(n)]
    raise ValueError(f"not a positional method: {method!r}")


def positional_metrics(rec: dict, method: str) -> dict:
    """``alignment`` of a positional ranking from a record's own fields (``tokens``, ``evidence``, ``rankable``):
    what :func:`lenscope.evaluate.alignment.evaluate_examples` stores, recomputed for records written before these
    methods existed."""
    return alignment(positional_scores(len(rec["tokens"]), method), rec["evidence"], rec["rankable"])
