"""The attribution-graph view: the prediction explained through transcoder features (``AttributionGraph``, whose
class declares ``VIEW = "graph"``), pruned as circuit-tracer prunes, with its exactness checks."""

from __future__ import annotations

from typing import Protocol

from torch import Tensor

from ...report.payloads import rounded
from .. import Shown, View, meta_of, one


class AttributionGraphLike(Protocol):
    """An attribution graph (:class:`lenscope.features.graphs.graph.AttributionGraph`)."""

    model: str
    tokens: list[str]
    n_layers: int
    logit_ids: Tensor
    logit_tokens: list[str]
    exactness_error: float
    real_error: float
    tolerance: float

    def to_dict(self, node_threshold: float = 0.8, edge_threshold: float = 0.98) -> dict: ...


def graph_payload(g: AttributionGraphLike, node_threshold: float = 0.8, edge_threshold: float = 0.98) -> dict:
    """The ``graph`` view: the graph pruned as circuit-tracer prunes (its ``to_dict(node_threshold,
    edge_threshold)``), each node with its ``influence`` (its cumulative share of the influence on the logits, which
    the page's slider thresholds: lower shows fewer nodes) and a logit node with its ``logit_token`` (its
    ``activation`` is its probability); ``layer_sites``: each block's transcoder site; the scores, the checks and the
    supernodes as ``to_dict`` gives them."""
    d = g.to_dict(node_threshold, edge_threshold)
    out_tok = dict(zip((int(i) for i in g.logit_ids.tolist()), g.logit_tokens))
    nodes = []
    for n in d["nodes"]:
        rec = {k: n[k] for k in ("id", "kind", "layer", "position", "feature")}
        rec["activation"] = None if n["activation"] is None else rounded(n["activation"])
        rec["influence"] = rounded(n["influence"], 6)
        if n["kind"] == "logit":
            rec["logit_token"] = out_tok[n["feature"]]
        nodes.append(rec)
    links = [{"source": e["source"], "target": e["target"], "weight": rounded(e["weight"])} for e in d["links"]]
    out = {k: d[k] for k in ("model", "tokens", "node_threshold", "edge_threshold", "n_active_features",
                             "n_feature_nodes")}
    out.update({k: rounded(d[k]) for k in ("replacement_score", "completeness_score", "max_exactness_error",
                                           "real_error", "tolerance", "seconds")})
    out.update(n_layers=int(g.n_layers), layer_sites={str(s.rpartition(".")[2]): s for s in d["sites"]},
               nodes=nodes, links=links, supernodes=[list(s) for s in d["supernodes"]])
    return out


def graph_checks(g: AttributionGraphLike, payload: dict) -> list[tuple[str, float | None, float | None]]:
    """An attribution graph's checks, ``(name, value, tolerance)``: every node's input against its edges and bias
    terms, and the frozen replacement model against the real run (both relative; ``attribution_graph`` refuses a
    graph beyond the tolerance), then the replacement and completeness scores of its ``payload`` (reported)."""
    return [("a node's input vs its edges and bias terms (relative, worst node)", float(g.exactness_error),
             float(g.tolerance)),
            ("frozen replacement model vs the real run (relative, worst node)", float(g.real_error),
             float(g.tolerance)),
            ("replacement score (reported)", payload["replacement_score"], None),
            ("completeness score (reported)", payload["completeness_score"], None)]


class Graph(View):
    key = "graph"
    title = "Attribution graph"
    blurb = ("The prediction explained through transcoder features (Ameisen et al. 2025): each edge a direct effect "
             "through the model frozen at the real run, exact. Rows: the tokens' embeddings, each block, the logits; "
             "columns: positions. The slider prunes by influence on the logits; click a node for its details, "
             "shift-click to select nodes and group them into a supernode.")
    order = 100

    def show(self, obj, *, node_threshold: float = 0.8, edge_threshold: float = 0.98) -> Shown:
        """An attribution graph, pruned at ``node_threshold`` / ``edge_threshold`` (the page's slider prunes
        further), with its exactness checks."""
        one(obj, "a list of attribution graphs")
        d = graph_payload(obj, node_threshold, edge_threshold)
        checks = [{"section": self.key, "name": name, "value": v, "tolerance": tol,
                   "ok": None if tol is None or v is None else bool(v <= tol), "note": ""}
                  for name, v, tol in graph_checks(obj, d)]
        return Shown(self.key, d, meta_of(obj), f"{self.title} · {obj.model}", self.blurb, checks,
                     {"graph": float(obj.seconds)})


VIEW = Graph()
