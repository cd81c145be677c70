"""Result objects -> the plain data the report's scripts draw (``assets/<key>.js``): one conversion per view,
shared by the report's sections (:mod:`lenscope.report.sections`, which compute the results and record their
checks), the results' own ``_repr_html_`` in notebooks (:mod:`lenscope.viz.notebook`) and ``lenscope serve``.

The functions read results duck-typed through :mod:`lenscope.viz.protocols` (viz never names a method): a
:class:`~lenscope.attribution.ComponentAttribution`, :class:`~lenscope.attribution.Explanation`,
:class:`~lenscope.mixing.maps.MixingMaps`, :class:`~lenscope.mixing.alti.MixingMatrices`,
:class:`~lenscope.lenses.trajectory.PredictionTrajectory`, the features' results or an attribution graph. Floats
are rounded to 5 significant digits (None for a non-finite value); large arrays travel :func:`packed` (base64
float32).
"""

from __future__ import annotations

import base64
import math

import numpy as np
import torch
from torch import Tensor

from ..protocols import (
    AttributionGraphLike,
    ComponentsLike,
    ExplanationLike,
    FeatureActivationsLike,
    FeatureCardLike,
    MixingMapsLike,
    MixingMatricesLike,
    TrajectoryLike,
)

TRAJECTORY_FIELDS = ("lens", "tokens", "state_labels", "top_tokens", "topk_tokens", "top_prob", "entropy", "kl",
                     "topk_prob", "causal")


def packed(x: Tensor | np.ndarray, digits: int | None = None) -> dict:
    """A float tensor for the page: ``{"shape": [...], "f32": base64 of little-endian float32}`` (4 bytes a
    number before base64, far smaller than JSON text for the large maps). Non-finite values are refused."""
    a = x.detach().cpu().float().numpy() if isinstance(x, Tensor) else np.asarray(x, dtype=np.float32)
    if not np.isfinite(a).all():
        raise ValueError("a report array holds NaN or infinity")
    a = np.ascontiguousarray(a, dtype="<f4")
    return {"shape": list(a.shape), "f32": base64.b64encode(a.tobytes()).decode("ascii")}


def unpack(d: dict) -> np.ndarray:
    """Inverse of :func:`packed` (for tests and for reading a report's data back)."""
    return np.frombuffer(base64.b64decode(d["f32"]), dtype="<f4").reshape(d["shape"])


def rounded(x: float, digits: int = 5) -> float | None:
    """``x`` to ``digits`` significant digits; None for NaN or infinity (JSON has neither)."""
    x = float(x)
    if not math.isfinite(x):
        return None
    return float(f"{x:.{digits}g}")


def rounded_list(t, digits: int = 5) -> list:
    """A tensor or sequence, flattened, each value :func:`rounded`."""
    return [rounded(v, digits) for v in torch.as_tensor(t).reshape(-1).tolist()]


# --------------------------------------------------------------------------------------------- components


def dla_view(res: ComponentsLike) -> dict:
    """One logit's direct logit attribution for ``components.js``: per layer the attention (its heads and the
    output-projection bias) and the MLP, per head ``heads (layer, head)`` (zeros without ``by_head``), and the
    embedding / bias terms as ``other``."""
    L = max((l for l in res.layers), default=-1) + 1
    H = max((h for h in res.heads), default=-1) + 1
    attn, mlp = [0.0] * L, [0.0] * L
    heads = torch.zeros(L, H)
    other = []
    for n, l, h, v in zip(res.names, res.layers, res.heads, res.values.tolist()):
        if h >= 0:
            heads[l, h] = v
            attn[l] += v
        elif l >= 0 and n.endswith(".mlp"):
            mlp[l] += v
        elif l >= 0:
            attn[l] += v  # the output-projection bias belongs to the attention sub-layer
        else:
            other.append({"name": n, "value": rounded(v)})
    return {"label": res.target, "minus": res.foil, "logit": rounded(res.logit), "total": rounded(res.total),
            "completeness_error": res.completeness_error, "attn": rounded_list(attn), "mlp": rounded_list(mlp),
            "heads": [rounded_list(r) for r in heads], "other": other}


