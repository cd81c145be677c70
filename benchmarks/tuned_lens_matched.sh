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
# SEEDS="1 2" also trains the identity-start lenscope run with those batch orders (TrainSettings.seed), one thread
# each, side by side after the others: how much the order of the same sequences moves the result.
# LIBRARY_RUNS=N repeats the library's run N more times, side by side: its loader (torchdata's DataLoader2) orders
# the batches differently on every run despite its fixed seed, so its spread is measured the same way as lenscope's.
# BENCH_DIR=DIR keeps the runs there and skips any run whose JSON is already in it (then only the rest and the
# combining step run).
# Needs .venv (./dev) and .venv-tunedlens (see the docstring of reference_tuned_lens.py).
# Usage: [SEEDS="1 2"] [LIBRARY_RUNS=N] [BENCH_DIR=DIR] benchmarks/tuned_lens_matched.sh [TOKENS] [EVAL_TOKENS] [SEQ_LEN] [OUT]
set -euo pipefail
cd "$(dirname "$0")/.."
tokens="${1:-4096}"; eval_tokens="${2:-1024}"; seq_len="${3:-256}"
out="${4:-docs/results/bench-tuned-lens-matched-issue22.json}"
tmp="${BENCH_DIR:-$(mktemp -d)}"; mkdir -p "$tmp"
export OMP_NUM_THREADS=1
done_() { [ -s "$tmp/$1.json" ]; }
ref=""
done_ ref-matched || { .venv-tunedlens/bin/python benchmarks/reference_tuned_lens.py --tokens "$tokens" --eval-tokens "$eval_tokens" \
  --seq-len "$seq_len" --tokens-per-step $((4 * seq_len)) --batch-size 4 --recipe lenscope \
  --save-ids "$tmp/ids.safetensors" > "$tmp/ref-matched.json" & ref=$!; }
while [ ! -s "$tmp/ids.safetensors" ]; do sleep 2; [ -n "$ref" ] && kill -0 $ref 2>/dev/null || break; done
sleep 2  # (written in one call; let it finish)
ours() { done_ "$2" || .venv/bin/python benchmarks/bench_tuned_lens.py --ids "$tmp/ids.safetensors" --tokens "$tokens" \
  --eval-tokens "$eval_tokens" --precision fp32 --init "$1" --seed "${3:-0}" > "$tmp/$2.json"; }
ours identity ours-matched & a=$!
ours least-squares ours-start & b=$!
[ -n "$ref" ] && wait $ref; wait $a; wait $b
pids=()
for sd in ${SEEDS:-}; do ours identity "ours-matched-seed$sd" "$sd" & pids+=($!); done
for p in "${pids[@]}"; do wait "$p"; done
pids=()
for k in $(seq 1 "${LIBRARY_RUNS:-0}"); do
  done_ "ref-matched-run$k" || { .venv-tunedlens/bin/python benchmarks/reference_tuned_lens.py --tokens "$tokens" \
    --eval-tokens "$eval_tokens" --seq-len "$seq_len" --tokens-per-step $((4 * seq_len)) --batch-size 4 \
    --recipe lenscope > "$tmp/ref-matched-run$k.json" & pids+=($!); }
done
for p in "${pids[@]}"; do wait "$p"; done
.venv/bin/python - "$tmp" "$out" "SEEDS='${SEEDS:-}' LIBRARY_RUNS=${LIBRARY_RUNS:-0} bash $0 $*" <<'PY'
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
seeds = {int(f.stem.rsplit("seed", 1)[1]): json.loads(f.read_text().strip().splitlines()[-1])
         for f in sorted(tmp.glob("ours-matched-seed*.json"))}
if seeds:  # the identity-start run with other batch orders: the spread that the order alone gives
    ratios = [o["mean_kl_tuned"] / r["mean_kl_tuned"]] + [x["mean_kl_tuned"] / r["mean_kl_tuned"] for x in seeds.values()]
    res["lenscope-seeds"] = seeds
    res["kl_ratio_seeds"] = {"0": ratios[0], **{str(k): v for k, v in zip(seeds, ratios[1:])}}
    res["kl_ratio_mean_over_seeds"] = sum(ratios) / len(ratios)
    res["kl_ratio_min_over_seeds"], res["kl_ratio_max_over_seeds"] = min(ratios), max(ratios)
    print(f"identity start, batch orders {[0, *seeds]}: KL ratios {[round(x, 3) for x in ratios]}")
reps = [json.loads(f.read_text().strip().splitlines()[-1]) for f in sorted(tmp.glob("ref-matched-run*.json"))]
if reps:  # the library's own spread over batch orders (its loader reorders on every run)
    kls = [r["mean_kl_tuned"]] + [x["mean_kl_tuned"] for x in reps]
    res["tuned-lens-reruns"] = reps
    res["library_kl_runs"] = kls
    res["library_kl_mean"] = sum(kls) / len(kls)
    ours = [o["mean_kl_tuned"]] + [x["mean_kl_tuned"] for x in seeds.values()]
    res["lenscope_kl_runs"] = ours
    res["lenscope_kl_mean"] = sum(ours) / len(ours)
    res["kl_ratio_of_means"] = res["lenscope_kl_mean"] / res["library_kl_mean"]
    print(f"library runs {[round(x, 3) for x in kls]}, lenscope runs {[round(x, 3) for x in ours]}: ratio of means "
          f"{res['kl_ratio_of_means']:.4f}")
out.write_text(json.dumps(res, indent=1) + "\n")
print(f"wrote {out}")
PY
