"""Attribution graphs on SmolLM2 with lenscope's own transcoders: time, peak memory, the exactness checks and the
graph's scores, for a transcoder on every block and on every third block, with the machine record.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_graph.py --dict DIR \
        --out docs/results/features/bench-graph-smollm2.json

``DIR``: transcoders for ``mlp_out.*`` (``benchmarks/bench_dict_train.py --role transcoder --site 'mlp_out.*'``).
Each setting runs in this process, one after the other; peak memory is the process's resident peak
(``ru_maxrss``) after each, so the second's includes the first's (the model and the dictionaries dominate).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import record


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dict", required=True, help="transcoders for mlp_out.* (a folder of dictionary folders)")
    ap.add_argument("--prompt", default="Fact: the capital of the state containing Dallas is the city")
    ap.add_argument("--max-feature-nodes", type=int, default=5000)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--every", default="1,3", help="comma-separated: a transcoder on every n-th block")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    machine = record()  # at the start: the load then; the run's own load is in "machine_end"

    import lenscope
    from lenscope.features.graphs.graph import attribution_graph
    from lenscope.features.graphs.heads import edge_heads
    from lenscope.models.dictionaries.dictionary import load_dictionaries

    t0 = time.perf_counter()
    lm = lenscope.load(args.model)
    dicts = load_dictionaries(args.dict)
    load_s = time.perf_counter() - t0
    n_tokens = int(lm.tokenizer(args.prompt, return_tensors="pt").input_ids.shape[1])
    runs = {}
    for every in [int(x) for x in args.every.split(",")]:
        ds = [d for d in dicts if d.layer % every == 0]
        t = time.perf_counter()
        g = attribution_graph(lm, args.prompt, ds, max_feature_nodes=args.max_feature_nodes,
                              batch_size=args.batch_size, progress=True)
        secs = time.perf_counter() - t
        t = time.perf_counter()
        eh = edge_heads(lm, g, ds)  # the pruned graph's edges over the heads that carry them
        heads_s = time.perf_counter() - t
        d = g.to_dict()
        runs[f"every_{every}"] = {
            "transcoders": len(ds), "seconds": round(secs, 1), "peak_rss_gb": round(
                resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
            "n_active_features": g.n_active, "n_feature_nodes": g.n_features, "n_nodes": g.n_nodes,
            "n_logits": g.n_logits, "logit_tokens": g.logit_tokens, "logit_probs": g.logit_probs.tolist(),
            "exactness_error": g.exactness_error, "real_error": g.real_error,
            "replacement_score": d["replacement_score"], "completeness_score": d["completeness_score"],
            "pruned_nodes": len(d["nodes"]), "pruned_links": len(d["links"]),
            "heads": {"edges": int(eh.edges.shape[0]), "seconds": round(heads_s, 1), "error": eh.error,
                      "residual_share": float(eh.residual.abs().sum() / (eh.residual.abs().sum()
                                                                         + eh.heads.abs().sum()))}}
        print(json.dumps({f"every_{every}": runs[f"every_{every}"]}), flush=True)
    out = {"machine": machine, "machine_end": record(), "model": args.model, "prompt": args.prompt,
           "prompt_tokens": n_tokens,
           "max_feature_nodes": args.max_feature_nodes, "batch_size": args.batch_size,
           "load_seconds": round(load_s, 1), "dictionaries": args.dict, "runs": runs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
