"""Held-out evaluation of several tuned lenses next to the logit lens, sharing one forward pass per batch.

    .venv/bin/python benchmarks/lens_compare.py --model smollm2 --tokens 4096 \
        --lens 15min=lenses/smollm2-15min --lens p1=lenses/smollm2 [--mid] [--no-check] --out results.json

Exact full-vocabulary KL(final || lens) in float32 on the last 20% of wiki.test.raw (the part training never
sees). Prints, per lens, the mean KL, the ratio to the logit lens and whether it is below the logit lens at
every layer, then a per-layer markdown table; writes every number to --out. `--no-check` evaluates a lens on
a model it was not trained on (lens transfer).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import lenscope
from lenscope.lenses import LogitLens, TunedLens, evaluate_lenses, read_text, split_text, token_sequences

DEFAULT_TEXT = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "wikitext2" / "wiki.test.raw"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--lens", action="append", default=[], help="name=directory (repeatable)")
    ap.add_argument("--data", type=Path, default=DEFAULT_TEXT)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--mid", action="store_true", help="also the mid-layer (after-attention) states")
    ap.add_argument("--no-check", action="store_true", help="allow lenses trained on another model")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--logit-from", type=Path, help="take the logit lens's numbers from an earlier --out file of the "
                                                    "same model, tokens and data instead of evaluating it again")
    args = ap.parse_args()
    lm = lenscope.load(args.model)
    seqs = token_sequences(lm, split_text(read_text(args.data), "eval"), args.seq_len, max_tokens=args.tokens)
    lenses = {} if args.logit_from else {"logit": LogitLens(lm.anatomy)}
    for spec in args.lens:
        name, _, path = spec.partition("=")
        lenses[name] = TunedLens.load(path, lm, check_model=not args.no_check)
    t0 = time.perf_counter()
    evs = evaluate_lenses(lm, lenses, seqs, batch_size=args.batch_size, mid=args.mid, progress=False)
    secs = time.perf_counter() - t0
    if args.logit_from:
        from lenscope.lenses import LensEvaluation

        prev = json.loads(args.logit_from.read_text())
        d = prev["evaluations"]["logit"]
        any_ev = next(iter(evs.values()))
        if (prev["model"], prev["n_tokens"]) != (lm.name, any_ev.n_tokens):
            raise SystemExit(f"{args.logit_from} is for {prev['model']}, {prev['n_tokens']} tokens")
        col = lambda k: torch.tensor([r[k] for r in d["layers"]])
        evs = {"logit": LensEvaluation(model=lm.name, lens="logit", n_tokens=d["n_tokens"], kl=col("kl"), ce=col("ce"),
                                       entropy=col("entropy"), top1=col("top1_agreement"),
                                       depth_hist=torch.zeros(1)), **evs}
    g = evs["logit"]
    summary = {}
    for name, ev in evs.items():
        if name == "logit":
            continue
        below = [bool(float(a) < float(b)) for a, b in zip(ev.kl[:-1], g.kl[:-1])]
        row = {"mean_kl": ev.mean_kl, "ratio": ev.mean_kl / g.mean_kl, "below_every_layer": all(below),
               "layers_not_below": [i for i, b in enumerate(below) if not b],
               "mean_depth": ev.mean_depth if ev.depth_hist.numel() > 1 else None}
        if args.mid:
            mb = [bool(float(a) < float(b)) for a, b in zip(ev.mid_kl, g.mid_kl)]
            row.update({"mean_mid_kl": ev.mean_mid_kl, "mid_ratio": ev.mean_mid_kl / g.mean_mid_kl,
                        "mid_below_every_layer": all(mb)})
        summary[name] = row
        print(f"{name}: mean KL {ev.mean_kl:.3f}, ratio {row['ratio']:.3f}, below logit at every layer: {all(below)}"
              + (f" (not at {row['layers_not_below']})" if not all(below) else "")
              + (f"; mid states: mean KL {row['mean_mid_kl']:.3f}, ratio {row['mid_ratio']:.3f}" if args.mid else ""))
    names = list(evs)
    print(f"\n{lm.name}: {g.n_tokens} held-out positions, KL(final || lens) in nats, {secs:.0f} s\n")
    print("| layer | " + " | ".join(names) + " |")
    print("| ---: |" + " ---: |" * len(names))
    for i in range(g.kl.shape[0]):
        print(f"| {i} | " + " | ".join(f"{float(evs[n].kl[i]):.3f}" for n in names) + " |")
    if args.mid:
        for i in range(g.mid_kl.shape[0]):
            print(f"| {i}.mid | " + " | ".join(f"{float(evs[n].mid_kl[i]):.3f}" for n in names) + " |")
    print("| mean | " + " | ".join(f"{evs[n].mean_kl:.3f}" for n in names) + " |")
    if args.out:
        training = {n: {k: v for k, v in l.training_info.items() if k != "history"} for n, l in lenses.items()
                    if isinstance(l, TunedLens)}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"model": lm.name, "n_tokens": g.n_tokens, "eval_seconds": round(secs, 1),
                                        "summary": summary, "training": training,
                                        "evaluations": {n: e.to_dict() for n, e in evs.items()}}, indent=1))


if __name__ == "__main__":
    main()
