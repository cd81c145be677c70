"""Heat maps of intervention results (patching, tracing): drawing only; the math lives in `lenscope.interventions`."""

from __future__ import annotations


def heatmap(values, columns, title: str, label: str, ax=None, xlabel: str = "position", signed: bool | None = None):
    """``values (layer, column)`` as an image, layer 0 at the bottom."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    data = values.detach().cpu().float().numpy()
    if ax is None:
        fig, ax = plt.subplots(figsize=(max(4.5, 0.55 * data.shape[1] + 2.5), max(3.0, 0.18 * data.shape[0] + 1.8)))
    fig = ax.figure
    import numpy as np

    if signed is None:
        signed = bool((np.nan_to_num(data) < 0).any())
    vmax = float(np.nanmax(abs(data))) if np.isfinite(data).any() else 1.0
    vmax = vmax or 1.0
    im = ax.imshow(data, aspect="auto", origin="lower", cmap="RdBu_r" if signed else "Purples",
                   vmin=-vmax if signed else 0.0, vmax=vmax, interpolation="nearest")
    ax.set_xticks(range(len(columns)), [repr(c) if xlabel.startswith("position") else c for c in columns],
                  rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("layer")
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, label=label)
    fig.tight_layout()
    return fig


def heatmaps(panels, columns, title: str, label: str):
    """Several ``(name, values (layer, column))`` panels side by side, one colour scale each."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    n = len(panels)
    L = panels[0][1].shape[0]
    fig, axes = plt.subplots(1, n, figsize=(n * max(3.5, 0.45 * len(columns) + 1.8), max(3.2, 0.18 * L + 2.0)))
    axes = [axes] if n == 1 else list(axes)
    for ax, (name, vals) in zip(axes, panels):
        heatmap(vals, columns, name, label, ax=ax)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def plot_knowledge_neurons(res, ax=None):
    """Knowledge neurons (:class:`lenscope.interventions.neurons.KnowledgeNeurons`): each layer's largest IG
    attribution against the threshold, with the probabilities after suppressing and amplifying them."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.5))
    A = res.attributions
    ax.bar(range(A.shape[0]), A.max(1).values.tolist(), color="#ff7f0e", label="largest attribution")
    ax.axhline(res.threshold * float(A.max()), color="black", lw=0.7, ls="--", label="threshold")
    ax.set_xlabel("layer")
    ax.set_ylabel("IG attribution")
    ax.set_title(f"Knowledge neurons of {res.target!r}: {len(res.neurons)} neurons; P {res.p_base:.3f} → "
                 f"{res.p_suppressed:.3f} suppressed, {res.p_amplified:.3f} amplified", fontsize=9)
    ax.legend(fontsize=7)
    ax.figure.tight_layout()
    return ax.figure
