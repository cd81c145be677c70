"""One training step of a cross-layer transcoder, timed by phase (forward, backward, the decoder projection, Adam),
on random rows: where a CLT step's time goes (issue 44).

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/profile_clt_step.py --tokens 512

SmolLM2's shape by default (30 blocks, d 576), TopK, width 1024, k 32. Prints the machine record and, for two steps
after a warm-up, the seconds of each phase.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import record


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--d", type=int, default=576)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--k", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=512)
    args = ap.parse_args(argv)
    print(json.dumps(record()))
    import torch

    from lenscope.features.dictionaries.train import DictSettings
    from lenscope.features.dictionaries.train_clt import CLTTrainable

    torch.manual_seed(0)
    s = DictSettings(kind="topk", role="transcoder", width=args.width, k=args.k, bf16=False)
    m = CLTTrainable(args.layers, args.d, s, seed=0)
    opt = torch.optim.Adam([p for p in m.parameters() if p.requires_grad], lr=1e-3)
    x = torch.randn(args.tokens, args.layers, args.d)
    y = torch.randn(args.tokens, args.layers, args.d)

    def step() -> dict:
        t, a = {}, time.perf_counter()
        loss, _ = m(x, y)
        t["forward"], a = time.perf_counter() - a, time.perf_counter()
        loss.backward()
        t["backward"], a = time.perf_counter() - a, time.perf_counter()
        m.after_backward()
        t["after_backward"], a = time.perf_counter() - a, time.perf_counter()
        opt.step()
        t["adam"], a = time.perf_counter() - a, time.perf_counter()
        opt.zero_grad(set_to_none=True)
        m.after_step(0.0)
        t["after_step"] = time.perf_counter() - a
        return {k: round(v, 2) for k, v in t.items()}

    step()
    for _ in range(2):
        print(json.dumps(step()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
