"""What one tuned-lens training step costs, and what each change to it saves (smollm2, one batch of 4 x 256).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_lens_step.py --model smollm2 --repeats 3 [--fp32] \
        [--batch 4] [--out docs/results/lens-training-step-bench.json]

Times the objective's forward + backward over every state of one batch (``kl_backward``) in variants that
switch the changes of issue 11 on one at a time, in this process's CPU time (best of ``--repeats``; on a
shared machine CPU time is steadier than the wall clock, though caches and memory bandwidth are still
shared). The variants give the same gradient up to bfloat16 rounding (printed: gradient norm). Also times the
model's forward pass. Prints one JSON line and (``--out``) writes it, with ``benchmarks/machine.py``'s
``record()`` under ``"machine"``. ``--batch`` sequences of 256 tokens (default 4, the training batch; fewer to
keep a run short on a loaded or bf16-less machine: the cost is per token, so the ratios between variants hold).
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
from lenscope.lenses import TunedLens, read_text, split_text, token_sequences
from lenscope.lenses import objective as O
from lenscope.lenses.training.precision import cpu_features
from lenscope.models.runtime.trace import residual_states

DEFAULT_TEXT = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "wikitext2" / "wiki.test.raw"


def step(lm, lens, states, final, bf16: bool, ref_lse: bool, budget: float, pbar_bf16: bool) -> float:
    W = O._unembed_weight(lm, bf16)
    c, pbar = O.kl_to_final_terms(lm, final, W if pbar_bf16 else None)
    ref = final.argmax(-1) if ref_lse else None
    n_states, n_tokens = states.shape[:2]
    total = 0.0
    for ss, ts in O.chunks(n_states, n_tokens, lm.anatomy.vocab_size, budget):
        loss = O.lens_kl_loss(lm, lens, states[ss, ts], c[ts], pbar[ts], W, first_state=ss.start,
                              ref=None if ref is None else ref[ts]) / (n_states * n_tokens)
        loss.backward()
        total += loss.item()
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--fp32", action="store_true", help="also the float32 variants (slow where bf16 is native)")
    ap.add_argument("--batch", type=int, default=4, help="sequences of 256 tokens in the batch")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    machine = record()
    lm = lenscope.load(args.model)
    seqs = token_sequences(lm, split_text(read_text(DEFAULT_TEXT), "train")[:100_000], 256)
    batch = seqs[: args.batch]
    L = lm.anatomy.n_layers
    t = time.process_time()
    cap = residual_states(lm, batch)
    fwd = time.process_time() - t
    states, final = cap["states"][:L].flatten(1, 2), cap["logits"].flatten(0, 1)
    variants = {  # name: (bf16, lse at the reference token, block bytes, pbar in bf16)
        "before (bf16, max-token lse, 1.5 GB blocks, fp32 pbar)": (True, False, 1.5e9, False),
        "+ lse at the final top token (= now)": (True, True, 1.5e9, False),
        "+ 200 MB blocks (tried, not kept)": (True, True, 2e8, False),
        "+ 200 MB blocks + pbar in bf16 (tried, not kept)": (True, True, 2e8, True),
    }
    if args.fp32:
        variants["fp32 before (logsumexp autograd)"] = (False, False, 1.5e9, False)
        variants["fp32 now (softmax kept, lse at the final top token)"] = (False, True, 1.5e9, False)
    res = {}
    for rep in range(args.repeats):
        for name, (bf16, ref, budget, pb) in variants.items():
            if rep > 0 and not bf16:
                continue  # one repeat of the slow float32 variants
            lens = TunedLens(lm.anatomy)
            t = time.process_time()
            kl = step(lm, lens, states, final, bf16, ref, budget, pb)
            dt = time.process_time() - t
            r = res.setdefault(name, {"cpu_s": [], "kl": kl, "grad_norm": float(lens.A.grad.norm())})
            r["cpu_s"].append(round(dt, 2))
            print(f"{name}: {dt:.2f} s (kl {kl:.4f}, |grad A| {r['grad_norm']:.5f})", flush=True)
    tokens = states.shape[1]
    out = {"machine": machine, "model": lm.name, "tokens_per_step": tokens, "repeats": args.repeats, "states": L,
           "forward_cpu_s": round(fwd, 2),
           "threads": torch.get_num_threads(), "native_bf16": cpu_features(),
           "variants": {k: {**v, "best_s": min(v["cpu_s"]),
                            "tokens_per_s_incl_forward": round(tokens / (min(v["cpu_s"]) + fwd), 1)}
                        for k, v in res.items()}}
    print(json.dumps(out))
    if args.out is not None:
        args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
