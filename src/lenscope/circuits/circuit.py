"""Circuits (sets of edges or nodes), their faithfulness, and the greedy exact pruning they are compared with.

A circuit keeps some edges of the component graph; every other edge carries the ablated write (the corrupted
run's, or the mean over the clean prompts) in the run of :func:`lenscope.circuits.patch.circuit_metrics`. A node
circuit keeps the nodes' outgoing edges. Faithfulness normalises the circuit's metric (mean over prompts) so that
``0`` is the corrupted run and ``1`` the clean run:

    faithfulness = (metric(circuit) - metric(corrupted)) / (metric(clean) - metric(corrupted))

:func:`faithfulness` evaluates the top-``k`` circuits of a scoring on a log-spaced grid of ``k`` (10 edges to all
of them, every circuit of the grid as rows of one batch); :func:`smallest_circuit` refines the grid by bisection to
the smallest ``k`` reaching a fraction (0.8 by default); :func:`greedy_circuit` is the exact, ACDC-like baseline:
visit the receivers from the logits down and drop each incoming edge whose removal moves the metric by less than
``tau`` (in units of clean minus corrupted), measured exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..errors import InputError
from ..models.loading.load import LoadedModel
from ..results import Result
from .graph import ComponentGraph, end_metrics, groups
from .patch import _writes, circuit_metrics, mean_writes


def log_grid(total: int, start: int = 10, per_decade: int = 4) -> list[int]:
    """Log-spaced circuit sizes from ``start`` (or 1 for tiny graphs) to ``total``, both included."""
    if total < 1:
        raise InputError("a circuit needs at least one edge or node")
    lo = min(start, total)
    if lo == total:
        return [total]
    n = max(2, math.ceil(per_decade * math.log10(total / lo)) + 1)
    ks = torch.logspace(math.log10(lo), math.log10(total), n, dtype=torch.float64).round().long().tolist()
    return sorted(set(ks) | {lo, total})


def _ranking(graph: ComponentGraph, scores) -> tuple[str, list]:
    """``(level, members in decreasing |score|)``: edges as ``(sender, receiver)`` index pairs, or node names."""
    if hasattr(scores, "ranking"):  # EdgeAttribution
        if list(scores.senders) != list(graph.senders) or list(scores.receivers) != list(graph.receivers):
            raise InputError("the edge scores were computed on another model")
        return "edges", [tuple(x) for x in scores.ranking().tolist()]
    nodes = [n for n in scores.nodes() if n["name"] in graph.senders]
    if not nodes:
        raise InputError("the node scores name no node of this model's graph")
    nodes.sort(key=lambda n: -abs(n["score"]))
    return "nodes", [n["name"] for n in nodes]


def _kept(graph: ComponentGraph, level: str, members) -> Tensor:
    """``(S, R)`` bool: the edges a circuit keeps."""
    if level == "nodes":
        return graph.node_edges(set(members))
    keep = torch.zeros_like(graph.valid)
    if members:
        idx = torch.tensor(list(members), dtype=torch.long).reshape(-1, 2)
        keep[idx[:, 0], idx[:, 1]] = True
    return keep & graph.valid


@dataclass(repr=False)
class Circuit(Result):
    """A set of edges (``[sender, receiver]`` names) or nodes (names) of one model's component graph."""

    level: str
    members: list
    model: str
    method: str = ""
    info: dict = field(default_factory=dict)

    @classmethod
    def top(cls, lm: LoadedModel, scores, k: int) -> Circuit:
        """The ``k`` edges (or nodes) with the largest ``|score|``."""
        graph = ComponentGraph.of(lm)
        level, ranked = _ranking(graph, scores)
        if level == "edges":
            members = [[graph.senders[s], graph.receivers[r]] for s, r in ranked[:k]]
        else:
            members = ranked[:k]
        return cls(level, members, lm.name, getattr(scores, "method", ""), {"k": k})

    def edge_mask(self, graph: ComponentGraph) -> Tensor:
        if self.level == "nodes":
            return _kept(graph, "nodes", self.members)
        return _kept(graph, "edges", [(graph.sender_index(s), graph.receiver_index(r)) for s, r in self.members])

    def _keys(self) -> set:
        return {tuple(m) if isinstance(m, list) else m for m in self.members}

    def diff(self, other: Circuit) -> dict:
        """``{only_here, only_there, both}``: the members in one circuit and not the other, and the shared ones."""
        if self.level != other.level:
            raise InputError(f"cannot diff a circuit of {self.level} with one of {other.level}")
        a, b = self._keys(), other._keys()
        return {"only_here": sorted(a - b), "only_there": sorted(b - a), "both": sorted(a & b)}

    def to_dict(self) -> dict:
        key = "edges" if self.level == "edges" else "nodes"
        items = ([{"src": s, "dst": r} for s, r in self.members] if self.level == "edges"
                 else [{"name": n} for n in self.members])
        return {"level": self.level, "model": self.model, "method": self.method, key: items, **self.info}

    def draw(self, ax=None):
        """The circuit as a layered graph (matplotlib)."""
        from ..viz.circuit_plots import plot_circuit

        return plot_circuit(self, ax=ax)

    def __len__(self) -> int:
        return len(self.members)

    def __repr__(self) -> str:
        return f"Circuit({self.level}={len(self.members)}, model={self.model!r}, method={self.method!r})"


