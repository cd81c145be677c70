r"""Speed and memory of lenscope's circuit methods on smollm2 (CPU), in one run on one set of prompts.

The issue's targets: attribution patching (AtP) of every node on 50 IOI prompts at least 50x faster than exact node
patching of the same nodes; EAP-IG (5 steps) of every edge (~1.2e5) on 50 prompts in under 2 minutes on 2 cores,
with the edge scoring's memory bounded (peak resident memory stated).

Every method runs on the same ``--n`` IOI pairs (``lenscope.data.contrast.ioi_contrasts``: names swapped) and is
timed once, after a warm-up of each on one pair; a plain forward pass over the same clean prompts is the unit of the
ratios. Peak memory: the process's resident-set high-water mark (``VmHWM``), reset before each method through
``/proc/self/clear_refs``, minus the resident memory before it (the loaded model).

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_circuits.py --n 50 --out docs/results/circuits-speed.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from machine import record  # noqa: E402

import lenscope  # noqa: E402
from lenscope.circuits import (  # noqa: E402
    atp_star,
    attribution_patching,
    check_against_exact,
    edge_attribution,
    exact_node_patching,
)
from lenscope.data.contrast import ioi_contrasts, tokenize_with  # noqa: E402
from lenscope.models.runtime.engine import run  # noqa: E402


def _rss_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _reset_peak() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def timed(fn):
    _reset_peak()
    before = _rss_mb("VmRSS")
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t, _rss_mb("VmHWM") - before


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--n", type=int, default=50)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--skip-exact", action="store_true", help="leave out exact node patching (the slow part)")
    ap.add_argument("--out", default="docs/results/circuits-speed.json")
    args = ap.parse_args()
    machine = record()
    lm = lenscope.load(args.model)
    pairs = ioi_contrasts(args.n, seed=0, corruption="swap", tokenize=tokenize_with(lm))
    ids = torch.tensor([tokenize_with(lm)(p.clean) for p in pairs]) if len({len(tokenize_with(lm)(p.clean))
                                                                             for p in pairs}) == 1 else None
    out: dict = {"model": args.model, "n": len(pairs), "machine": machine, "steps": args.steps}
    with torch.no_grad():  # warm-up, and the unit: one plain forward pass over the clean prompts
        for p in pairs[:2]:
            run(lm, torch.tensor([tokenize_with(lm)(p.clean)]), last_only=True)
        t = time.perf_counter()
        if ids is not None:
            run(lm, ids, last_only=True)
        else:
            for p in pairs:
                run(lm, torch.tensor([tokenize_with(lm)(p.clean)]), last_only=True)
        out["forward_seconds"] = time.perf_counter() - t
    print(f"forward {out['forward_seconds']:.2f} s", flush=True)
    warm = pairs[:1]  # every method once on one pair first: lazy conversions and allocator warm-up stay out
    attribution_patching(lm, pairs=warm), atp_star(lm, pairs=warm), edge_attribution(lm, warm, method="eap")
    if not args.skip_exact:
        exact_node_patching(lm, pairs=warm)
    atp, out["atp_seconds"], out["atp_peak_mb"] = timed(lambda: attribution_patching(lm, pairs=pairs))
    print(f"atp {out['atp_seconds']:.1f} s", flush=True)
    star, out["atp_star_seconds"], out["atp_star_peak_mb"] = timed(lambda: atp_star(lm, pairs=pairs))
    print(f"atp* {out['atp_star_seconds']:.1f} s", flush=True)
    eap, out["eap_seconds"], out["eap_peak_mb"] = timed(lambda: edge_attribution(lm, pairs, method="eap"))
    print(f"eap {out['eap_seconds']:.1f} s", flush=True)
    eig, out["eap_ig_seconds"], out["eap_ig_peak_mb"] = timed(
        lambda: edge_attribution(lm, pairs, method="eap-ig", steps=args.steps))
    print(f"eap-ig {out['eap_ig_seconds']:.1f} s", flush=True)
    out["edges"] = eig.n_edges
    out["nodes"] = len(atp.nodes())
    out["metric_clean"], out["metric_corrupted"] = atp.metric_clean, atp.metric_corrupted
    if not args.skip_exact:
        ex, out["exact_nodes_seconds"], out["exact_nodes_peak_mb"] = timed(
            lambda: exact_node_patching(lm, pairs=pairs))
        print(f"exact nodes {out['exact_nodes_seconds']:.1f} s", flush=True)
        out["atp_speedup_vs_exact"] = out["exact_nodes_seconds"] / out["atp_seconds"]
        out["atp_star_speedup_vs_exact"] = out["exact_nodes_seconds"] / out["atp_star_seconds"]
        out["check_atp"] = check_against_exact(atp, ex)
        out["check_atp_star"] = check_against_exact(star, ex)
    for k in ("atp", "atp_star", "eap", "eap_ig") + (() if args.skip_exact else ("exact_nodes",)):
        out[f"{k}_forwards"] = out[f"{k}_seconds"] / out["forward_seconds"]
    out["load_1min_after"] = round(__import__("os").getloadavg()[0], 2)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: v for k, v in out.items() if not isinstance(v, dict)}, indent=1))


if __name__ == "__main__":
    main()
