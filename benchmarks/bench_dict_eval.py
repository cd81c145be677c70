"""A trained dictionary evaluated on held-out text beside its baseline (``lenscope dict eval``), with the machine
record, for the numbers docs/features.md quotes.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_dict_eval.py --dict DIR \
        --out docs/results/features/eval-smollm2-resid5.json

Writes ``evaluate_dictionaries(...).to_dict()`` (the fields of ``dict eval --json``), the dictionary's training
record (``info``: tokens, seconds) and ``benchmarks/machine.py``'s ``record()`` under ``"machine"``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import record

ROOT = Path(__file__).resolve().parent.parent


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dict", required=True, help="the dictionary folder")
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "corpus"))
    ap.add_argument("--tokens", type=int, default=100_000)
    ap.add_argument("--splice-tokens", type=int, default=None)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    machine = record()

    import lenscope
    from lenscope.features.dictionaries.evaluate import evaluate_dictionaries
    from lenscope.models.dictionaries.dictionary import load_dictionaries

    lm = lenscope.load(args.model)
    dicts = load_dictionaries(args.dict)
    t0 = time.perf_counter()
    ev = evaluate_dictionaries(lm, dicts, args.data, tokens=args.tokens, splice_tokens=args.splice_tokens,
                               progress=True)
    out = {"machine": machine, "model": args.model, "seconds": round(time.perf_counter() - t0, 1),
           "training": [d.info for d in dicts], **ev.to_dict()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1, default=str) + "\n")
    print(json.dumps({k: out[k] for k in ("explained_variance", "l0", "dead_fraction", "loss_recovered", "kl")
                      if k in out}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
