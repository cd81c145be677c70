"""The least-squares start of tuned-lens training alone (no KL step): how good a lens it is, on how much text, at
what cost, against the logit lens on the held-out text `lens eval` reads.

    .venv/bin/python benchmarks/lens_start.py --model smollm2 --tokens 8192,32768 --eval-tokens 8192 \
        --out docs/results/smollm2-lens-start.json

For each training-token count: `lenscope.lenses.training.warmstart.regression_start` on the first 80% of wiki.test.raw
(whole 256-token sequences, the training run's own choice of sequences and its default ridge), timed; then one
`evaluate_lenses` over the eval part (its last 20%) for the logit lens and every start: exact full-vocabulary KL
and precision@1 per layer. Writes everything with the machine record.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import record

import lenscope
from lenscope.lenses import LogitLens, TrainSettings, TunedLens, evaluate_lenses, read_text, split_text, token_sequences
from lenscope.lenses.training.selection import split_validation
from lenscope.lenses.training.warmstart import regression_start

DEFAULT_TEXT = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "wikitext2" / "wiki.test.raw"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--data", type=Path, default=DEFAULT_TEXT)
    ap.add_argument("--tokens", default="8192,32768", help="training tokens of each start, comma-separated")
    ap.add_argument("--eval-tokens", type=int, default=8192)
    ap.add_argument("--out", type=Path, default=Path("docs/results/smollm2-lens-start.json"))
    args = ap.parse_args()
    machine = record()
    s = TrainSettings()
    lm = lenscope.load(args.model)
    text = read_text(args.data)
    train, _ = split_validation(token_sequences(lm, split_text(text, "train"), s.seq_len), s.validation_tokens)
    evals = token_sequences(lm, split_text(text, "eval"), s.seq_len, max_tokens=args.eval_tokens)
    lenses, starts = {"logit": LogitLens(lm.anatomy, model_name=lm.name)}, {}
    for n in (int(x) for x in args.tokens.split(",")):
        lens = TunedLens(lm.anatomy, model_name=lm.name)
        t0 = time.perf_counter()
        rec = regression_start(lm, lens, train, tokens=n, ridge=s.init_ridge, batch_size=s.batch_size, seed=s.seed)
        rec["wall_s"] = round(time.perf_counter() - t0, 2)
        starts[str(n)] = rec
        lenses[f"start-{n}"] = lens
        print(f"start on {rec['tokens']} tokens: {rec['wall_s']} s", file=sys.stderr, flush=True)
    ev = evaluate_lenses(lm, lenses, evals, progress=False)
    logit = ev["logit"].mean_kl
    L = lm.anatomy.n_layers
    res = {"machine": machine, "ridge": s.init_ridge, "eval_tokens": ev["logit"].n_tokens, "starts": starts,
           "summary": {}, "layers": {}}
    for name, e in ev.items():
        rows = e.layers()[:L]  # the output state is exact for every lens
        res["layers"][name] = {"kl": [r["kl"] for r in rows], "precision_at_1": [r["precision_at_1"] for r in rows]}
        res["summary"][name] = {"mean_kl": e.mean_kl, "ratio": e.mean_kl / logit,
                                "mean_precision_at_1": sum(r["precision_at_1"] for r in rows) / L}
        print(f"{name}: mean KL {e.mean_kl:.3f}, ratio {e.mean_kl / logit:.3f}", file=sys.stderr)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
