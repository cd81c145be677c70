"""Speed of ``lenscope eval alignment``: seconds per example and stage, batched vs one example at a time.

Two parts (``--parts``, default both), one JSON file (``--out``) and a printed table:

1. ``stages``: the first ``--per-dataset`` examples of each dataset (default: the 11 BLiMP subsets with
   evidence and IOI) through :func:`lenscope.evaluate.evaluate_examples` in the batches the runner forms
   (equal token length, ``--batch-size``); wall-clock and process CPU seconds per example for each stage
   (trace, logit, alti-logit, gradients = grad-norm + grad-x-input, ig, erasure), and the extrapolation to
   the full table (``--full`` examples, default 2400 = 12 datasets x 200).
2. ``unbatched``: the same examples with ``lenscope.explain`` one example and one method at a time (each
   method doing its own trace or forward passes), for the speed-up of batching and sharing.

CPU time is the number to compare on a shared machine: with other processes on the cores, wall-clock time
grows with the load while CPU time does not (much). The load average is recorded.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_eval.py --model smollm2 --per-dataset 8 \\
        --out docs/results/evaluation/bench-eval-smollm2.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import bf16_native, cpu_name

STAGES = ("trace", "logit", "alti-logit", "gradients", "ig", "erasure")


def batches(lm, examples, batch_size):
    from lenscope.evaluate.evidence import prepare

    keyed = sorted(((prepare(lm, ex).n, k, ex) for k, ex in enumerate(examples)
                    if prepare(lm, ex).skip is None), key=lambda x: (x[0], x[1]))
    out, cur, n = [], [], None
    for m, _, ex in keyed:
        if cur and (m != n or len(cur) >= batch_size):
            out.append(cur)
            cur = []
        cur.append(ex)
        n = m
    if cur:
        out.append(cur)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dataset", action="append", help="dataset specs (default: blimp:all11 and ioi)")
    ap.add_argument("--per-dataset", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--ig-steps", type=int, default=16)
    ap.add_argument("--full", type=int, default=2400, help="examples in the full table (for the extrapolation)")
    ap.add_argument("--parts", default="stages,unbatched")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import lenscope
    from lenscope.attribution.explain import explain
    from lenscope.evaluate import evaluate_examples, load_datasets
    from lenscope.evaluate.alignment import EVAL_METHODS
    from lenscope.evaluate.evidence import prepare

    lm = lenscope.load(args.model)
    data = load_datasets(args.dataset or ["blimp:all11", "ioi"], args.per_dataset)
    examples = [ex for exs in data.values() for ex in exs]
    res = {"model": args.model, "cpu": cpu_name(), "bf16_native": bf16_native(), "threads": torch.get_num_threads(),
           "torch": torch.__version__, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
           "load_average_start": os.getloadavg(), "examples": len(examples), "ig_steps": args.ig_steps}
    parts = args.parts.split(",")
    bs = batches(lm, examples, args.batch_size)
    n_align = sum(len(b) for b in bs)
    res["alignment_examples"] = n_align
    evaluate_examples(lm, bs[0][:2], EVAL_METHODS, ig_steps=args.ig_steps)  # warm-up

    if "stages" in parts:
        wall, cpu = Counter(), Counter()
        t0, c0 = time.perf_counter(), time.process_time()
        for b in bs:
            for r in evaluate_examples(lm, b, EVAL_METHODS, ig_steps=args.ig_steps):
                wall.update(r.get("time", {}))
                cpu.update(r.get("cpu", {}))
        res["stages"] = {
            "wall_per_example": {k: wall[k] / n_align for k in STAGES},
            "cpu_per_example": {k: cpu[k] / n_align for k in STAGES},
            "wall_total": time.perf_counter() - t0, "cpu_total": time.process_time() - c0,
            "batches": len(bs),
        }
        cpu_ex = sum(cpu[k] for k in STAGES) / n_align
        wall_ex = sum(wall[k] for k in STAGES) / n_align
        res["stages"]["extrapolated_full_minutes"] = {"cpu": cpu_ex * args.full / 60, "wall": wall_ex * args.full / 60}

    if "unbatched" in parts:
        wall, cpu = Counter(), Counter()
        for b in bs:
            for ex in b:
                p = prepare(lm, ex)
                for m in EVAL_METHODS:
                    t0, c0 = time.perf_counter(), time.process_time()
                    explain(lm, p.ids, p.target_id, p.foil_id, method=m,
                            **({"steps": args.ig_steps} if m == "ig" else {}))
                    wall[m] += time.perf_counter() - t0
                    cpu[m] += time.process_time() - c0
        res["unbatched"] = {"wall_per_example": {m: wall[m] / n_align for m in EVAL_METHODS},
                            "cpu_per_example": {m: cpu[m] / n_align for m in EVAL_METHODS}}
    res["load_average_end"] = os.getloadavg()

    print(f"{args.model} on {res['cpu']}, {n_align} alignment examples, load average {res['load_average_start'][0]:.1f}"
          f" -> {res['load_average_end'][0]:.1f}")
    if "stages" in res:
        print("batched, seconds per example (CPU / wall):")
        for k in STAGES:
            print(f"  {k:<12} {res['stages']['cpu_per_example'][k]:.3f} / {res['stages']['wall_per_example'][k]:.3f}")
        ext = res["stages"]["extrapolated_full_minutes"]
        print(f"  full table ({args.full} examples): {ext['cpu']:.1f} CPU minutes, {ext['wall']:.1f} wall minutes here")
    if "unbatched" in res:
        print("one example and method at a time (lenscope.explain), seconds per example (CPU / wall):")
        for m in EVAL_METHODS:
            un = res["unbatched"]
            print(f"  {m:<12} {un['cpu_per_example'][m]:.3f} / {un['wall_per_example'][m]:.3f}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
