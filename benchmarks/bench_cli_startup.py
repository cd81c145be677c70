"""How fast the CLI answers without doing work: ``lenscope --help``, a group's ``--help`` and a usage error.

Each command runs ``--repeats`` times in a fresh interpreter; the median wall and CPU (user + system of the child)
seconds are kept, with whether torch / transformers were imported (``-X importtime``). Run::

    .venv/bin/python benchmarks/bench_cli_startup.py --out docs/results/bench-cli-startup.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

COMMANDS = {"help": ["--help"], "lens_help": ["lens", "--help"], "usage_error": ["explain"]}


def once(args: list[str]) -> tuple[float, float]:
    t0 = time.perf_counter()
    before = os.times()
    subprocess.run([sys.executable, "-m", "lenscope", *args], capture_output=True, check=False)
    after = os.times()
    wall = time.perf_counter() - t0
    cpu = (after.children_user - before.children_user) + (after.children_system - before.children_system)
    return wall, cpu


def imports(args: list[str]) -> dict:
    err = subprocess.run([sys.executable, "-X", "importtime", "-m", "lenscope", *args], capture_output=True,
                         text=True, check=False).stderr
    names = {ln.split("|")[-1].strip() for ln in err.splitlines() if ln.startswith("import time:")}
    return {"torch": "torch" in names, "transformers": "transformers" in names}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    from machine import record

    res = {"machine": record(), "repeats": a.repeats, "commands": {}}
    for key, args in COMMANDS.items():
        once(args)  # warm the file cache
        runs = [once(args) for _ in range(a.repeats)]
        res["commands"][key] = {"argv": ["lenscope", *args],
                                "wall_s": round(statistics.median(w for w, _ in runs), 3),
                                "cpu_s": round(statistics.median(c for _, c in runs), 3), **imports(args)}
        print(key, res["commands"][key], flush=True)
    if a.out:
        a.out.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
