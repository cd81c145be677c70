"""Fine-tune smollm2 for a few hundred steps on SST-2 sentences (language modelling), to test lens transfer.

    OMP_NUM_THREADS=1 .venv/bin/python examples/finetune_sst2.py --steps 200 --out models/smollm2-sst2

A tuned lens is trained on one model; does it still read a model that was fine-tuned from it? This script
makes such a model: the causal-LM loss on the sentences of SST-2's validation split
(``../shared/data/sst2/dev.tsv``, 872 movie-review sentences), AdamW, the matmuls in bfloat16 autocast on CPUs
that run it natively. The result is a transformers folder that ``lenscope.load`` reads like any other. Then

    .venv/bin/python benchmarks/lens_compare.py --model models/smollm2-sst2 --no-check \
        --lens base=lenses/smollm2 --lens retrained=lenses/smollm2-sst2

compares the base model's lens on the fine-tuned model with the logit lens and a lens retrained on it.
(SST-2 comes without a license and is meant for evaluation: the fine-tuned weights are a local test
artefact, not something to publish.)
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

import lenscope

DEFAULT_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "sst2" / "dev.tsv"


def sentences(path: Path) -> list[str]:
    rows = path.read_text(encoding="utf-8").splitlines()[1:]
    return [r.split("\t")[0].strip() for r in rows if r.strip()]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--max-len", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto",
                    help="bf16 autocast for the matmuls (auto: where the CPU runs bfloat16 natively)")
    args = ap.parse_args()

    lm = lenscope.load(args.model)
    model, tok = lm.model, lm.tokenizer
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    native = bool(getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)())
    bf16 = args.precision == "bf16" or (args.precision == "auto" and native)
    texts = sentences(args.data)
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    for p in model.parameters():
        p.requires_grad_(True)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    order: list[str] = []
    log = []
    t0 = time.perf_counter()
    for step in range(args.steps):
        if len(order) < args.batch_size:
            order += rng.sample(texts, len(texts))
        batch, order = order[: args.batch_size], order[args.batch_size :]
        enc = tok(batch, return_tensors="pt", padding=True, truncation=True, max_length=args.max_len)
        labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
        lr = args.lr * min(1.0, (step + 1) / 10) * (1 - step / args.steps)  # short warm-up, linear decay
        for g in opt.param_groups:
            g["lr"] = lr
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(**enc, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        log.append([step + 1, round(loss.item(), 4)])
        if (step + 1) % 10 == 0 or step == 0:
            print(f"step {step + 1}/{args.steps} loss {loss.item():.3f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    tok.save_pretrained(args.out)
    (args.out / "finetune.json").write_text(json.dumps(
        {"base": args.model, "data": str(args.data), "steps": args.steps, "batch_size": args.batch_size, "lr": args.lr,
         "max_len": args.max_len, "bf16_autocast": bf16, "seconds": round(time.perf_counter() - t0, 1),
         "loss": log}, indent=1))
    print(f"saved to {args.out}: first-10 mean loss {sum(l for _, l in log[:10]) / min(10, len(log)):.3f}, "
          f"last-10 {sum(l for _, l in log[-10:]) / min(10, len(log)):.3f}")


if __name__ == "__main__":
    main()
