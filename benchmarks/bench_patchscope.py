"""The Patchscope lens beside the logit lens (and a tuned lens): quality and cost on held-out text.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_patchscope.py --model smollm2 --tokens 2048 \
        [--tuned lenses/smollm2-15min] --out docs/results/bench-patchscope-smollm2.json

Quality: on the eval part of wiki.test.raw (its last 20%, as ``lenscope lens eval`` reads it: the text a tuned lens
never trains on), per layer the exact full-vocabulary KL(final || lens) and precision@1 (the lens's top-1 equals
the model's own final top-1) for each lens, with ``lenscope.lenses.evaluate_lenses`` (the numbers ``lens eval
--json`` gives), and per layer which lens wins on each.

Cost, on ``--timing-tokens`` tokens of the same text (best of ``--repeat``): the model's forward pass per token;
the Patchscope lens per token (every state of every token patched and run to the last block:
``PatchscopeLens.transform_all``), alone and with the readout of every state (what the logit lens does); the
prompt's prefix, computed once; and the brute force the lens replaces (the real model on the whole identity
prompt, one row per (state, token), an engine edit at the patched block) on ``--brute-rows`` rows, per row and
extrapolated per token. Ratios are to the forward pass. Writes everything with the machine record.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import record

import lenscope
from lenscope.lenses import (
    LogitLens,
    PatchscopeLens,
    TunedLens,
    evaluate_lenses,
    read_text,
    split_text,
    token_sequences,
)
from lenscope.lenses.lenses import decode
from lenscope.models.runtime.engine import Edit, run
from lenscope.models.runtime.trace import residual_states

DEFAULT_TEXT = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "wikitext2" / "wiki.test.raw"


def best_of(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


@torch.no_grad()
def costs(lm, lens: PatchscopeLens, ids: torch.Tensor, repeat: int, brute_rows: int) -> dict:
    """Seconds per token of the forward pass, the Patchscope lens, and the brute force it replaces."""
    A = lm.anatomy
    n_tok = ids.numel()
    lens = PatchscopeLens(lm, prompt=lens.prompt, target_layer=lens.target_layer)  # a fresh one: time its prefix
    t0 = time.perf_counter()
    lens.prefix()
    prefix_s = time.perf_counter() - t0
    forward = best_of(lambda: run(lm, ids), repeat)
    states = residual_states(lm, ids)["states"].flatten(1, 2)  # (state, tokens, d_model)
    transform = best_of(lambda: lens.transform_all(states), repeat)

    def read_all():
        x = lens.transform_all(states)
        for i in range(x.shape[0]):
            decode(A, x[i])

    def logit_read():
        for i in range(states.shape[0]):
            decode(A, states[i])

    with_readout = best_of(read_all, repeat)
    logit = best_of(logit_read, repeat)
    out = {"tokens": n_tok, "states": int(states.shape[0]), "prompt_tokens": lens.n_prompt,
           "prefix_once_s": round(prefix_s, 4),
           "forward_per_token_s": forward / n_tok, "patchscope_per_token_s": transform / n_tok,
           "patchscope_with_readout_per_token_s": with_readout / n_tok, "logit_lens_per_token_s": logit / n_tok}
    out["patchscope_over_forward"] = out["patchscope_per_token_s"] / out["forward_per_token_s"]
    out["patchscope_with_readout_over_forward"] = out["patchscope_with_readout_per_token_s"] / out[
        "forward_per_token_s"]
    out["logit_lens_over_forward"] = out["logit_lens_per_token_s"] / out["forward_per_token_s"]
    if brute_rows > 0:  # the engine on the whole prompt, one row per (state, token): what the lens replaces
        L = A.n_layers
        flat = states[:L].reshape(-1, A.d_model)
        pick = torch.randperm(flat.shape[0], generator=torch.Generator().manual_seed(0))[:brute_rows]
        h, blocks = flat[pick], (pick // states.shape[1])
        P = lens.n_prompt

        def brute():
            edits = []
            for b in blocks.unique().tolist():
                rows = torch.nonzero(blocks == b)[:, 0]
                edits.append(Edit("resid_pre", b, rows, torch.full((rows.numel(),), P - 1), h[rows]))
            return run(lm, lens.ids[None].repeat(h.shape[0], 1), edits=edits, last_only=True).logits[:, -1]

        brute_s = best_of(brute, repeat)
        ours_s = best_of(lambda: lens.run(h, blocks), repeat)
        exact = (decode(A, lens.run(h, blocks)) - brute().float()).abs().max()
        out.update({"brute_rows": int(h.shape[0]), "brute_per_row_s": brute_s / h.shape[0],
                    "patchscope_per_row_s": ours_s / h.shape[0], "brute_over_patchscope": brute_s / ours_s,
                    "brute_max_abs_logit_diff": float(exact),
                    "brute_per_token_s": brute_s / h.shape[0] * states.shape[0]})
        out["brute_over_forward"] = out["brute_per_token_s"] / out["forward_per_token_s"]
    return out


def figure(evs: list, title: str, path: Path) -> None:
    """Per-layer KL (log scale; the output state, where every lens is the model's own readout and KL is 0 up to
    rounding, falls below the axis) and precision@1 of every lens, drawn by ``plot_lens_evaluation``."""
    import matplotlib.pyplot as plt

    from lenscope.viz.lens_plots import plot_lens_evaluation
    from lenscope.viz.plots import save_figure

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.4))
    plot_lens_evaluation(evs[0], evs[1:], ax=axes[0], log=True, metric="kl")
    axes[0].set_ylim(bottom=1e-3)
    plot_lens_evaluation(evs[0], evs[1:], ax=axes[1], metric="top1")
    axes[1].set_ylabel("precision@1 (top-1 = the model's final top-1)")
    fig.suptitle(title, y=1.04)
    save_figure(fig, path)
    print(f"figure: {path}")


def evaluations_from(path: Path) -> tuple[list, str]:
    """The lens evaluations of a results file this script wrote (for ``--replot``)."""
    from lenscope.lenses import LensEvaluation

    d = json.loads(path.read_text())
    evs = []
    for e in d["evaluations"].values():
        col = {k: torch.tensor([float(r[k] if r[k] is not None else "nan") for r in e["layers"]])
               for k in ("kl", "ce", "entropy", "top1_agreement")}
        evs.append(LensEvaluation(model=e["model"], lens=e["lens"], n_tokens=e["n_tokens"], kl=col["kl"], ce=col["ce"],
                                  entropy=col["entropy"], top1=col["top1_agreement"],
                                  depth_hist=torch.zeros(len(e["layers"]) + 1)))
    return evs, f"{d['model']}: {d['n_tokens']} held-out tokens of {Path(d['data']).name} (eval part)"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--data", type=Path, default=DEFAULT_TEXT)
    ap.add_argument("--tokens", type=int, default=2048, help="held-out tokens for KL and precision@1")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--tuned", type=Path, help="a tuned-lens directory, evaluated beside the other two")
    ap.add_argument("--timing-tokens", type=int, default=256, help="tokens the costs are measured on")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--brute-rows", type=int, default=64, help="(state, token) rows for the brute force (0: skip)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--png", type=Path, help="the per-layer KL and precision@1 of every lens as a figure")
    ap.add_argument("--replot", type=Path, help="only draw --png from this results file")
    args = ap.parse_args()
    if args.replot:
        figure(*evaluations_from(args.replot), args.png)
        return
    machine = record()
    lm = lenscope.load(args.model)
    L = lm.anatomy.n_layers
    text = split_text(read_text(args.data), "eval")
    seqs = token_sequences(lm, text, args.seq_len, max_tokens=args.tokens)
    ps = PatchscopeLens(lm)
    lenses = {"logit": LogitLens(lm.anatomy, model_name=lm.name), "patchscope": ps}
    if args.tuned:
        lenses["tuned"] = TunedLens.load(args.tuned, lm)
    t = time.perf_counter()
    evs = evaluate_lenses(lm, lenses, seqs, batch_size=args.batch_size, progress=False)
    eval_s = time.perf_counter() - t

    timing_ids = token_sequences(lm, text, min(args.seq_len, args.timing_tokens), max_tokens=args.timing_tokens)[:1]
    cost = costs(lm, ps, timing_ids, args.repeat, args.brute_rows)

    names = list(evs)
    per = {n: evs[n].to_dict() for n in names}
    wins = {"kl": [], "precision_at_1": []}
    for i in range(L):
        wins["kl"].append(min(names, key=lambda n: per[n]["layers"][i]["kl"]))
        wins["precision_at_1"].append(max(names, key=lambda n: per[n]["layers"][i]["precision_at_1"]))
    summary = {n: {"mean_kl": per[n]["mean_kl"],
                   "mean_precision_at_1": sum(r["precision_at_1"] for r in per[n]["layers"][:L]) / L,
                   "kl": [r["kl"] for r in per[n]["layers"]],
                   "precision_at_1": [r["precision_at_1"] for r in per[n]["layers"]],
                   "layers_won_kl": [i for i, w in enumerate(wins["kl"]) if w == n],
                   "layers_won_precision_at_1": [i for i, w in enumerate(wins["precision_at_1"]) if w == n]}
               for n in names}
    result = {"model": lm.name, "data": str(args.data), "part": "eval", "n_tokens": evs["logit"].n_tokens,
              "n_layers": L, "prompt": ps.prompt, "eval_seconds": round(eval_s, 1), "summary": summary,
              "winner_per_layer": wins, "cost": cost, "evaluations": per, "machine": machine}
    print(f"{lm.name}: {result['n_tokens']} held-out tokens; per layer KL (nats) / precision@1")
    print("| layer | " + " | ".join(names) + " |")
    print("| ---: |" + " ---: |" * len(names))
    for i in range(L + 1):
        print(f"| {i} | " + " | ".join(f"{summary[n]['kl'][i]:.3f} / {summary[n]['precision_at_1'][i]:.2f}"
                                       for n in names) + " |")
    print("| mean | " + " | ".join(f"{summary[n]['mean_kl']:.3f} / {summary[n]['mean_precision_at_1']:.2f}"
                                   for n in names) + " |")
    print(json.dumps(cost, indent=1))
    if args.png:
        figure([evs[n] for n in names], f"{lm.name}: {result['n_tokens']} held-out tokens of {args.data.name} "
               "(eval part)", args.png)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
        print(f"written: {args.out}")


if __name__ == "__main__":
    main()
