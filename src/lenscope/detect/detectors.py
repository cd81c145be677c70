"""Anomaly detectors (scikit-learn pipelines, :class:`MahalanobisDetector`) and AUROC with its bootstrap
interval."""

from __future__ import annotations

import numpy as np
from sklearn.base import BaseEstimator, OutlierMixin, TransformerMixin

from ..errors import InputError
from ..stats import percentile_interval, resample

# ------------------------------------------------------------------------------------------- detectors

DETECTORS = ("iforest", "lof", "mahalanobis")


class MahalanobisDetector(OutlierMixin, BaseEstimator):
    """Squared Mahalanobis distance to the clean training mean, covariance shrunk with Ledoit-Wolf (so that
    it exists with more features than examples). scikit-learn's novelty convention: ``score_samples`` is
    higher for more normal points (minus the squared distance)."""

    def __init__(self, assume_centered: bool = False):
        self.assume_centered = assume_centered

    def fit(self, X, y=None):
        from sklearn.covariance import LedoitWolf

        X = np.asarray(X, dtype=np.float64)
        self.covariance_model_ = LedoitWolf(assume_centered=self.assume_centered).fit(X)
        self.threshold_ = float(np.quantile(self.covariance_model_.mahalanobis(X), 0.975))
        return self

    def score_samples(self, X):
        return -self.covariance_model_.mahalanobis(np.asarray(X, dtype=np.float64))

    def predict(self, X):
        """+1 (normal) within the 97.5th percentile of the training distances, -1 (anomalous) beyond it."""
        return np.where(-self.score_samples(X) <= self.threshold_, 1, -1)


class DropConstant(TransformerMixin, BaseEstimator):
    """Drop the features that are constant on the training set (e.g. what every lens reads from the embedding
    of the answer position's token, the same in every prompt): they carry nothing, and they would change the
    Ledoit-Wolf shrinkage of the Mahalanobis detector. Keeps everything when every feature is constant."""

    def fit(self, X, y=None):
        X = np.asarray(X, dtype=np.float64)
        keep = np.ptp(X, axis=0) > 0
        self.keep_ = keep if keep.any() else np.ones_like(keep)
        return self

    def transform(self, X):
        return np.asarray(X, dtype=np.float64)[:, self.keep_]


def make_detector(name: str, seed: int = 0, n_train: int | None = None):
    """A scikit-learn pipeline: drop features constant on the clean training set, standardise the others,
    then the detector.

    ``iforest``: IsolationForest(200 trees); ``lof``: LocalOutlierFactor(novelty=True, 20 neighbours, fewer
    when the training set is small); ``mahalanobis``: :class:`MahalanobisDetector`.
    """
    from sklearn.ensemble import IsolationForest
    from sklearn.neighbors import LocalOutlierFactor
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    if name == "iforest":
        est = IsolationForest(n_estimators=200, random_state=seed)
    elif name == "lof":
        k = 20 if n_train is None else max(1, min(20, n_train - 1))
        est = LocalOutlierFactor(n_neighbors=k, novelty=True)
    elif name == "mahalanobis":
        est = MahalanobisDetector()
    else:
        raise InputError(f"detector must be one of {', '.join(DETECTORS)}, not {name!r}")
    return make_pipeline(DropConstant(), StandardScaler(), est)


def anomaly_scores(detector, X) -> np.ndarray:
    """Higher = more anomalous (minus scikit-learn's ``score_samples``)."""
    return -np.asarray(detector.score_samples(np.asarray(X, dtype=np.float64)), dtype=np.float64)


def _pairwise(labels, scores) -> np.ndarray:
    """``H[i, j]`` over positives ``i`` and negatives ``j``: 1 if the positive scores higher, 1/2 on a tie."""
    labels = np.asarray(labels).astype(bool)
    scores = np.asarray(scores, dtype=np.float64)
    if labels.shape != scores.shape or labels.ndim != 1:
        raise InputError("labels and scores must be 1-d and of the same length")
    pos, neg = scores[labels], scores[~labels]
    if pos.size == 0 or neg.size == 0:
        raise InputError("AUROC needs at least one positive (injected) and one negative (clean) example")
    if not (np.isfinite(pos).all() and np.isfinite(neg).all()):
        raise InputError("the anomaly scores contain NaN or infinite values")
    return (pos[:, None] > neg[None, :]) + 0.5 * (pos[:, None] == neg[None, :])


def auroc(labels, scores) -> float:
    """Area under the ROC curve: P(score of a random positive > that of a random negative), ties counting 1/2."""
    return float(_pairwise(labels, scores).mean())


def bootstrap_aurocs(labels, scores, n: int = 1000, seed: int = 0) -> np.ndarray:
    """AUROCs of ``n`` stratified bootstrap resamples: positives and negatives are each resampled with
    replacement to their own count, so every resample has both classes.

    Draws (:func:`lenscope.stats.resample`): ``rng = np.random.default_rng(seed)``, then
    ``rng.integers(0, n_pos, (n, n_pos))`` and ``rng.integers(0, n_neg, (n, n_neg))``. A resample's AUROC is
    ``c_pos H c_neg / (n_pos n_neg)`` with ``c`` the draw counts and ``H`` the pairwise matrix, i.e. exactly the
    AUROC of the resampled scores.
    """
    if isinstance(n, bool) or n < 1:
        raise InputError(f"the number of bootstrap resamples must be at least 1, not {n!r}")
    H = _pairwise(labels, scores)
    n_pos, n_neg = H.shape
    rng = np.random.default_rng(seed)
    ip, ineg = resample(n_pos, n, rng), resample(n_neg, n, rng)
    cp = np.zeros((n, n_pos))
    cn = np.zeros((n, n_neg))
    np.add.at(cp, (np.arange(n)[:, None], ip), 1.0)
    np.add.at(cn, (np.arange(n)[:, None], ineg), 1.0)
    return np.einsum("bi,ij,bj->b", cp, H, cn) / (n_pos * n_neg)


def auroc_interval(replicates, level: float = 0.95) -> tuple[float, float]:
    """Percentile interval of bootstrap replicates (:func:`lenscope.stats.percentile_interval`)."""
    if not 0 < level < 1:
        raise InputError(f"the interval level must be between 0 and 1, not {level!r}")
    lo, hi = percentile_interval(np.asarray(replicates, dtype=np.float64), level)
    return float(lo), float(hi)
