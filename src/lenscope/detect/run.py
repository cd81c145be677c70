"""Detectors fitted and scored on detection features (:func:`evaluate_detectors`, :class:`DetectionResult`), and
:func:`detect`, which runs everything."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from ..errors import InputError
from ..lenses.lenses import Lens
from ..models.loading.load import LoadedModel
from ..results import Result
from .detectors import DETECTORS, anomaly_scores, auroc, auroc_interval, bootstrap_aurocs, make_detector
from .features import DetectionFeatures, detection_features
from .task import build_labelled_set, load_sst2, write_labelled_set

# --------------------------------------------------------------------------------------------- results


@dataclass(repr=False)
class DetectionResult(Result):
    """AUROC of each detector on each feature set (clean held-out prompts vs injected prompts).

    - ``auroc (feature, detector)``: mean over the ``splits`` random clean train/test splits
    - ``auroc_low, auroc_high (feature, detector)``: percentile interval (``level``) of the stratified bootstrap
      replicates of the test set, pooled over the splits (so it covers test sampling and the split)
    - ``split_auroc (split, feature, detector)``
    - ``replicates (feature, detector, replicate)``: the bootstrap AUROCs. Within a split every feature set and
      detector is scored on the same resamples (same draws), so differences between them are paired
      (:meth:`difference`).

    JSON fields: ``model``, ``lenses``, ``features``, ``detectors``, the counts ``n_clean`` (all clean prompts),
    ``n_clean_train``, ``n_clean_test`` (per split), ``n_injected`` (all test), ``splits``, ``n_bootstrap``,
    ``level``, ``seed``, ``clean_accuracy`` and ``injection_followed`` (how the model answered),
    ``feature_dims``.
    """

    model: str
    lenses: list[str]
    features: list[str]
    detectors: list[str]
    feature_dims: list[int]
    n_clean: int
    n_injected: int
    n_clean_train: int
    n_clean_test: int
    splits: int
    n_bootstrap: int
    level: float
    seed: int
    clean_accuracy: float | None
    injection_followed: float | None
    auroc: Tensor
    auroc_low: Tensor
    auroc_high: Tensor
    split_auroc: Tensor
    replicates: Tensor

    def difference(self, features: str, baseline: str = "final-state", detector: str = "mahalanobis") -> dict:
        """AUROC of ``features`` minus that of ``baseline`` for one detector, with the percentile interval of
        the paired bootstrap differences."""
        for name, options in ((features, self.features), (baseline, self.features), (detector, self.detectors)):
            if name not in options:
                raise InputError(f"{name!r} is not among {options}")
        i, b, j = self.features.index(features), self.features.index(baseline), self.detectors.index(detector)
        diff = (self.replicates[i, j] - self.replicates[b, j]).numpy()
        lo, hi = auroc_interval(diff, self.level)
        return {"features": features, "baseline": baseline, "detector": detector,
                "auroc_diff": float(self.auroc[i, j] - self.auroc[b, j]), "diff_ci": [lo, hi]}

    def differences(self, baseline: str = "final-state") -> list[dict]:
        """:meth:`difference` of every lens trajectory against ``baseline``, for every detector."""
        if baseline not in self.features:
            return []
        return [self.difference(f, baseline, d) for f in self.lenses if f in self.features for d in self.detectors]

    def records(self) -> list[dict]:
        return [{"detector": d, "features": f, "auroc": float(self.auroc[i, j]),
                 "auroc_ci": [float(self.auroc_low[i, j]), float(self.auroc_high[i, j])]}
                for i, f in enumerate(self.features) for j, d in enumerate(self.detectors)]

    def to_dict(self) -> dict:
        return {"model": self.model, "lenses": list(self.lenses), "n_clean": self.n_clean,
                "n_injected": self.n_injected, "n_clean_train": self.n_clean_train, "n_clean_test": self.n_clean_test,
                "splits": self.splits, "n_bootstrap": self.n_bootstrap, "level": self.level, "seed": self.seed,
                "clean_accuracy": self.clean_accuracy, "injection_followed": self.injection_followed,
                "feature_dims": dict(zip(self.features, self.feature_dims)), "results": self.records(),
                "vs_final_state": self.differences("final-state")}

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def to_frame(self):
        import pandas as pd

        rows = self.records()
        for r in rows:
            r["ci_low"], r["ci_high"] = r.pop("auroc_ci")
        return pd.DataFrame(rows)

    def table(self) -> str:
        """A markdown table: feature sets down, detectors across, ``AUROC [low, high]``."""
        head = "| features (dim) | " + " | ".join(self.detectors) + " |"
        lines = [head, "| --- |" + " ---: |" * len(self.detectors)]
        for i, f in enumerate(self.features):
            cells = [f"{float(self.auroc[i, j]):.3f} [{float(self.auroc_low[i, j]):.3f}, "
                     f"{float(self.auroc_high[i, j]):.3f}]" for j in range(len(self.detectors))]
            lines.append(f"| {f} ({self.feature_dims[i]}) | " + " | ".join(cells) + " |")
        return "\n".join(lines)

    def plot(self, ax=None):
        """AUROC with its interval, per feature set (groups) and detector (colours)."""
        from ..viz.detect_plots import plot_detection

        return plot_detection(self, ax=ax)

    def __repr__(self) -> str:
        best = int(self.auroc.argmax())
        f, d = divmod(best, len(self.detectors))
        return (f"DetectionResult({self.model!r}, clean={self.n_clean}, injected={self.n_injected}, "
                f"features={self.features}, best={self.features[f]}/{self.detectors[d]} "
                f"AUROC {float(self.auroc.max()):.3f})")


def _n_train(n_clean: int, n_injected: int, train_fraction: float) -> int:
    if not 0 < train_fraction < 1:
        raise InputError(f"the training fraction must be between 0 and 1, not {train_fraction!r}")
    n_train = int(round(train_fraction * n_clean))
    if n_train < 2 or n_clean - n_train < 1 or n_injected < 1:
        raise InputError(f"too few examples: {n_clean} clean and {n_injected} injected give {n_train} clean "
                         "prompts to train on; at least 2 for training, 1 clean held out and 1 injected are needed "
                         "(raise --limit)")
    return n_train


def evaluate_detectors(features: DetectionFeatures, detectors=DETECTORS, *, train_fraction: float = 0.5,
                       splits: int = 5, n_bootstrap: int = 1000, level: float = 0.95,
                       seed: int = 0) -> DetectionResult:
    """Fit each detector on each feature set with clean training prompts only; score held-out clean prompts
    against all injected prompts.

    For split ``s`` the clean prompts are permuted with ``np.random.default_rng(seed + s)`` and the first
    ``round(train_fraction * n_clean)`` train the detectors (standardisation included). The detectors' own
    randomness (isolation forest) is seeded with ``seed + s`` too; the bootstrap of split ``s`` with
    ``seed + s``.
    """
    detectors = list(detectors)
    for d in detectors:
        if d not in DETECTORS:
            raise InputError(f"detector must be one of {', '.join(DETECTORS)}, not {d!r}")
    if not detectors:
        raise InputError("give at least one detector")
    if isinstance(splits, bool) or splits < 1:
        raise InputError(f"the number of splits must be at least 1, not {splits!r}")
    injected = features.injected.numpy().astype(bool)
    clean_idx = np.flatnonzero(~injected)
    inj_idx = np.flatnonzero(injected)
    n_train = _n_train(clean_idx.size, inj_idx.size, train_fraction)
    sets = features.feature_sets()
    names = list(sets)
    F, D = len(names), len(detectors)
    split_auc = np.zeros((splits, F, D))
    reps = np.zeros((F, D, splits * n_bootstrap))
    for s in range(splits):
        perm = np.random.default_rng(seed + s).permutation(clean_idx)
        train, test_clean = perm[:n_train], perm[n_train:]
        test = np.concatenate([test_clean, inj_idx])
        labels = np.concatenate([np.zeros(test_clean.size), np.ones(inj_idx.size)])
        for fi, name in enumerate(names):
            X = sets[name]
            for di, det in enumerate(detectors):
                model = make_detector(det, seed=seed + s, n_train=n_train).fit(X[train])
                sc = anomaly_scores(model, X[test])
                split_auc[s, fi, di] = auroc(labels, sc)
                reps[fi, di, s * n_bootstrap : (s + 1) * n_bootstrap] = bootstrap_aurocs(labels, sc, n_bootstrap,
                                                                                         seed=seed + s)
    lo = np.zeros((F, D))
    hi = np.zeros((F, D))
    for fi in range(F):
        for di in range(D):
            lo[fi, di], hi[fi, di] = auroc_interval(reps[fi, di], level)
    return DetectionResult(
        model=features.model, lenses=list(features.lens_names), features=names, detectors=detectors,
        feature_dims=[int(sets[n].shape[1]) for n in names], n_clean=int(clean_idx.size),
        n_injected=int(inj_idx.size), n_clean_train=n_train, n_clean_test=int(clean_idx.size - n_train),
        splits=splits, n_bootstrap=n_bootstrap, level=level, seed=seed, clean_accuracy=features.clean_accuracy(),
        injection_followed=features.injection_followed(), auroc=torch.tensor(split_auc.mean(0), dtype=torch.float64),
        auroc_low=torch.tensor(lo, dtype=torch.float64), auroc_high=torch.tensor(hi, dtype=torch.float64),
        split_auroc=torch.tensor(split_auc, dtype=torch.float64), replicates=torch.tensor(reps, dtype=torch.float32))


def detect(lm: LoadedModel, lenses: dict[str, Lens] | None = None, *, examples: list[tuple[str, int]] | None = None,
           limit: int | None = None, seed: int = 0, detectors=DETECTORS, train_fraction: float = 0.5,
           splits: int = 5, n_bootstrap: int = 1000, batch_size: int = 16, out: str | Path | None = None,
           progress: bool = True) -> tuple[DetectionResult, DetectionFeatures, list[dict]]:
    """Everything: the labelled set (SST-2 dev unless ``examples`` are given; ``limit`` prompts per class at
    most), the features of each lens, and the detectors' AUROCs. With ``out``, writes ``labelled_set.jsonl``,
    ``features.safetensors``, ``detect.safetensors`` and ``detect.json`` there."""
    if examples is None:
        examples = load_sst2()
    rows = build_labelled_set(examples, limit, seed=seed)
    _n_train(sum(not r["injected"] for r in rows), sum(bool(r["injected"]) for r in rows), train_fraction)
    feats = detection_features(lm, rows, lenses, batch_size=batch_size, progress=progress)
    res = evaluate_detectors(feats, detectors, train_fraction=train_fraction, splits=splits,
                             n_bootstrap=n_bootstrap, seed=seed)
    if out is not None:
        out = Path(out)
        write_labelled_set(rows, out / "labelled_set.jsonl")
        feats.save(out / "features.safetensors")
        res.save(out / "detect.safetensors")
        (out / "detect.json").write_text(json.dumps(res.to_dict(), indent=2) + "\n")
    return res, feats, rows
