r"""Attribution graphs beside the circuit methods on smollm2: which layers, positions and heads each puts first.

For ``--task ioi`` or ``--task sva``, the first ``--n`` pairs exactly as ``benchmarks/circuits_study.py`` draws them
(``ioi_contrasts(n, seed=0, corruption="swap")`` / ``sva_contrasts(n, seed=0)``, tokenized by the model), the
attribution graph of each CLEAN prompt with the clean target as its only logit node (``max_feature_nodes``,
transcoders on every ``--every``-th block), its pruned edges (node threshold 0.8, edge threshold 0.98) split over the
heads (``edge_heads``), and what the graph puts first:

- **layers**: per block, the summed influence on the logit (``graph_prune.node_influence``: ``w An + w An^2 + ...``,
  ``w`` the target's probability, ``An`` the adjacency with each row's absolute values normalised to sum 1) of its
  feature nodes and its error node(s), i.e. of the block's MLP as the transcoder and its error carry it;
- **positions**: the same sum per position (features and error nodes; the token node's influence is kept apart);
  across prompts the positions are pooled by their role (``FIRST``, the first token; IOI: ``IO``, ``S1``, ``S2``,
  ``END``; SVA: ``SUBJ``, ``ATTR``, ``END``; any other position by its token text, the positions of one text in a
  prompt summed);
- **heads**: for every pruned edge ``s -> t``, the absolute part each head ``(l, h)`` carries (``|H[l, h][t, s]|``,
  the head split of ``edge_heads``) weighted as circuit-tracer weights the edge when pruning: divided by the
  target's summed absolute input ``sum_s' |A[t, s']|`` (the normalised adjacency) and multiplied by the target's
  influence plus its logit weight (``influence_t + w_t``; ``w_t`` is the target's probability for the logit node, 0
  otherwise). The attention-free (residual) parts are summed the same way, as the residual share.

Each prompt's layer, position and head scores are divided by its target's probability (``w``) before they are
averaged over prompts, so every prompt counts the same. Top 5 of each are listed, twice: over the whole graph
(``all``) and with the first position left out (``without_first``: its nodes, and the edges from or to them).
smollm2 has no BOS token, so its first token is the attention sink (massive activations); circuit-tracer gives a
BOS no nodes, lenscope does the same for a special first token only, so here the first real token's nodes stay in
the graph, and they dominate the influence.

Beside them, read from ``docs/results/circuits/<task>.json`` (not recomputed; 8 pairs, of which these are the
first ``--n``): exact node patching's top 10 nodes (heads and MLPs with their layers; no positions stored), the
edges EAP-IG is known to hold in its top 10 (the file keeps only each method's misses of exact's top 10 edges, so
an edge EAP missed and EAP-IG did not is one of EAP-IG's top 10; its own ranking is not stored), and the routes'
recall of exact's top 10 (the routes' components themselves are not stored). No method in that file stores
positions. The overlaps count the graph's top-5 heads and layers in those lists.

The graph explains the clean target's logit (minus the mean logit) alone; the circuit methods explain the metric
``logit(target) - logit(foil)`` between the clean and the corrupted prompt. ``--contrast``: the graph's one logit node
is that contrast too (``attribution_graph(..., foil=)``), still on the clean prompt alone (a graph has no corrupted
run). Writes ``docs/results/features/graph-circuits-<task>.json`` (``-contrast`` with ``--contrast``):

    nice -n 19 env OMP_NUM_THREADS=1 .venv/bin/python benchmarks/graph_circuits_study.py --task ioi --n 8
    nice -n 19 env OMP_NUM_THREADS=1 .venv/bin/python benchmarks/graph_circuits_study.py --task sva --n 8
    nice -n 19 env OMP_NUM_THREADS=1 .venv/bin/python benchmarks/graph_circuits_study.py --task ioi --n 8 --contrast
    nice -n 19 env OMP_NUM_THREADS=1 .venv/bin/python benchmarks/graph_circuits_study.py --task sva --n 8 --contrast

(``--n 8``: the same 8 pairs as the circuits files; one thread, as on a shared 2-core machine two threads wait on
each other.)
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import record  # noqa: E402

TOP = 5


def roles(task: str, tokens: list[str], meta: dict) -> list[str]:
    """Each position's role in the prompt (see the module's docstring)."""
    words = [t.strip() for t in tokens]
    out = [repr(w) for w in words]
    if task == "ioi":
        seen_s = 0
        for i, w in enumerate(words):
            if w == meta.get("io"):
                out[i] = "IO"
            elif w == meta.get("s"):
                seen_s += 1
                out[i] = f"S{seen_s}"
    else:
        for i, w in enumerate(words):
            if w == meta.get("noun"):
                out[i] = "SUBJ"
            elif w == meta.get("attractor"):
                out[i] = "ATTR"
    out[0], out[-1] = "FIRST", "END"
    return out


def graph_summary(g, eh, skip_first: bool = False) -> dict:
    """A graph's layer, position and head scores (see the module's docstring), not yet divided by ``w``; with
    ``skip_first`` the nodes at the first position and the edges from or to them are left out."""
    from lenscope.features.graphs.prune import logit_weights, node_influence, node_positions

    o = g.offsets()
    inf = node_influence(g)
    w = logit_weights(g)
    L, P = g.n_layers, g.n_pos
    pos_of = node_positions(g)
    keep = (pos_of > 0) if skip_first else torch.ones_like(pos_of, dtype=torch.bool)
    kinf = torch.where(keep, inf, torch.zeros_like(inf))
    layer = torch.zeros(L, dtype=torch.float64)
    pos = torch.zeros(P, dtype=torch.float64)
    f_inf = kinf[: o["error"]]
    layer.index_add_(0, g.feature_layer.long(), f_inf)
    pos.index_add_(0, g.feature_pos.long(), f_inf)
    e_inf = kinf[o["error"]: o["token"]].reshape(L, P)  # error nodes are block-major
    layer += e_inf.sum(1)
    pos += e_inf.sum(0)
    tok = kinf[o["token"]: o["logit"]]
    rowsum = g.adjacency.abs().double().sum(1).clamp_min(1e-30)
    t, s = eh.edges[:, 0], eh.edges[:, 1]
    weight = (inf[t] + w[t]) / rowsum[t] * (keep[t] & keep[s]).double()
    heads = (eh.heads.abs().double() * weight[:, None, None]).sum(0)  # (layer, head)
    resid = float((eh.residual.abs().double() * weight).sum())
    return {"layer": layer, "position": pos, "token": tok, "heads": heads, "residual": resid}


def top(scores: dict, k: int = TOP) -> list[dict]:
    return [{"name": n, "score": float(v)} for n, v in sorted(scores.items(), key=lambda kv: -kv[1])[:k]]


def stored_methods(circ: dict) -> dict:
    """What ``docs/results/circuits/<task>.json`` keeps of exact patching, EAP-IG and the routes (see the module's
    docstring)."""
    head = re.compile(r"^L(\d+)H(\d+)$")
    exact = circ["nodes"]["exact_top10"]

    def comp(name):  # an edge end: "L16H0", "L17H4.k" -> "L17H4", "L0.mlp", "embed", "logits"
        return re.sub(r"\.[qkv]$", "", name)

    def layer_of(name):
        m = re.match(r"^L(\d+)", name)
        return int(m.group(1)) if m else None

    fn_eap = set(circ["edges"]["eap"]["false_negatives"])
    fn_eig = set(circ["edges"]["eap_ig"]["false_negatives"])
    eig_known = sorted(fn_eap - fn_eig)
    exact_edges_known = sorted(fn_eap | fn_eig)
    eig_comps = sorted({comp(c) for e in eig_known for c in e.split("->")})
    return {
        "exact_nodes": {"top10": exact, "heads": [n for n in exact if head.match(n)],
                        "mlp_layers": [layer_of(n) for n in exact if n.endswith(".mlp")],
                        "layers": sorted({layer_of(n) for n in exact if layer_of(n) is not None}),
                        "positions": None},
        "eap_ig": {"top10_recall_of_exact": circ["edges"]["eap_ig"]["top10_recall"],
                   "top10_known": eig_known, "exact_top10_edges_known": exact_edges_known,
                   "heads": [c for c in eig_comps if head.match(c)],
                   "mlp_layers": sorted({layer_of(c) for c in eig_comps if c.endswith(".mlp")}),
                   "positions": None},
        "routes": {"tau": circ["routes"]["tau"], "components": circ["routes"]["components"],
                   "recall_of_exact_top10": circ["routes"]["recall"], "found": circ["routes"]["found"],
                   "missed": circ["routes"]["missed"],
                   "heads_found": [n for n in circ["routes"]["found"] if head.match(n)], "positions": None},
        "note": "the circuits file keeps exact patching's top 10 nodes, each edge method's misses of exact's top 10 "
                "edges and the routes' recall of exact's top 10; no ranking of EAP-IG's edges or of the routes' "
                "components and no positions",
    }


def overlaps(graph: dict, other: dict) -> dict:
    g_heads = [h["name"] for h in graph["top_heads"]]
    g_layers = [int(x["name"]) for x in graph["top_layers"]]
    ex, eig, rt = other["exact_nodes"], other["eap_ig"], other["routes"]

    def both(a, b):
        return sorted(set(a) & set(b), key=a.index)

    out = {
        "heads_top5_in_exact_top10": both(g_heads, ex["heads"]),
        "layers_top5_in_exact_top10_mlps": both(g_layers, ex["mlp_layers"]),
        "layers_top5_in_exact_top10_layers": both(g_layers, ex["layers"]),
        "heads_top5_in_eap_ig_known_top10": both(g_heads, eig["heads"]),
        "layers_top5_in_eap_ig_known_mlps": both(g_layers, eig["mlp_layers"]),
        "heads_top5_in_routes_found": both(g_heads, rt["heads_found"]),
        "exact_top10_heads_in_graph_top10_heads": both(ex["heads"], [h["name"] for h in graph["top10_heads"]]),
    }
    out["counts"] = {k: len(v) for k, v in out.items()}
    out["counts"]["exact_top10_heads"] = len(ex["heads"])
    out["counts"]["exact_top10_mlps"] = len(ex["mlp_layers"])
    return out


def study_pairs(lm, task: str, n: int, circ_path: Path) -> tuple[dict, list]:
    """``circ_path``'s results (``circuits_study.py``'s) and the first ``n`` of its ``task`` pairs, drawn as it drew
    them; refused when the first differs from its recorded example."""
    from lenscope.data.contrast import ioi_contrasts, sva_contrasts, tokenize_with

    circ = json.loads(circ_path.read_text())
    tok = tokenize_with(lm)
    drawn = max(n, int(circ["n"]))
    pairs = (ioi_contrasts(drawn, seed=0, corruption="swap", tokenize=tok) if task == "ioi"
             else sva_contrasts(drawn, seed=0, tokenize=tok))[:n]
    if circ.get("example", {}).get("clean") != pairs[0].clean:
        raise SystemExit(f"the pairs differ from {circ_path}'s (its example: {circ.get('example', {}).get('clean')!r})")
    return circ, pairs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", choices=("ioi", "sva"), default="ioi")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dict", default="/work/runs/tc95", help="transcoders for mlp_out.* (a folder of folders)")
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-feature-nodes", type=int, default=1000)
    ap.add_argument("--every", type=int, default=1, help="a transcoder on every n-th block")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--circuits", default=None, help="default docs/results/circuits/<task>.json")
    ap.add_argument("--out", default=None)
    ap.add_argument("--contrast", action="store_true", help="one logit node: logit(target) - logit(foil)")
    args = ap.parse_args(argv)
    machine = record()
    circ_path = Path(args.circuits or f"docs/results/circuits/{args.task}.json")
    suffix = "-contrast" if args.contrast else ""
    out_path = Path(args.out or f"docs/results/features/graph-circuits-{args.task}{suffix}.json")

    import lenscope
    from lenscope.features.graphs.graph import attribution_graph
    from lenscope.features.graphs.heads import edge_heads
    from lenscope.features.graphs.prune import first_position_share, graph_scores, prune
    from lenscope.models.dictionaries.dictionary import load_dictionaries
    from lenscope.models.loading.load import resolve_token

    lm = lenscope.load(args.model)
    circ, pairs = study_pairs(lm, args.task, args.n, circ_path)
    dicts = [d for d in load_dictionaries(args.dict) if d.layer % args.every == 0]

    views = ("all", "without_first")
    sums = {v: {"layer": defaultdict(float), "position": defaultdict(float), "head": defaultdict(float),
                "residual": 0.0, "heads_total": 0.0, "token": 0.0} for v in views}
    prompts = []
    for p in pairs:
        target = resolve_token(lm, p.target)
        foil = resolve_token(lm, p.foil) if args.contrast else None
        t0 = time.perf_counter()
        g = attribution_graph(lm, p.clean, dicts, target=target, foil=foil,
                              max_feature_nodes=args.max_feature_nodes, batch_size=args.batch_size)
        t1 = time.perf_counter()
        eh = edge_heads(lm, g, dicts)
        t2 = time.perf_counter()
        rep, comp = graph_scores(g)
        pr = prune(g)
        w = float(g.logit_probs[0])
        role = roles(args.task, g.tokens, p.meta)
        rec = {"clean": p.clean, "target": p.target, "target_id": target, "foil": p.foil if foil is not None else None,
               "foil_id": foil, "logit_node_input": float(g.inputs[-1]), "target_prob": w,
               "tokens": g.tokens, "roles": role, "seconds": round(t1 - t0, 1), "heads_seconds": round(t2 - t1, 1),
               "n_active": g.n_active, "n_feature_nodes": g.n_features, "n_nodes": g.n_nodes,
               "exactness_error": g.exactness_error, "real_error": g.real_error, "replacement_score": rep,
               "completeness_score": comp, "pruned_nodes": int(pr.node_mask.sum()),
               "pruned_edges": int(eh.edges.shape[0]), "head_error": eh.error}
        for v in views:
            s = graph_summary(g, eh, skip_first=v == "without_first")
            acc = sums[v]
            layers = {str(li): float(x) for li, x in enumerate(s["layer"])}
            H = s["heads"].shape[1]
            heads = {f"L{li}H{h}": float(s["heads"][li, h]) for li in range(s["heads"].shape[0]) for h in range(H)}
            for k, x in layers.items():
                acc["layer"][k] += x / w
            for j, x in enumerate(s["position"].tolist()):
                if x or v == "all":
                    acc["position"][role[j]] += x / w
            for k, x in heads.items():
                acc["head"][k] += x / w
            acc["residual"] += s["residual"] / w
            acc["heads_total"] += float(s["heads"].sum()) / w
            acc["token"] += float(s["token"].sum()) / w
            rec[v] = {"residual_share": s["residual"] / max(s["residual"] + float(s["heads"].sum()), 1e-30),
                      "token_influence": float(s["token"].sum()) / w, "top_layers": top(layers),
                      "top_positions": top({f"{j}:{role[j]}": float(x) for j, x in enumerate(s["position"])
                                           if j or v == "all"}),
                      "top_heads": top(heads)}
            if v == "all":
                rec["first_position_share"] = first_position_share(g)
        prompts.append(rec)
        print(json.dumps({k: x for k, x in rec.items() if k not in ("tokens", "roles")}), flush=True)

    n = len(prompts)

    def mean_top(scores: dict, k: int = TOP) -> list[dict]:
        return [{"name": r["name"], "score": r["score"] / n} for r in top(scores, k)]

    graph = {}
    for v in views:
        acc = sums[v]
        graph[v] = {"top_layers": mean_top(acc["layer"]), "top_positions": mean_top(acc["position"]),
                    "top_heads": mean_top(acc["head"]), "top10_heads": mean_top(acc["head"], 10),
                    "layer_scores": {k: x / n for k, x in acc["layer"].items()},
                    "position_scores": {k: x / n for k, x in sorted(acc["position"].items(), key=lambda kv: -kv[1])},
                    "residual_share": acc["residual"] / max(acc["residual"] + acc["heads_total"], 1e-30),
                    "token_influence": acc["token"] / n}
    other = stored_methods(circ)
    mean = {k: sum(r[k] for r in prompts) / n for k in ("seconds", "heads_seconds", "target_prob",
                                                        "replacement_score", "completeness_score", "n_active",
                                                        "n_feature_nodes", "pruned_edges")}
    mean["exactness_error_max"] = max(r["exactness_error"] for r in prompts)
    mean["head_error_max"] = max(r["head_error"] for r in prompts)
    mean["first_position_share"] = sum(r["first_position_share"] for r in prompts) / n
    res = {"task": args.task, "model": args.model, "machine": machine, "machine_end": record(),
           "settings": {"n": n, "contrast": args.contrast, "max_feature_nodes": args.max_feature_nodes,
                        "every": args.every,
                        "transcoders": len(dicts), "dictionaries": args.dict, "batch_size": args.batch_size,
                        "node_threshold": 0.8, "edge_threshold": 0.98, "circuits_file": str(circ_path),
                        "scores": "layers/positions: summed node influence (features + error nodes) / w; heads: "
                                  "sum over pruned edges of |head part| / sum|A[t,:]| * (influence_t + w_t), / w; "
                                  "means over prompts; without_first: the nodes at the first position and the "
                                  "edges from or to them left out"},
           "graph": graph, "others": other, "overlap": {v: overlaps(graph[v], other) for v in views}, "mean": mean,
           "prompts": prompts}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps({k: res[k] for k in ("graph", "overlap", "mean")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
