"""Static plots of circuits: information-flow routes as a (token, layer) graph, a circuit of the component graph,
and a faithfulness curve."""

from __future__ import annotations

import math
from typing import Protocol

from torch import Tensor

from .lens_plots import show_token

# what these plots read of a result (viz names no method's class, not even in a hint: docs/design.md, "Layers")


class RoutesLike(Protocol):
    """Information-flow routes (:class:`lenscope.circuits.routes.InformationFlowRoutes`)."""

    model: str
    tokens: list[str]
    prediction: str
    layers: int
    tau: float
    src: Tensor
    dst: Tensor
    via: Tensor
    importance: Tensor
    nodes: Tensor


class CircuitLike(Protocol):
    """A circuit of the component graph (:class:`lenscope.circuits.circuit.Circuit`)."""

    model: str
    level: str
    method: str
    members: list


class FaithfulnessLike(Protocol):
    """A faithfulness curve (:class:`lenscope.circuits.circuit.Faithfulness`)."""

    total: int
    level: str
    method: str

    def points(self) -> list: ...


COLORS = {"attn": (0.12, 0.35, 0.75), "mlp": (0.90, 0.45, 0.05), "resid": (0.35, 0.35, 0.35)}
MLP_DX = 0.22  # the FF edge is drawn as a bend to the right of the residual line


def _y(layer: int, kind: int, mid: float) -> float:
    return layer + (mid if kind else 0.0)


def route_segments(res: RoutesLike) -> list[tuple[str, list[tuple[float, float]], float]]:
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


def plot_routes(res: RoutesLike, ax=None, min_alpha: float = 0.12):
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


RECEIVER_STYLE = {"q": "-", "k": "--", "v": ":"}


def _node_xy(name: str) -> tuple[float, float]:
    """Where a component sits: block on y (embed below, logits above), heads by index then the MLP on x."""
    if name == "embed":
        return -0.75, -1.0
    if name == "logits":
        return -0.75, 10_000.0  # placed above the top block by plot_circuit
    layer = int(name[1:].split("H")[0].split(".")[0])
    if "H" in name:
        return float(int(name.split("H")[1].split(".")[0])), float(layer)
    return -1.5, float(layer)  # an MLP, left of the heads


def plot_circuit(circuit: CircuitLike, ax=None):
    """A circuit as a layered graph: blocks bottom to top, each block's MLP (square) left of its heads (dots);
    an edge into a head's query, key or value input drawn solid, dashed or dotted. Returns the figure."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    if circuit.level == "edges":
        pairs = [(s, r) for s, r in circuit.members]
        names = {s for s, _ in pairs} | {r.rsplit(".", 1)[0] if r.endswith((".q", ".k", ".v")) else r for _, r in pairs}
    else:
        pairs, names = [], set(circuit.members)
    layers = [_node_xy(n)[1] for n in names if n not in ("logits",)]
    top = (max(layers) if layers else 0.0) + 1.0
    if ax is None:
        fig, ax = plt.subplots(figsize=(8, min(14.0, 2.0 + 0.35 * (top + 2))), layout="constrained")
    else:
        fig = ax.figure

    def xy(name):
        x, y = _node_xy(name)
        return (x, top) if name == "logits" else (x, y)

    for s, r in pairs:
        kind = r.rsplit(".", 1)[1] if r.endswith((".q", ".k", ".v")) else None
        dst = r.rsplit(".", 1)[0] if kind else r
        (x0, y0), (x1, y1) = xy(s), xy(dst)
        ax.plot([x0, x1], [y0, y1], RECEIVER_STYLE.get(kind, "-"), color=(0.2, 0.3, 0.6, 0.5), linewidth=0.8)
    for n in names:
        x, y = xy(n)
        marker = "s" if n.endswith(".mlp") or n in ("embed", "logits") else "o"
        ax.scatter([x], [y], marker=marker, s=28, color=COLORS["mlp"] if marker == "s" else COLORS["attn"], zorder=3)
        if n in ("embed", "logits"):
            ax.annotate(n, (x, y), textcoords="offset points", xytext=(6, 0), fontsize=7)
    heads = sorted({int(_node_xy(n)[0]) for n in names if "H" in n})
    ax.set_xticks([-1.5] + heads, ["MLP"] + [f"H{h}" for h in heads], fontsize=7)
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.set_ylabel("block")
    ax.set_xlabel("into a head's query: solid, key: dashed, value: dotted")
    ax.set_title(f"{circuit.model} · circuit of {len(circuit.members)} {circuit.level} ({circuit.method})", fontsize=10)
    return fig


def plot_faithfulness(curve: FaithfulnessLike, ax=None, fraction: float = 0.8):
    """Faithfulness against circuit size (log x), the ``fraction`` line and the smallest size reaching it."""
    return _faithfulness(curve.points(), curve.total, curve.level, curve.method, ax, fraction)


def _faithfulness(points: list[dict], total: int, level: str, label: str, ax, fraction: float):
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    if ax is None:
        fig, ax = plt.subplots(figsize=(6, 3.6), layout="constrained")
    else:
        fig = ax.figure
    pts = [p for p in points if p["k"] > 0 and p["value"] == p["value"]]
    ax.plot([p["k"] for p in pts], [p["value"] for p in pts], "o-", markersize=3, label=label or "scores")
    ax.axhline(fraction, color="grey", linestyle="--", linewidth=0.8)
    hit = [p["k"] for p in pts if p["value"] >= fraction]
    if hit:
        ax.axvline(hit[0], color="grey", linestyle=":", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xlabel(f"{level} kept (of {total})")
    ax.set_ylabel("faithfulness (0 corrupted, 1 clean)")
    ax.legend(fontsize=8)
    return fig


def plot_summary(d: dict, max_members: int = 60):
    """``circuit_json``'s result as one figure: the smallest circuit reaching 0.8 (at most ``max_members`` of
    the best-scored edges or nodes) and the faithfulness curve."""
    from types import SimpleNamespace

    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    k = min(d.get("smallest") or max_members, max_members)
    if d["level"] == "edges":
        members = [[e["src"], e["dst"]] for e in d["edges"][:k]]
    else:
        members = [n["name"] for n in d["nodes"] if n["name"] != "logits"][:k]
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 6), layout="constrained")
    plot_circuit(SimpleNamespace(level=d["level"], members=members, model=d["model"], method=d["method"]), ax=a)
    if d.get("faithfulness"):
        _faithfulness(d["faithfulness"], d["total"], d["level"], d["method"], b, 0.8)
    else:
        b.set_axis_off()
    return fig
