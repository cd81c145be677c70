"""The lens-training precision probe's cost on a model: the early-stopping probe against timing the whole block.

    .venv/bin/python benchmarks/bench_precision_probe.py --model smollm2 --out docs/results/bench-precision-probe.json

Without native bfloat16 (or with LENSCOPE_NATIVE_BF16=0) `choose_precision` times one block of the objective in
float32, then a 64th of it in bfloat16, and stops there when that is clearly slower. This script runs the
probe both ways in one process (the whole-block way by setting PROBE_FIRST_PART to 1) and records the seconds
each took and the decision each made.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import record  # benchmarks/machine.py

import lenscope
from lenscope.lenses import precision as P


def probe(lm, first_part: int) -> dict:
    P._PROBES.clear()
    P.PROBE_FIRST_PART = first_part
    t0 = time.perf_counter()
    rec = P.choose_precision(lm, None, native=False)
    return {"seconds": round(time.perf_counter() - t0, 3), "decision": rec["unembed_dtype"],
            "measured_s": rec["measured_s"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="docs/results/bench-precision-probe.json")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    machine = record()
    lm = lenscope.load(args.model)
    default = P.PROBE_FIRST_PART
    early = probe(lm, default)
    whole = probe(lm, 1)
    P.PROBE_FIRST_PART = default
    out = {"machine": machine, "model": args.model, "first_part": default, "early_stop": early, "whole_block": whole,
           "speedup": round(whole["seconds"] / max(early["seconds"], 1e-9), 2),
           "load_1min_after": round(os.getloadavg()[0], 2)}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
