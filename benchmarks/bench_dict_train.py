"""Training a sparse dictionary on a CPU from the corpus: the issue's target SmolLM2 SAE (resid_post.5, width 4608,
k 32), streamed through the engine under a time budget.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_dict_train.py --max-minutes 30 \
        --out docs/results/features/bench-dict-train-smollm2-resid5.json

(``--max-minutes 2 --buffer 16384 --out ..._smoke.json``: the check that it runs.) Records the tokens trained
on, tokens/s (model loading excluded, the streaming forward passes included), the last batch's training metrics
(explained variance, L0, dead fraction), the curve over tokens, the cost of the streaming pass (the forward
stopped after block 5) against a plain full forward on the same batch, and ``benchmarks/machine.py``'s
``record()`` under ``"machine"``. The dictionary is saved to ``--dict-out`` for ``lenscope dict eval``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import record

ROOT = Path(__file__).resolve().parent.parent


def forward_costs(lm, site: str, seq_len: int, batch: int, repeats: int = 2) -> dict:
    """Seconds of one forward pass over ``batch`` sequences: stopped after ``site`` (what training runs) and whole."""
    import torch

    from lenscope.models.runtime import engine

    ids = torch.randint(0, lm.anatomy.vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(0))
    out = {}
    for name, fn in (("stopped_at_site_s", lambda: engine.capture(lm, ids, [site], stop_after=site)),
                     ("full_forward_s", lambda: engine.run(lm, ids, logits=True))):
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            with torch.no_grad():
                fn()
            best = min(best, time.perf_counter() - t0)
        out[name] = round(best, 4)
    out["ratio"] = round(out["stopped_at_site_s"] / out["full_forward_s"], 3)
    out["sequences"], out["seq_len"] = batch, seq_len
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--site", default="resid_post.5")
    ap.add_argument("--kind", default="topk")
    ap.add_argument("--role", default="sae", help="sae, transcoder or skip (a transcoder is named by its mlp_out site)")
    ap.add_argument("--width", type=int, default=4608)
    ap.add_argument("--k", type=int, default=32)
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "corpus"))
    ap.add_argument("--max-minutes", type=float, default=30.0)
    ap.add_argument("--tokens", type=int, default=0, help="the most tokens to use (0: no limit)")
    ap.add_argument("--batch-size", type=int, default=4096)
    ap.add_argument("--lr", type=float, default=None, help="the base learning rate (default: the settings' own)")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--forward-batch", type=int, default=8)
    ap.add_argument("--buffer", type=int, default=65_536, help="rows in the shuffle buffer")
    ap.add_argument("--dtype", default=None, help="the model's dtype (default float32; bfloat16 where native)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--dict-out", default=None)
    a = ap.parse_args()

    import torch

    import lenscope
    from lenscope.features.dictionaries.train import DictSettings, train

    machine = record()
    t0 = time.perf_counter()
    lm = lenscope.load(a.model, **({"dtype": a.dtype} if a.dtype else {}))
    load_s = time.perf_counter() - t0
    s = DictSettings(kind=a.kind, role=a.role, width=a.width, k=a.k, tokens=a.tokens, max_minutes=a.max_minutes,
                     batch_size=a.batch_size, buffer=a.buffer, lr=a.lr)
    dict_out = a.dict_out or tempfile.mkdtemp()
    Ds = train(s, lm=lm, sites=a.site, data=a.data, seq_len=a.seq_len, forward_batch=a.forward_batch,
               out=dict_out)
    D = Ds[0]
    tr = D.info["training"]
    last = max((d.site for d in Ds), key=lambda n: int(n.rsplit(".", 1)[1]))
    res = {"machine": machine, "model": a.model, "site": a.site, "kind": a.kind, "role": a.role, "width": a.width,
           "k": a.k, "dictionaries": len(Ds), "max_minutes": a.max_minutes, "buffer": a.buffer, "data": a.data,
           "part": "train", "load_s": round(load_s, 2),
           "tokens": tr["tokens"], "seconds": tr["seconds"], "tokens_per_s": tr["tokens_per_s"],
           "threads": torch.get_num_threads(), "model_dtype": str(lm.model.dtype),
           "forward_passes": tr.get("forward_passes"),
           "final": tr["final"], "history": tr["history"], "precision": tr["precision"]["matmul_dtype"],
           "lr": tr["lr"], "scale": tr["scale_in"], "dictionary": str(dict_out),
           "forward_cost": forward_costs(lm, last, a.seq_len, a.forward_batch)}
    if len(Ds) > 1:
        res["final_by_site"] = {d.site: d.info["training"]["final"] for d in Ds}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps({k: res[k] for k in ("tokens", "seconds", "tokens_per_s", "final")}))


if __name__ == "__main__":
    main()
