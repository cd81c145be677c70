"""Speed-up of a Ray sweep on this machine: the mixing study (or causal tracing over facts) sequentially with 1
and with N torch threads, and on a local Ray with N workers of one thread each.

    .venv/bin/python benchmarks/bench_ray.py --model smollm2 --sweep mixing --n 24 --workers 2 \
        --out docs/results/bench-ray-smollm2.json

Each configuration writes to its own temporary folder; the records are checked to be identical. Ray's start-up
(the local cluster and each worker loading the model) is timed separately from the sweep itself.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from machine import bf16_native, cpu_name  # noqa: E402

import lenscope  # noqa: E402


def run(kind, lm, items, out, ray=None, workers=2):
    if kind == "mixing":
        from lenscope.sweeps.mixing_study import mixing_study

        mixing_study(lm, items, out, dataset="bench", progress=False, ray=ray, workers=workers)
    else:
        from lenscope.sweeps.causal_trace import causal_trace_sweep

        causal_trace_sweep(lm, items, out, samples=3, window=5, progress=False, ray=ray, workers=workers)
    return (Path(out) / "records.jsonl").read_text()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--sweep", choices=["mixing", "facts"], default="mixing")
    ap.add_argument("--n", type=int, default=24)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    lm = lenscope.load(a.model)
    if a.sweep == "mixing":
        from lenscope.sweeps.mixing_study import load_sentences

        items = load_sentences("sst2", a.n)[1]
    else:
        from lenscope.sweeps.causal_trace import load_facts

        items = load_facts("facts", a.n)
    res = {"model": a.model, "sweep": a.sweep, "n": len(items), "workers": a.workers, "cpu": cpu_name(),
           "cores": os.cpu_count(), "bf16_native": bf16_native(), "loadavg_before": os.getloadavg()[0]}
    tmp = Path(tempfile.mkdtemp())
    outs = {}
    for threads in (1, a.workers):
        torch.set_num_threads(threads)
        t = time.perf_counter()
        outs[f"seq{threads}"] = run(a.sweep, lm, items, tmp / f"seq{threads}")
        res[f"sequential_{threads}_threads_s"] = round(time.perf_counter() - t, 2)
    torch.set_num_threads(1)
    import ray

    t = time.perf_counter()
    ray.init(num_cpus=a.workers, include_dashboard=False, log_to_driver=False)
    res["ray_init_s"] = round(time.perf_counter() - t, 2)
    t = time.perf_counter()
    run(a.sweep, lm, items[:a.workers], tmp / "warm", ray=True, workers=a.workers)  # start-up: workers load the model
    res["ray_warmup_s"] = round(time.perf_counter() - t, 2)
    t = time.perf_counter()
    outs["ray"] = run(a.sweep, lm, items, tmp / "ray", ray=True, workers=a.workers)
    res["ray_s_including_worker_start"] = round(time.perf_counter() - t, 2)
    # Ray's workers run one torch thread: byte-identical to the one-thread sequential run (more threads change
    # the order of float reductions, so the two-thread run differs in the last digits)
    res["identical_to_sequential_1_thread"] = outs["ray"] == outs["seq1"]
    res["speedup_vs_1_thread"] = round(res["sequential_1_threads_s"] / res["ray_s_including_worker_start"], 2)
    res[f"speedup_vs_{a.workers}_threads"] = round(res[f"sequential_{a.workers}_threads_s"]
                                                  / res["ray_s_including_worker_start"], 2)
    res["loadavg_after"] = os.getloadavg()[0]
    print(json.dumps(res, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
