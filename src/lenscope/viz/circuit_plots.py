"""Static plots of circuits: information-flow routes as a (token, layer) graph."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from .lens_plots import show_token

if TYPE_CHECKING:
    from ..circuits.routes import InformationFlowRoutes

COLORS = {"attn": (0.12, 0.35, 0.75), "mlp": (0.90, 0.45, 0.05), "resid": (0.35, 0.35, 0.35)}
MLP_DX = 0.22  # the FF edge is drawn as a bend to the right of the residual line


def _y(layer: int, kind: int, mid: float) -> float:
    return layer + (mid if kind else 0.0)


def route_segments(res: InformationFlowRoutes) -> list[tuple[str, list[tuple[float, float]], float]]:
    """Every kept edge as ``(kind, polyline, importance)`` in plot coordinates: token index on x, layer on y
    (``x^l`` at ``l``, ``x^mid`` of block ``l`` at ``l + 0.5``); kind ``attn`` / ``mlp`` / ``resid``."""
    mid = 0.5
    out = []
    for (sl, st, sk), (dl, dt, dk), (_, code), w in zip(res.src.tolist(), res.dst.tolist(), res.via.tolist(),
                                                         res.importance.tolist()):
        a, b = (st, _y(sl, sk, mid)), (dt, _y(dl, dk, mid))
        if code == -2:
            bend = (max(a[0], b[0]) + MLP_DX, (a[1] + b[1]) / 2)
            out.append(("mlp", [a, bend, b], w))
        elif code == -1:
            out.append(("resid", [a, b], w))
        else:
            out.append(("attn", [a, b], w))
    return out


def plot_routes(res: InformationFlowRoutes, ax=None, min_alpha: float = 0.12):
    """The routes of one prediction: tokens on x, layers on y, each kept edge a line whose opacity (and width) grows
    with its importance (``sqrt``, at least ``min_alpha``: edges just above a small ``tau`` stay visible); attention
    edges blue, FF edges orange (a bend right of the residual line), residual edges
    grey; reached nodes as dots. Returns the figure."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.collections import LineCollection

    n, L = len(res.tokens), res.layers
    if ax is None:
        fig, ax = plt.subplots(figsize=(min(18.0, 1.2 + 0.55 * n), min(16.0, 1.5 + 0.45 * L)), layout="constrained")
    else:
        fig = ax.figure
    segs = route_segments(res)
    for kind in ("resid", "mlp", "attn"):
        lines = [p for k, p, _ in segs if k == kind]
        if not lines:
            continue
        ws = [w for k, _, w in segs if k == kind]
        colors = [(*COLORS[kind], max(min_alpha, min(1.0, math.sqrt(w)))) for w in ws]
        ax.add_collection(LineCollection(lines, colors=colors, linewidths=[0.6 + 2.0 * math.sqrt(w) for w in ws],
                                         label={"attn": "attention", "mlp": "FF block", "resid": "residual"}[kind]))
    mids = [p[1] for k, p, _ in segs if k == "mlp"]
    if mids:
        ax.scatter([m[0] for m in mids], [m[1] for m in mids], s=10, marker="s", color=COLORS["mlp"], zorder=3)
    nodes = res.nodes.tolist()
    ax.scatter([t for _, t, _ in nodes], [_y(l, k, 0.5) for l, _, k in nodes], s=9, color="black", zorder=4)
    ax.set_xlim(-0.6, n - 0.4)
    ax.set_ylim(-0.4, L + 0.4)
    ax.set_xticks(range(n), [show_token(t, 10) for t in res.tokens], rotation=90, fontsize=7)
    ax.set_yticks(range(L + 1), [str(i) for i in range(L + 1)], fontsize=7)
    ax.set_ylabel("layer (x^l; x^mid half-way)")
    ax.set_title(f"{res.model} · routes of {show_token(res.tokens[-1])!s} → {show_token(res.prediction)!s} · "
                 f"τ = {res.tau:g}", fontsize=10, pad=18)
    if segs:
        ax.legend(loc="lower left", bbox_to_anchor=(0.0, 1.02), ncol=3, fontsize=7, frameon=False)
    return fig
