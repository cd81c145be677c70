"""Per-layer held-out metrics of a trained tuned lens next to the logit lens (the table in docs/lenses.md).

    .venv/bin/python benchmarks/lens_table.py --model smollm2 --lens lenses/smollm2 --tokens 8192

Evaluates on the last 20% of wiki.test.raw (the part `lenscope lens train` never sees), float32.
Prints a markdown table and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import lenscope
from lenscope.lenses import LogitLens, TunedLens, evaluate_lenses, read_text, split_text, token_sequences

DEFAULT_TEXT = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "wikitext2" / "wiki.test.raw"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--lens", required=True)
    ap.add_argument("--data", type=Path, default=DEFAULT_TEXT)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=4)
    args = ap.parse_args()
    lm = lenscope.load(args.model)
    seqs = token_sequences(lm, split_text(read_text(args.data), "eval"), args.seq_len, max_tokens=args.tokens)
    evs = evaluate_lenses(lm, {"tuned": TunedLens.load(args.lens, lm), "logit": LogitLens(lm.anatomy)}, seqs,
                          batch_size=args.batch_size)
    t, g = evs["tuned"], evs["logit"]
    print(f"{lm.name}: {t.n_tokens} held-out tokens, KL(final || lens) in nats\n")
    print("| layer | KL tuned | KL logit | CE tuned | CE logit | top-1 tuned | top-1 logit |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for a, b in zip(t.layers(), g.layers()):
        print(f"| {a['layer']} | {a['kl']:.3f} | {b['kl']:.3f} | {a['ce']:.3f} | {b['ce']:.3f} | "
              f"{a['top1_agreement']:.1%} | {b['top1_agreement']:.1%} |")
    below = all(float(x) < float(y) for x, y in zip(t.kl[:-1], g.kl[:-1]))
    print(f"\nmean KL: tuned {t.mean_kl:.3f}, logit {g.mean_kl:.3f}, ratio {t.mean_kl / g.mean_kl:.3f}; "
          f"tuned below logit at every layer but the output: {below}; "
          f"mean prediction depth tuned {t.mean_depth:.2f}, logit {g.mean_depth:.2f}")
    print(json.dumps({"model": lm.name, "n_tokens": t.n_tokens, "mean_kl_tuned": t.mean_kl, "mean_kl_logit": g.mean_kl,
                      "ratio": t.mean_kl / g.mean_kl, "below_every_layer": below,
                      "training": {k: v for k, v in TunedLens.load(args.lens, lm).training_info.items()
                                   if k != "history"},
                      "tuned": t.to_dict(), "logit": g.to_dict()}))


if __name__ == "__main__":
    main()
