"""Time ``lenscope serve`` through its HTTP API: start-up, and with the model resident the time to the first views.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_serve.py --model smollm2 --out docs/results/serve-speed.json
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_serve.py --model tiny:llama --out /tmp/serve-tiny.json
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_serve.py --case supersede --model smollm2 \
        --out docs/results/serve-supersede.json

Starts ``lenscope serve --model M`` as a child process (``python -m lenscope``, a free 127.0.0.1 port) and measures,
in the default case (``--case speed``),

- ``startup.models_s``: process start to ``GET /api/models`` answering (the app up, no model loaded yet);
- ``startup.first_analyze_s``: process start to the first ``POST /api/analyze`` answered (``prediction`` of a short
  prompt), which includes loading the model (lazily, on first use);
- per prompt (20 tokens on smollm2; each prompt new to the server, so nothing is cached), as the page asks:
  ``first_views_s``, POST to the answer with ``prediction, trajectory, components`` (the one trace they share
  included; the target of issue 20: at most 1 s), then ``attribution``, ``mixing``, ``flow`` one request each, in
  that order, each timed from its own POST; the server's own seconds per view are kept beside them.

The medians over the prompts are under ``median``.

``--case supersede``: the first views of a new prompt while the previous prompt's attribution is running (each
prompt new to the server). First, with nothing else running, one prompt's first views (``idle.first_views_s``) and
its attribution (``idle.attribution_s``, the length of the job the other runs interrupt). Then, for each fraction f
of ``--fractions``: the attribution of an old prompt is posted, and f x ``idle.attribution_s`` later

- ``aborted``: the old request's connection is closed, as the page does to the requests of the input it leaves
  (its job stops at its next chunk), and the new prompt's first views are posted: ``first_views_s`` from that POST;
- ``kept_running``: (``--kept-running`` fractions) the old request stays open, as another client's would, and the
  new prompt's first views wait behind its whole job: ``first_views_s`` from the POST, and ``old_attribution_s``.

Medians are under ``median``, the largest aborted one under ``max``. Records ``benchmarks/machine.py``'s ``record()``
under ``"machine"`` (with the 1-minute load average at the end under ``load_1min_after``): timings on a shared
machine vary with what else runs.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
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
NEW = [  # 20 tokens each, for --case supersede: every case needs prompts new to the server
    "The young baker woke up early every single morning, and when the bread was finally ready she opened the",
    "During the long cold winter in the high mountains, the hungry villagers gathered around the fire and told old",
    "After the final exam at the university, the exhausted students went to the park and played a game of",
    "When the little boy lost his red balloon at the crowded fair, his older sister bought him a new",
    "The old captain looked at the dark clouds over the sea and quickly ordered the sailors to lower the heavy",
    "On a quiet Sunday afternoon, my old grandmother sat by the window and slowly knitted a warm wool",
    "The famous scientist spent twenty years studying the stars, and at the end of her career she wrote a",
    "Every summer the whole family drove to the lake, where the children swam all day long and caught small",
    "When Anna and Peter arrived at the station very late at night, Peter handed the heavy suitcase to",
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


class Pending:
    """A ``POST /api/analyze`` answered in a thread, which :meth:`abort` cancels by closing its connection (what the
    page's ``AbortController`` does)."""

    def __init__(self, port: int, body: dict):
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
        self.t0 = time.perf_counter()
        self.conn.request("POST", "/api/analyze", json.dumps(body), {"Content-Type": "application/json"})
        self.status: int | str | None = None
        self.seconds: float | None = None
        self.thread = threading.Thread(target=self._wait, daemon=True)
        self.thread.start()

    def _wait(self) -> None:
        try:
            r = self.conn.getresponse()
            r.read()
            self.status, self.seconds = r.status, time.perf_counter() - self.t0
        except (OSError, http.client.HTTPException):
            self.status = "aborted"

    def abort(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.sock.shutdown(socket.SHUT_RDWR)
        self.conn.close()
        self.thread.join(60)

    def join(self) -> None:
        self.thread.join()
        self.conn.close()


@contextlib.contextmanager
def server(model: str):
    """``lenscope serve --model MODEL`` on a free port until the block ends: ``(base, port, t0, t_models,
    command)``, t0 the process start and t_models when ``/api/models`` first answered."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "lenscope", "serve", "--model", model, "--port", str(port)]
    log = tempfile.TemporaryFile()  # the server's log (a pipe nobody reads would fill up and block it)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, env=dict(os.environ))
    try:
        while True:
            try:
                models = call(base, "/api/models", timeout=5)
                break
            except (urllib.error.URLError, ConnectionError, OSError):
                if proc.poll() is not None:
                    log.seek(0)
                    raise SystemExit("lenscope serve exited: " + log.read().decode()[-2000:]) from None
                if time.perf_counter() - t0 > 300:
                    raise SystemExit("lenscope serve did not answer within 300 s") from None
                time.sleep(0.02)
        t_models = time.perf_counter() - t0
        assert models["models"][0] == {"name": model, "loaded": False}, models
        yield base, port, t0, t_models, " ".join(cmd[1:])
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def speed(args) -> dict:
    with server(args.model) as (base, _, t0, t_models, command):
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

    med = {"first_views_s": round(statistics.median(r["first_views_s"] for r in runs), 4),
           "cached_all_s": round(statistics.median(r["cached_all_s"] for r in runs), 4)}
    med.update({f"{k}_s": round(statistics.median(r["views_s"][k] for r in runs), 4) for k in SLOWER})
    print(f"median first views {med['first_views_s']:.3f} s (target 1 s)")
    return {"model": args.model, "command": command,
            "startup": {"models_s": round(t_models, 3), "first_analyze_s": round(t_first, 3)},
            "target_first_views_s": 1.0, "meets_target": med["first_views_s"] <= 1.0, "median": med, "runs": runs}


def supersede(args) -> dict:
    texts = iter(NEW)
    with server(args.model) as (base, port, _, _, command):
        call(base, "/api/analyze", {"model": args.model, "text": WARM, "sections": ["prediction"]})  # load it
        text = next(texts)
        s, d = timed(base, {"model": args.model, "text": text, "sections": FIRST})
        s2, _ = timed(base, {"model": args.model, "text": text, "sections": ["attribution"]})
        idle = {"text": text, "tokens": len(d["tokens"]), "first_views_s": round(s, 4), "attribution_s": round(s2, 4)}
        print(f"nothing else running: first views {s:.3f} s, attribution {s2:.3f} s", flush=True)

        def case(fraction: float, abort: bool) -> dict:
            old, new = next(texts), next(texts)
            job = Pending(port, {"model": args.model, "text": old, "sections": ["attribution"]})
            time.sleep(fraction * idle["attribution_s"])
            if abort:
                job.abort()
            after = time.perf_counter() - job.t0
            s, d = timed(base, {"model": args.model, "text": new, "sections": FIRST})
            if not abort:
                job.join()
            out = {"fraction": fraction, "old": old, "new": new, "after_s": round(after, 4),
                   "first_views_s": round(s, 4), "server_s": {k: d["timings"][k] for k in ["trace", *FIRST]},
                   "old_status": job.status}
            if not abort:
                out["old_attribution_s"] = round(job.seconds, 4)
            print(f"{'aborted' if abort else 'kept running'} at {fraction:.2f} of the attribution ({after:.2f} s): "
                  f"the new prompt's first views {s:.3f} s", flush=True)
            return out

        aborted = [case(f, True) for f in args.fractions]
        kept = [case(f, False) for f in args.kept_running]
    med = {"first_views_aborted_s": round(statistics.median(c["first_views_s"] for c in aborted), 4)}
    if kept:
        med["first_views_kept_running_s"] = round(statistics.median(c["first_views_s"] for c in kept), 4)
    return {"model": args.model, "command": command, "idle": idle, "aborted": aborted, "kept_running": kept,
            "median": med, "max": {"first_views_aborted_s": max(c["first_views_s"] for c in aborted)}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", choices=["speed", "supersede"], default="speed")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--out", default=None, help="default docs/results/serve-speed.json (serve-supersede.json)")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help="how many of the 20-token prompts to time")
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.2, 0.5, 0.8],
                    help="supersede: when the old attribution is aborted, as a fraction of its idle length")
    ap.add_argument("--kept-running", type=float, nargs="*", default=[0.5],
                    help="supersede: the same with the old request kept open (another client's job)")
    args = ap.parse_args()
    if args.case == "supersede" and len(args.fractions) + len(args.kept_running) > (len(NEW) - 1) // 2:
        raise SystemExit(f"at most {(len(NEW) - 1) // 2} cases in all (two new prompts each)")
    machine = record()
    out = speed(args) if args.case == "speed" else supersede(args)
    out["machine"] = machine
    try:
        out["load_1min_after"] = round(os.getloadavg()[0], 2)
    except OSError:
        pass
    path = Path(args.out or f"docs/results/serve-{'speed' if args.case == 'speed' else 'supersede'}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