def components_payload(views: dict[str, ComponentsLike] | ComponentsLike) -> dict:
    """The ``components`` view: ``{name: ComponentAttribution}`` (the report's ``difference``, ``target`` and
    ``foil``; the first one names the target and foil), or one result, shown as ``difference`` when it has a
    foil, else ``target``."""
    if not isinstance(views, dict):
        views = {"difference" if views.foil_id is not None else "target": views}
    first = next(iter(views.values()))
    return {"target": first.target, "foil": first.foil, "views": {k: dla_view(v) for k, v in views.items()}}


# -------------------------------------------------------------------------------------------- trajectory


def trajectory_payload(trajs: TrajectoryLike | list[TrajectoryLike]) -> dict:
    """The ``trajectory`` view: one or more lenses' trajectories on the same text, floats to 4 decimals."""
    if not isinstance(trajs, (list, tuple)):
        trajs = [trajs]
    out = []
    for t in trajs:
        d = t.to_dict(digits=4)
        out.append({k: d[k] for k in TRAJECTORY_FIELDS})
    return {"trajectories": out}


# ------------------------------------------------------------------------------------------- attribution


def explanation_record(e: ExplanationLike) -> dict:
    """One method's row of the ``attribution`` view: its scores, invariant error and (where its method reports
    one: integrated gradients) completeness error."""
    rec = {"scores": rounded_list(e.scores), "invariant_error": e.invariant_error}
    if e.reports_completeness:
        rec["completeness_error"] = e.info.get("completeness_error")
    return rec


def attribution_payload(explanations: dict[str, ExplanationLike] | list[ExplanationLike] | ExplanationLike, *,
                        tokens: list[str] | None = None, target=..., foil=...) -> dict:
    """The ``attribution`` view: every method's scores side by side, and the per-layer scores of the methods that
    split the attention's logit update by layer (those with ``layer_scores`` and ``attention_update``: Logit,
    ALTI-Logit). ``tokens``/``target``/``foil`` default to the explanations' own (the first that has a target;
    None where none has)."""
    if not isinstance(explanations, dict):
        if not isinstance(explanations, (list, tuple)):
            explanations = [explanations]
        explanations = {e.method: e for e in explanations}
    exs = list(explanations.values())
    if tokens is None:
        tokens = list(exs[0].tokens)
    named = [e for e in exs if e.target is not None]
    if target is ...:
        target = named[0].target if named else None
    if foil is ...:
        foil = named[0].foil if named else None
    out = {"tokens": tokens, "target": target, "foil": foil, "methods": {}, "layers": {}}
    for m, e in explanations.items():
        out["methods"][m] = explanation_record(e)
        if e.layer_scores is not None and e.attention_update is not None:
            out["layers"][m] = packed(e.layer_scores)
    return out


# ------------------------------------------------------------------------------------------ mixing, flow


def mixing_payload(maps: dict[str, MixingMapsLike] | MixingMapsLike) -> dict:
    """The ``mixing`` view: ``{scope: MixingMaps}`` (as :func:`~lenscope.mixing.maps.context_mixing` returns)
    or one scope's maps."""
    if not isinstance(maps, dict):
        maps = {maps.scope: maps}
    first = next(iter(maps.values()))
    out = {"tokens": list(first.tokens), "scopes": list(maps), "maps": {}, "completeness_error": {}}
    for scope, m in maps.items():
        out["maps"][scope] = packed(m.maps)
        out["completeness_error"][scope] = m.completeness_error
    return out


def flow_payload(mm: MixingMatricesLike) -> dict:
    """The ``flow`` view: ALTI (or value zeroing) contributions per layer and the last layer's rollout."""
    return {"tokens": list(mm.tokens), "contributions": packed(mm.contributions), "rollout": packed(mm.rollout[-1]),
            "degenerate_rows": mm.degenerate_rows}


# ---------------------------------------------------------------------------------------------- features


