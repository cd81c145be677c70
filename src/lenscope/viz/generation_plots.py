"""Static picture of a generated continuation explained token by token (``lenscope generate --png``): one
method's matrix (generated token x source token, blank after each step's own position) and a strip of each
generated token's probability beside its row."""

from __future__ import annotations

from ..errors import InputError
from .lens_plots import show_token
from .views.generation import as_dict

MAX_LABELS = 80  # at most this many tick labels per axis (every k-th token beyond)


def generation_matrix(d_or_gen, method: str | None = None):
    """``(matrix (step, src) float64 with NaN after each step's position, method)``: ``method``'s scores of every
    step over the tokens before the last generated one (default: the generation's first method)."""
    import numpy as np

    d = as_dict(d_or_gen)
    methods = list(d["methods"])
    if method is None:
        if not methods:
            raise InputError("this generation explains no method; generate with explain=(...)")
        method = methods[0]
    if method not in methods:
        raise InputError(f"this generation has no {method!r} explanations; it has {', '.join(methods) or 'none'}")
    steps = d["generated"]
    cols = max((g["position"] for g in steps), default=0)
    out = np.full((len(steps), cols), np.nan)
    for k, g in enumerate(steps):
        s = g["explanations"][method]["scores"]
        out[k, : len(s)] = [np.nan if v is None else v for v in s]
    return out, method


def _ticks(ax_set, labels, **kw):
    step = max(1, -(-len(labels) // MAX_LABELS))
    idx = list(range(0, len(labels), step))
    ax_set(idx, [labels[i] for i in idx], **kw)


def plot_generation(d_or_gen, method: str | None = None, ax=None):
    """The matrix of ``method``'s scores (rows: generated tokens; columns: source tokens; blank where a step has no
    score, a dashed line where the prompt ends; diverging colours for signed scores) with the generated tokens'
    probabilities in a strip beside it (an axes labelled ``"prob"``). Takes ``lenscope.generate``'s result or its
    ``to_dict()``; draws into ``ax`` when given (the strip and colour bar as insets). Returns the figure."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    import numpy as np

    d = as_dict(d_or_gen)
    data, method = generation_matrix(d, method)
    steps, tokens = d["generated"], d["tokens"]
    n_steps, cols = data.shape
    if ax is None:
        w = min(40.0, max(6.0, 0.26 * cols + 3.2))
        h = min(40.0, max(3.0, 0.26 * n_steps + 2.4))
        fig = plt.figure(figsize=(w, h), layout="constrained")
        gs = fig.add_gridspec(1, 3, width_ratios=[max(cols, 1), max(0.9, cols / 40), max(0.5, cols / 60)])
        ax = fig.add_subplot(gs[0, 0])
        ax_p, ax_c = fig.add_subplot(gs[0, 1], sharey=ax), fig.add_subplot(gs[0, 2])
    else:
        fig = ax.figure
        ax_p, ax_c = ax.inset_axes([1.01, 0, 0.04, 1], sharey=ax), ax.inset_axes([1.09, 0, 0.025, 1])
    finite = data[np.isfinite(data)]
    signed = bool((finite < -1e-12).any())
    vmax = float(np.abs(finite).max()) if finite.size else 1.0
    vmax = vmax if vmax > 0 else 1.0
    cmap = plt.get_cmap("RdBu_r" if signed else "viridis").with_extremes(bad="#eeeeee")
    im = ax.imshow(data, aspect="auto", cmap=cmap, vmin=-vmax if signed else 0, vmax=vmax, interpolation="nearest")
    n_prompt = len(d["prompt_tokens"])
    if 0 < n_prompt < cols:
        ax.axvline(n_prompt - 0.5, color="#3b5bdb", lw=1.2, ls="--")
    _ticks(ax.set_xticks, [show_token(t, 10) for t in tokens[:cols]], rotation=60, ha="right", fontsize=7)
    _ticks(ax.set_yticks, [show_token(g["token"], 12) for g in steps], fontsize=7)
    ax.set_xlabel("source token")
    ax.set_ylabel("generated token")
    model = d.get("model") or ""
    ax.set_title(f"{method}: {model} · {n_steps} generated tokens", fontsize=9)
    fig.colorbar(im, cax=ax_c, label="score")

    probs = np.array([[np.nan if g.get("prob") is None else g["prob"]] for g in steps])
    ax_p.set_label("prob")
    ax_p.imshow(probs, aspect="auto", cmap="viridis", vmin=0, vmax=1, interpolation="nearest")
    if n_steps <= MAX_LABELS:
        for k, p in enumerate(probs[:, 0]):
            ax_p.text(0, k, f"{p:.2g}", ha="center", va="center", fontsize=6.5, color="white" if p < 0.6 else "black")
    ax_p.set_xticks([0], ["prob"], fontsize=7)
    ax_p.tick_params(axis="y", labelleft=False, left=False)
    return fig
