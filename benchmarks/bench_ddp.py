"""Tuned-lens training throughput: N torchrun processes (data-parallel, gloo on CPU) against one process with one
thread and against one process with N threads (the fair baseline: the same cores, torch's own threading).

    .venv/bin/python benchmarks/bench_ddp.py --model smollm2 --tokens 2048 --ranks 2 \
        --out docs/results/bench-ddp-smollm2.json

Each configuration trains the same global batch (4 sequences of 256 tokens) for ``--tokens`` tokens, float32
unembedding matmuls (the same precision everywhere); tokens/s is the lens's own training record (model loading
excluded). The three runs go one after the other in this one invocation: 1 process x 1 thread, 1 process x N
threads, N processes x 1 thread. Records ``benchmarks/machine.py``'s ``record()`` under ``"machine"``.
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
from machine import record

ROOT = Path(__file__).resolve().parent.parent


def train(ranks: int, threads: int, out: Path, a) -> dict:
    args = ["lens", "train", "--model", a.model, "--data", a.data, "--tokens", str(a.tokens), "--seq-len", "256",
            "--batch-size", "4", "--precision", "fp32", "--checkpoint-every", "0", "--out", str(out), "--json"]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    if ranks == 1:
        cmd = [sys.executable, "-m", "lenscope", *args]
    else:
        cmd = [str(Path(sys.executable).with_name("torchrun")), "--standalone", f"--nproc-per-node={ranks}",
               "-m", "lenscope", *args]
    r = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, cwd=ROOT)
    if r.returncode != 0:
        raise SystemExit(r.stderr[-3000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "wikitext2" / "wiki.test.raw"))
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    res = {"machine": record(), "model": a.model, "tokens": a.tokens, "threads_per_rank": a.threads}
    n = a.ranks
    runs = {"ranks_1": (1, a.threads), f"ranks_1_threads_{n * a.threads}": (1, n * a.threads),
            f"ranks_{n}": (n, a.threads)}
    for key, (ranks, threads) in runs.items():
        s = train(ranks, threads, tmp / key, a)
        res[key] = {"processes": ranks, "threads_per_process": threads, "tokens_per_s": s["tokens_per_s"],
                    "seconds": s["seconds"], "steps": s["steps"], "final_train_kl": s["final_train_kl"],
                    "load_1min_after": round(os.getloadavg()[0], 2)}
        print(key, json.dumps(res[key]), flush=True)
    ddp = res[f"ranks_{n}"]["tokens_per_s"]
    res["speedup"] = round(ddp / res["ranks_1"]["tokens_per_s"], 2)  # vs 1 process x 1 thread (the old comparison)
    res["speedup_vs_threads"] = round(ddp / res[f"ranks_1_threads_{n * a.threads}"]["tokens_per_s"], 2)
    res["threads_speedup"] = round(res[f"ranks_1_threads_{n * a.threads}"]["tokens_per_s"]
                                   / res["ranks_1"]["tokens_per_s"], 2)
    print(json.dumps(res, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
