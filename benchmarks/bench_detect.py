"""Where the injection signal sits: per-state AUROC and per-subgroup AUROC from a saved `lens detect` run.

    .venv/bin/lenscope lens detect --model smollm2 --lens /work/lenses/smollm2 --lens logit \
        --out docs/results/lens-detect/smollm2
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_detect.py docs/results/lens-detect/smollm2

Reads ``features.safetensors`` and ``labelled_set.jsonl`` from the folder (no model needed) and writes there:

- ``per-state.json`` / ``per-state.png``: AUROC of each state's 5 statistics alone, per lens (Mahalanobis and
  LOF, same splits and bootstrap as the run), beside the baselines; and the trajectory without its output state
- ``paper-style.json``: the features as the paper's code reduced them for two-choice tasks: per state, only the
  log-odds of the two answers (``logp_positive - logp_negative``), 31 numbers for smollm2; and the inner
  states alone (no output state, no KL column)
- ``subgroups.json``: AUROC of each feature set per injection template, placement, and whether the model
  followed the injection (Mahalanobis, split 0: clean held-out prompts against that subgroup's injected ones)
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from lenscope.detect import (
    DetectionFeatures,
    anomaly_scores,
    auroc,
    auroc_interval,
    bootstrap_aurocs,
    evaluate_detectors,
    make_detector,
    read_labelled_set,
)


def per_state(feats: DetectionFeatures, detectors=("mahalanobis", "lof"), seed: int = 0) -> dict:
    Ln, N, S, K = feats.trajectory.shape
    names = [f"{lens}@{s}" for lens in feats.lens_names for s in range(S)]
    names += [f"{lens}@0..{S - 2}" for lens in feats.lens_names]  # the trajectory without the output state
    traj = torch.zeros(len(names), N, S - 1, K)
    for li in range(Ln):
        for s in range(S):
            traj[li * S + s, :, 0] = feats.trajectory[li, :, s]
        traj[Ln * S + li] = feats.trajectory[li, :, : S - 1]
    # one-state features live in the first state slot; the rest of the slots stay zero (constant columns,
    # which the standardisation leaves at zero and the detectors ignore)
    single = replace(feats, lens_names=names, trajectory=traj)
    res = evaluate_detectors(single, list(detectors), seed=seed)
    out = {"detectors": list(detectors), "states": S, "rows": res.records(), "lenses": list(feats.lens_names)}
    return out


def paper_style(feats: DetectionFeatures, seed: int = 0) -> dict:
    """Two reductions of the trajectory: ``<lens>-logodds`` (the paper's code for two-choice tasks: per state
    the log-odds of the two answers, the output state included) and ``<lens>-inner`` (states 0..n_layers-1 only
    and no KL column: what the lens reads from the inner states, with nothing computed from the output)."""
    k_pos, k_neg = feats.stat_names.index("logp_positive"), feats.stat_names.index("logp_negative")
    logodds = (feats.trajectory[..., k_pos] - feats.trajectory[..., k_neg])[..., None]
    keep = [k for k, n in enumerate(feats.stat_names) if n != "kl_to_final"]
    inner = feats.trajectory[:, :, :-1][..., keep]
    S = feats.trajectory.shape[2]
    both = torch.zeros(2 * len(feats.lens_names), feats.n_examples, S, len(keep))
    both[: len(feats.lens_names), :, :, :1] = logodds
    both[len(feats.lens_names) :, :, : S - 1] = inner  # zero padding: constant columns, ignored
    names = [f"{n}-logodds" for n in feats.lens_names] + [f"{n}-inner" for n in feats.lens_names]
    return evaluate_detectors(replace(feats, lens_names=names, trajectory=both), seed=seed).to_dict()


def subgroups(feats: DetectionFeatures, rows: list[dict], seed: int = 0, detector: str = "mahalanobis") -> dict:
    sets = feats.feature_sets()
    injected = feats.injected.numpy().astype(bool)
    clean = np.flatnonzero(~injected)
    n_train = int(round(0.5 * clean.size))
    perm = np.random.default_rng(seed).permutation(clean)
    train, test_clean = perm[:n_train], perm[n_train:]
    groups: dict[str, np.ndarray] = {"all": np.flatnonzero(injected)}
    for key in ("template", "placement", "target"):
        for v in sorted({r[key] for r in rows if r["injected"]}, key=str):
            groups[f"{key}={v}"] = np.flatnonzero([r["injected"] and r[key] == v for r in rows])
    followed = feats.followed.numpy().astype(bool)
    groups["followed=yes"] = np.flatnonzero(injected & followed)
    groups["followed=no"] = np.flatnonzero(injected & ~followed)
    out = {"detector": detector, "n_clean_test": int(test_clean.size), "groups": {}}
    for name, X in sets.items():
        model = make_detector(detector, seed=seed, n_train=n_train).fit(X[train])
        sc = anomaly_scores(model, X)
        for g, idx in groups.items():
            if idx.size == 0:
                continue
            lab = np.concatenate([np.zeros(test_clean.size), np.ones(idx.size)])
            s = np.concatenate([sc[test_clean], sc[idx]])
            lo, hi = auroc_interval(bootstrap_aurocs(lab, s, 1000, seed=seed))
            out["groups"].setdefault(g, {"n": int(idx.size)})[name] = [auroc(lab, s), lo, hi]
    return out


def main(folder: str) -> None:
    folder = Path(folder)
    feats = DetectionFeatures.load(folder / "features.safetensors")
    rows = read_labelled_set(folder / "labelled_set.jsonl")
    assert [str(r["id"]) for r in rows] == feats.ids, "features and labelled set do not match"

    ps = per_state(feats)
    (folder / "per-state.json").write_text(json.dumps(ps, indent=2) + "\n")
    from lenscope.viz.detect_plots import plot_per_state
    from lenscope.viz.plots import save_figure

    save_figure(plot_per_state(ps), folder / "per-state.png")
    S = ps["states"]
    print(f"per-state AUROC ({', '.join(ps['detectors'])}), best state per lens:")
    for lens in ps["lenses"]:
        for det in ps["detectors"]:
            cells = [r for r in ps["rows"] if r["detector"] == det and r["features"].startswith(lens + "@")
                     and ".." not in r["features"]]
            best = max(cells, key=lambda r: r["auroc"])
            no_out = next(r for r in ps["rows"] if r["detector"] == det and r["features"] == f"{lens}@0..{S - 2}")
            print(f"  {lens:6s} {det:12s} best {best['features']}: {best['auroc']:.3f} {best['auroc_ci']}; "
                  f"output state alone: {cells[-1]['auroc']:.3f}; trajectory without the output state: "
                  f"{no_out['auroc']:.3f} {no_out['auroc_ci']}")
    ps2 = paper_style(feats)
    (folder / "paper-style.json").write_text(json.dumps(ps2, indent=2) + "\n")
    print("\nreduced trajectories (-logodds: per-state log-odds of the two answers; -inner: no output state, no KL):")
    for r in ps2["results"]:
        if r["features"].endswith("-logodds") or r["features"].endswith("-inner"):
            lo, hi = r["auroc_ci"]
            print(f"  {r['features']:16s} {r['detector']:12s} {r['auroc']:.3f} [{lo:.3f}, {hi:.3f}]")
    sg = subgroups(feats, rows)
    (folder / "subgroups.json").write_text(json.dumps(sg, indent=2) + "\n")
    names = [k for k in next(iter(sg["groups"].values())) if k != "n"]
    print(f"\nAUROC per subgroup ({sg['detector']}, split 0, {sg['n_clean_test']} clean held out):")
    print(f"  {'group':28s} {'n':>4s} " + " ".join(f"{n:>14s}" for n in names))
    for g, d in sg["groups"].items():
        print(f"  {g:28s} {d['n']:4d} " + " ".join(f"{d[n][0]:14.3f}" for n in names))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "docs/results/lens-detect/smollm2")
