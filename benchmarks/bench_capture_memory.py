"""Selective capture: peak memory of capturing only the residual stream against a full Trace (issue 17).

Each variant runs in its own fresh process (peak RSS is a per-process high-water mark), one torch thread:

- ``forward``: the model's forward pass, no hooks (the reference);
- ``residual``: ``capture(lm, ids, [("resid_pre", i) for every block])`` — only what a lens reads;
- ``trace``: ``lenscope.trace`` — every site a Trace holds (per-head attention patterns of every block included).

Reported per variant: the peak RSS during the pass (Linux ``VmHWM``, reset after loading) minus the RSS after
loading the model (``peak_over_loaded_mb``), and the bytes of the tensors the variant keeps (``kept_mb``). Run::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_capture_memory.py --out docs/results/bench-capture-memory.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

VARIANTS = ("forward", "residual", "trace")


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> None:
    """Reset the process's peak RSS (VmHWM) to its current RSS (Linux: ``5`` into ``clear_refs``)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def child(variant: str, model: str, n_tokens: int) -> dict:
    import torch

    torch.set_num_threads(1)
    import lenscope
    from lenscope.models.runtime.engine import capture

    lm = lenscope.load(model)
    ids = torch.randint(0, lm.anatomy.vocab_size, (1, n_tokens), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # warm up allocator and lazy imports on a short input, then measure
        lm.model(input_ids=ids[:, :8])
    loaded = _status_mb("VmRSS")
    _reset_peak()
    with torch.no_grad():
        if variant == "forward":
            kept = [lm.model(input_ids=ids, use_cache=False).logits]
        elif variant == "residual":
            kept = list(capture(lm, ids, [("resid_pre", i) for i in range(lm.anatomy.n_layers)]).values())
        else:
            tr = lenscope.trace(lm, ids[0])
            kept = [v for v in vars(tr).values() if isinstance(v, torch.Tensor)]
            kept += list(tr.norms.values())
    peak = _status_mb("VmHWM")
    seen, kept_bytes = set(), 0
    for t in kept:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            kept_bytes += t.untyped_storage().nbytes()
    return {"variant": variant, "loaded_rss_mb": round(loaded, 1), "peak_mb": round(peak, 1),
            "peak_over_loaded_mb": round(peak - loaded, 1),
            "kept_mb": round(kept_bytes / 2**20, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.model, a.tokens)))
        return
    from machine import record

    rows = {}
    for v in VARIANTS:
        out = subprocess.run([sys.executable, __file__, "--child", v, "--model", a.model, "--tokens", str(a.tokens)],
                             capture_output=True, text=True, check=True, env={"OMP_NUM_THREADS": "1",
                                                                              **_env()})
        rows[v] = json.loads(out.stdout.strip().splitlines()[-1])
        print(rows[v], flush=True)
    res = {"machine": record(), "model": a.model, "tokens": a.tokens, "variants": rows,
           "residual_over_trace": round(rows["residual"]["peak_over_loaded_mb"]
                                        / rows["trace"]["peak_over_loaded_mb"], 3)}
    print(json.dumps(res, indent=1))
    if a.out:
        a.out.write_text(json.dumps(res, indent=1) + "\n")


def _env() -> dict:
    import os

    return {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}


if __name__ == "__main__":
    main()
