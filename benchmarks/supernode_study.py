r"""Automatic supernodes checked by ablation on smollm2 (issue 45): do the graph's predictions rank the groups' real
effects right?

For ``--task ioi`` or ``--task sva``, the first ``--n`` pairs exactly as ``benchmarks/circuits_study.py`` draws them
(``ioi_contrasts(n, seed=0, corruption="swap")`` / ``sva_contrasts(n, seed=0)``, tokenized by the model; checked
against ``docs/results/circuits/<task>.json``'s example), the attribution graph of each CLEAN prompt with the clean
target as its only logit node (``max_feature_nodes``, a transcoder on every block), its automatic supernodes
(``features.graphs.supernodes.auto_supernodes``: the pruned graph's feature nodes, node threshold 0.8, edge threshold
0.98, grouped by their edge profiles at one position within a band of blocks, merged while the average similarity is
above the threshold; every pair of a ``--thresholds`` value and a ``--layer-spans`` value tried on the same graph),
and every supernode ablated in the real model through the latent sites (``check_supernodes``, factor 0: one real run
per group). Per setting: each group's real change of the target's demeaned logit beside the graph's ``direct`` and
``frozen_total`` predictions, the Spearman correlation over every group of every prompt (pooled; also per prompt),
and the groups flagged (opposite sign, or more than ``--ratio`` apart; changes below 1% of a prompt's largest count
as none). The baseline: ``--singles`` single feature nodes of each pruned graph (the largest direct edges to the
logit first) ablated one at a time, their Spearman pooled the same way. ``frozen_total`` leaves out the responses
of the active features that are not nodes (``settings.missing_features``, per prompt) unless
``--max-feature-nodes`` covers them all.

The first threshold with the first span is the headline setting (by default auto_supernodes' own defaults: threshold
0, a band of ceil(30 / 6) = 5 blocks): ``spearman``, ``flagged``, ``groups`` at the top of the file; the others are
under ``settings_tried``. ``beyond_first``: the same Spearman over the groups at positions after the first (the
first token is smollm2's attention sink: no BOS). Writes ``docs/results/features/supernodes-<task>.json``;
``--save-graph PATH`` keeps the first prompt's graph with its headline supernodes (``PATH`` with the suffix
``.safetensors``: ``AttributionGraph.save``, reloadable with ``.load``; ``.json``: its ``to_dict()``, the CLI's
JSON)::

    nice -n 19 env OMP_NUM_THREADS=1 .venv/bin/python benchmarks/supernode_study.py --task ioi --n 4 \
        --dict /work/runs/tc25 --save-graph /work/runs/supernode-graph.safetensors
    nice -n 19 env OMP_NUM_THREADS=1 .venv/bin/python benchmarks/supernode_study.py --task sva --n 4 \
        --dict /work/runs/tc25
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from graph_circuits_study import study_pairs  # noqa: E402
from machine import record  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", choices=("ioi", "sva"), default="ioi")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dict", default="/work/runs/tc25", help="transcoders for mlp_out.* (a folder of folders)")
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-feature-nodes", type=int, default=500)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--thresholds", default="0.0,0.3,0.6", help="merge thresholds; the first: the headline")
    ap.add_argument("--layer-spans", default="5,2", help="layer bands tried with each threshold; the first: the "
                    "headline")
    ap.add_argument("--prediction", choices=("direct", "frozen_total"), default="direct")
    ap.add_argument("--ratio", type=float, default=2.0)
    ap.add_argument("--singles", type=int, default=30, help="the baseline: this many single feature nodes ablated")
    ap.add_argument("--circuits", default=None, help="default docs/results/circuits/<task>.json")
    ap.add_argument("--out", default=None)
    ap.add_argument("--note", default=None, help="a note kept in the settings (e.g. on the transcoders)")
    ap.add_argument("--save-graph", default=None, help="keep the first prompt's graph with its supernodes here")
    args = ap.parse_args(argv)
    machine = record()
    circ_path = Path(args.circuits or f"docs/results/circuits/{args.task}.json")
    out_path = Path(args.out or f"docs/results/features/supernodes-{args.task}.json")
    grid = [(float(t), int(s)) for s in args.layer_spans.split(",") for t in args.thresholds.split(",")]

    import lenscope
    from lenscope.features.graphs.check import intervene
    from lenscope.features.graphs.graph import attribution_graph
    from lenscope.features.graphs.supernodes import (
        auto_supernodes,
        check_supernodes,
        feature_similarity,
        pooled_spearman,
    )
    from lenscope.models.dictionaries.dictionary import load_dictionaries
    from lenscope.models.loading.load import resolve_token
    from lenscope.results import finite_json
    from lenscope.stats import spearman

    lm = lenscope.load(args.model)
    _, pairs = study_pairs(lm, args.task, args.n, circ_path)  # graph_circuits_study.py's pairs
    dicts = load_dictionaries(args.dict)
    checks = {ts: [] for ts in grid}
    singles = []  # (prompt, layer, position, real, direct, frozen_total) of single feature nodes
    prompts = []
    for k, p in enumerate(pairs):
        target = resolve_token(lm, p.target)
        t0 = time.perf_counter()
        g = attribution_graph(lm, p.clean, dicts, target=target, max_feature_nodes=args.max_feature_nodes,
                              batch_size=args.batch_size)
        t1 = time.perf_counter()
        rec = {"clean": p.clean, "target": p.target, "target_id": target, "target_prob": float(g.logit_probs[0]),
               "graph_seconds": round(t1 - t0, 1), "n_active": g.n_active, "n_feature_nodes": g.n_features,
               "exactness_error": g.exactness_error, "by_setting": {}}
        for t, span in grid:
            g.supernodes = []
            sns = auto_supernodes(g, threshold=t, layer_span=span)
            t2 = time.perf_counter()
            chk = check_supernodes(lm, g, dicts, prediction=args.prediction, ratio=args.ratio) if sns else None
            checks[t, span] += [(k, chk)] if chk else []
            rec["by_setting"][f"{t}:{span}"] = {
                "supernodes": len(sns), "grouped_features": sum(len(s) - 1 for s in sns),
                "spearman_direct": chk.spearman_direct if chk else None,
                "spearman_frozen_total": chk.spearman_frozen_total if chk else None,
                "flagged": len(chk.flagged) if chk else 0, "check_seconds": round(time.perf_counter() - t2, 1)}
            if k == 0 and (t, span) == grid[0] and args.save_graph:
                base = Path(args.save_graph).with_suffix("")
                g.save(base.with_suffix(".safetensors"))
                base.with_suffix(".json").write_text(json.dumps(finite_json(g.to_dict()), indent=1) + "\n")
        feats = feature_similarity(g)[0]  # the pruned graph's feature nodes, the largest direct edges first
        o = g.offsets()
        for i in feats[g.adjacency[o["logit"], feats].abs().argsort(descending=True)[: args.singles]].tolist():
            r = intervene(lm, g, dicts, [i])
            singles.append({"prompt": k, "layer": int(g.feature_layer[i]), "position": int(g.feature_pos[i]),
                            "real": float(r.real[0]), "direct": float(r.direct[0]),
                            "frozen_total": float(r.frozen_total[0])})
        prompts.append(rec)
        print(json.dumps({x: y for x, y in rec.items()}), flush=True)

    def summary(ts: tuple) -> dict:
        kc = checks[ts]
        cs = [c for _, c in kc]
        groups = [{"prompt": k, **row} for k, c in kc for row in c.to_dict()["groups"]]
        flagged = [{"prompt": k, **f} for k, c in kc for f in c.flagged]
        n = len(groups)

        def pooled(pred):
            return pooled_spearman(cs, pred) if cs else None

        # the groups beyond the first token (a group sits at one position: its nodes' ids end in it), where the
        # sink (smollm2 has no BOS) is not ablated
        beyond = [r for r in groups if int(str(r["nodes"][0]).rsplit("_", 1)[1]) > 0]

        def rho(rows, pred):
            if len(rows) < 2:
                return None
            return spearman(torch.tensor([r["real"] for r in rows]), torch.tensor([r[pred] for r in rows]))

        return {"threshold": ts[0], "layer_span": ts[1], "n_groups": n, "spearman": pooled(args.prediction),
                "beyond_first": {"n_groups": len(beyond), "spearman_direct": rho(beyond, "direct"),
                                 "spearman_frozen_total": rho(beyond, "frozen_total")},
                "spearman_direct": pooled("direct"), "spearman_frozen_total": pooled("frozen_total"),
                "n_flagged": len(flagged), "flagged_share": len(flagged) / n if n else None,
                "per_prompt_spearman_direct": [c.spearman_direct for c in cs],
                "per_prompt_spearman_frozen_total": [c.spearman_frozen_total for c in cs],
                "flagged": flagged, "groups": groups}

    head = summary(grid[0])

    def single_rho(pred: str):
        if len(singles) < 2:
            return None
        return spearman(torch.tensor([r["real"] for r in singles]), torch.tensor([r[pred] for r in singles]))


    res = {"task": args.task, "model": args.model, "machine": machine, "machine_end": record(),
           "settings": {"n": len(prompts), "max_feature_nodes": args.max_feature_nodes, "dictionaries": args.dict,
                        "transcoders": len(dicts), "sites": [d.site for d in dicts],
                        "widths": sorted({d.width for d in dicts}), "batch_size": args.batch_size,
                        "node_threshold": 0.8, "edge_threshold": 0.98, "threshold": grid[0][0],
                        "layer_span": grid[0][1],
                        "prediction": args.prediction, "ratio": args.ratio, "floor": 0.01, "factor": 0.0,
                        "logit": "the clean target's demeaned logit (one logit node)",
                        "circuits_file": str(circ_path), "note": args.note,
                        "training": [{"site": d.site, "kind": d.kind,
                                      **{k: (d.info.get("training") or {}).get(k) for k in ("tokens", "steps")},
                                      "explained_variance": ((d.info.get("training") or {}).get("final") or {})
                                      .get("explained_variance")} for d in dicts],
                        "missing_features": [r["n_active"] - r["n_feature_nodes"] for r in prompts]},
           "spearman": head["spearman"], "spearman_direct": head["spearman_direct"],
           "spearman_frozen_total": head["spearman_frozen_total"], "n_groups": head["n_groups"],
           "n_flagged": head["n_flagged"], "flagged_share": head["flagged_share"], "flagged": head["flagged"],
           "beyond_first": head["beyond_first"],
           "groups": head["groups"],
           "per_prompt_spearman_direct": head["per_prompt_spearman_direct"],
           "settings_tried": [{k: v for k, v in summary(ts).items() if k not in ("groups",)} for ts in grid[1:]],
           "singles": {"n": len(singles), "spearman_direct": single_rho("direct"),
                       "spearman_frozen_total": single_rho("frozen_total"),
                       "note": "the baseline: single feature nodes of the pruned graph (the largest direct edges to "
                               "the logit first) ablated one at a time, pooled over the prompts",
                       "rows": singles},
           "prompts": prompts}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(finite_json(res), indent=1) + "\n")
    print(json.dumps(finite_json({k: res[k] for k in ("spearman", "spearman_direct", "spearman_frozen_total",
                                                      "n_groups", "n_flagged")}), indent=1))
    for s in res["settings_tried"]:
        keys = ("threshold", "layer_span", "spearman_direct", "spearman_frozen_total", "n_groups", "n_flagged")
        print(json.dumps(finite_json({k: s[k] for k in keys})))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
