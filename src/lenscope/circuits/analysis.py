"""One circuit analysis as JSON: the scores of a method, their faithfulness curve and, on request, the check
against exact patching. What ``lenscope circuit --json`` prints and the report's circuit view draws.

Fields: ``method, level, model, metric, n, metric_clean, metric_corrupted, seconds``; ``nodes: [{name, score}]``
(names ``embed``, ``L{l}H{h}``, ``L{l}.mlp``, ``logits``; at the edge level a sender's score is the sum of its
outgoing edges' scores and ``logits`` the sum of the edges into the logits); ``edges: [{src, dst, score}]`` (edge
level; receivers ``L{l}H{h}.q|.k|.v``, ``L{l}.mlp``, ``logits``) by decreasing ``|score|``, the ``top`` first or
all; ``total`` (edges or nodes scored); ``faithfulness: [{k, fraction, value}]`` and ``smallest`` (the smallest
grid ``k`` reaching 0.8, or null); with ``check``: ``check: {spearman, top10_recall, false_negatives, ...}``
against exact patching (every node; for edges the approximation's top 50 and a seeded random sample of the rest).
"""

from __future__ import annotations

import time

import torch

from ..errors import InputError
from ..models.loading.load import LoadedModel
from .atp import _ranks, attribution_patching, check_against_exact, exact_node_patching
from .atp_star import atp_star
from .circuit import Circuit
from .circuit import faithfulness as faithfulness_curve
from .edges import EdgeAttribution, edge_attribution
from .graph import ComponentGraph
from .patch import exact_edge_patching

NODE_METHODS = ("atp", "atp-star", "exact")
EDGE_METHODS = ("eap", "eap-ig", "exact")
LEVELS = ("nodes", "edges")


def _check_request(method: str, level: str) -> None:
    if level not in LEVELS:
        raise InputError(f"unknown level {level!r}; choose nodes or edges")
    allowed = NODE_METHODS if level == "nodes" else EDGE_METHODS
    if method not in allowed:
        other = "edges" if level == "nodes" else "nodes"
        hint = f" ({method} scores {other}: use --level {other})" if method in NODE_METHODS + EDGE_METHODS else ""
        raise InputError(f"method {method!r} does not score {level}{hint}; choose one of {', '.join(allowed)}")


def edge_nodes(res: EdgeAttribution) -> list[dict]:
    """Node scores of an edge scoring: each sender's outgoing sum, and the sum into ``logits``."""
    s = torch.where(res.scores.isnan(), torch.zeros(()), res.scores)
    out = [{"name": n, "score": float(v)} for n, v in zip(res.senders, s.sum(1).tolist())]
    return out + [{"name": "logits", "score": float(s[:, -1].sum())}]


def check_edges(approx: EdgeAttribution, exact: EdgeAttribution, top: int = 10) -> dict:
    """The check of :func:`~lenscope.circuits.atp.check_against_exact` over the edges ``exact`` scored."""
    scored = exact.valid & ~exact.scores.isnan()
    a, x = approx.scores[scored].double(), exact.scores[scored].double()
    names = [f"{approx.senders[s]}->{approx.receivers[r]}" for s, r in zip(*[t.tolist() for t in scored.nonzero(
        as_tuple=True)])]
    k = min(top, len(names))
    top_a = set(a.abs().argsort(descending=True)[:k].tolist())
    top_x = x.abs().argsort(descending=True)[:k].tolist()
    missed = [names[i] for i in top_x if i not in top_a]
    spearman = float(torch.corrcoef(torch.stack([_ranks(a), _ranks(x)]))[0, 1]) if len(names) > 1 else float("nan")
    return {"spearman": spearman, f"top{top}_recall": (k - len(missed)) / max(k, 1), "false_negatives": missed,
            "mae": float((a - x).abs().mean()), "edges": len(names)}


