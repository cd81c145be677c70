"""What a mixture of experts costs lenscope: ``verify`` and one ALTI-Logit explanation on a small random MoE model and
on a dense model of the same width, each as a ratio to that model's own forward pass.

The two models (random weights, lenscope's tiny tokenizer, float32, eager attention) share everything but the MLP:
``--layers`` blocks of width ``--d-model`` with ``--heads`` heads (Llama-style: RMSNorm, rotary, SwiGLU). The MoE
model (Mixtral) has ``--experts`` experts of width ``--d-expert``, ``--top-k`` per token; the dense model (Llama)
one MLP of width ``top_k * d_expert``, so both do the same MLP arithmetic per token in their forward pass. The
input is ``--tokens`` random token ids.

Timed, interleaved in ``--rounds`` rounds after a warm-up (medians): the forward pass (``lm.model(ids)`` under
``torch.no_grad``, no cache), ``lenscope.verify`` (its own trace, every sub-layer recomputed and compared) and
``lenscope.explain(..., method="alti-logit")`` (its own trace). One JSON file (``--out``) with the machine record::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_moe.py --threads 1 --out docs/results/bench-moe.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from machine import record  # benchmarks/machine.py

import lenscope
from lenscope.models.families import family_for
from lenscope.models.loading.load import LoadedModel, random_model
from lenscope.models.loading.tokenizer import tiny_special_ids, tiny_tokenizer


def build(kind: str, args) -> LoadedModel:
    from transformers import LlamaConfig, MixtralConfig

    from lenscope.models.families import tiny_tokens

    common = dict(num_hidden_layers=args.layers, hidden_size=args.d_model, num_attention_heads=args.heads,
                  num_key_value_heads=args.heads, max_position_embeddings=max(512, args.tokens),
                  rope_theta=10000.0, tie_word_embeddings=False, **tiny_tokens(tiny_special_ids()))
    if kind == "moe":
        cfg = MixtralConfig(intermediate_size=args.d_expert, num_local_experts=args.experts,
                            num_experts_per_tok=args.top_k, **common)
    else:
        cfg = LlamaConfig(intermediate_size=args.top_k * args.d_expert, **common)
    model = random_model(cfg)
    model.eval()
    model.requires_grad_(False)
    return LoadedModel(model=model, tokenizer=tiny_tokenizer(), anatomy=family_for(model).read(model),
                       name=f"bench:{kind}")


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--d-expert", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    models = {k: build(k, args) for k in ("moe", "dense")}
    V = models["moe"].anatomy.vocab_size
    ids = torch.randint(3, V, (args.tokens,), generator=torch.Generator().manual_seed(0))
    target = "#5"

    def forward(lm):
        with torch.no_grad():
            lm.model(input_ids=ids[None], use_cache=False)

    tasks = {
        "forward": forward,
        "verify": lambda lm: lenscope.verify(lm, ids),
        "alti_logit": lambda lm: lenscope.explain(lm, ids, target, method="alti-logit"),
    }
    checks = {}
    for name, lm in models.items():  # warm-up, and the numbers that say the run is the real thing
        rep = lenscope.verify(lm, ids)
        ex = lenscope.explain(lm, ids, target, method="alti-logit")
        checks[name] = {"verify_ok": rep.ok, "max_rel_sublayer_error": rep.max_rel_sublayer_error,
                        "alti_logit_invariant_error": ex.invariant_error,
                        "alti_completeness_error": ex.info.get("alti_completeness_error")}
        forward(lm)
    times = {m: {t: [] for t in tasks} for m in models}
    for _ in range(args.rounds):
        for name, lm in models.items():
            for t, fn in tasks.items():
                times[name][t].append(timed(lambda: fn(lm)))
    out = {"machine": record(), "settings": {k: v for k, v in vars(args).items() if k != "out"},
           "params": {m: sum(p.numel() for p in lm.model.parameters()) for m, lm in models.items()}, "models": {}}
    for name in models:
        med = {t: statistics.median(v) for t, v in times[name].items()}
        out["models"][name] = {
            "seconds": {t: round(v, 6) for t, v in med.items()},
            "ratio": {t: round(med[t] / med["forward"], 2) for t in tasks if t != "forward"},
            **checks[name],
        }
    out["moe_over_dense"] = {t: round(out["models"]["moe"]["ratio"][t] / out["models"]["dense"]["ratio"][t], 2)
                             for t in ("verify", "alti_logit")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    for name in models:
        m = out["models"][name]
        print(f"{name:6s} forward {m['seconds']['forward'] * 1e3:8.2f} ms   verify {m['ratio']['verify']:6.2f}x   "
              f"alti-logit {m['ratio']['alti_logit']:6.2f}x   verify ok {m['verify_ok']}")


if __name__ == "__main__":
    main()
