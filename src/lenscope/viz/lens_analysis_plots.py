"""Plots of causal bases (influence per direction, causal fidelity) and prediction depth.

Only drawing happens here (nothing is imported from the methods); the numbers come from :mod:`lenscope.lenses.cbe`
and :mod:`lenscope.lenses.depth`.
Every function returns the matplotlib Figure (save it with :func:`lenscope.viz.plots.save_figure`).
"""

from __future__ import annotations

from .lens_plots import show_token
from .plots import _figure

LENS_COLORS = {"tuned": "#1f77b4", "logit": "#d62728"}
MARKERS = "osD^v<>phx"


def _color(name: str, i: int) -> str:
    import matplotlib

    return LENS_COLORS.get(name, matplotlib.colormaps["tab10"](i % 10))


def plot_sigma(results, ax=None):
    """Influence per direction: each lens's causal basis (solid) and the principal components of the same
    states under that lens (dashed), log scale. ``results``: :class:`CausalBasis` objects (one state each)."""
    fig, ax = _figure(ax, (6.4, 4.0))
    names = []
    for i, r in enumerate(results):
        col = _color(r.lens, len(names) if r.lens not in names else names.index(r.lens))
        if r.lens not in names:
            names.append(r.lens)
        x = range(1, r.k + 1)
        ax.plot(x, r.sigma.numpy(), marker=MARKERS[i % len(MARKERS)], color=col,
                label=f"{r.lens} lens CBE, state {r.layer}")
        ax.plot(x, r.pca_sigma.numpy(), marker=MARKERS[i % len(MARKERS)], color=col, ls="--", alpha=0.6, mfc="none",
                label=f"{r.lens} lens, principal components")
        if r.model_sigma is not None and r.model_sigma.numel():
            ax.plot(x, r.model_sigma.numpy(), color=col, ls=":", alpha=0.8, label=f"model, {r.lens} CBE directions")
    ax.set_yscale("log")
    ax.set_xlabel("direction (rank)")
    ax.set_ylabel("influence σ (nats, mean-ablation KL)")
    model = results[0].model if results else ""
    ax.set_title(f"Causal basis vs principal components ({model})")
    ax.legend(fontsize=7, frameon=False)
    ax.grid(alpha=0.3)
    return fig


def plot_fidelity(groups: dict, ax=None, *, rho: dict | None = None):
    """Causal fidelity: lens influence (x) vs the model's influence (y) of every basis direction, log-log.
    ``groups``: lens name -> list of :class:`CausalBasis` (one per state). ``rho``: lens name -> its Spearman
    correlation pooled over its states (:func:`lenscope.lenses.cbe.fidelity_spearman`, computed by the caller:
    this module draws only), shown in the legend; without it the legend names the lenses only."""
    fig, ax = _figure(ax, (5.6, 5.0))
    lo, hi = float("inf"), 0.0
    for gi, (name, results) in enumerate(groups.items()):
        col = _color(name, gi)
        r_s = None if rho is None else rho.get(name)
        first = True
        for li, r in enumerate(results):
            if r.model_sigma is None or not r.model_sigma.numel():
                continue
            x, y = r.sigma.numpy(), r.model_sigma.numpy()
            lab = None
            if first and r_s is not None:
                lab = f"{name} lens (Spearman ρ = {r_s:.2f})"
            elif first and rho is None:
                lab = f"{name} lens"
            ax.scatter(x, y, color=col, marker=MARKERS[li % len(MARKERS)], s=28, alpha=0.8, label=lab)
            first = False
            lo = min(lo, float(x.min()), float(y.min()))
            hi = max(hi, float(x.max()), float(y.max()))
    if hi > 0:
        lo = max(lo, hi * 1e-6)
        ax.plot([lo, hi], [lo, hi], color="gray", lw=0.8, ls="--")
    # marker legend for states
    states = sorted({r.layer for rs in groups.values() for r in rs})
    for li, s in enumerate(states):
        ax.scatter([], [], color="gray", marker=MARKERS[li % len(MARKERS)], label=f"state {s}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("influence on the lens σ(v; lens) (nats)")
    ax.set_ylabel("influence on the model's output σ(v; model) (nats)")
    ax.set_title("Causal fidelity of CBE directions")
    ax.legend(fontsize=7, frameon=False)
    ax.grid(alpha=0.3)
    return fig


def plot_depth_stats(stats, ax=None, min_count: int = 10):
    """Prediction depth histogram per lens (bars, fraction of tokens; the last bin = never settles) and the
    model's mean loss at each depth with at least ``min_count`` tokens (lines, right axis)."""
    import numpy as np

    fig, ax = _figure(ax, (7.2, 4.0))
    ax2 = ax.twinx()
    n = len(stats)
    width = 0.8 / max(1, n)
    for i, s in enumerate(stats):
        col = _color(s.lens, i)
        hist = np.asarray(s.histogram(), dtype=float)
        frac = hist / max(1.0, hist.sum())
        x = np.arange(len(hist))
        ax.bar(x + (i - (n - 1) / 2) * width, frac, width=width, color=col, alpha=0.7,
               label=f"{s.lens} lens (mean {s.mean_depth:.1f}, ρ(depth, loss) = {s.spearman_with_loss:.2f})"
               if s.mean_depth is not None and s.spearman_with_loss is not None else f"{s.lens} lens")
        ml = np.array([np.nan if v is None else v for v in s.mean_loss_by_depth()])
        ml[hist < min_count] = np.nan  # a mean over a handful of tokens is noise
        ax2.plot(x, ml, color=col, marker=".", lw=1)
    L = stats[0].n_layers if stats else 0
    ticks = list(range(0, L, max(1, L // 10))) + [L]
    ax.set_xticks(ticks)
    ax.set_xticklabels([str(t) for t in ticks[:-1]] + ["never"])
    ax.set_xlabel("prediction depth (state)")
    ax.set_ylabel("fraction of tokens")
    ax2.set_ylabel("model loss at that depth (nats, lines)")
    title = stats[0].data if stats and stats[0].data else ""
    ax.set_title(f"Prediction depth{': ' + title if title else ''} ({stats[0].model if stats else ''})")
    ax.legend(fontsize=7, frameon=False, loc="upper left")
    return fig


def plot_token_depths(results, ax=None):
    """Prediction depth of each token of one text (bars per lens; a hatched full bar = never settles)."""
    import numpy as np

    if not isinstance(results, (list, tuple)):
        results = [results]
    r0 = results[0]
    P = len(r0.tokens)
    fig, ax = _figure(ax, (max(5.0, 0.45 * P + 1.5), 3.6))
    n = len(results)
    width = 0.8 / n
    for i, r in enumerate(results):
        d = r.depth.numpy()
        never = d < 0
        h = np.where(never, r.n_layers, d)
        x = np.arange(P) + (i - (n - 1) / 2) * width
        bars = ax.bar(x, h, width=width, color=_color(r.lens, i), alpha=0.8, label=f"{r.lens} lens")
        for b, nv in zip(bars, never):
            if nv:
                b.set_hatch("//")
                b.set_alpha(0.3)
    ax.set_xticks(range(P))
    ax.set_xticklabels([show_token(t, 10) for t in r0.tokens], rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("prediction depth (state)")
    ax.set_ylim(0, r0.n_layers)
    ax.set_title("Prediction depth per token (hatched: never settles)")
    ax.legend(fontsize=7, frameon=False)
    return fig
