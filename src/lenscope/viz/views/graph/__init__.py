"""The attribution-graph view: the prediction explained through transcoder features (``AttributionGraph``, whose
class declares ``VIEW = "graph"``), pruned as circuit-tracer prunes, with its exactness checks."""

from __future__ import annotations

from typing import Protocol

from torch import Tensor

from ....errors import InputError
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

    def to_dict(self, node_threshold: float = 0.8, edge_threshold: float = 0.98, labels: dict | None = None) -> dict:
        ...


# the first position's nodes are hidden on the page by default when they carry at least this share of the feature and
# error nodes' influence: the attention sink of a model without a BOS (about 0.7 on smollm2, docs/circuits.md), whose
# nodes would crowd out the rest; below it (a prompt opening with a BOS has no first-position features) they are shown
SINK_SHARE = 0.5
# the page's edge slider starts here: an edge is drawn when its |weight| is at least this share of the strongest's
EDGE_SHARE = 0.1
FIRST_TOKEN = ("auto", "show", "hide")


def graph_payload(g: AttributionGraphLike, node_threshold: float = 0.8, edge_threshold: float = 0.98,
                  labels: dict | None = None, first_token: str = "auto") -> dict:
    """The ``graph`` view: the graph pruned as circuit-tracer prunes (its ``to_dict(node_threshold, edge_threshold,
    labels)``), each node with its ``influence`` (its cumulative share of the influence on the logits, which the
    page's slider thresholds: lower shows fewer nodes), a feature node with its ``label`` (from ``labels``, ``{site:
    [label of each feature]}`` as :func:`lenscope.features.dictionaries.labels.labels_for` reads them; None where
    there is none) and a logit node with its ``logit_token`` (its ``activation`` is its probability);
    ``layer_sites``: each block's transcoder site; ``first_position_share``: the share of the feature and error
    nodes' influence at the first position, and ``hide_first``: whether the page starts with those nodes hidden
    (``first_token``: ``"hide"``, ``"show"``, or ``"auto"``: hidden when that share is at least
    :data:`SINK_SHARE`); the scores, the checks and the supernodes as ``to_dict`` gives them."""
    if first_token not in FIRST_TOKEN:
        raise InputError(f"first_token must be one of {', '.join(FIRST_TOKEN)}; got {first_token!r}")
    d = g.to_dict(node_threshold, edge_threshold, labels=labels)
    out_tok = dict(zip((int(i) for i in g.logit_ids.tolist()), g.logit_tokens))
    nodes = []
    for n in d["nodes"]:
        rec = {k: n[k] for k in ("id", "kind", "layer", "position", "feature")}
        rec["activation"] = None if n["activation"] is None else rounded(n["activation"])
        rec["influence"] = rounded(n["influence"], 6)
        if n["kind"] == "logit":
            rec["logit_token"] = out_tok[n["feature"]]
        if n["kind"] == "feature":
            rec["label"] = n.get("label")
        nodes.append(rec)
    links = [{"source": e["source"], "target": e["target"], "weight": rounded(e["weight"])} for e in d["links"]]
    out = {k: d[k] for k in ("model", "tokens", "node_threshold", "edge_threshold", "n_active_features",
                             "n_feature_nodes")}
    out.update({k: rounded(d[k]) for k in ("replacement_score", "completeness_score", "max_exactness_error",
                                           "real_error", "tolerance", "seconds")})
    share = float(d["first_position_share"])
    auto = share >= SINK_SHARE and len(d["tokens"]) > 1  # a one-token prompt's first position is the whole graph
    out.update(n_layers=int(g.n_layers), layer_sites={str(s.rpartition(".")[2]): s for s in d["sites"]},
               nodes=nodes, links=links, supernodes=[list(s) for s in d["supernodes"]],
               skip_first=bool(d["skip_first"]), first_position_share=rounded(share),
               hide_first={"auto": auto, "show": False, "hide": True}[first_token],
               edge_share=EDGE_SHARE)
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
             "through the model frozen at the real run, exact. Drawn as a diagram: rows are the tokens' embeddings, "
             "each block and the logits, columns the positions, each node in its own place (a feature with its "
             "label beside it where the label is cached and there is room). The first slider prunes nodes by "
             "influence on the logits, the second hides edges weaker than a share of the strongest "
             f"({EDGE_SHARE} to start). The first-token switch hides or shows the first position's feature and error "
             "nodes, their share of the influence stated beside it; they start hidden when that share is at least "
             f"{SINK_SHARE} (the attention sink of a model without a BOS), else shown. Hover a node for its numbers, "
             "click it for its details, shift-click to select nodes and group them into a supernode, drawn as a box "
             "around its members.")
    order = 100

    def show(self, obj, *, node_threshold: float = 0.8, edge_threshold: float = 0.98, labels: dict | None = None,
             first_token: str = "auto") -> Shown:
        """An attribution graph, pruned at ``node_threshold`` / ``edge_threshold`` (the page's slider prunes
        further), its features' ``labels`` (``{site: [label of each feature]}``, where cached) and the first
        position's nodes hidden or shown at first (``first_token``: :func:`graph_payload`), with its exactness
        checks."""
        one(obj, "a list of attribution graphs")
        d = graph_payload(obj, node_threshold, edge_threshold, labels, first_token)
        checks = [{"section": self.key, "name": name, "value": v, "tolerance": tol,
                   "ok": None if tol is None or v is None else bool(v <= tol), "note": ""}
                  for name, v, tol in graph_checks(obj, d)]
        return Shown(self.key, d, meta_of(obj), f"{self.title} · {obj.model}", self.blurb, checks,
                     {"graph": float(obj.seconds)})


VIEW = Graph()
