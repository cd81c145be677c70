"""Time ``lenscope serve`` through its HTTP API: start-up, and with the model resident the time to the first views.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_serve.py --model smollm2 --out docs/results/serve-speed.json
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_serve.py --model tiny:llama --out /tmp/serve-tiny.json

Starts ``lenscope serve --model M`` as a child process (``python -m lenscope``, a free 127.0.0.1 port) and measures

- ``startup.models_s``: process start to ``GET /api/models`` answering (the app up, no model loaded yet);
- ``startup.first_analyze_s``: process start to the first ``POST /api/analyze`` answered (``prediction`` of a short
  prompt), which includes loading the model (lazily, on first use);
- per prompt (20 tokens on smollm2; each prompt new to the server, so nothing is cached), as the page asks:
  ``first_views_s``, POST to the answer with ``prediction, trajectory, components`` (the one trace they share
  included; the target of issue 20: at most 1 s), then ``attribution``, ``mixing``, ``flow`` one request each, in
  that order, each timed from its own POST; the server's own seconds per view are kept beside them.

The medians over the prompts are under ``median``. Records ``benchmarks/machine.py``'s ``record()`` under
``"machine"``: timings on a shared machine vary with what else runs.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import record  # noqa: E402

WARM = "The capital of France is"
PROMPTS = [  # 20 tokens each with smollm2's tokenizer
    "The old lighthouse keeper slowly climbed the stairs every night, and when the storm finally came he lit the",
    "After the long meeting in Paris, the tired foreign ministers signed the treaty and then flew home to their",
    "When Mary and John went to the store on a sunny Saturday morning, John gave a cold drink to",
]
FIRST = ["prediction", "trajectory", "components"]
SLOWER = ["attribution", "mixing", "flow"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def call(base: str, path: str, body: dict | None = None, timeout: float = 600) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, method="GET" if body is None else "POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def timed(base: str, body: dict) -> tuple[float, dict]:
    t = time.perf_counter()
    d = call(base, "/api/analyze", body)
    return time.perf_counter() - t, d


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--out", default="docs/results/serve-speed.json")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help="how many of the 20-token prompts to time")
    args = ap.parse_args()

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "lenscope", "serve", "--model", args.model, "--port", str(port)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=dict(os.environ))
    try:
        while True:
            try:
                models = call(base, "/api/models", timeout=5)
                break
            except (urllib.error.URLError, ConnectionError, OSError):
                if proc.poll() is not None:
                    raise SystemExit("lenscope serve exited: " + proc.stderr.read().decode()[-2000:]) from None
                if time.perf_counter() - t0 > 300:
                    raise SystemExit("lenscope serve did not answer within 300 s") from None
                time.sleep(0.02)
        t_models = time.perf_counter() - t0
        assert models["models"][0] == {"name": args.model, "loaded": False}, models
        call(base, "/api/analyze", {"model": args.model, "text": WARM, "sections": ["prediction"]})
        t_first = time.perf_counter() - t0
        print(f"start-up: /api/models after {t_models:.2f} s, first analyze (loading {args.model}) after "
              f"{t_first:.2f} s", flush=True)

        runs = []
        for text in PROMPTS[:args.prompts]:
            body = {"model": args.model, "text": text}
            s, d = timed(base, dict(body, sections=FIRST))
            run = {"text": text, "tokens": len(d["tokens"]), "first_views_s": round(s, 4),
                   "server_s": {k: d["timings"][k] for k in ["trace", *FIRST]}, "views_s": {}}
            for key in SLOWER:
                s2, d2 = timed(base, dict(body, sections=[key]))
                run["views_s"][key] = round(s2, 4)
                run["server_s"][key] = d2["timings"][key]
            s3, _ = timed(base, dict(body, sections=FIRST + SLOWER))
            run["cached_all_s"] = round(s3, 4)  # every view again: answered from the cache
            runs.append(run)
            print(f"{run['tokens']} tokens: first views {run['first_views_s']:.3f} s; "
                  + ", ".join(f"{k} {v:.3f} s" for k, v in run["views_s"].items())
                  + f"; all again (cached) {run['cached_all_s']:.3f} s", flush=True)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()

    med = {"first_views_s": round(statistics.median(r["first_views_s"] for r in runs), 4),
           "cached_all_s": round(statistics.median(r["cached_all_s"] for r in runs), 4)}
    med.update({f"{k}_s": round(statistics.median(r["views_s"][k] for r in runs), 4) for k in SLOWER})
    out = {"model": args.model, "command": " ".join(cmd[1:]),
           "startup": {"models_s": round(t_models, 3), "first_analyze_s": round(t_first, 3)},
           "target_first_views_s": 1.0, "meets_target": med["first_views_s"] <= 1.0, "median": med, "runs": runs,
           "machine": record()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"median first views {med['first_views_s']:.3f} s (target 1 s); wrote {args.out}")


if __name__ == "__main__":
    main()
