"""``lenscope graph`` on SmolLM2 with a transcoder on every block and no practical node limit, as a user runs it:
does it finish within the memory budget, or refuse in one line, rather than grow past the machine? The command runs
in a child process; its peak resident memory (``ru_maxrss`` of the children), its exit status, its estimate and
budget (the lines it logs) and, when it refuses, its one-line message are recorded.

    .venv/bin/python benchmarks/graph_memory_smollm2.py --dict DIR --out docs/results/features/graph-memory-smollm2.json

``DIR``: transcoders for every block (``lenscope dict train --model smollm2 --site 'mlp_out.*' --transcoder --kind
jumprelu --width 1024 --k 64 --data ../shared/data/corpus --max-minutes 8 --out DIR``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

PROMPT = "Fact: the capital of the state containing Dallas is"


def main() -> None:
    from machine import record

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dict", required=True)
    ap.add_argument("--max-feature-nodes", type=int, default=100000)
    ap.add_argument("--max-memory", default=None, help="passed on (default: the command's own default budget)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    exe = str(Path(sys.executable).with_name("lenscope"))
    cmd = [exe, "graph", PROMPT, "--model", "smollm2", "--dict", a.dict, "--max-feature-nodes",
           str(a.max_feature_nodes)]
    if a.max_memory:
        cmd += ["--max-memory", a.max_memory]
    mem_available = next(int(x.split()[1]) * 1024 for x in Path("/proc/meminfo").read_text().splitlines()
                         if x.startswith("MemAvailable:"))
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=dict(os.environ))
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    err = p.stderr.strip().splitlines()
    est = [line for line in err if "memory budget" in line]
    res = {"machine": record(), "command": " ".join(cmd[1:]), "returncode": p.returncode, "seconds": round(seconds, 1),
           "mem_available_gb_at_start": round(mem_available / 1e9, 2), "peak_rss_gb": round(peak / 1e9, 2),
           "memory_lines": est, "last_lines": err[-6:] + p.stdout.strip().splitlines()[:3]}
    m = re.search(r"(\d+) of (\d+) active features", p.stdout)
    if m:
        res["feature_nodes"], res["active_features"] = int(m.group(1)), int(m.group(2))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
