"""Static plots of context attributions: a layer × token heat map (or bars) and token-to-token matrices."""

from __future__ import annotations

from .lens_plots import show_token
from .plots import _figure


def _sym_limits(values) -> float:
    import numpy as np

    v = float(np.nanmax(np.abs(values))) if values.size else 0.0
    return v if v > 0 else 1.0


def plot_explanation(res, ax=None):
    """Layer × token heat map of ``res.layer_scores`` with the total per token beneath it (diverging colours
    centred at zero for signed scores), or one bar per token when the method has no per-layer scores."""

    n = len(res.tokens)
    labels = [f"{show_token(t, 10)}" for t in res.tokens]
    what = res.what()
    ctx = "".join(res.tokens[max(0, res.position - 8): res.position + 1])
    title = f"{res.method}: {what}\n…{ctx!r}"
    scores = res.scores.double().numpy()
    signed = bool((scores < -1e-12).any()) or (res.layer_scores is not None and bool((res.layer_scores < -1e-12).any()))
    if res.layer_scores is None:
        fig, ax = _figure(ax, (max(5.0, 0.42 * n + 2.0), 3.6))
        fig.set_layout_engine("constrained")
        colors = ["#c0392b" if v < 0 else "#2563eb" for v in scores]
        ax.bar(range(n), scores, color=colors)
        ax.axhline(0, color="black", lw=0.6)
        ax.set_xticks(range(n), labels, rotation=60, ha="right", fontsize=8)
        ax.set_ylabel("score")
        ax.set_title(title, fontsize=9)
        return fig
    L = res.layer_scores.shape[0]
    data = res.layer_scores.double().numpy()
    if ax is None:
        import matplotlib.pyplot as plt

        fig, (ax, ax2) = plt.subplots(2, 1, figsize=(max(5.5, 0.42 * n + 2.8), max(3.6, 0.2 * L + 2.6)),
                                      gridspec_kw={"height_ratios": [max(L, 4), 1.3]}, sharex=True,
                                      layout="constrained")
    else:
        fig, ax2 = ax.figure, None
    cmap = "RdBu_r" if signed else "viridis"
    vmax = _sym_limits(data)
    im = ax.imshow(data, aspect="auto", origin="lower", cmap=cmap, vmin=-vmax if signed else 0, vmax=vmax,
                   interpolation="nearest")
    ax.set_ylabel("layer")
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, label="per-layer score", fraction=0.05, pad=0.02)
    if ax2 is not None:
        v2 = _sym_limits(scores)
        ax2.imshow(scores[None, :], aspect="auto", cmap=cmap, vmin=-v2 if signed else 0, vmax=v2,
                   interpolation="nearest")
        for j, v in enumerate(scores):
            ax2.text(j, 0, f"{v:.2g}", ha="center", va="center", fontsize=6.5,
                     color="white" if abs(v) > 0.6 * v2 else "black")
        ax2.set_yticks([0], ["total"])
        ax2.set_xticks(range(n), labels, rotation=60, ha="right", fontsize=8)
    else:
        ax.set_xticks(range(n), labels, rotation=60, ha="right", fontsize=8)
    return fig


def plot_matrix(mm, layer: int = -1, which: str = "rollout", ax=None):
    """One layer's token-to-token matrix of a :class:`~lenscope.mixing.alti.MixingMatrices` (row = position,
    column = source)."""
    data = (mm.rollout if which == "rollout" else mm.contributions)[layer].double().numpy()
    n = data.shape[0]
    fig, ax = _figure(ax, (max(4.5, 0.35 * n + 2), max(4.0, 0.35 * n + 1.5)))
    im = ax.imshow(data, cmap="Blues", vmin=0, vmax=max(float(data.max()), 1e-9), interpolation="nearest")
    labels = [show_token(t, 10) for t in mm.tokens]
    ax.set_xticks(range(n), labels, rotation=60, ha="right", fontsize=7)
    ax.set_yticks(range(n), labels, fontsize=7)
    L = mm.contributions.shape[0]
    ax.set_title(f"{mm.method} {which}, layer {layer % L}", fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.04)
    fig.tight_layout()
    return fig
