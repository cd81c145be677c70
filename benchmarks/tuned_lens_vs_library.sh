#!/usr/bin/env bash
# Train a tuned lens on smollm2 with the tuned-lens library and with lenscope on the same token ids and budget,
# twice each, in one invocation:
#   defaults: each side's own recipe (library: SGD Nesterov, clip 1.0, bf16 autocast, 1 sequence per forward
#             x 4 accumulated per step; lenscope: AdamW 2e-3, warm-up + decay, 4 sequences per step, precision
#             auto, the least-squares start on the same ids);
#   matched:  the same recipe on both (lenscope's: AdamW 2e-3 wd 1e-3, warm-up max(1, 10%) + linear decay, no
#             clipping, float32, 4 sequences per step with no accumulation, the identity start), the same token ids
#             in the same budget.
# lenscope's per-layer selection (--keep-best) is off in all runs (the library has none; it would hold out text).
# Prints a table and writes every run's JSON (with benchmarks/machine.py's record() under "machine") into OUT.
# Needs .venv (./dev) and .venv-tunedlens (see the docstring of reference_tuned_lens.py).
# Usage: [BENCH_DIR=DIR] [PARALLEL=1] benchmarks/tuned_lens_vs_library.sh [TOKENS] [EVAL_TOKENS] [SEQ_LEN] [OUT]
# (with BENCH_DIR holding ids.safetensors and ref.json from an earlier run, run 1 is not repeated)
set -euo pipefail
cd "$(dirname "$0")/.."
tokens="${1:-2048}"; eval_tokens="${2:-2048}"; seq_len="${3:-128}"
out="${4:-docs/results/bench-tuned-lens-vs-library.json}"
per_step=$((4 * seq_len))  # 4 sequences per optimizer step on both sides
tmp="${BENCH_DIR:-$(mktemp -d)}"; mkdir -p "$tmp"
common=(--tokens "$tokens" --eval-tokens "$eval_tokens" --seq-len "$seq_len")
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# 1. library defaults (it writes the token ids every other run trains and evaluates on)
if [ ! -s "$tmp/ids.safetensors" ]; then
  .venv-tunedlens/bin/python benchmarks/reference_tuned_lens.py "${common[@]}" --tokens-per-step "$per_step" \
    --batch-size 1 --out "$tmp/ref-lens" --save-ids "$tmp/ids.safetensors" > "$tmp/ref.json"
fi
# 2. lenscope defaults; 3. library with lenscope's recipe, 4 sequences per forward, no accumulation;
# 4. lenscope, the same recipe in float32. PARALLEL=1 runs 2-4 at the same time (each one thread; on a loaded
# machine compare the CPU seconds, which the runs also record).
run2() { .venv/bin/python benchmarks/bench_tuned_lens.py --ids "$tmp/ids.safetensors" --tokens "$tokens" --init least-squares \
  --eval-tokens "$eval_tokens" --out "$tmp/ours-lens" > "$tmp/ours.json"; }
run3() { .venv-tunedlens/bin/python benchmarks/reference_tuned_lens.py "${common[@]}" --tokens-per-step "$per_step" \
  --batch-size 4 --recipe lenscope > "$tmp/ref-matched.json"; }
run4() { .venv/bin/python benchmarks/bench_tuned_lens.py --ids "$tmp/ids.safetensors" --tokens "$tokens" \
  --eval-tokens "$eval_tokens" --precision fp32 > "$tmp/ours-matched.json"; }
if [ "${PARALLEL:-0}" = 1 ]; then
  run2 & p2=$!; run3 & p3=$!; run4 & p4=$!
  wait $p2; wait $p3; wait $p4
else
  run2; run3; run4
fi
while [ ! -s "$tmp/ref.json" ]; do sleep 10; done  # run 1 may still be going (started by an earlier invocation)
.venv/bin/python - "$tmp" "$out" "$0 $*" <<'PY'
import json, sys
from pathlib import Path
sys.path.insert(0, "benchmarks")
from machine import record
tmp, out, cmd = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
runs = {k: json.loads((tmp / f"{k}.json").read_text().strip().splitlines()[-1])
        for k in ("ref", "ours", "ref-matched", "ours-matched")}
machine = record()
machine["command"] = "bash " + cmd
machine["load_1min_at_start"] = runs["ref"]["machine"]["load_1min"]
res = {"machine": machine,
       "defaults": {"tuned-lens": runs["ref"], "lenscope": runs["ours"]},
       "matched": {"tuned-lens": runs["ref-matched"], "lenscope": runs["ours-matched"]}}
machine["parallel"] = __import__("os").environ.get("PARALLEL", "0") == "1"
print(f"{'':24}{'tokens/s':>10}{'train s':>10}{'tok/CPU s':>10}{'mean KL tuned':>15}{'mean KL logit':>15}")
for part in ("defaults", "matched"):
    r, o = res[part]["tuned-lens"], res[part]["lenscope"]
    for name, x in (("tuned-lens", r), ("lenscope", o)):
        print(f"{part + ' ' + name:24}{x['tokens_per_s']:>10.1f}{x['train_seconds']:>10.1f}{x.get('tokens_per_cpu_s', float('nan')):>10.1f}"
              f"{x['mean_kl_tuned']:>15.3f}{x['mean_kl_logit']:>15.3f}")
    res[part]["speed_ratio"] = o["tokens_per_s"] / r["tokens_per_s"]
    res[part]["kl_ratio"] = o["mean_kl_tuned"] / r["mean_kl_tuned"]
    if "tokens_per_cpu_s" in r and "tokens_per_cpu_s" in o:
        res[part]["cpu_speed_ratio"] = o["tokens_per_cpu_s"] / r["tokens_per_cpu_s"]
    print(f"{part}: speed ratio lenscope / tuned-lens {res[part]['speed_ratio']:.2f}x; "
          f"held-out mean KL ratio (lenscope / tuned-lens) {res[part]['kl_ratio']:.3f}")
out.write_text(json.dumps(res, indent=1) + "\n")
print(f"wrote {out}")
PY
