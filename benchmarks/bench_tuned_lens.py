"""lenscope side of the tuned-lens benchmark (see benchmarks/README.md).

Trains a tuned lens with lenscope on the same token ids the reference run used (``--ids``, written by
``reference_tuned_lens.py --save-ids``) or on wiki.test.raw directly, times the training alone, and
evaluates KL(final || lens) per layer on held-out ids over all positions, in float32 (the library's
``eval_loop`` definition), for the tuned and the logit lens. Prints one JSON line.

    .venv/bin/python benchmarks/bench_tuned_lens.py --ids /tmp/ids.safetensors --tokens 16384
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
from lenscope.lenses import LogitLens, TrainSettings, read_text, split_text, token_sequences, train_tuned_lens
from lenscope.lenses.evaluate import lens_metrics
from lenscope.models.runtime.trace import residual_states

DEFAULT_TEXT = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "wikitext2" / "wiki.test.raw"


def kl_per_layer(lm, lens, seqs: torch.Tensor, batch: int = 4) -> list[float]:
    total = torch.zeros(lm.anatomy.n_layers + 1, dtype=torch.float64)
    count = 0
    for i in range(0, seqs.shape[0], batch):
        cap = residual_states(lm, seqs[i : i + batch])
        kl, _, _, _ = lens_metrics(lm, lens, cap["states"].flatten(1, 2), cap["logits"].flatten(0, 1), None)
        total += kl
        count += cap["logits"].shape[0] * cap["logits"].shape[1]
    return (total[:-1] / count).tolist()  # the lens layers (the output state is 0 for every lens)


def combine(folder: Path, out: Path, command: str) -> None:
    """One results file from the runs of ``tuned_lens_vs_library.sh`` in ``folder`` (ref, ours, ref-matched,
    ours-matched .json), for when the script's own combining step cannot run (a run that did not finish in time
    is recorded as such, never filled in). The run files are copied to ``<out's stem>-runs/`` beside it, to be
    committed with it (``tests/test_numbers.py`` asks for them)."""
    runs = {}
    for k in ("ref", "ours", "ref-matched", "ours-matched"):
        f = folder / f"{k}.json"
        lines = f.read_text().strip().splitlines() if f.exists() else []
        runs[k] = json.loads(lines[-1]) if lines else {"did_not_finish": True}
    machine = record()
    machine["command"] = command
    res = {"machine": machine, "defaults": {"tuned-lens": runs["ref"], "lenscope": runs["ours"]},
           "matched": {"tuned-lens": runs["ref-matched"], "lenscope": runs["ours-matched"]}}
    for part in ("defaults", "matched"):
        r, o = res[part]["tuned-lens"], res[part]["lenscope"]
        if "tokens_per_s" in r and "tokens_per_s" in o:
            res[part]["speed_ratio"] = o["tokens_per_s"] / r["tokens_per_s"]
            res[part]["kl_ratio"] = o["mean_kl_tuned"] / r["mean_kl_tuned"]
        if "tokens_per_cpu_s" in r and "tokens_per_cpu_s" in o:
            res[part]["cpu_speed_ratio"] = o["tokens_per_cpu_s"] / r["tokens_per_cpu_s"]
    out.write_text(json.dumps(res, indent=1) + "\n")
    keep = out.with_name(out.stem + "-runs")  # the run files, committed beside the results file
    keep.mkdir(parents=True, exist_ok=True)
    for k in runs:
        if (folder / f"{k}.json").exists():
            (keep / f"{k}.json").write_text((folder / f"{k}.json").read_text())
    print(f"wrote {out} and the run files to {keep}/")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--ids", type=Path, default=None, help="safetensors with 'train' and 'eval' (n, seq_len) ids")
    ap.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--eval-tokens", type=int, default=32 * 256)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--optimizer", default="adam")
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto",
                    help="unembedding matmuls of training: auto (bf16 where native or measured faster), fp32, bf16")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--keep-best", action="store_true",
                    help="hold out validation sequences and keep each layer's best translator (off: the library "
                         "trains on exactly these ids, so lenscope does too)")
    ap.add_argument("--init", choices=("identity", "least-squares"), default="identity",
                    help="the translators' start: identity (as the library; default, so the runs stay matched) or "
                         "lenscope's least-squares start, fitted on the same training ids")
    ap.add_argument("--seed", type=int, default=0, help="the order of the training batches (TrainSettings.seed)")
    ap.add_argument("--combine", type=Path, default=None,
                    help="only combine the run files of tuned_lens_vs_library.sh in this folder into --results")
    ap.add_argument("--results", type=Path, default=Path("docs/results/bench-tuned-lens-vs-library.json"))
    args = ap.parse_args()
    if args.combine is not None:
        import shlex

        return combine(args.combine, args.results, "python " + " ".join(shlex.quote(a) for a in sys.argv))
    machine = record()

    lm = lenscope.load(args.model)
    if args.ids is not None:
        from safetensors.torch import load_file

        ids = load_file(str(args.ids))
        train, evals = ids["train"], ids["eval"]
    else:
        text = read_text(args.text)
        train = token_sequences(lm, split_text(text, "train"), args.seq_len)
        evals = token_sequences(lm, split_text(text, "eval"), args.seq_len, max_tokens=args.eval_tokens)
    train = train[: -(-args.tokens // train.shape[1])]
    evals = evals[: args.eval_tokens // evals.shape[1]]
    settings = TrainSettings(tokens=args.tokens, seq_len=train.shape[1], batch_size=args.batch_size,
                             optimizer=args.optimizer, lr=args.lr, keep_best=args.keep_best, init=args.init,
                             seed=args.seed,
                             init_tokens=int(train.numel()),
                             bf16={"auto": None, "fp32": False, "bf16": True}[args.precision])
    t0, c0 = time.perf_counter(), time.process_time()
    lens = train_tuned_lens(lm, train, settings, out=args.out, progress=False)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    tuned = kl_per_layer(lm, lens, evals)
    logit = kl_per_layer(lm, LogitLens(lm.anatomy), evals)
    print(json.dumps({
        "impl": "lenscope", "train_tokens": lens.training_info["tokens_seen"], "train_seconds": round(seconds, 3),
        "tokens_per_s": round(lens.training_info["tokens_seen"] / seconds, 2),
        "train_cpu_seconds": round(cpu, 3), "tokens_per_cpu_s": round(lens.training_info["tokens_seen"] / cpu, 2),
        "mean_kl_tuned": sum(tuned) / len(tuned), "mean_kl_logit": sum(logit) / len(logit),
        "kl_per_layer_tuned": tuned, "kl_per_layer_logit": logit, "steps": lens.training_info["steps"],
        "optimizer": args.optimizer, "lr": settings.base_lr(), "batch_size": args.batch_size,
        "precision": lens.training_info.get("precision"), "keep_best": args.keep_best,
        "init": lens.training_info.get("init", "identity"), "seed": args.seed,
        "eval_tokens": int(evals.numel()),
        "machine": machine,
    }))


if __name__ == "__main__":
    main()
