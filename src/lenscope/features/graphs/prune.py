"""Pruning an attribution graph and scoring it, as circuit-tracer does.

- ``normalize(A) = |A| / rowsum(|A|)``: each target's incoming absolute weights sum to 1;
- the influence of every node on the logits: ``w An + w An^2 + ...`` (``w``: the logit nodes' probabilities; the
  graph is acyclic, so the series ends);
- nodes kept in order of influence up to ``node_threshold`` of the total (token and logit nodes always), then
  edges scored by ``An[t, s] * (influence_t + w_t)`` over the kept nodes and kept up to ``edge_threshold``; a
  feature or error node needs a kept outgoing edge and a feature a kept incoming one, repeated until nothing
  changes;
- the replacement score: the share of the influence on the logits that starts at token nodes rather than error
  nodes; the completeness score: the share of every node's normalised input that comes from non-error nodes,
  weighted by the node's influence.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ...errors import InputError

CHUNK = 1024  # rows of the adjacency at a time where the graph-sized work runs (no (node, node) float64 copy)


def normalize(A: Tensor) -> Tensor:
    A = A.abs()
    return A / A.sum(1, keepdim=True).clamp_min(1e-10)


class Normalized:
    """``normalize(A)`` of an adjacency ``A`` (any float dtype, ``(node, node)``), never materialised: float64 row
    sums and ``v @ normalize(A)`` a :data:`CHUNK` of rows at a time, each chunk's rows normalised in float64 as
    :func:`normalize` does (only the sum over the chunks is ordered otherwise)."""

    def __init__(self, A: Tensor):
        self.A, n = A, A.shape[0]
        self.rowsum = torch.cat([A[a: a + CHUNK].abs().double().sum(1) for a in range(0, n, CHUNK)]) if n else \
            torch.zeros(0, dtype=torch.float64)

    def rows(self, a: int, b: int) -> Tensor:
        return self.A[a:b].abs().double() / self.rowsum[a:b, None].clamp_min(1e-10)

    def __rmatmul__(self, v: Tensor) -> Tensor:  # v @ normalize(A)
        out = torch.zeros(self.A.shape[1], dtype=torch.float64)
        for a in range(0, self.A.shape[0], CHUNK):
            if bool(v[a: a + CHUNK].any()):
                out += v[a: a + CHUNK] @ self.rows(a, a + CHUNK)
        return out


def influence(A, w: Tensor, max_iter: int = 1000) -> Tensor:
    """``w A + w A^2 + ...`` for an acyclic graph's (normalised) adjacency ``A[target, source]`` (a tensor or a
    :class:`Normalized`)."""
    cur = w @ A
    total = cur.clone()
    for _ in range(max_iter):
        if not bool(cur.any()):
            return total
        cur = cur @ A
        total += cur
    raise RuntimeError("the influence did not converge: the graph has a cycle")


def logit_weights(g) -> Tensor:
    w = torch.zeros(g.n_nodes, dtype=torch.float64)
    w[g.offsets()["logit"]:] = g.logit_probs.double()
    return w


def node_influence(g) -> Tensor:
    """Every node's influence on the logit nodes (weighted by their probabilities), ``(node,)``."""
    return influence(Normalized(g.adjacency), logit_weights(g))


def threshold_of(scores: Tensor, fraction: float, *, in_place: bool = False) -> float:
    """The smallest score among the top ones that make up ``fraction`` of the total (``scores``' dtype throughout).
    Sorted (``in_place``: ``scores``, a 1-d CPU tensor, reordered; no copy) and summed a block at a time: no index
    array or cumulative sum the size of the scores."""
    s = scores.detach().reshape(-1).numpy()
    if not in_place:
        s = s.copy()
    s.sort()  # ascending, in place
    if not s.size:
        return float("inf")
    total = s.sum()
    if float(total) <= 0:
        return float("inf")
    goal = np.asarray(fraction, dtype=s.dtype)
    run = np.zeros((), dtype=s.dtype)
    block = 1 << 20
    for end in range(s.size, 0, -block):  # largest first
        part = s[max(0, end - block): end][::-1]
        cum = (np.cumsum(part) + run) / total
        i = int(np.searchsorted(cum, goal))
        if i < part.size:
            return float(part[i])
        run = run + part.sum()
    return float(s[0])


@dataclass
class Pruned:
    """``node_mask (node,)``, ``edge_mask (node, node)`` (``[target, source]``), ``influence (node,)``: each
    node's cumulative share of the total influence at its rank (circuit-tracer's exported ``influence``)."""

    node_mask: Tensor
    edge_mask: Tensor
    influence: Tensor


