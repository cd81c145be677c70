"""Static plots of lens results: prediction trajectories (annotated heat maps) and per-layer lens curves.

Only drawing happens here; the numbers come from :mod:`lenscope.lenses`. Every function returns the
matplotlib Figure (save it with :func:`lenscope.viz.plots.save_figure`).
"""

from __future__ import annotations

import warnings

from ..errors import InputError
from .plots import _figure

# colour = how settled the lens is: bright cells are confident / close to the model's output
CMAPS = {"entropy": "viridis_r", "kl": "magma_r", "prob": "viridis"}
LABELS = {"entropy": "entropy of the lens (nats)", "kl": "KL(final ‖ lens) (nats, log scale)",
          "prob": "top-1 probability"}
METRIC_LABELS = {"kl": "KL(final ‖ lens) (nats)", "ce": "cross-entropy (nats)", "entropy": "entropy (nats)",
                 "top1": "top-1 agreement with the output"}


def show_token(token: str, width: int | None = None) -> str:
    """A token as it reads in a plot: visible whitespace, ``$`` escaped for matplotlib, cut to ``width``."""
    s = token.replace(" ", "␣").replace("\n", "↵").replace("\t", "⇥")
    s = "".join(f"\\x{ord(c):02x}" if ord(c) < 0x20 or c == "\x7f" else c for c in s)  # other control characters
    if width is not None and len(s) > width:
        s = s[: width - 1] + "…"
    return s.replace("$", r"\$")


def _check_value(value: str) -> None:
    if value not in CMAPS:
        raise InputError(f"value must be one of {', '.join(CMAPS)}, not {value!r}")


def _range(trajs, value: str) -> tuple[float, float]:
    if value == "prob":
        return 0.0, 1.0
    top = max(float(t.values(value).max()) for t in trajs)
    return 0.0, max(top, 1e-6)


def _norm(value: str, vmin: float, vmax: float):
    """Linear colour scale; KL (from 0 at the output to tens of nats at the embeddings) on a log(1 + x) scale."""
    import matplotlib as mpl
    import numpy as np

    if value == "kl":
        return mpl.colors.FuncNorm((np.log1p, np.expm1), vmin=vmin, vmax=vmax)
    return mpl.colors.Normalize(vmin=vmin, vmax=vmax)


def _state_ticks(labels: list[str]) -> list[str]:
    out = list(labels)
    out[0] = f"{labels[0]} embed"
    out[-1] = f"{labels[-1]} output"
    return out