def _sample_edges(res: EdgeAttribution, top: int, sample: int, seed: int) -> torch.Tensor:
    """``(S, R)`` mask: the ``top`` edges by ``|score|`` and ``sample`` more drawn at random (seeded)."""
    ranked = res.ranking()
    mask = torch.zeros_like(res.valid)
    head = ranked[:top]
    mask[head[:, 0], head[:, 1]] = True
    rest = ranked[top:]
    if len(rest) and sample > 0:
        g = torch.Generator().manual_seed(seed)
        pick = rest[torch.randperm(len(rest), generator=g)[:sample]]
        mask[pick[:, 0], pick[:, 1]] = True
    return mask


def circuit_json(lm: LoadedModel, pairs, *, method: str = "eap-ig", level: str = "edges", top: int | None = None,
                 check: bool = False, faithfulness: bool = True, steps: int = 5, ablation: str = "corrupted",
                 metric: str = "logit_diff", check_top: int = 50, check_sample: int = 150, seed: int = 0,
                 reference=None, progress=None, keep: dict | None = None) -> dict:
    """Score the circuit of ``pairs`` with ``method`` at ``level`` and return the JSON described above;
    ``progress(stage, done, total)`` is called as the stages (``scores``, ``faithfulness``, ``check``) advance;
    ``keep``, a dict, receives the result objects (``scores``, ``faithfulness``, ``circuit``: the smallest grid
    circuit reaching 0.8) to save
    (``ablation="mean"``: edges outside a circuit carry the mean over ``reference``'s clean prompts, default
    ``pairs``)."""
    _check_request(method, level)
    pairs = list(pairs)

    def tell(stage):
        return None if progress is None else (lambda done, total: progress(stage, done, total))
    t0 = time.perf_counter()
    if level == "edges":
        ComponentGraph.of(lm)  # refuses what has no edge graph before any work
        if method == "exact":
            res = exact_edge_patching(lm, pairs, metric=metric, ablation=ablation, reference=reference,
                                      progress=tell("scores"))
        else:
            res = edge_attribution(lm, pairs, method=method, steps=steps, metric=metric, progress=tell("scores"))
        out = {"method": method, "level": level, "model": lm.name, "metric": metric, "n": res.n,
               "metric_clean": res.metric_clean, "metric_corrupted": res.metric_corrupted,
               "nodes": edge_nodes(res), "edges": res.edges(top), "total": res.n_edges}
    else:
        fn = {"atp": attribution_patching, "atp-star": atp_star, "exact": exact_node_patching}[method]
        res = fn(lm, pairs=pairs, metric=metric)
        nodes = sorted(res.nodes(), key=lambda n: -abs(n["score"]))
        out = {"method": method, "level": level, "model": lm.name, "metric": metric, "n": res.n,
               "metric_clean": res.metric_clean, "metric_corrupted": res.metric_corrupted,
               "nodes": nodes[:top] if top else nodes, "edges": [], "total": len(nodes)}
    out["seconds"] = time.perf_counter() - t0
    if keep is not None:
        keep["scores"] = res
    if faithfulness:
        if progress is not None:
            progress("faithfulness", 0, 1)
        curve = faithfulness_curve(lm, pairs, res, ablation=ablation, reference=reference, metric=metric)
        out["faithfulness"] = curve.points()
        out["smallest"] = curve.smallest(0.8)
        if keep is not None:
            keep["faithfulness"] = curve
            if out["smallest"] is not None:
                keep["circuit"] = Circuit.top(lm, res, out["smallest"])
        out["ablation"] = ablation
        if progress is not None:
            progress("faithfulness", 1, 1)
    if check and method != "exact":
        t1 = time.perf_counter()
        if level == "nodes":
            ex = exact_node_patching(lm, pairs=pairs, metric=metric)
            out["check"] = check_against_exact(res, ex)
        else:
            mask = _sample_edges(res, check_top, check_sample, seed)
            ex = exact_edge_patching(lm, pairs, mask, metric=metric, ablation=ablation, reference=reference,
                                     progress=tell("check"))
            out["check"] = check_edges(res, ex)
        out["check"]["seconds_exact"] = time.perf_counter() - t1
    out["seconds_total"] = time.perf_counter() - t0
    return out
