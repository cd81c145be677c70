"""Static plots of context-mixing maps (one heat map per layer) and of the mixing analyses."""

from __future__ import annotations

import math

from .lens_plots import show_token


def plot_maps(res, layers=None, cols: int = 4):
    """A grid of ``(pos, src)`` heat maps of a :class:`~lenscope.mixing.maps.MixingMaps`, one per layer
    (rows = output position i, columns = source j), each on its own colour scale."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    idx = list(range(len(res.layers))) if layers is None else [res.layers.index(l) for l in layers]
    n = len(res.tokens)
    cols = max(1, min(cols, len(idx)))
    rows = math.ceil(len(idx) / cols)
    side = min(4.2, max(2.4, 0.16 * n + 1.2))
    fig, axes = plt.subplots(rows, cols, figsize=(side * cols + 0.6, side * rows + 0.5), squeeze=False,
                             layout="constrained")
    labels = [show_token(t, 8) for t in res.tokens]
    ticks = n <= 40
    for ax in axes.flat[len(idx):]:
        ax.axis("off")
    for ax, k in zip(axes.flat, idx):
        m = res.maps[k].double().numpy()
        ax.imshow(m, cmap="Blues", vmin=0, vmax=max(float(m.max()), 1e-12), interpolation="nearest")
        ax.set_title(f"layer {res.layers[k]}", fontsize=9)
        if ticks:
            ax.set_xticks(range(n), labels, rotation=90, fontsize=6)
            ax.set_yticks(range(n), labels, fontsize=6)
        else:
            ax.set_xticks([])
            ax.set_yticks([])
    fig.suptitle(f"{res.model} · scope {res.scope} · ‖F_i(x_j)‖ (row i = output, column j = source)", fontsize=10)
    return fig


def plot_study(study) -> dict:
    """The figures of a :class:`~lenscope.sweeps.mixing_study.MixingStudy`: contextualization change per layer and
    scope pair (paper Fig. 3/6), FF output norm against the bypassed residual (Fig. 7), and the LN-weight
    analysis (Fig. 8)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    L = len(study.ff_norm)
    x = list(range(L))
    title = f"{study.model} · {study.dataset} ({study.n_sentences} sentences)"
    figs = {}
    kinds = ["full"] + (["lower"] if study.placement != "post" else [])
    fig, axes = plt.subplots(1, len(kinds), figsize=(6.2 * len(kinds), 3.8), squeeze=False, layout="constrained")
    for ax, kind in zip(axes[0], kinds):
        _layer_curves(ax, x, "contextualization change (1 − Spearman ρ)",
                      [(vals, "o", pair.replace("->", " → ")) for pair, vals in study.cc[kind].items()], legend=None)
        ax.set_title(f"{'full maps' if kind == 'full' else 'lower triangle'}", fontsize=9)
    axes[0][-1].legend(fontsize=7, loc="best")
    fig.suptitle(title, fontsize=10)
    figs["contextualization"] = fig

    fig, ax = plt.subplots(figsize=(6.2, 3.6), layout="constrained")
    _layer_curves(ax, x, "mean L2 norm",
                  [(study.ff_norm, "o", "‖FF output‖"), (study.bypass_norm, "s", "‖vector bypassed by RES‖")])
    ax.set_yscale("log")
    ax.set_title(title, fontsize=9)
    figs["ff_norms"] = fig

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 3.6), layout="constrained")
    _layer_curves(a1, x, "corr(|γ| of next norm, mean |FF output|)",
                  [(study.gamma_pearson, "o", "Pearson"), (study.gamma_spearman, "s", "Spearman")])
    a1.axhline(0, color="black", lw=0.6)
    _layer_curves(a2, x, "contextualization change by FF",
                  [(study.cc_ff, "o", "all dimensions"), (study.cc_ff_masked, "s", "without the 1% smallest |γ|")])
    fig.suptitle(title, fontsize=10)
    figs["gamma"] = fig
    return figs


def _layer_curves(ax, x, ylabel: str, curves, legend: int | None = 8) -> None:
    """Draw ``curves`` ``[(values (layer,), marker, label)]`` against the layers ``x`` on ``ax`` (a None value is a
    gap), label the axes, add a grid and, unless ``legend`` is None, a legend in that font size."""
    for vals, marker, label in curves:
        ax.plot(x, [float("nan") if v is None else v for v in vals], marker=marker, ms=3, label=label)
    ax.set_xlabel("layer")
    ax.set_ylabel(ylabel)
    if legend is not None:
        ax.legend(fontsize=legend)
    ax.grid(alpha=0.3)
