#!/usr/bin/env bash
# The matched comparison with the tuned-lens library (issue 22), without the library's own default run (its bf16
# autocast is emulated and does not finish on a CPU without AVX512-BF16): on the same token ids and budget,
#   tuned-lens:          the library's Train loop with lenscope's recipe (--recipe lenscope of reference_tuned_lens.py:
#                        AdamW 2e-3 wd 1e-3, warm-up max(1, 10%) + linear decay, no clipping, float32, 4 sequences
#                        per step, no accumulation); it writes the token ids the other two read;
#   lenscope:            the same recipe, the identity start (bench_tuned_lens.py --precision fp32 --init identity);
#   lenscope (start):    the same recipe after lenscope's least-squares start, fitted on the same training ids.
# Each run one thread; the two lenscope runs start once the ids exist and run beside the library's (compare tokens
# per CPU second, which every run records). Evaluation: the same held-out ids, all positions, float32.
# Needs .venv (./dev) and .venv-tunedlens (see the docstring of reference_tuned_lens.py).
# Usage: benchmarks/tuned_lens_matched.sh [TOKENS] [EVAL_TOKENS] [SEQ_LEN] [OUT]
set -euo pipefail
cd "$(dirname "$0")/.."
tokens="${1:-4096}"; eval_tokens="${2:-1024}"; seq_len="${3:-256}"
out="${4:-docs/results/bench-tuned-lens-matched-issue22.json}"
tmp="$(mktemp -d)"
export OMP_NUM_THREADS=1
.venv-tunedlens/bin/python benchmarks/reference_tuned_lens.py --tokens "$tokens" --eval-tokens "$eval_tokens" \
  --seq-len "$seq_len" --tokens-per-step $((4 * seq_len)) --batch-size 4 --recipe lenscope \
  --save-ids "$tmp/ids.safetensors" > "$tmp/ref-matched.json" &
ref=$!
while [ ! -s "$tmp/ids.safetensors" ]; do sleep 2; kill -0 $ref 2>/dev/null || break; done
sleep 2  # (written in one call; let it finish)
ours() { .venv/bin/python benchmarks/bench_tuned_lens.py --ids "$tmp/ids.safetensors" --tokens "$tokens" \
  --eval-tokens "$eval_tokens" --precision fp32 --init "$1" > "$tmp/$2.json"; }
ours identity ours-matched & a=$!
ours least-squares ours-start & b=$!
wait $ref; wait $a; wait $b
.venv/bin/python - "$tmp" "$out" "bash $0 $*" <<'PY'
import json, sys
from pathlib import Path
sys.path.insert(0, "benchmarks")
from machine import record
tmp, out, cmd = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
runs = {k: json.loads((tmp / f"{k}.json").read_text().strip().splitlines()[-1])
        for k in ("ref-matched", "ours-matched", "ours-start")}
machine = record()
machine["command"] = cmd
r, o, s = runs["ref-matched"], runs["ours-matched"], runs["ours-start"]
res = {"machine": machine, "tuned-lens": r, "lenscope": o, "lenscope-start": s,
       "kl_ratio": o["mean_kl_tuned"] / r["mean_kl_tuned"], "kl_ratio_start": s["mean_kl_tuned"] / r["mean_kl_tuned"],
       "cpu_speed_ratio": o["tokens_per_cpu_s"] / r["tokens_per_cpu_s"]}
for name, x in (("tuned-lens", r), ("lenscope", o), ("lenscope, start", s)):
    print(f"{name:18}{x['tokens_per_cpu_s']:>8.2f} tok/CPU-s  mean KL tuned {x['mean_kl_tuned']:.3f}  "
          f"logit {x['mean_kl_logit']:.3f}")
print(f"held-out mean KL, lenscope / library: {res['kl_ratio']:.3f} (identity start), {res['kl_ratio_start']:.3f} "
      f"(least-squares start)")
out.write_text(json.dumps(res, indent=1) + "\n")
print(f"wrote {out}")
PY
