"""Feature labels and model-written explanations of a trained dictionary, shown so that a reader can judge them.

Ten live features of the dictionary (drawn with ``--seed``), each with its deterministic label
(``lenscope dict label``), its density, its three largest held-out contexts (the token at the maximum between
``<<`` and ``>>``), and for each ``--explainers`` model its one-line explanation and detection score
(:mod:`lenscope.evaluate.explanations`: AUROC of the model's Yes/No answers on the feature's active contexts,
not shown to the explainer, against contexts of the other drawn features on which it is silent).

    python benchmarks/feature_labels_study.py --dict /work/runs/sae6 --explainers smollm2,gemma3-270m \\
        --out docs/results/features/labels-smollm2.json

Writes the results file (with ``benchmarks/machine.py``'s record) and prints the markdown table docs/features.md
shows.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import record  # noqa: E402


def _cell(e: dict) -> str:
    score = "n/a" if e["detection"] is None else f"{e['detection']:.2f}"
    return f"{e['text'].replace('|', '/')} ({score})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dict", required=True, help="a dictionary folder (one dictionary)")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--data", default="../shared/data/corpus")
    ap.add_argument("--explainers", default="smollm2", help="comma-separated models that write and judge")
    ap.add_argument("--n", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--out", default="docs/results/features/labels-smollm2.json")
    args = ap.parse_args()
    machine = record()
    t0 = time.perf_counter()

    from lenscope.evaluate.explanations import context_text, explain_features, pick_features
    from lenscope.features.dictionaries.cards import feature_cards
    from lenscope.features.dictionaries.labels import cached_labels
    from lenscope.models.dictionaries.dictionary import load_dictionaries
    from lenscope.models.loading.load import load

    lm = load(args.model)
    (d,) = load_dictionaries(args.dict)
    doc, _ = cached_labels(lm, [d], args.dict, args.data, tokens=args.tokens, top=20)
    rec = doc["dictionaries"][d.site]
    feats = pick_features(d.width, args.n, args.seed, [lab != "dead" for lab in rec["label"]])
    cards = feature_cards(lm, d, feats, args.data, tokens=args.tokens, top=3, context=(10, 2))
    rows = [{"feature": f, "label": rec["label"][f], "density": rec["density"][f],
             "contexts": [context_text(t, c.center) for t in c.context_tokens], "explanations": {}}
            for f, c in zip(feats, cards)]
    summary = {}
    for name in args.explainers.split(","):
        ex = lm if name == args.model else load(name)
        r = explain_features(lm, d, feats, args.data, ex, tokens=args.tokens, seed=args.seed,
                             labels=[rec["label"][f] for f in feats])
        for row, t, s, a in zip(rows, r.explanations, r.detection, r.accuracy):
            row["explanations"][name] = {"text": t, "detection": s, "accuracy": a}
        summary[name] = {"mean_detection": r.mean_detection(),
                         "scored": sum(s is not None for s in r.detection), "shown": r.shown}
    info = d.info.get("training", {}) if isinstance(getattr(d, "info", None), dict) else {}
    out = {"machine": machine, "model": args.model, "dictionary": args.dict, "site": d.site, "kind": d.kind,
           "width": d.width, "training": {k: info.get(k) for k in ("tokens", "steps", "seconds", "final")},
           "data": args.data, "tokens": doc["tokens"], "seed": args.seed, "features": rows, "explainers": summary,
           "seconds": round(time.perf_counter() - t0, 1)}
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
    names = args.explainers.split(",")
    print("| feature | label | density | top contexts | " + " | ".join(f"{n}: explanation (detection)" for n in names)
          + " |")
    print("|" + " --- |" * (4 + len(names)))
    for r in rows:
        ctx = "<br>".join("`" + c.replace("`", "'").replace("\n", "⏎").replace("|", "\\|") + "`"
                          for c in r["contexts"])
        ex = " | ".join(_cell(r["explanations"][n]) for n in names)
        print(f"| {r['feature']} | `{r['label']}` | {r['density']:.4f} | {ctx} | {ex} |")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
