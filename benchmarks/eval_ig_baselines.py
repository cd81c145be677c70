"""Integrated gradients from the zero, pad and mean baselines on the same examples: MRR against the evidence
and the completeness error, one ``eval alignment`` folder per baseline plus one JSON that puts them side by side.

Each baseline runs as ``lenscope eval alignment --methods ig --baseline B --out OUT/B`` would (the same
:func:`lenscope.evaluate.run_alignment` call, so folders that command filled are resumed, not recomputed), and
``OUT/ig-baselines.json`` gets, per baseline and dataset: ``n``, ``mrr``, ``mrr_ci``, ``dot``, ``random_mrr``,
``completeness`` (median and max of the relative and absolute error, see ``docs/evaluation.md``), plus the
baseline's description (the pad token) and the machine record.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/eval_ig_baselines.py --model smollm2 \\
        --dataset blimp:anaphor_gender_agreement --dataset blimp:determiner_noun_agreement_1 --dataset ioi \\
        --limit 20 --out docs/results/evaluation/ig-baselines-smollm2
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import record


def main(argv=None) -> None:
    import lenscope
    from lenscope.attribution.baselines import IG_BASELINES, ig_baseline
    from lenscope.evaluate import run_alignment

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dataset", action="append", required=True)
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--ig-steps", type=int, default=16)
    ap.add_argument("--baselines", default=",".join(IG_BASELINES))
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    out = Path(a.out)
    lm = lenscope.load(a.model)
    res = {"machine": record(), "model": a.model, "specs": a.dataset, "limit": a.limit, "ig_steps": a.ig_steps,
           "completeness_error": "relative: |sum of scores - (f(x) - f(baseline))| / max(|f(x) - f(baseline)|, 1e-6);"
           " abs: the numerator, in logit units", "baselines": {}}
    for b in a.baselines.split(","):
        s = run_alignment(lm, a.dataset, ["ig"], out=out / b, limit=a.limit, ig_steps=a.ig_steps, baseline=b,
                          progress=False)
        info = ig_baseline(lm, b)[1]
        res["baselines"][b] = {"baseline": info, "computed_now": s.info["computed_now"],
                               "versions": s.info["versions"], "datasets": {}}
        for d, ds in s.datasets.items():
            e = ds["methods"]["ig"]
            res["baselines"][b]["datasets"][d] = {"n": e["n"], "mrr": e["mrr"], "mrr_ci": e["mrr_ci"], "dot": e["dot"],
                                                  "random_mrr": ds["random_mrr"],
                                                  "completeness": ds["ig_completeness"]}
            c = ds["ig_completeness"]
            print(f"{b:5s} {d:40s} n {e['n']:3d}  MRR {e['mrr']:.3f}  completeness rel median {c['median']:.2g} "
                  f"max {c['max']:.2g}  abs median {c['median_abs']:.2g} max {c['max_abs']:.2g}")
    (out / "ig-baselines.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
