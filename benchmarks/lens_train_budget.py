"""Train a tuned lens within a time budget, optionally measured in this process's CPU time.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/lens_train_budget.py --model smollm2 --max-minutes 15 \
        --out lenses/smollm2-15min-cpu --cpu-time [--precision fp32]

`lenscope lens train --max-minutes M` budgets wall-clock time. On a shared machine the wall clock mostly
measures the other processes, so `--cpu-time` budgets the CPU seconds of this process instead: with one
thread (OMP_NUM_THREADS=1) that is what M minutes on an otherwise idle core would give. `--precision fp32`
emulates a CPU without native bfloat16 (the unembedding matmuls in float32). Prints one JSON line with the
training record (precision decision, plan, tokens/s).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import lenscope
from lenscope.lenses import TrainSettings, read_text, split_text, token_sequences, train_tuned_lens

DEFAULT_TEXT = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "wikitext2" / "wiki.test.raw"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--data", type=Path, default=DEFAULT_TEXT)
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-minutes", type=float, default=15.0)
    ap.add_argument("--tokens", type=int, default=0, help="most tokens (0: no limit)")
    ap.add_argument("--cpu-time", action="store_true", help="budget this process's CPU time, not wall-clock time")
    ap.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto")
    ap.add_argument("--patience", type=int, default=None)
    ap.add_argument("--mid", action="store_true")
    ap.add_argument("--batch-size", type=int, default=4)
    args = ap.parse_args()
    clock = time.process_time if args.cpu_time else time.perf_counter
    started = clock()
    wall0 = time.perf_counter()
    lm = lenscope.load(args.model)
    seqs = token_sequences(lm, split_text(read_text(args.data), "train"), 256)
    extra = {} if args.patience is None else {"patience": args.patience}
    s = TrainSettings(tokens=args.tokens, max_minutes=args.max_minutes, batch_size=args.batch_size, checkpoint_every=10,
                      bf16={"auto": None, "bf16": True, "fp32": False}[args.precision], mid=args.mid, **extra)
    lens = train_tuned_lens(lm, seqs, s, out=args.out, clock=clock, started=started, progress=False,
                            log=lambda m: print(m, file=sys.stderr, flush=True))
    info = {k: v for k, v in lens.training_info.items() if k != "history"}
    info["wall_s"] = round(time.perf_counter() - wall0, 1)
    info["clock"] = "process CPU time" if args.cpu_time else "wall clock"
    print(json.dumps(info))


if __name__ == "__main__":
    main()
