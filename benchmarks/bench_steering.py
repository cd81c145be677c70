"""Steering, measured (issue 34): the results and pictures of docs/steering.md, and the speed of the batched sweep.

Per behaviour (``--behaviours``: sentiment, tense; the contrast sets of ``benchmarks/data/steering/``, written by
``make_sets.py``), on smollm2, one results file each under ``--out``:

- ``<b>-eval.json``: a ``--method`` (mean-diff) direction built at ``--layer`` from the 48 pairs, measured on the 128
  held-out inputs at the ``--layers`` (5) and ``--multipliers`` (7), with the damage on the start of WikiText-2's
  test split (2,048 tokens): ``lenscope steer eval``'s JSON;
- ``<b>-transfer.json``: the same direction on the transfer phrasings (no damage: it is the held-out run's);
  for sentiment also ``sentiment-sst2.json``: 64 SST-2 validation sentences (read from the shared data at run time,
  not committed: SST-2 has no explicit licence) followed by " Overall, the movie was", answers " good" / " bad";
- ``<b>-methods.json``: actadd, mean-diff, pca and probe at ``--layer``, each measured at its own layer;
- ``<b>-locus.json``: where the vector acts on the first held-out input (logit lens and DLA, steered vs not).

``timing.json`` (``--timing``): the sweep of 5 layers x 7 multipliers over the 128 held-out sentiment inputs by
lenscope (every input with every setting as rows of batches of at most ``max_tokens`` tokens) against one forward
pass per (layer, multiplier) setting (each length group of inputs one batch, the same engine edits and grouping);
the two interleaved (``--repeats``), the 1-minute load average before and after each run recorded (the machine is
shared). The whole ``evaluate_steering`` of ``sentiment-eval.json`` (sweep, bootstrap, damage) is timed there
(``run``). Pictures go to ``--png``.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_steering.py --out docs/results/steering \\
        --png docs/images --timing
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "benchmarks")]

import torch  # noqa: E402
from machine import record  # noqa: E402

DATA = ROOT / "benchmarks" / "data" / "steering"
ALPHA_LOCUS = 8.0


def load1() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def write(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1) + "\n")
    print("wrote", path, flush=True)


def sst2_inputs(n: int = 64):
    """``n`` SST-2 validation sentences (half positive, half negative, file order) + " Overall, the movie was"."""
    from lenscope.data.shared import shared_file
    from lenscope.data.steering import SteeringInput

    path = shared_file("sst2/dev.tsv")
    if path is None:
        return None
    rows = [ln.rsplit("\t", 1) for ln in path.read_text(encoding="utf-8").splitlines()[1:] if "\t" in ln]
    pos = [s.strip() for s, lab in rows if lab.strip() == "1"][: n // 2]
    neg = [s.strip() for s, lab in rows if lab.strip() == "0"][: n // 2]
    return [SteeringInput(f"{s} Overall, the movie was", " good", " bad", row=i + 1)
            for i, s in enumerate(p for pair in zip(pos, neg) for p in pair)]


def per_setting(lm, vector, ids, answers, layers, alphas):
    """The measures by one forward pass per (layer, multiplier) setting: the inputs of one token length as one batch
    (the grouping lenscope's sweep uses; no padding), the vector added by the engine's edits."""
    from lenscope.models.runtime.engine import run
    from lenscope.steering import add_edits
    from lenscope.steering.directions import length_groups

    groups = [(P, torch.tensor(idx)) for P, idx in length_groups(ids).items()]
    xs = {P: torch.stack([ids[i] for i in idx.tolist()]) for P, idx in groups}
    base = torch.empty(len(ids), dtype=torch.float64)
    measure = torch.full((len(layers), len(ids), len(alphas)), float("nan"), dtype=torch.float64)
    with torch.no_grad():
        for k, layer in enumerate(layers):
            for j, a in enumerate([None] + alphas.tolist()):
                if a == 0 or (a is None and k > 0):
                    continue
                for P, idx in groups:
                    n = len(idx)
                    edits = [] if a is None else add_edits(vector, torch.arange(n), torch.full((n,), layer),
                                                           torch.full((n,), float(a)), torch.arange(P))
                    lg = run(lm, xs[P], edits, last_only=True).logits[:, -1].double()
                    m = lg.gather(1, answers[idx, :1])[:, 0] - lg.gather(1, answers[idx, 1:])[:, 0]
                    if a is None:
                        base[idx] = m
                    else:
                        measure[k, idx, j - 1] = m
    return base, measure


def timing(lm, args, out: Path) -> None:
    from lenscope.data.steering import read_steering_inputs, read_steering_pairs
    from lenscope.steering import build_direction
    from lenscope.steering.directions import text_ids
    from lenscope.steering.evaluate import resolve_inputs, sweep_measures

    pairs = read_steering_pairs(DATA / "sentiment_pairs.csv")
    inputs = read_steering_inputs(DATA / "sentiment_heldout.csv")[: args.inputs]
    d = build_direction(lm, pairs, args.method, args.layer)
    items, answers = resolve_inputs(lm, inputs)
    ids = text_ids(lm, [x.text for x in items], [x.row for x in items], "held-out")
    alphas = torch.tensor(args.multipliers, dtype=torch.float64)
    runs = {"lenscope_sweep": [], "one_forward_per_setting": []}
    results = {}
    for rep in range(args.repeats):
        order = ["lenscope_sweep", "one_forward_per_setting"] if rep % 2 == 0 else \
            ["one_forward_per_setting", "lenscope_sweep"]
        for name in order:
            before, t, c = load1(), time.perf_counter(), time.process_time()
            if name == "lenscope_sweep":
                res = sweep_measures(lm, d.vector, ids, answers, args.layers, alphas, max_tokens=args.max_tokens)
            else:
                res = per_setting(lm, d.vector, ids, answers, args.layers, alphas)
            runs[name].append({"seconds": time.perf_counter() - t, "cpu_seconds": time.process_time() - c,
                               "load_before": before, "load_after": load1()})
            results[name] = res
            print(name, runs[name][-1], flush=True)
    (b1, m1), (b2, m2) = results["lenscope_sweep"], results["one_forward_per_setting"]
    nz = alphas != 0
    diff = max(float((b1 - b2).abs().max()), float((m1[..., nz] - m2[..., nz]).abs().max()))
    best = {k: min(r["seconds"] for r in v) for k, v in runs.items()}
    n_rows = len(ids) * (1 + len(args.layers) * int(nz.sum()))
    write(out / "timing.json", {
        "machine": record(), "model": lm.name, "behaviour": "sentiment", "inputs": len(ids),
        "layers": args.layers, "multipliers": args.multipliers, "rows": n_rows,
        "tokens": int(sum(x.numel() for x in ids)) * (1 + len(args.layers) * int(nz.sum())),
        "max_tokens": args.max_tokens, "runs": runs, "best": best,
        "speedup": best["one_forward_per_setting"] / best["lenscope_sweep"],
        "max_abs_measure_difference": diff,
        "note": "2 cores shared with other jobs: the load averages say how busy they were; the two sweeps are "
                "interleaved so that both see the same load"})


def behaviour(lm, name: str, args, out: Path, png: Path | None) -> None:
    from lenscope.data.steering import read_steering_inputs, read_steering_pairs
    from lenscope.steering import build_direction, evaluate_steering, steering_locus
    from lenscope.viz.plots import save_figure

    pairs = read_steering_pairs(DATA / f"{name}_pairs.csv")
    held = read_steering_inputs(DATA / f"{name}_heldout.csv")[: args.inputs]
    trans = read_steering_inputs(DATA / f"{name}_transfer.csv")
    d = build_direction(lm, pairs, args.method, args.layer)
    d.save(out / f"{name}-direction")
    kw = dict(bootstrap=1000, seed=0, max_tokens=args.max_tokens)

    def done(path):
        return path.exists() and not args.force

    p = out / f"{name}-eval.json"
    if not done(p):
        before, t, c = load1(), time.perf_counter(), time.process_time()
        ev = evaluate_steering(lm, d, held, args.multipliers, args.layers, **kw)
        wall = time.perf_counter() - t
        run = {"seconds": wall, "cpu_seconds": time.process_time() - c, "load_before": before, "load_after": load1(),
               "within_15_minutes": wall <= 900}
        write(p, {"machine": record(), "run": run, **ev.to_dict()})
    ev = json.loads(p.read_text())
    if png is not None:
        from lenscope.viz.steering_plots import plot_steering

        for kind in ("effect", "damage", "slopes"):
            save_figure(plot_steering(ev, kind, title=f"{name}: {args.method} direction built at resid_pre."
                                      f"{args.layer}, 128 held-out inputs"), png / f"steering-{name}-{kind}.png")
    for tag, inputs in (("transfer", trans), ("sst2", sst2_inputs() if name == "sentiment" else None)):
        p = out / f"{name}-{tag}.json"
        if inputs is None or done(p):
            continue
        ev = evaluate_steering(lm, d, inputs, args.multipliers, args.layers, damage_data=None, **kw)
        write(p, {"machine": record(), **ev.to_dict()})
    p = out / f"{name}-methods.json"
    if not done(p):
        res = {}
        for method in ("actadd", "mean-diff", "pca", "probe"):
            dm = build_direction(lm, pairs, method, args.layer)
            ev = evaluate_steering(lm, dm, held, args.method_multipliers, damage_data=None, **kw)
            res[method] = {"direction": dm.config(), **ev.to_dict()["layers"][str(args.layer)]}
            print(method, res[method]["mean_effect"], flush=True)
        write(p, {"machine": record(), "model": lm.name, "layer": args.layer, "inputs": len(held), "methods": res})
    p = out / f"{name}-locus.json"
    if not done(p):
        x = held[0]
        loc = steering_locus(lm, d, x.text, x.answer_positive, x.answer_negative, ALPHA_LOCUS)
        write(p, {"machine": record(), **loc.to_dict()})
        if png is not None:
            save_figure(loc.plot(), png / f"steering-{name}-locus.png")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="docs/results/steering")
    ap.add_argument("--png", default=None, help="folder for the pictures")
    ap.add_argument("--behaviours", default="sentiment,tense")
    ap.add_argument("--method", default="mean-diff")
    ap.add_argument("--layer", type=int, default=12)
    ap.add_argument("--layers", default="6,9,12,15,18")
    ap.add_argument("--multipliers", default="-8,-4,-2,0,2,4,8")
    ap.add_argument("--method-multipliers", default="-4,0,4", help="multipliers of the methods' comparison")
    ap.add_argument("--inputs", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--timing", action="store_true", help="also the sweep's speed (timing.json)")
    ap.add_argument("--timing-only", action="store_true")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--force", action="store_true", help="recompute results files that exist")
    args = ap.parse_args()
    args.layers = [int(x) for x in args.layers.split(",")]
    args.multipliers = [float(x) for x in args.multipliers.split(",")]
    args.method_multipliers = [float(x) for x in args.method_multipliers.split(",")]
    if args.threads:
        torch.set_num_threads(args.threads)
    import lenscope

    lm = lenscope.load("smollm2")
    out = ROOT / args.out
    png = None if args.png is None else ROOT / args.png
    if not args.timing_only:
        for name in args.behaviours.split(","):
            behaviour(lm, name, args, out, png)
    if args.timing or args.timing_only:
        timing(lm, args, out)


if __name__ == "__main__":
    main()