@dataclass(repr=False)
class Faithfulness(Result):
    """Faithfulness of the top-``k`` circuits of one scoring: ``k (point,)``, ``value (point,)``; ``fraction`` is
    ``k / total``."""

    k: Tensor
    value: Tensor
    total: int
    level: str
    method: str
    ablation: str
    metric_clean: float
    metric_corrupted: float
    n: int
    model: str
    info: dict = field(default_factory=dict)

    def points(self) -> list[dict]:
        """``[{k, fraction, value}]``."""
        return [{"k": int(k), "fraction": int(k) / self.total, "value": float(v)}
                for k, v in zip(self.k.tolist(), self.value.tolist())]

    def smallest(self, fraction: float = 0.8) -> int | None:
        """The smallest ``k`` of the grid whose circuit reaches ``fraction`` (None when none does)."""
        hit = (self.value >= fraction).nonzero()
        return int(self.k[hit[0, 0]]) if len(hit) else None

    def to_dict(self) -> dict:
        return {"level": self.level, "method": self.method, "ablation": self.ablation, "total": self.total,
                "n": self.n, "metric_clean": self.metric_clean, "metric_corrupted": self.metric_corrupted,
                "faithfulness": self.points(), **self.info}

    def to_frame(self):
        import pandas as pd

        return pd.DataFrame(self.points())

    def plot(self, ax=None, fraction: float = 0.8):
        from ..viz.circuit_plots import plot_faithfulness

        return plot_faithfulness(self, ax=ax, fraction=fraction)

    def __repr__(self) -> str:
        return (f"Faithfulness({self.level}, points={self.k.numel()}, total={self.total}, "
                f"smallest_0.8={self.smallest()})")


class _Evaluator:
    """Mean metric over all prompts of a batch of circuits (``(C, S, R)`` kept-edge masks), sender writes cached."""

    def __init__(self, lm: LoadedModel, pairs, metric: str, position: int, ablation: str, memory_mb: float,
                 reference=None):
        self.lm, self.ablation, self.memory_mb = lm, ablation, memory_mb
        self.graph = ComponentGraph.of(lm)
        self.groups = groups(lm, pairs, metric, position)
        self.n = sum(g.size for g in self.groups)
        ref = None if reference is None or ablation != "mean" else mean_writes(lm, self.graph, reference, metric)
        self.writes = [_writes(lm, self.graph, g, ablation, ref) for g in self.groups]
        ends = [end_metrics(lm, g, metric) for g in self.groups]
        self.m_clean = sum(float(c.sum()) for c, _ in ends) / self.n
        self.m_corr = sum(float(x.sum()) for _, x in ends) / self.n
        if abs(self.m_clean - self.m_corr) < 1e-6:
            raise InputError("the clean and corrupted prompts give the same metric, so faithfulness (a fraction of "
                             "their difference) is undefined: use a corruption that changes the prediction")
        self.evaluations = 0

    def __call__(self, kept: Tensor) -> Tensor:
        """``(C,)`` faithfulness of the circuits ``kept (C, S, R)``."""
        removed = self.graph.valid[None] & ~kept
        total = torch.zeros(kept.shape[0])
        for g, w in zip(self.groups, self.writes):
            total += circuit_metrics(self.lm, self.graph, g, removed, ablation=self.ablation,
                                     memory_mb=self.memory_mb, writes=w).sum(1)
        self.evaluations += kept.shape[0]
        return (total / self.n - self.m_corr) / (self.m_clean - self.m_corr)


