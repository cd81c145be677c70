"""Time ``lenscope report`` per section and measure the page, on a real model.

    .venv/bin/python benchmarks/bench_report.py --model smollm2 --tokens 30 --threads 1 --out docs/results/bench-report-smollm2.json

Records the CPU (lscpu's model name), bf16 support, the thread count and whether the machine was busy (the
1-minute load average), since timings on a shared 2-core machine vary with what else runs.
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
from machine import bf16_native, cpu_name  # noqa: E402

import lenscope  # noqa: E402
from lenscope.viz.report import build_report  # noqa: E402

BASE = ("When Mary and John went to the store on a sunny afternoon after school, John gave a bottle of fresh "
        "cold milk and a small cake from the bakery to")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tokens", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    t = time.perf_counter()
    lm = lenscope.load(a.model)
    load_s = time.perf_counter() - t
    ids = lm.tokenizer(BASE, add_special_tokens=False)["input_ids"]
    text = lm.tokenizer.decode(ids[-a.tokens:] if lm.anatomy.causal else ids[: a.tokens - 2])
    runs = []
    for _ in range(a.repeat):
        t = time.perf_counter()
        rep = build_report(lm, text)
        page = rep.html()
        runs.append({"timings": rep.timings, "seconds_with_page": time.perf_counter() - t, "bytes": len(page.encode())})
    best = min(runs, key=lambda r: r["seconds_with_page"])
    res = {"model": a.model, "tokens": len(rep.meta["tokens"]), "text": text, "load_seconds": round(load_s, 2),
           "best": best, "runs": runs, "ok": rep.ok, "cpu": cpu_name(), "bf16_native": bf16_native(),
           "threads": a.threads, "loadavg_1min": os.getloadavg()[0], "torch": torch.__version__}
    print(json.dumps(res, indent=1))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
