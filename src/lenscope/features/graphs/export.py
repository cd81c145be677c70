"""An attribution graph in circuit-tracer's JSON (``metadata``, ``qParams``, ``nodes``, ``links``; schema version
1), which circuit-tracer's local viewer and Neuronpedia open.

Node ids as circuit-tracer writes them (:func:`lenscope.features.graphs.graph.node_id`) except an error node's,
``"{layer}_-1_{pos}"`` where circuit-tracer 0.5 writes ``"0_{layer}_{pos}"``, the id of the layer-0 feature
``{layer}`` at ``{pos}`` too; ``metadata.scan`` is the model's name and ``metadata.transcoder_list`` the sites of the
transcoders (circuit-tracer's: the transcoder set's name, its files). A feature's ``feature`` field is
the Cantor pairing of its layer and latent, an error's -1, a token's its position, a logit's its token id; the
logits' ``layer`` is one past the last block (``n_layers + 1``), the tokens' ``"E"``. Checked against a file
circuit-tracer wrote (``tests/features/test_graph_export_ct.py``). The graph is pruned with the
given thresholds first (:func:`lenscope.features.graphs.prune.prune`); a feature's ``clerp`` is its cached
label (:mod:`lenscope.features.dictionaries.labels`) where one is given, else empty; ``influence`` is each node's
cumulative share of the total influence at its rank; supernodes (:meth:`AttributionGraph.group`) go to
``qParams.supernodes``. Everything else (the bias terms, the checks) stays in lenscope's own file
(:meth:`AttributionGraph.save`).
"""

from __future__ import annotations

import json
from pathlib import Path

from .prune import prune

TYPES = {"feature": "cross layer transcoder", "error": "mlp reconstruction error", "token": "embedding",
         "logit": "logit"}


def cantor(a: int, b: int) -> int:
    return (a + b) * (a + b + 1) // 2 + b


def _token(s: str) -> str:
    return s.replace("\n", "⏎").replace("\t", "→").replace("\r", "↵")


def node_label(g, rec: dict, labels: dict | None) -> str | None:
    """The label of the feature node ``rec`` of ``g`` from ``labels`` (``{site: [label of each feature]}``,
    :func:`lenscope.features.dictionaries.labels.labels_for`); None for other nodes and where there is none."""
    if not labels or rec["kind"] != "feature":
        return None
    from ...viz.views.feature import feature_label

    site = next((s for s in g.sites if s.rpartition(".")[2] == str(rec["layer"])), None)
    return feature_label(labels, site, rec["feature"])


def circuit_tracer_json(g, slug: str = "lenscope-graph", node_threshold: float = 0.8,
                        edge_threshold: float = 0.98, labels: dict | None = None) -> dict:
    """The graph ``g`` (an :class:`~lenscope.features.graphs.graph.AttributionGraph`) as circuit-tracer's JSON
    document; with ``labels`` (``{site: [label of each feature]}``) each feature node's ``clerp`` is its label."""
    from .graph import node_id

    pr = prune(g, node_threshold, edge_threshold)
    recs = {int(i): g.node(int(i)) for i in pr.node_mask.nonzero()[:, 0]}
    t, s = pr.edge_mask.nonzero(as_tuple=True)
    links = [(a, b) for a, b in zip(t.tolist(), s.tolist()) if a in recs and b in recs]
    used = {i for ab in links for i in ab} | {i for i, r in recs.items() if r["kind"] in ("token", "logit")}
    nodes = []
    o = g.offsets()
    for i in sorted(used):
        r = recs[i]
        k, p = r["kind"], r["position"]
        n = {"node_id": node_id(g, i, r), "feature": None, "layer": None, "ctx_idx": p, "feature_type": TYPES[k],
             "token_prob": 0.0, "is_target_logit": False, "run_idx": 0, "reverse_ctx_idx": 0, "jsNodeId": None,
             "clerp": "", "influence": float(pr.influence[i]), "activation": None}
        if k == "feature":
            n.update(feature=cantor(r["layer"], r["feature"]), layer=str(r["layer"]),
                     jsNodeId=f"{r['layer']}_{r['feature']}-0", activation=r["activation"],
                     clerp=node_label(g, r, labels) or "")
        elif k == "error":
            n.update(feature=-1, layer=str(r["layer"]), jsNodeId=f"{r['layer']}_{p}-0")
        elif k == "token":
            n.update(feature=p, layer="E", jsNodeId=f"E_{g.input_ids[p]}-{p}")
        else:
            j = i - o["logit"]
            tok = _token(g.logit_tokens[j])
            prob = float(g.logit_probs[j])
            n.update(feature=int(g.logit_ids[j]), layer=str(g.n_layers + 1), jsNodeId=f"L_{int(g.logit_ids[j])}-{p}",
                     token_prob=prob, is_target_logit=j == 0, clerp=f'Output "{tok}" (p={prob:.3f})', influence=None)
        nodes.append(n)
    ids = {i: node_id(g, i, recs[i]) for i in used}
    return {
        "metadata": {"slug": slug, "scan": g.model, "transcoder_list": list(g.sites),
                     "prompt_tokens": [_token(x) for x in g.tokens], "prompt": "".join(g.tokens),
                     "node_threshold": node_threshold, "schema_version": 1},
        "qParams": {"pinnedIds": [], "supernodes": [list(sn) for sn in g.supernodes], "linkType": "both",
                    "clickedId": "", "sg_pos": ""},
        "nodes": nodes,
        "links": [{"source": ids[b], "target": ids[a], "weight": float(g.adjacency[a, b])} for a, b in links],
    }


def write_circuit_tracer(g, path: str | Path, **kw) -> Path:
    """Write :func:`circuit_tracer_json` to ``path`` (a ``.json`` file; its stem is the slug unless given)."""
    path = Path(path)
    kw.setdefault("slug", path.stem)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(circuit_tracer_json(g, **kw), indent=2, ensure_ascii=False))
    return path


__all__ = ["cantor", "circuit_tracer_json", "node_label", "write_circuit_tracer"]