def prune_memory(n_nodes: int, n_kept: int | None = None) -> int:
    """Bytes :func:`prune` takes beyond the graph (``n_kept`` nodes kept, at most all): the edge mask ``N^2``; over
    the kept nodes the edge scores in float64 (``8 K^2``, at first beside the float32 gather, ``4 K^2``) with, at
    the most, the positive scores (``8 K^2``) and two masks (``2 K^2``): ``18 K^2``; a chunk's rows in float64 twice,
    ``16 CHUNK N``."""
    K = n_nodes if n_kept is None else n_kept
    return n_nodes * n_nodes + 18 * K * K + 16 * min(CHUNK, n_nodes) * n_nodes


def prune(g, node_threshold: float = 0.8, edge_threshold: float = 0.98) -> Pruned:
    """The nodes and edges to keep (see the module's docstring). The graph-sized work runs in chunks of rows; the
    edge scores only over the kept nodes (every other score is zero): at most :func:`prune_memory` bytes."""
    for name, v in (("node_threshold", node_threshold), ("edge_threshold", edge_threshold)):
        if not 0.0 <= v <= 1.0:
            raise InputError(f"{name} must lie in [0, 1]; got {v}")
    o = g.offsets()
    w = logit_weights(g)
    inf = influence(Normalized(g.adjacency), w)
    keep = inf >= threshold_of(inf, node_threshold)
    keep[o["token"]:] = True
    idx = keep.nonzero()[:, 0]
    # over the kept nodes: the adjacency without the others, normalised, then scaled in place into the scores
    Pn = g.adjacency[idx[:, None], idx[None, :]].double()
    Pn.abs_()
    Pn /= Pn.sum(1, keepdim=True).clamp_min(1e-10)
    wk = w[idx]
    Pn *= (influence(Pn, wk) + wk)[:, None]
    pos = Pn[Pn > 0]
    cut = threshold_of(pos, edge_threshold, in_place=True)
    del pos
    edges_k = Pn >= cut
    edges_k &= Pn > 0
    del Pn
    keep_k = torch.ones(idx.numel(), dtype=torch.bool)
    fe, f = idx < o["token"], idx < o["error"]  # features and errors need a kept outgoing edge, features an incoming
    while True:
        before = keep_k.clone()
        edges_k[~keep_k] = False
        edges_k[:, ~keep_k] = False
        keep_k[fe] &= edges_k[:, fe].any(0)
        keep_k[f] &= edges_k[f].any(1)
        if bool((keep_k == before).all()):
            break
    edges_k[~keep_k] = False
    edges_k[:, ~keep_k] = False
    keep = torch.zeros_like(keep)
    keep[idx[keep_k]] = True
    edges = torch.zeros(g.n_nodes, g.n_nodes, dtype=torch.bool)
    edges[idx[:, None], idx[None, :]] = edges_k
    order = inf.argsort(descending=True)
    cum = torch.empty_like(inf)
    total = inf.sum()
    cum[order] = inf[order].cumsum(0) / (total if float(total) > 0 else 1.0)
    return Pruned(keep, edges, cum)


def graph_scores(g) -> tuple[float, float]:
    """``(replacement, completeness)`` of the unpruned graph (see the module's docstring)."""
    o = g.offsets()
    An = Normalized(g.adjacency)
    w = logit_weights(g)
    inf = influence(An, w)
    tok, err = float(inf[o["token"]: o["logit"]].sum()), float(inf[o["error"]: o["token"]].sum())
    replacement = tok / (tok + err) if tok + err > 0 else 1.0
    from_err = torch.cat([An.rows(a, a + CHUNK)[:, o["error"]: o["token"]].sum(1)
                          for a in range(0, g.n_nodes, CHUNK)])
    non_error = torch.where(An.rowsum > 0, 1 - from_err, torch.ones_like(from_err))
    weight = inf + w
    completeness = float((non_error * weight).sum() / weight.sum()) if float(weight.sum()) > 0 else 1.0
    return replacement, completeness


def node_positions(g) -> Tensor:
    """Every node's position ``(node,)`` (a logit node's: the last)."""
    o, P = g.offsets(), g.n_pos
    return torch.cat([g.feature_pos.long(), torch.arange(o["token"] - o["error"]) % P, torch.arange(P),
                      torch.full((g.n_logits,), P - 1)])


def first_position_share(g, inf: Tensor | None = None) -> float:
    """The share of the feature and error nodes' influence on the logits (``inf``, default
    :func:`node_influence`) that lies at the first position: in a model without a BOS the first token is the
    attention sink and carries most of it (docs/circuits.md); 0.0 for a graph whose feature and error nodes have no
    influence."""
    inf = node_influence(g) if inf is None else inf
    o = g.offsets()
    fe = inf[: o["token"]].double()
    total = float(fe.sum())
    return float(fe[node_positions(g)[: o["token"]] == 0].sum()) / total if total > 0 else 0.0


__all__ = ["CHUNK", "Normalized", "Pruned", "first_position_share", "graph_scores", "influence", "node_influence",
           "node_positions", "normalize", "prune", "prune_memory", "threshold_of"]