def _draw(traj, ax, value: str, vmin: float, vmax: float, width: int = 7):
    """Heat map of one trajectory on ``ax``; returns the image (for a colorbar)."""
    import matplotlib as mpl
    import numpy as np

    data = traj.values(value).float().numpy()
    S, P = data.shape
    cmap = mpl.colormaps[CMAPS[value]]
    norm = _norm(value, vmin, vmax)
    im = ax.imshow(data, origin="lower", aspect="auto", cmap=cmap, norm=norm, interpolation="nearest")

    # annotation size from the cell size in points
    bbox = ax.get_window_extent().transformed(ax.figure.dpi_scale_trans.inverted())
    cell_w, cell_h = bbox.width * 72 / P, bbox.height * 72 / S
    font = float(np.clip(min(cell_h * 0.62, cell_w / (0.62 * width)), 3.5, 8.0))
    targets = traj.targets()
    rgba = cmap(norm(data))
    lum = 0.2126 * rgba[..., 0] + 0.7152 * rgba[..., 1] + 0.0722 * rgba[..., 2]
    for s in range(S):
        for p in range(P):
            tok = traj.top_tokens[s][p]
            hit = targets[p] is not None and tok == targets[p]
            ax.text(p, s, show_token(tok, width), ha="center", va="center", fontsize=font,
                    color="black" if lum[s, p] > 0.5 else "white", fontweight="bold" if hit else "normal",
                    clip_on=True)

    ax.set_xticks(range(P), [show_token(t, 12) for t in traj.tokens], rotation=55, ha="right",
                  rotation_mode="anchor", fontsize=7)
    ax.set_yticks(range(S), _state_ticks(traj.state_labels), fontsize=6.5 if S > 40 else 7)
    ax.set_xlabel("input token", fontsize=8)
    ax.set_ylabel("state (bottom: embeddings, top: output)", fontsize=8)
    if traj.causal:  # what each position is trained to predict
        top = ax.secondary_xaxis("top")
        top.set_xticks(range(P), [show_token(t, 12) if t is not None else "" for t in targets], rotation=55,
                       ha="left", rotation_mode="anchor", fontsize=7, color="#555555")
        top.tick_params(length=0)
    ax.set_xticks(np.arange(-0.5, P, 1), minor=True)
    ax.set_yticks(np.arange(-0.5, S, 1), minor=True)
    ax.grid(which="minor", color="white", linewidth=0.4)
    ax.tick_params(which="minor", length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    return im


def _colorbar(fig, im, ax, value: str, vmax: float, **kw):
    cb = fig.colorbar(im, ax=ax, **kw)
    cb.set_label(LABELS[value], fontsize=8)
    if value == "kl":  # readable ticks on the log(1 + x) scale
        ticks = [t for t in (0, 0.1, 0.3, 1, 3, 10, 30, 100, 300, 1000) if t <= vmax]
        cb.set_ticks(ticks, labels=[f"{t:g}" for t in ticks])
    cb.ax.tick_params(labelsize=7)
    return cb


def _title(traj) -> str:
    return f"{traj.lens} lens · {traj.model}"


def _size(traj, n: int = 1) -> tuple[float, float]:
    return (min(40.0, 1.6 + n * (0.62 * traj.n_pos + 1.0)), min(40.0, 2.2 + 0.24 * traj.n_states))


def plot_trajectory(traj, ax=None, value: str = "entropy", width: int = 7):
    """Annotated heat map of a :class:`~lenscope.lenses.trajectory.PredictionTrajectory`.

    Rows are states (embeddings at the bottom, the output at the top), columns the input tokens (for
    decoders the token each position predicts is written along the top). Each cell shows the lens's top-1
    token (bold where it is the token the position is trained to predict; ``␣`` marks a space), coloured by
    ``value``: ``"entropy"``, ``"kl"`` or ``"prob"`` (bright = confident / close to the output).
    """
    _check_value(value)
    fig, ax = _figure(ax, _size(traj))
    vmin, vmax = _range([traj], value)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Glyph .* missing")
        im = _draw(traj, ax, value, vmin, vmax, width)
        _colorbar(fig, im, ax, value, vmax, fraction=0.04, pad=0.02)
        ax.set_title(_title(traj), fontsize=10, pad=34 if traj.causal else 6)
        fig.tight_layout()
    return fig


def plot_trajectories(trajs, value: str = "entropy", width: int = 7):
    """Several trajectories (e.g. tuned and logit lens on the same text) side by side with one colour scale."""
    import matplotlib as mpl
    import matplotlib.pyplot as plt

    _check_value(value)
    trajs = list(trajs)
    if not trajs:
        raise InputError("no trajectories given; pass at least one PredictionTrajectory")
    mpl.use("Agg", force=False)
    w, h = _size(trajs[0], len(trajs))
    fig, axes = plt.subplots(1, len(trajs), figsize=(w, h), squeeze=False)
    vmin, vmax = _range(trajs, value)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Glyph .* missing")
        fig.tight_layout()  # settle the axes' sizes before choosing the font size of the cells
        for traj, ax in zip(trajs, axes[0]):
            im = _draw(traj, ax, value, vmin, vmax, width)
            ax.set_title(_title(traj), fontsize=10, pad=34 if traj.causal else 6)
        for ax in axes[0][1:]:
            ax.set_ylabel("")
        fig.tight_layout()
        _colorbar(fig, im, list(axes[0]), value, vmax, fraction=0.03, pad=0.015)
    return fig


def plot_lens_evaluation(ev, other=None, ax=None, log: bool = False, metric: str = "kl"):
    """Per-state curves of a :class:`~lenscope.lenses.evaluate.LensEvaluation` (and ``other``, one or a list, e.g.
    the logit lens next to a tuned lens), labelled by their ``.lens`` names.

    ``metric`` is ``"kl"`` (default), ``"ce"``, ``"entropy"`` or ``"top1"``; ``log=True`` puts the y axis on a
    log scale (the output state, where KL is 0 by definition, is then left out).
    """
    import numpy as np

    if metric not in METRIC_LABELS:
        raise InputError(f"metric must be one of {', '.join(METRIC_LABELS)}, not {metric!r}")
    evs = [ev] + (list(other) if isinstance(other, (list, tuple)) else [other] if other is not None else [])
    fig, ax = _figure(ax, (7, 4))
    colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"]
    for i, e in enumerate(evs):
        y = getattr(e, metric).float().numpy()
        x = np.arange(len(y))
        if log:
            keep = y > 0
            x, y = x[keep], y[keep]
        label = f"{e.lens} lens"
        if metric == "kl":
            label += f" (mean {e.mean_kl:.3g} nats)"
        ax.plot(x, y, marker="o", markersize=3.5, lw=1.6, color=colors[i % len(colors)], label=label)
    if log:
        ax.set_yscale("log")
    L = evs[0].n_layers
    ax.set_xlabel(f"state (0 = embeddings, {L} = output)")
    ax.set_ylabel(METRIC_LABELS[metric])
    ax.set_xlim(-0.5, L + 0.5)
    ax.grid(True, which="major", alpha=0.3)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.set_title(f"{METRIC_LABELS[metric]} per layer · {evs[0].model} ({evs[0].n_tokens} tokens)", fontsize=10)
    ax.legend(frameon=False, fontsize=8)
    fig.tight_layout()
    return fig