def rounded_tree(x, digits: int = 5):
    """Dicts and lists with every float :func:`rounded` (tensors as lists)."""
    if isinstance(x, bool) or x is None or isinstance(x, (int, str)):
        return x
    if isinstance(x, float):
        return rounded(x, digits)
    if isinstance(x, dict):
        return {k: rounded_tree(v, digits) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [rounded_tree(v, digits) for v in x]
    if hasattr(x, "tolist"):
        return rounded_tree(x.tolist(), digits)
    return x


def feature_payload(card: FeatureCardLike | dict) -> dict:
    """The ``feature`` view: one feature's card (its ``to_dict()``), floats to 5 significant digits."""
    return rounded_tree(card.to_dict() if hasattr(card, "to_dict") else dict(card))


def features_payload(fa: FeatureActivationsLike, cards=()) -> dict:
    """The ``features`` view: the prompt's tokens and, per dictionary (``sites``) and position, its active latents
    strongest first as ``[feature, activation]`` pairs, the L0 per position, and the ``cards`` of some features
    (:func:`feature_payload`, keyed ``"site#feature"``) that a click opens."""
    active = []
    for j in range(len(fa.sites)):
        per = []
        for ids, vals in zip(fa.ids[j].tolist(), fa.values[j].tolist()):
            per.append([[i, rounded(v)] for i, v in zip(ids, vals) if i >= 0])
        active.append(per)
    out_cards = {}
    for c in cards:
        d = feature_payload(c)
        out_cards[f"{d['site']}#{d['feature']}"] = d
    return {"tokens": list(fa.tokens), "sites": list(fa.sites), "widths": [int(w) for w in fa.widths],
            "l0": [[int(v) for v in row] for row in fa.l0.tolist()], "active": active, "cards": out_cards}


# ------------------------------------------------------------------------------------------ attribution graph


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


# -------------------------------------------------------------------------------- alignment (encoder-decoder)


def alignment_payload(ps, source_tokens: list[str], prefix_tokens: list[str], *, words: dict | None = None,
                      links: dict | None = None, gold=None, aer: dict | None = None, source: str = "",
                      target: str = "") -> dict:
    """The ``alignment`` view of a translation pair: ``ps`` one pair's scores (``pair_scores``: ``scores[method]``
    ``(target token, n_source + decoder-input tokens)``, ``n_source``, ``decoder_ids``) with the tokens' texts; row
    ``i`` explains target token ``prefix_tokens[i + 1]``. ``words``: the pair's
    :class:`~lenscope.evaluate.aer.WordScores` (its words, each token's word, per method the word-level scores
    ``(target word, source word)``, ``null``: the index of one more column, the source's end token, which links
    nothing); ``links``: per method each target word's best source word ``{(source word, target word)}``;
    ``gold``: the pair's gold links (``sure``, ``possible``); ``aer``: per method its AlignmentErrorRate against
    them. ``summary``: what ``lenscope report --json`` prints of it (no matrix)."""
    out = {"source": source, "target": target, "n_source": int(ps.n_source), "source_tokens": list(source_tokens),
           "prefix_tokens": list(prefix_tokens), "target_tokens": list(prefix_tokens[1:]), "methods": {},
           "words": None, "links": None, "gold": None, "aer": None}
    for m, s in ps.scores.items():
        out["methods"][m] = {"scores": packed(s)}
    if words is not None:
        out["words"] = {"source": list(words.source_words), "target": list(words.target_words),
                        "source_of": list(words.source_of), "target_of": list(words.target_of),
                        "null": words.null, "scores": {m: packed(v) for m, v in words.scores.items()}}
    if links is not None:
        out["links"] = {m: sorted([int(i), int(j)] for i, j in v) for m, v in links.items()}
    if gold is not None:
        out["gold"] = {"sure": sorted([int(i), int(j)] for i, j in gold.sure),
                       "possible": sorted([int(i), int(j)] for i, j in gold.possible - gold.sure)}
    if aer is not None:
        out["aer"] = {m: {"aer": rounded(r.aer, 17), "precision": rounded(r.precision, 17),
                          "recall": rounded(r.recall, 17),
                          **r.totals} for m, r in aer.items()}
    out["summary"] = {k: out[k] for k in ("source", "target", "n_source", "source_tokens", "prefix_tokens", "links",
                                          "gold", "aer")}
    out["summary"]["methods"] = list(out["methods"])
    return out
