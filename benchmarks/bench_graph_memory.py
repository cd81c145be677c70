"""The attribution graph's memory estimate (``lenscope.features.graphs.memory.GraphMemory``) against what the process's
resident memory grew by while building the graph: a tiny model with random transcoders on every block, prompts of a
few lengths and two batch sizes, each run in a fresh interpreter (the peak resident size, ``ru_maxrss``, never
falls within a process). The same for the head split of the graph's edges (``graph_heads.HeadsMemory``): the graph
built and saved in one interpreter, split in another that loaded it (the estimate less the graph it holds against
the growth after the load).

    .venv/bin/python benchmarks/bench_graph_memory.py --out docs/results/features/bench-graph-memory.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

# the model, random transcoders on every block and the prompt, shared by both measurements (family, reps given)
SETUP = """import lenscope, torch
from lenscope.models.dictionaries.dictionary import Dictionary
lm = lenscope.load(f"tiny:{family}")
A = lm.anatomy
ds = []
for L in range(A.n_layers):
    D = Dictionary.init(A.d_model, 40, kind="topk", role="transcoder", k=6, site=f"mlp_out.{L}", seed=L + 1)
    D.b_enc = torch.randn(40, generator=torch.Generator().manual_seed(L)) * 0.1
    ds.append(D)
text = "The cat sat on the mat because it was warm. " * reps
"""

ONE = r"""
import gc, json, resource, sys
import torch
import lenscope
from lenscope.features.graphs.graph import attribution_graph
from lenscope.features.graphs.memory import graph_memory, nbytes
from lenscope.models.dictionaries.dictionary import Dictionary
from lenscope.models.runtime.trace import trace

family, reps, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
""" + SETUP + r"""attribution_graph(lm, "The cat", ds, max_memory=10**12)  # warm: every code path loaded once
gc.collect()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
g = attribution_graph(lm, text, ds, batch_size=batch, max_memory=10**12)
g.to_dict()  # pruned and scored, as the CLI does
grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
est = graph_memory(n_pos=g.n_pos, n_layers=g.n_layers, d_model=A.d_model,
                   n_heads=max(layer.attn.n_heads for layer in A.layers), n_active=g.n_active,
                   block_active=int(torch.bincount(g.feature_layer).max()), n_features=g.n_features,
                   n_logits=g.n_logits, batch_size=batch, trace_bytes=nbytes(trace(lm, text)))
print(json.dumps({"tokens": g.n_pos, "active_features": g.n_active, "batch_size": batch, "estimate_mb":
                  round(est.total / 1e6, 1), "rss_growth_mb": round(grew / 1e6, 1),
                  "estimate_over_growth": round(est.total / max(grew, 1), 2)}))
"""

HEADS = r"""
import gc, json, resource, sys
import torch
import lenscope
from lenscope.features.graphs.graph import AttributionGraph, attribution_graph
from lenscope.features.graphs.memory import nbytes
from lenscope.features.graphs.heads import edge_heads, heads_memory
from lenscope.features.graphs.prune import prune
from lenscope.models.dictionaries.dictionary import Dictionary

family, reps, batch, path, build = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5] == "1"
""" + SETUP + r"""if build:
    attribution_graph(lm, text, ds, max_memory=10**12).save(path)
    sys.exit()
small = attribution_graph(lm, "The cat", ds, max_memory=10**12)
edge_heads(lm, small, ds, max_memory=10**12)  # warm
g = AttributionGraph.load(path)
del small
gc.collect()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
eh = edge_heads(lm, g, ds, batch_size=batch, max_memory=10**12)  # the edges pruned first, as the CLI does
grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
from lenscope.features.graphs.memory import graph_memory
from lenscope.features.graphs.prune import prune_memory
from lenscope.models.runtime.trace import trace
dims = dict(n_pos=g.n_pos, n_layers=A.n_layers, d_model=A.d_model,
            n_heads=max(layer.attn.n_heads for layer in A.layers), n_active=g.n_active)
frozen = graph_memory(n_features=0, n_logits=0, batch_size=0, block_active=0, **dims).frozen
est = heads_memory(n_targets=int(eh.edges[:, 0].unique().numel()), n_edges=eh.edges.shape[0], batch_size=batch,
                   held=nbytes(g) + nbytes(trace(lm, text)) + frozen, prune=prune_memory(g.n_nodes), **dims)
est_growth = est.total - nbytes(g)
print(json.dumps({"tokens": g.n_pos, "edges": int(eh.edges.shape[0]), "batch_size": batch,
                  "estimate_mb": round(est_growth / 1e6, 1), "rss_growth_mb": round(grew / 1e6, 1),
                  "estimate_over_growth": round(est_growth / max(grew, 1), 2)}))
"""

RESOLUTION_MB = 5.0


def main() -> None:
    from machine import record

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="llama")
    ap.add_argument("--reps", type=int, nargs="+", default=[2, 4, 6])
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 256])
    ap.add_argument("--head-batches", type=int, nargs="+", default=[8, 32])
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
    heads = {}
    with tempfile.TemporaryDirectory() as tmp:
        for reps in a.reps:
            path = str(Path(tmp) / f"g{reps}.safetensors")
            subprocess.run([sys.executable, "-c", HEADS, a.family, str(reps), "1", path, "1"], check=True, cwd=ROOT)
            for b in a.head_batches:
                out = subprocess.run([sys.executable, "-c", HEADS, a.family, str(reps), str(b), path, "0"],
                                     capture_output=True, text=True, check=True, cwd=ROOT)
                r = json.loads(out.stdout.strip().splitlines()[-1])
                heads[f"tokens_{r['tokens']}_batch_{b}"] = r
                print("heads", r, flush=True)
    # a growth of a few MB is below what ru_maxrss resolves here (the model's loading peaks higher): not a ratio
    h_ratios = [r["estimate_over_growth"] for r in heads.values() if r["rss_growth_mb"] >= RESOLUTION_MB]
    res = {"machine": record(), "model": f"tiny:{a.family}", "runs": runs, "min_estimate_over_growth": min(ratios),
           "max_estimate_over_growth": max(ratios), "heads": heads,
           "heads_min_estimate_over_growth": min(h_ratios, default=None),
           "heads_max_estimate_over_growth": max(h_ratios, default=None),
           "heads_ratio_from_growth_of_at_least_mb": RESOLUTION_MB}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
