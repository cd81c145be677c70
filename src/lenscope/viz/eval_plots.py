"""Figures of ``eval alignment`` (drawing only; numbers come from :class:`AlignmentSummary`)."""

from __future__ import annotations

import math

from .plots import KIND_COLORS


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt


def _short(name: str) -> str:
    return name.replace("blimp:", "").replace("_agreement", "_agr").replace("determiner_noun", "det_noun")


def plot_layer_contributions(summary, datasets=None, cols: int = 4):
    """Ferrando et al. §5: per layer, the mean update of the contrastive logit difference (target − foil)
    written by attention and by the MLP, one panel per dataset (with the mean logit difference)."""
    plt = _plt()
    names = [d for d in (datasets or summary.datasets) if summary.datasets[d]["layers"].get("n")]
    if not names:
        raise ValueError("no per-layer contributions in this summary (no example was traced)")
    cols = min(cols, len(names))
    rows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 2.6 * rows), squeeze=False, sharex=True)
    for ax in axes.flat[len(names):]:
        ax.axis("off")
    for ax, d in zip(axes.flat, names):
        lay = summary.datasets[d]["layers"]
        x = range(len(lay["attention"]))
        ax.plot(x, lay["attention"], color=KIND_COLORS["attn"], label="attention", lw=1.4)
        ax.plot(x, lay["mlp"], color=KIND_COLORS["mlp"], label="MLP", lw=1.4)
        ax.axhline(0, color="black", lw=0.5)
        ax.set_title(f"{_short(d)} (n={lay['n']}, Δlogit {lay['logit']:+.2f})", fontsize=8)
        ax.tick_params(labelsize=7)
    for ax in axes[-1]:
        ax.set_xlabel("layer", fontsize=8)
    for ax in axes[:, 0]:
        ax.set_ylabel("mean update of logit(w) − logit(f)", fontsize=7)
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(f"{summary.model}: attention and MLP updates of the contrastive logit, per layer", fontsize=10)
    fig.tight_layout()
    return fig


def plot_mrr(summary, correct: bool = False):
    """MRR per dataset and method with 95% bootstrap intervals (grouped bars)."""
    plt = _plt()
    names = [d for d, ds in summary.datasets.items() if ds["n"]]
    methods = summary.methods
    fig, ax = plt.subplots(figsize=(max(6.0, 0.75 * len(names) + 1.5), 4.0))
    w = 0.8 / max(1, len(methods))
    cmap = plt.get_cmap("tab10")
    for k, m in enumerate(methods):
        xs, ys, lo, hi = [], [], [], []
        for i, d in enumerate(names):
            e = summary.datasets[d]["methods"].get(m) or {}
            e = (e.get("correct") or {}) if correct else e
            if e.get("mrr") is None:
                continue
            xs.append(i + (k - (len(methods) - 1) / 2) * w)
            ys.append(e["mrr"])
            ci = e.get("mrr_ci") or [e["mrr"], e["mrr"]]
            lo.append(e["mrr"] - ci[0])
            hi.append(ci[1] - e["mrr"])
        ax.bar(xs, ys, w, yerr=[lo, hi], label=m, color=cmap(k), capsize=1.5, error_kw={"lw": 0.6})
    rand = [summary.datasets[d].get("random_mrr") for d in names]
    if all(r is not None for r in rand):
        ax.scatter(range(len(names)), rand, marker="_", s=400, color="black", zorder=3, label="random ranking")
    ax.set_xticks(range(len(names)), [_short(d) for d in names], rotation=40, ha="right", fontsize=7)
    ax.set_ylabel("MRR" + (" (model correct)" if correct else ""))
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=7, ncol=min(7, len(methods) + 1), loc="upper center", bbox_to_anchor=(0.5, 1.18))
    fig.tight_layout()
    return fig


def plot_aer(ids, per_sentence, aer: float, precision: float, recall: float, method: str = ""):
    """``lenscope eval aer``: each sentence's alignment error rate (bars; a sentence with no link at all has none)
    and the corpus AER (line), with precision and recall in the title."""
    plt = _plt()
    vals = [float(v) for v in per_sentence]
    fig, ax = plt.subplots(figsize=(max(4.0, 0.3 * len(vals) + 1.5), 3.0))
    ax.bar(range(len(vals)), [0.0 if math.isnan(v) else v for v in vals], color=KIND_COLORS["attn"])
    ax.axhline(aer, color="black", lw=1.0, ls="--", label=f"corpus AER {aer:.3f}")
    ax.set_xticks(range(len(vals)))
    ax.set_xticklabels([str(i) for i in ids], rotation=90 if len(vals) > 8 else 0, fontsize=7)
    ax.set_ylim(0, 1)
    ax.set_ylabel("AER (lower is better)", fontsize=8)
    ax.set_xlabel("sentence", fontsize=8)
    ax.legend(fontsize=7)
    who = f"{method}: " if method else ""
    ax.set_title(f"{who}alignment error rate (precision {precision:.3f}, recall {recall:.3f})", fontsize=9)
    fig.tight_layout()
    return fig
