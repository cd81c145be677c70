"""Time ``lenscope report`` per section and measure the page, on a real model.

    .venv/bin/python benchmarks/bench_report.py --model smollm2 --tokens 30 --threads 1 \
        --out docs/results/bench-report-smollm2.json
    .venv/bin/python benchmarks/bench_report.py --model smollm2 --demo --threads 1 \
        --out docs/results/bench-report-smollm2-demo.json

``--tokens N``: the last N tokens of a longer sentence, the model's own top prediction explained. ``--demo``:
``./dev demo``'s sentence, target and foil instead. Records ``benchmarks/machine.py``'s ``record()`` under
``"machine"`` (the command, the CPU, bf16 support, threads, the 1-minute load average, the date), since timings
on a shared 2-core machine vary with what else runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from machine import record  # noqa: E402

import lenscope  # noqa: E402
from lenscope.report import build_report  # noqa: E402

BASE = ("When Mary and John went to the store on a sunny afternoon after school, John gave a bottle of fresh "
        "cold milk and a small cake from the bakery to")
DEMO = ("When Mary and John went to the store, John gave a drink to", " Mary", " John")  # what ./dev demo explains


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tokens", type=int, default=30)
    ap.add_argument("--demo", action="store_true", help="./dev demo's sentence, target and foil")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    machine = record()  # the load average before this run adds its own
    t = time.perf_counter()
    lm = lenscope.load(a.model)
    load_s = time.perf_counter() - t
    ids = lm.tokenizer(BASE, add_special_tokens=False)["input_ids"]
    text = lm.tokenizer.decode(ids[-a.tokens:] if lm.anatomy.causal else ids[: a.tokens - 2])
    target = foil = None
    if a.demo:
        text, target, foil = DEMO
    runs = []
    for _ in range(a.repeat):
        t = time.perf_counter()
        rep = build_report(lm, text, target, foil)
        page = rep.html()
        runs.append({"timings": rep.timings, "seconds_with_page": time.perf_counter() - t, "bytes": len(page.encode())})
    best = min(runs, key=lambda r: r["seconds_with_page"])
    res = {"model": a.model, "tokens": len(rep.meta["tokens"]), "text": text, "target": target, "foil": foil,
           "load_seconds": round(load_s, 2), "best": best, "runs": runs, "ok": rep.ok, "machine": machine,
           "loadavg_1min_after": round(os.getloadavg()[0], 2)}
    print(json.dumps(res, indent=1))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
