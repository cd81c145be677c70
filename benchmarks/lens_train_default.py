"""The tuned lens a new user gets: `lens train --max-minutes 15` with every default, then `lens eval` (8,192 held-out
tokens) of it and of the logit lens; one results file with the training record, both evaluations and the ratio.

    .venv/bin/python benchmarks/lens_train_default.py --out /tmp/lens15 \
        --results docs/results/smollm2-lens-15min-issue22.json [--minutes 15] [--model smollm2]

Runs the three CLI commands exactly as a user would (each its own process, on an otherwise idle machine: the
time budget is wall-clock) and keeps their JSON. `--combine DIR` only combines `train.json`, `eval-tuned.json`
and `eval-logit.json` already in DIR (the same commands run by hand) into `--results`. Either way the three run files
are copied to `<results stem>-runs/` beside the results file, to be committed with it (`tests/test_numbers.py`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from machine import record

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "wikitext2" / "wiki.test.raw"


def commands(model: str, out: Path, minutes: float, data: Path) -> dict[str, list[str]]:
    cli = [sys.executable, "-m", "lenscope"]
    common = ["--model", model, "--data", str(data)]
    return {"train": cli + ["lens", "train", *common, "--max-minutes", f"{minutes:g}", "--out", str(out), "--json"],
            "eval-tuned": cli + ["lens", "eval", *common, "--lens", str(out), "--json"],
            "eval-logit": cli + ["lens", "eval", *common, "--lens", "logit", "--json"]}


def combine(folder: Path, results: Path, machine: dict, cmds: dict) -> dict:
    runs = {k: json.loads((folder / f"{k}.json").read_text()) for k in ("train", "eval-tuned", "eval-logit")}
    tuned, logit = runs["eval-tuned"], runs["eval-logit"]
    kl_t = [r["kl"] for r in tuned["layers"]]
    kl_l = [r["kl"] for r in logit["layers"]]
    p1_t = [r["precision_at_1"] for r in tuned["layers"]]
    p1_l = [r["precision_at_1"] for r in logit["layers"]]
    n = len(kl_t) - 1  # the output state is exact for both
    config = json.loads((Path(runs["train"]["out"]) / "config.json").read_text())
    res = {
        "machine": machine, "commands": {k: " ".join(v) for k, v in cmds.items()},
        "training": {k: runs["train"][k] for k in ("steps", "tokens_seen", "seconds", "tokens_per_s", "precision",
                                                  "time_budget")},
        "init": config["training"].get("init"),
        "selection": runs["train"].get("selection"),
        "summary": {"mean_kl_tuned": tuned["mean_kl"], "mean_kl_logit": logit["mean_kl"],
                    "ratio": tuned["mean_kl"] / logit["mean_kl"],
                    "below_logit_at_every_layer": all(a < b for a, b in zip(kl_t[:n], kl_l[:n])),
                    "eval_tokens": tuned.get("n_tokens"),
                    "mean_precision_at_1_tuned": sum(p1_t[:n]) / n, "mean_precision_at_1_logit": sum(p1_l[:n]) / n},
        "kl_per_layer": {"tuned": kl_t, "logit": kl_l}, "precision_at_1_per_layer": {"tuned": p1_t, "logit": p1_l},
    }
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps(res, indent=1) + "\n")
    keep = results.with_name(results.stem + "-runs")  # the run files, committed beside the results file
    keep.mkdir(parents=True, exist_ok=True)
    for k in runs:
        (keep / f"{k}.json").write_text((folder / f"{k}.json").read_text())
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--out", type=Path, default=Path("/tmp/lens15"))
    ap.add_argument("--minutes", type=float, default=15.0)
    ap.add_argument("--results", type=Path, default=Path("docs/results/smollm2-lens-15min-issue22.json"))
    ap.add_argument("--combine", type=Path, default=None, help="only combine the JSON files already in this folder")
    ap.add_argument("--train-load", type=float, default=None,
                    help="with --combine: the 1-minute load average seen when the training command started")
    args = ap.parse_args()
    machine = record()
    try:
        import os

        machine["load_1min_at_train_start"] = args.train_load if args.combine else round(os.getloadavg()[0], 2)
    except OSError:
        pass
    cmds = commands(args.model, args.out, args.minutes, args.data)
    folder = args.combine
    if folder is None:
        folder = args.out.with_name(args.out.name + "-runs")
        folder.mkdir(parents=True, exist_ok=True)
        for name, cmd in cmds.items():
            print("+", " ".join(cmd), file=sys.stderr, flush=True)
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            (folder / f"{name}.json").write_text(out)
    res = combine(folder, args.results, machine, cmds)
    s = res["summary"]
    print(f"{res['training']['steps']} steps, {res['training']['tokens_seen']} tokens, "
          f"{res['training']['tokens_per_s']} tokens/s; mean KL tuned {s['mean_kl_tuned']:.3f}, logit "
          f"{s['mean_kl_logit']:.3f}, ratio {s['ratio']:.3f}; below the logit lens at every layer: "
          f"{s['below_logit_at_every_layer']}")


if __name__ == "__main__":
    main()
