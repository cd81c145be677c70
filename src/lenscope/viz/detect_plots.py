"""Plots of prompt-injection detection: AUROC per feature set and detector, mean trajectories by class.

Only drawing happens here; the numbers come from :mod:`lenscope.detect`. Functions return the Figure.
"""

from __future__ import annotations

from ..errors import InputError
from .plots import _figure

DETECTOR_COLORS = {"iforest": "#1f77b4", "lof": "#ff7f0e", "mahalanobis": "#2ca02c"}


def plot_detection(result, ax=None):
    """Points with interval bars: one group per feature set, one colour per detector; chance at 0.5."""
    import numpy as np

    F, D = len(result.features), len(result.detectors)
    fig, ax = _figure(ax, (max(5.0, 1.4 * F + 2), 3.6))
    width = 0.7 / max(D, 1)
    for j, det in enumerate(result.detectors):
        x = np.arange(F) + (j - (D - 1) / 2) * width
        y = result.auroc[:, j].numpy()
        err = np.stack([y - result.auroc_low[:, j].numpy(), result.auroc_high[:, j].numpy() - y]).clip(min=0)
        ax.errorbar(x, y, yerr=err, fmt="o", capsize=3, color=DETECTOR_COLORS.get(det), label=det)
    ax.axhline(0.5, color="#999999", lw=0.8, ls="--")
    ax.set_xticks(range(F))
    ax.set_xticklabels([f"{f}\n({d})" for f, d in zip(result.features, result.feature_dims)])
    ax.set_ylim(min(0.4, float(result.auroc_low.min()) - 0.02), 1.01)
    ax.set_ylabel(f"AUROC ({int(result.level * 100)}% interval)")
    ax.set_title(f"injected vs clean prompts on {result.model}: {result.n_injected} injected, "
                 f"{result.n_clean_test} clean held out", fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    return fig


def plot_mean_trajectories(features, stat: str = "logp_answers", ax=None):
    """Mean (and interquartile band) of one statistic per state, clean vs injected, one panel per lens.

    ``stat``: one of ``features.stat_names``, or ``logp_answers`` (log probability of any answer token)."""
    import matplotlib.pyplot as plt

    names = list(features.stat_names) + ["logp_answers"]
    if stat not in names:
        raise InputError(f"stat must be one of {', '.join(names)}, not {stat!r}")
    if stat == "logp_answers":  # log of the probability of any answer token: log-sum-exp of the class columns
        values = features.trajectory[..., : len(features.classes)].logsumexp(-1)
    else:
        values = features.trajectory[..., features.stat_names.index(stat)]
    n = len(features.lens_names)
    if ax is None:
        fig, axes = plt.subplots(1, n, figsize=(4.2 * n, 3.2), squeeze=False, sharey=True)
        axes = list(axes[0])
    else:
        fig, _ = _figure(ax, None)
        axes = [ax] * n
    inj = features.injected == 1
    for li, (name, a) in enumerate(zip(features.lens_names, axes)):
        for mask, label, color in ((~inj, "clean", "#1f77b4"), (inj, "injected", "#d62728")):
            if not bool(mask.any()):
                continue
            v = values[li][mask]  # (example, state)
            x = range(v.shape[1])
            a.plot(x, v.mean(0).numpy(), color=color, label=f"{label} (n={int(mask.sum())})")
            a.fill_between(x, v.quantile(0.25, 0).numpy(), v.quantile(0.75, 0).numpy(), color=color, alpha=0.15)
        a.set_title(f"{name} lens", fontsize=9)
        a.set_xlabel("state (0 = embeddings, last = output)")
    axes[0].set_ylabel(stat + (" (nats)" if stat in ("entropy", "kl_to_final") else " (log prob)"))
    axes[0].legend(fontsize=8)
    return fig


def plot_per_state(per_state: dict, ax=None):
    """AUROC of each state's statistics alone (``benchmarks/bench_detect.py``'s ``per-state.json``), one line
    per lens and detector, the baselines as horizontal lines."""
    rows = per_state["rows"]
    fig, ax = _figure(ax, (7.5, 3.6))
    styles = {"mahalanobis": "-", "lof": "--", "iforest": ":"}
    colors = ["#d62728", "#1f77b4", "#9467bd", "#8c564b"]
    for li, lens in enumerate(per_state["lenses"]):
        for det in per_state["detectors"]:
            cells = [r for r in rows if r["detector"] == det and r["features"].startswith(lens + "@")
                     and ".." not in r["features"]]
            x = [int(r["features"].split("@")[1]) for r in cells]
            ax.plot(x, [r["auroc"] for r in cells], styles.get(det, "-"), color=colors[li % len(colors)],
                    label=f"{lens} lens, {det}")
            ax.fill_between(x, [r["auroc_ci"][0] for r in cells], [r["auroc_ci"][1] for r in cells],
                            color=colors[li % len(colors)], alpha=0.08)
    for name, color in (("final-state", "#2ca02c"), ("final-probs", "#7f7f7f")):
        for det in per_state["detectors"]:
            r = next((r for r in rows if r["detector"] == det and r["features"] == name), None)
            if r is not None:
                ax.axhline(r["auroc"], color=color, lw=0.9, ls=styles.get(det, "-"), label=f"{name}, {det}")
    ax.axhline(0.5, color="#cccccc", lw=0.8)
    ax.set_xlabel("state (0 = embeddings, last = output)")
    ax.set_ylabel("AUROC of that state alone")
    ax.legend(fontsize=7, ncol=2, loc="lower right")
    return fig