def faithfulness(lm: LoadedModel, pairs, scores, *, ks: list[int] | None = None, ablation: str = "corrupted",
                 reference=None, metric: str | None = None, position: int = -1,
                 memory_mb: float = 1024) -> Faithfulness:
    """Faithfulness of the top-``k`` circuits of ``scores`` (an :class:`EdgeAttribution` or a
    :class:`NodeAttribution`) for each ``k`` of ``ks`` (default: :func:`log_grid` from 10 to all). Edges outside
    carry the corrupted run's write, or with ``ablation="mean"`` the mean over the clean prompts of ``reference``
    (pairs; default: ``pairs`` themselves) at each position."""
    metric = metric or scores.metric
    ev = _Evaluator(lm, pairs, metric, position, ablation, memory_mb, reference)
    level, ranked = _ranking(ev.graph, scores)
    ks = ks or log_grid(len(ranked))
    if min(ks) < 0 or max(ks) > len(ranked):
        raise InputError(f"circuit sizes must lie in 0..{len(ranked)}")
    kept = torch.stack([_kept(ev.graph, level, ranked[:k]) for k in ks])
    value = ev(kept)
    return Faithfulness(torch.tensor(ks), value, len(ranked), level, getattr(scores, "method", ""), ablation,
                        ev.m_clean, ev.m_corr, ev.n, lm.name)


def smallest_circuit(lm: LoadedModel, pairs, scores, fraction: float = 0.8, *, curve: Faithfulness | None = None,
                     ablation: str = "corrupted", reference=None, position: int = -1,
                     memory_mb: float = 1024) -> Circuit | None:
    """The smallest top-``k`` circuit of ``scores`` whose faithfulness reaches ``fraction``: the grid's first
    ``k`` that does (``curve``, computed when not given), refined by bisection against the grid point below it
    (faithfulness need not grow with ``k``, so this is the first crossing bisection finds). None when no ``k``
    reaches it."""
    curve = curve or faithfulness(lm, pairs, scores, ablation=ablation, reference=reference, position=position,
                                  memory_mb=memory_mb)
    hi = curve.smallest(fraction)
    if hi is None:
        return None
    ev = _Evaluator(lm, pairs, scores.metric, position, ablation, memory_mb, reference)
    level, ranked = _ranking(ev.graph, scores)
    below = [int(k) for k in curve.k.tolist() if k < hi]
    lo = below[-1] if below else 0
    best = float(curve.value[curve.k.tolist().index(hi)])
    while hi - lo > 1:
        mid = (lo + hi) // 2
        v = float(ev(_kept(ev.graph, level, ranked[:mid])[None])[0])
        if v >= fraction:
            hi, best = mid, v
        else:
            lo = mid
    c = Circuit.top(lm, scores, hi)
    c.info.update({"faithfulness": best, "fraction": fraction, "ablation": ablation})
    return c


def greedy_circuit(lm: LoadedModel, pairs, *, tau: float = 0.01, metric: str = "logit_diff", position: int = -1,
                   ablation: str = "corrupted", reference=None, candidates: Tensor | None = None,
                   memory_mb: float = 1024, progress=None) -> Circuit:
    """ACDC-like exact pruning: start from every edge (or the ``candidates (S, R)`` mask, every other edge ablated),
    visit the receivers from the logits down, and for each incoming edge remove it when that moves faithfulness by
    less than ``tau``; each decision is one exact run (all prompts). Cost: one run per candidate edge, so use it on
    small graphs or candidate sets."""
    ev = _Evaluator(lm, pairs, metric, position, ablation, memory_mb, reference)
    graph = ev.graph
    kept = graph.valid.clone() if candidates is None else candidates.bool() & graph.valid
    current = float(ev(kept[None])[0])
    start = current
    order = list(range(len(graph.receivers) - 1, -1, -1))
    todo = int(kept.sum())
    done = 0
    for r in order:
        for s in kept[:, r].nonzero().flatten().tolist():
            trial = kept.clone()
            trial[s, r] = False
            v = float(ev(trial[None])[0])
            if abs(v - current) < tau:
                kept, current = trial, v
            done += 1
            if progress is not None:
                progress(done, todo)
    s_idx, r_idx = kept.nonzero(as_tuple=True)
    members = [[graph.senders[s], graph.receivers[r]] for s, r in zip(s_idx.tolist(), r_idx.tolist())]
    return Circuit("edges", members, lm.name, "greedy-exact",
                   {"tau": tau, "faithfulness": current, "start_faithfulness": start, "ablation": ablation,
                    "evaluations": ev.evaluations})
