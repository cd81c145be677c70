"""Tuned-lens training throughput with 1 and with N torchrun processes (data-parallel, gloo on CPU).

    .venv/bin/python benchmarks/bench_ddp.py --model smollm2 --tokens 4096 --ranks 2 --out docs/results/bench-ddp-smollm2.json

Each configuration trains the same global batch (4 sequences of 256 tokens) for ``--tokens`` tokens, one torch
thread per process, float32 unembedding matmuls (the same precision everywhere); tokens/s is the lens's own
training record (model loading excluded).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import bf16_native, cpu_name  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def train(ranks: int, out: Path, a) -> dict:
    args = ["lens", "train", "--model", a.model, "--data", a.data, "--tokens", str(a.tokens), "--seq-len", "256",
            "--batch-size", "4", "--precision", "fp32", "--checkpoint-every", "0", "--out", str(out), "--json"]
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads)}
    if ranks == 1:
        cmd = [sys.executable, "-m", "lenscope", *args]
    else:
        cmd = [str(Path(sys.executable).with_name("torchrun")), "--standalone", f"--nproc-per-node={ranks}",
               "-m", "lenscope", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if r.returncode != 0:
        raise SystemExit(r.stderr[-3000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "wikitext2" / "wiki.test.raw"))
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    res = {"model": a.model, "tokens": a.tokens, "cpu": cpu_name(), "cores": os.cpu_count(),
           "bf16_native": bf16_native(), "threads_per_process": a.threads, "loadavg_before": os.getloadavg()[0]}
    for ranks in (1, a.ranks):
        s = train(ranks, tmp / f"r{ranks}", a)
        res[f"ranks_{ranks}"] = {"tokens_per_s": s["tokens_per_s"], "seconds": s["seconds"], "steps": s["steps"],
                                 "final_train_kl": s["final_train_kl"]}
    res["speedup"] = round(res[f"ranks_{a.ranks}"]["tokens_per_s"] / res["ranks_1"]["tokens_per_s"], 2)
    res["loadavg_after"] = os.getloadavg()[0]
    print(json.dumps(res, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
