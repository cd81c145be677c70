"""How long ``lenscope eval alignment --gold`` takes on 200 sentence pairs of a tiny translation model (issue 47:
under a minute), and what batching the pairs changes.

The pairs are made here (seeded): sources of 3 to 12 words from a small German vocabulary, targets their
word-by-word English, the diagonal as sure links. For each model: the command as a user runs it (a child process,
``--json``: the wall time includes Python's start and the model's load), and in this process the library call
(:func:`lenscope.evaluate.aer.model_alignments`, the command's default methods) with the pairs in
batches of 16 (one padded pass each) and one at a time, whose alignments must be the same. Run::

    .venv/bin/python benchmarks/bench_aer_gold.py --out docs/results/encoder-decoder/aer-gold-batched.json
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

SOURCE = "das Haus ist klein ich bin hier der Hund und die Katze schlafen im Garten heute".split()
TARGET = "the house is small I am here the dog and the cat sleep in garden today".split()


def gold_rows(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        idx = [rng.randrange(len(SOURCE)) for _ in range(rng.randint(3, 12))]
        rows.append({"source": " ".join(SOURCE[k] for k in idx), "target": " ".join(TARGET[k] for k in idx),
                     "sure": [[j, j] for j in range(len(idx))]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=200)
    ap.add_argument("--models", default="tiny:marian,tiny:t5,tiny:m2m100")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    from machine import record

    import lenscope
    from lenscope.data.alignments import read_gold_alignments
    from lenscope.evaluate.aer import model_alignments

    gold_path = Path(tempfile.mkdtemp()) / "gold.jsonl"
    gold_path.write_text("".join(json.dumps(r) + "\n" for r in gold_rows(a.pairs)))
    gold = read_gold_alignments(gold_path)
    res = {"machine": record(), "pairs": a.pairs, "models": {}}
    for name in a.models.split(","):
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, "-m", "lenscope", "eval", "alignment", "--gold", str(gold_path),
                            "--model", name, "--json", "--no-progress"],  # its default methods
                           capture_output=True, text=True, check=False)
        cli = time.perf_counter() - t0
        if p.returncode != 0:
            raise SystemExit(f"{name}: {p.stderr.strip()}")
        aer = {m: v["aer"] for m, v in json.loads(p.stdout)["methods"].items()}
        methods = list(aer)
        res["methods"] = methods
        lm = lenscope.load(name)
        model_alignments(lm, gold[:4], methods)  # warm
        times, links = {}, {}
        for bs in (16, 1):
            t0 = time.perf_counter()
            links[bs] = model_alignments(lm, gold, methods, batch_size=bs)
            times[bs] = time.perf_counter() - t0
        res["models"][name] = {"cli_wall_s": round(cli, 2), "library_batched_s": round(times[16], 2),
                               "library_one_at_a_time_s": round(times[1], 2), "batch_size": 16, "aer": aer,
                               "same_alignments": links[16] == links[1]}
        print(name, res["models"][name], flush=True)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
