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

import torch
from torch import Tensor

from ..errors import InputError


def normalize(A: Tensor) -> Tensor:
    A = A.abs()
    return A / A.sum(1, keepdim=True).clamp_min(1e-10)


def influence(A: Tensor, w: Tensor, max_iter: int = 1000) -> Tensor:
    """``w A + w A^2 + ...`` for an acyclic graph's (normalised) adjacency ``A[target, source]``."""
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
    return influence(normalize(g.adjacency.double()), logit_weights(g))


def threshold_of(scores: Tensor, fraction: float) -> float:
    """The smallest score among the top ones that make up ``fraction`` of the total."""
    s = scores.flatten().sort(descending=True).values
    total = s.sum()
    if float(total) <= 0:
        return float("inf")
    cum = s.cumsum(0) / total
    i = min(int(torch.searchsorted(cum, torch.tensor(fraction, dtype=cum.dtype))), s.numel() - 1)
    return float(s[i])


@dataclass
class Pruned:
    """``node_mask (node,)``, ``edge_mask (node, node)`` (``[target, source]``), ``influence (node,)``: each
    node's cumulative share of the total influence at its rank (circuit-tracer's exported ``influence``)."""

    node_mask: Tensor
    edge_mask: Tensor
    influence: Tensor


def prune(g, node_threshold: float = 0.8, edge_threshold: float = 0.98) -> Pruned:
    """The nodes and edges to keep (see the module's docstring)."""
    for name, v in (("node_threshold", node_threshold), ("edge_threshold", edge_threshold)):
        if not 0.0 <= v <= 1.0:
            raise InputError(f"{name} must lie in [0, 1]; got {v}")
    o = g.offsets()
    A = g.adjacency.double()
    w = logit_weights(g)
    inf = influence(normalize(A), w)
    keep = inf >= threshold_of(inf, node_threshold)
    keep[o["token"]:] = True
    P = A.clone()
    P[~keep] = 0
    P[:, ~keep] = 0
    Pn = normalize(P)
    scores = Pn * (influence(Pn, w) + w)[:, None]
    edges = scores >= threshold_of(scores, edge_threshold)
    edges &= scores > 0
    while True:
        before = keep.clone()
        edges[~keep] = False
        edges[:, ~keep] = False
        keep[: o["token"]] &= edges[:, : o["token"]].any(0)
        keep[: o["error"]] &= edges[: o["error"]].any(1)
        if torch.equal(keep, before):
            break
    edges[~keep] = False
    edges[:, ~keep] = False
    order = inf.argsort(descending=True)
    cum = torch.empty_like(inf)
    total = inf.sum()
    cum[order] = inf[order].cumsum(0) / (total if float(total) > 0 else 1.0)
    return Pruned(keep, edges, cum)


def graph_scores(g) -> tuple[float, float]:
    """``(replacement, completeness)`` of the unpruned graph (see the module's docstring)."""
    o = g.offsets()
    An = normalize(g.adjacency.double())
    w = logit_weights(g)
    inf = influence(An, w)
    tok, err = float(inf[o["token"]: o["logit"]].sum()), float(inf[o["error"]: o["token"]].sum())
    replacement = tok / (tok + err) if tok + err > 0 else 1.0
    non_error = 1 - An[:, o["error"]: o["token"]].sum(1)
    has_input = An.sum(1) > 0
    non_error = torch.where(has_input, non_error, torch.ones_like(non_error))
    weight = inf + w
    completeness = float((non_error * weight).sum() / weight.sum()) if float(weight.sum()) > 0 else 1.0
    return replacement, completeness


__all__ = ["Pruned", "graph_scores", "influence", "node_influence", "normalize", "prune", "threshold_of"]
