#!/usr/bin/env bash
# Train a tuned lens on smollm2 with the tuned-lens library and with lenscope on the same token ids and
# budget; print tokens/s of each, their ratio, and both held-out mean KLs.
# Needs .venv (./dev) and .venv-tunedlens (see the docstring of reference_tuned_lens.py).
# Usage: benchmarks/tuned_lens_vs_library.sh [TOKENS] [EVAL_TOKENS]
set -euo pipefail
cd "$(dirname "$0")/.."
tokens="${1:-16384}"; eval_tokens="${2:-8192}"
tmp="${BENCH_DIR:-$(mktemp -d)}"; mkdir -p "$tmp"
.venv-tunedlens/bin/python benchmarks/reference_tuned_lens.py --tokens "$tokens" --eval-tokens "$eval_tokens" --out "$tmp/ref-lens" \
  --save-ids "$tmp/ids.safetensors" > "$tmp/ref.json"
.venv/bin/python benchmarks/bench_tuned_lens.py --ids "$tmp/ids.safetensors" --tokens "$tokens" \
  --eval-tokens "$eval_tokens" --out "$tmp/ours-lens" > "$tmp/ours.json"
.venv/bin/python - "$tmp/ref.json" "$tmp/ours.json" <<'PY'
import json, sys
ref, ours = (json.loads(open(p).read().strip().splitlines()[-1]) for p in sys.argv[1:3])
print(f"{'':12}{'tokens/s':>10}{'train s':>10}{'mean KL tuned':>15}{'mean KL logit':>15}")
for r in (ref, ours):
    print(f"{r['impl']:12}{r['tokens_per_s']:>10.1f}{r['train_seconds']:>10.1f}{r['mean_kl_tuned']:>15.3f}{r['mean_kl_logit']:>15.3f}")
print(f"speed ratio lenscope / tuned-lens: {ours['tokens_per_s'] / ref['tokens_per_s']:.2f}x; "
      f"held-out mean KL ratio (lenscope / tuned-lens): {ours['mean_kl_tuned'] / ref['mean_kl_tuned']:.2f}")
PY
