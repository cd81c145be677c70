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
