"""The attribution graph's memory estimate (``lenscope.features.graph.GraphMemory``) against what the process's
resident memory grew by while building the graph: a tiny model with random transcoders on every block, prompts of a
few lengths and two batch sizes, each run in a fresh interpreter (the peak resident size, ``ru_maxrss``, never
falls within a process).

    .venv/bin/python benchmarks/bench_graph_memory.py --out docs/results/features/bench-graph-memory.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

ONE = r"""
import gc, json, resource, sys
import torch
import lenscope
from lenscope.features.graph import attribution_graph, graph_memory, nbytes
from lenscope.models.dictionary import Dictionary
from lenscope.models.trace import trace

family, reps, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
lm = lenscope.load(f"tiny:{family}")
A = lm.anatomy
ds = []
for L in range(A.n_layers):
    D = Dictionary.init(A.d_model, 40, kind="topk", role="transcoder", k=6, site=f"mlp_out.{L}", seed=L + 1)
    D.b_enc = torch.randn(40, generator=torch.Generator().manual_seed(L)) * 0.1
    ds.append(D)
text = "The cat sat on the mat because it was warm. " * reps
attribution_graph(lm, "The cat", ds, max_memory=10**12)  # warm: every code path loaded once
gc.collect()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
g = attribution_graph(lm, text, ds, batch_size=batch, max_memory=10**12)
grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
est = graph_memory(n_pos=g.n_pos, n_layers=g.n_layers, d_model=A.d_model,
                   n_heads=max(layer.attn.n_heads for layer in A.layers), n_active=g.n_active,
                   block_active=int(torch.bincount(g.feature_layer).max()), n_features=g.n_features,
                   n_logits=g.n_logits, batch_size=batch, trace_bytes=nbytes(trace(lm, text)))
print(json.dumps({"tokens": g.n_pos, "active_features": g.n_active, "batch_size": batch, "estimate_mb":
                  round(est.total / 1e6, 1), "rss_growth_mb": round(grew / 1e6, 1),
                  "estimate_over_growth": round(est.total / max(grew, 1), 2)}))
"""


def main() -> None:
    from machine import record

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="llama")
    ap.add_argument("--reps", type=int, nargs="+", default=[2, 4, 6])
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 256])
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    runs = {}
    for reps in a.reps:
        for b in a.batches:
            out = subprocess.run([sys.executable, "-c", ONE, a.family, str(reps), str(b)], capture_output=True,
                                 text=True, check=True, cwd=ROOT)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            runs[f"tokens_{r['tokens']}_batch_{b}"] = r
            print(r, flush=True)
    ratios = [r["estimate_over_growth"] for r in runs.values()]
    res = {"machine": record(), "model": f"tiny:{a.family}", "runs": runs, "min_estimate_over_growth": min(ratios),
           "max_estimate_over_growth": max(ratios)}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
