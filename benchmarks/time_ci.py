"""Time CI as it runs: ``CI=true bash .ci/run`` (that is ``./dev test``) on a fresh clone of this repository's
committed HEAD, with a ``shared/`` beside it as CI has (a link to this checkout's ``../shared``). The numbers of
docs/setup.md ("How long CI takes").

    .venv/bin/python benchmarks/time_ci.py --out docs/results/time-ci.json

Records the whole run's seconds and return code, each stage's seconds as ``./dev test`` prints them ("dev: ... took
N s": the set-up, the suite, the numerical suites at another thread count and on another kernel level), pytest's
closing lines, and ``benchmarks/machine.py``'s ``record()`` (command, CPU, threads, load, date) under ``"machine"``
with the load average at the end. The log of the run is kept beside the results (``--log``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from machine import record  # noqa: E402

STAGE = re.compile(r"^dev: (?:the )?(.+?) took (\d+) s$")
CLOSING = re.compile(r"^=*\s*(\d+ (?:passed|failed).*?)\s*=*$")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--log", default=None, help="where the run's output goes (default: beside --out, .log)")
    a = ap.parse_args()
    res: dict = {"machine": record()}
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
    res["commit"] = head.stdout.strip()
    log = Path(a.log or Path(a.out).with_suffix(".log"))
    with tempfile.TemporaryDirectory() as tmp:
        clone = Path(tmp) / "lenscope"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        shared = ROOT.parent / "shared"
        if shared.is_dir():
            (Path(tmp) / "shared").symlink_to(shared)
        env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
        env["CI"] = "true"
        t = time.perf_counter()
        with open(log, "w") as f:
            p = subprocess.run(["bash", ".ci/run"], cwd=clone, env=env, stdout=f, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL)
        res["seconds"] = round(time.perf_counter() - t, 1)
    res["returncode"] = p.returncode
    lines = log.read_text(errors="replace").splitlines()
    res["stages"] = {m.group(1): int(m.group(2)) for ln in lines if (m := STAGE.match(ln.strip()))}
    res["pytest"] = [m.group(1) for ln in lines if (m := CLOSING.match(ln.strip()))]
    res["load_1min_after"] = round(os.getloadavg()[0], 2)
    Path(a.out).write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))
    sys.exit(p.returncode)


if __name__ == "__main__":
    main()
