"""Context-mixing maps: time of every scope for every layer divided by one plain forward pass (same run,
interleaved, medians), with the closed-form IG and with the paper's numeric IG (20 midpoint steps), and how
the cost grows with length. Prints a table and writes JSON.

    .venv/bin/python benchmarks/bench_mixing.py --out docs/results/bench-mixing.json
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_mixing.py --models smollm2 --repeats 3 --lengths 16,32,64 \
        --out docs/results/bench-mixing-smollm2.json | tee docs/results/bench-mixing-smollm2.txt

The JSON carries ``benchmarks/machine.py``'s ``record()`` under ``"machine"`` (command, CPU, bf16, threads, load,
date); the printed log starts with the same record, so a log and its JSON say which run they are.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
from machine import record  # benchmarks/machine.py

import lenscope
from lenscope.mixing.maps import context_mixing
from lenscope.models.loading.load import encode

TEXT = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "wikitext2" / "wiki.test.raw"
SENTENCE = ("The keys to the old wooden cabinet that my grandmother kept in the kitchen near the big window "
            "overlooking the garden were lost last week, and nobody has seen them since then.")


def ids_of_length(lm, n: int) -> torch.Tensor:
    text = TEXT.read_text()[:20000] if TEXT.exists() else SENTENCE * 50
    return torch.tensor(lm.tokenizer(text)["input_ids"][:n])  # longer than the context: cut, not refused


def timed(fn, repeats: int) -> float:
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def measure(lm, ids: torch.Tensor, repeats: int, numeric: bool) -> dict:
    def fwd():
        with torch.no_grad():
            lm.model(ids[None], use_cache=False) if lm.anatomy.causal else lm.model(ids[None])

    fwd()
    context_mixing(lm, ids)  # warm-up
    f, full, num = [], [], []
    for _ in range(repeats):  # interleaved, so both see the same machine state
        f.append(timed(fwd, 1))
        full.append(timed(lambda: context_mixing(lm, ids), 1))
        if numeric:
            num.append(timed(lambda: context_mixing(lm, ids, numeric_steps=20), 1))
    row = {"tokens": int(ids.numel()), "forward_s": statistics.median(f), "all_scopes_s": statistics.median(full)}
    row["ratio"] = row["all_scopes_s"] / row["forward_s"]
    if numeric:
        row["numeric_ig20_s"] = statistics.median(num)
        row["numeric_ratio"] = row["numeric_ig20_s"] / row["forward_s"]
        a = context_mixing(lm, ids)
        b = context_mixing(lm, ids, numeric_steps=20)
        ff = "atbff" if lm.anatomy.placement == "post" else "atblnff"
        d = (a[ff].maps - b[ff].maps).abs().max() / a[ff].maps.abs().max()
        row["numeric_vs_exact_max_rel_diff"] = float(d)
        row["completeness_error"] = max(m.completeness_error for m in a.values())
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2,minilm")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--lengths", default="16,32,64,128,256,512")
    ap.add_argument("--max-length", type=int, default=512, help="skip longer sweeps (they take minutes)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    res = {"machine": record(), "models": {}}
    print("# " + json.dumps(res["machine"]), flush=True)
    for name in args.models.split(","):
        lm = lenscope.load(name)
        ids = encode(lm, SENTENCE)[:30]
        entry = {"sentence": measure(lm, ids, args.repeats, numeric=True), "lengths": []}
        print(f"{name}: {entry['sentence']}", flush=True)
        for n in [int(x) for x in args.lengths.split(",")]:
            if n > args.max_length or n > lm.anatomy.n_ctx:
                continue
            row = measure(lm, ids_of_length(lm, n), max(1, min(args.repeats, 3 if n <= 128 else 1)), numeric=False)
            entry["lengths"].append(row)
            print(f"  {n:>4} tokens: forward {row['forward_s'] * 1e3:8.1f} ms  all scopes {row['all_scopes_s']:8.2f} s"
                  f"  ratio {row['ratio']:7.1f}", flush=True)
        res["models"][name] = entry
    res["load_1min_after"] = round(os.getloadavg()[0], 2)
    print("# load average (1 min) at the end:", res["load_1min_after"])
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
