"""A cross-layer transcoder against per-layer transcoders at the same training time (issue 44's check): both trained
side by side from the corpus on SmolLM2 for ``--minutes`` each, then evaluated on the same held-out text.

    .venv/bin/python benchmarks/clt_vs_transcoders.py --minutes 20 \
        --out docs/results/features/clt-vs-transcoders-20min.json

The two trainings run at once, one thread each (``OMP_NUM_THREADS=1``), so they share the machine alike: each is
``lenscope dict train --max-minutes M`` with the same kind, width per block, k, batch and seed, one with
``--transcoder --site 'mlp_out.*'`` and one with ``--clt``. Then each is evaluated with ``lenscope dict eval
--no-splice-each`` (per block: explained variance of ``mlp_out.l``, L0, dead fraction; the whole replacement model
spliced into every MLP at once: top-1 agreement with the real model, delta loss, KL), again side by side. The
results file holds both commands' JSON, the machine record at the start and at the end, and
``clt_top1_above``: whether the CLT's replacement agrees with the model's top-1 more often.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import record

ROOT = Path(__file__).resolve().parent.parent


def _lenscope(args: list[str], log: Path) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "lenscope", *args], stdout=subprocess.PIPE,
                            stderr=log.open("w"), env=env, text=True)


def _both(jobs: dict[str, tuple[list[str], Path]]) -> dict:
    """Run the commands at once; their JSON outputs by name (a failure: its log's tail, and exit)."""
    procs = {name: _lenscope(args, log) for name, (args, log) in jobs.items()}
    out = {}
    for name, p in procs.items():
        stdout, _ = p.communicate()
        if p.returncode != 0:
            log = jobs[name][1]
            sys.exit(f"{name} failed ({p.returncode}): {log.read_text()[-2000:]}")
        out[name] = json.loads(stdout)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "corpus"))
    ap.add_argument("--minutes", type=float, default=20.0)
    ap.add_argument("--kind", default="topk")
    ap.add_argument("--width", type=int, default=1024, help="latents per block, both")
    ap.add_argument("--k", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=4096)
    ap.add_argument("--eval-tokens", type=int, default=32_768)
    ap.add_argument("--splice-tokens", type=int, default=8192)
    ap.add_argument("--work", default="/tmp/clt-vs-transcoders", help="where the dictionaries and logs go")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    machine = record()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    common = ["dict", "train", "--model", args.model, "--data", args.data, "--kind", args.kind, "--width",
              str(args.width), "--k", str(args.k), "--batch-size", str(args.batch_size), "--max-minutes",
              str(args.minutes), "--json"]
    t0 = time.time()
    train = _both({
        "transcoders": ([*common, "--out", str(work / "tc"), "--transcoder", "--site", "mlp_out.*"],
                        work / "train-tc.log"),
        "clt": ([*common, "--out", str(work / "clt"), "--clt"], work / "train-clt.log")})
    train_s = time.time() - t0
    ev_args = ["dict", "eval", "--model", args.model, "--data", args.data, "--tokens", str(args.eval_tokens),
               "--splice-tokens", str(args.splice_tokens), "--no-splice-each", "--no-baselines", "--json"]
    evals = _both({"transcoders": ([*ev_args, "--dict", str(work / "tc")], work / "eval-tc.log"),
                   "clt": ([*ev_args, "--dict", str(work / "clt")], work / "eval-clt.log")})

    def summary(ev: dict) -> dict:
        evs = [d["explained_variance"] for d in ev["dictionaries"]]
        return {"mean_explained_variance": sum(evs) / len(evs), "min_explained_variance": min(evs),
                "blocks_ev_at_least_0.7": sum(e >= 0.7 for e in evs),
                "mean_l0": sum(d["l0"] for d in ev["dictionaries"]) / len(evs),
                **{k: ev["replacement"][k] for k in ("top1_agreement", "delta_loss", "kl", "splice_tokens")}}

    result = {
        "machine": machine, "machine_end": record(),
        "settings": {k: v for k, v in vars(args).items() if k not in ("out",)},
        "train_wall_s": round(train_s, 1),
        "training": {name: {k: v for k, v in r.items() if k != "dictionaries"} for name, r in train.items()},
        "summary": {name: summary(ev) for name, ev in evals.items()},
        "evaluation": evals,
    }
    result["clt_top1_above"] = bool(result["summary"]["clt"]["top1_agreement"]
                                    > result["summary"]["transcoders"]["top1_agreement"])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["summary"], indent=1))
    print(f"clt_top1_above: {result['clt_top1_above']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
