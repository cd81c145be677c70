"""Speed of ``lenscope.generate``: every generated token explained from one pass, against one explain per step
and against inseq's step-wise attribution (issue 21). Writes one JSON file (``--out``) and prints a summary.

smollm2, a ``--prompt-tokens`` (30) token prompt, ``--tokens`` (32) generated tokens (greedy; generation stops
early at an end-of-sequence token, so the count actually generated is recorded):

- (a) ``generate_alti_logit_s``: everything ``generate(..., explain=("alti-logit",))`` does after decoding (one
  trace, per-step statistics and depth, all ALTI-Logit explanations); the decoding loop is reported apart
  (``generation_loop_s``);
- (b) ``explain_full_s``: one ``lenscope.explain(..., method="alti-logit")`` of the whole final sequence (its
  last position, target its top-1, foil the runner-up);
- (c) ``explain_per_step_s``: ``lenscope.explain`` once per generated step on that step's prefix (what a
  step-wise tool does);
- ratios ``a_over_b`` (target <= 3) and ``c_over_a`` (target >= 10);
- (d) the gradient methods ``grad-x-input`` and ``ig`` (16 Gauss-Legendre steps, zero baseline), explaining each
  generated token's logit (``foil=None``): generate's batch (all steps as rows of one batch) vs explain once per
  step (``--grad-repeats``, default 1, after a short warm-up);
- (e) inseq (``--inseq-python``, a separate venv with inseq; the model saved with ``save_pretrained``) run
  step-wise over the same generated tokens with ``input_x_gradient`` and ``integrated_gradients`` (the same
  objective, the generated token's logit; zero baseline; 16 steps), in one ``model.attribute`` call per method,
  timed in its own process (after a warm-up call); lenscope's batched times of (d) beside them. Where inseq
  cannot run, the file says why.

The inseq venv (inseq 0.7.1 runs with transformers 5.23 and captum 0.9): torch 2.13.0 shared from the main venv
(a folder of symlinks on a ``.pth`` path, no second torch download), then inseq from PyPI::

    python3 -m venv /tmp/inseq-venv && mkdir -p /tmp/inseq-torch
    for p in torch torch-2.13.0+cpu.dist-info torchgen; do ln -s $PWD/.venv/lib/python3.11/site-packages/$p \
        /tmp/inseq-torch/; done
    echo /tmp/inseq-torch > /tmp/inseq-venv/lib/python3.11/site-packages/torch-shared.pth
    /tmp/inseq-venv/bin/pip install inseq typing_extensions sympy networkx jinja2 fsspec filelock

Every time is the median of ``--repeats`` runs, the variants interleaved, after a warm-up. Run it quietly::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_generate.py --threads 1 --out docs/results/generate-speed.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = ("The history of the old harbour town begins with a small fishing village on the river mouth, where "
          "traders from the south came every summer to buy salt, wool and dried fish. In the twelfth century")

INSEQ_CHILD = r'''
import json, sys, time, torch
import inseq
from inseq.models import decoder_only
folder, ids_json, start, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
ids = json.loads(ids_json)
torch.set_num_threads(int(sys.argv[5]))
original = decoder_only.get_batch_from_inputs
def zero_baseline(*a, **kw):  # lenscope's baseline: the zero embedding (inseq embeds the unk token by default)
    batch = original(*a, **kw)
    batch.embedding.baseline_embeds = torch.zeros_like(batch.embedding.baseline_embeds)
    return batch
decoder_only.get_batch_from_inputs = zero_baseline
import importlib.metadata as md
out = {"versions": {k: md.version(k) for k in ("inseq", "transformers", "torch", "captum")}}
for method in ("input_x_gradient", "integrated_gradients"):
    try:
        model = inseq.load_model(folder, method)
        tok = model.tokenizer
        prompt, full = tok.decode(ids[:start]), tok.decode(ids)
        kw = dict(n_steps=steps, internal_batch_size=steps) if method == "integrated_gradients" else {}
        def run():
            return model.attribute(prompt, full, attributed_fn="logit", attr_pos_start=start, show_progress=False,
                                   pretty_progress=False, **kw)
        run()  # warm-up
        times = []
        for _ in range(int(sys.argv[6])):
            t = time.perf_counter(); res = run(); times.append(time.perf_counter() - t)
        seq = res.sequence_attributions[0]
        got = [t.id for t in seq.target]
        out[method] = {"times_s": times, "same_tokens": got == ids, "n_steps_attributed": len(got) - start}
    except Exception as e:
        out[method] = {"error": f"{type(e).__name__}: {e}"[:500]}
print("INSEQ-JSON " + json.dumps(out))
'''


def med(xs):
    return statistics.median(xs)


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def prompt_ids(lm, n: int):
    import torch

    ids = lm.tokenizer(PROMPT, return_tensors="pt")["input_ids"][0]
    if ids.numel() < n:
        raise SystemExit(f"the benchmark prompt has only {ids.numel()} tokens")
    return torch.as_tensor(ids[:n])


def part_alti_logit(lm, ids, n_new: int, repeats: int) -> dict:
    import lenscope

    g = lenscope.generate(lm, ids, n_new, explain=("alti-logit",))  # warm-up, and the sequence every part uses
    full, P = g.ids, g.prompt_len
    steps = list(range(P, len(full)))
    last_top, last_runner = _last_prediction(lm, full)
    times = {"a": [], "b": [], "c": [], "loop": []}
    for _ in range(repeats):  # interleaved
        _, gg = timed(lambda: lenscope.generate(lm, ids, n_new, explain=("alti-logit",)))
        times["a"].append(sum(v for k, v in gg.seconds.items() if k != "generate"))
        times["loop"].append(gg.seconds["generate"])
        times["b"].append(timed(lambda: lenscope.explain(lm, full, last_top, last_runner, method="alti-logit"))[0])
        times["c"].append(timed(lambda: [lenscope.explain(lm, full[:p], int(full[p]), int(g.foil_ids[i]),
                                                          method="alti-logit") for i, p in enumerate(steps)])[0])
    a, b, c = med(times["a"]), med(times["b"]), med(times["c"])
    return {"prompt_tokens": P, "generated_tokens": len(steps), "sequence_tokens": len(full),
            "text": g.text, "generation_loop_s": med(times["loop"]), "generate_alti_logit_s": a,
            "generate_breakdown_s": {k: v for k, v in g.seconds.items()}, "explain_full_s": b,
            "explain_per_step_s": c, "a_over_b": a / b, "c_over_a": c / a, "targets": {"a_over_b": "<= 3",
                                                                                    "c_over_a": ">= 10"},
            "times_s": times, "ids": full.tolist()}


def _last_prediction(lm, full):
    import torch

    with torch.no_grad():
        logits = lm.model(full[None]).logits[0, -1]
    top2 = logits.topk(2).indices
    return int(top2[0]), int(top2[1])


def part_gradients(lm, ids, n_new: int, repeats: int) -> dict:
    """(d): generate's batch vs explain once per step, both explaining the generated token's logit (no foil: the
    objective inseq's ``"logit"`` step function attributes, so (e) compares with these same numbers)."""
    import lenscope

    out = {}
    for m in ("grad-x-input", "ig"):
        opts = {"steps": 16} if m == "ig" else {}
        g = lenscope.generate(lm, ids, 2, explain=(m,), foil=None, **opts)  # warm-up (short)
        g = None
        batched, per_step = [], []
        for _ in range(repeats):  # interleaved
            gg = lenscope.generate(lm, ids, n_new, explain=(m,), foil=None, **opts)
            g = g or gg
            batched.append(gg.seconds[m])
            full, P = g.ids, g.prompt_len
            per_step.append(timed(lambda: [lenscope.explain(lm, full[:p], int(full[p]), None, method=m, **opts)
                                           for p in range(P, len(full))])[0])
        out[m] = {"batched_s": med(batched), "per_step_s": med(per_step), "per_step_over_batched":
                  med(per_step) / med(batched), "times_s": {"batched": batched, "per_step": per_step},
                  "foil": None}
    return out


def part_inseq(lm, ids, n_new: int, repeats: int, python: str, threads: int, ours: dict | None) -> dict:
    """(e): inseq's step-wise attribution over the same generated tokens, in its own venv and process; beside it
    lenscope's batched times of part (d) (the same objective; run here when (d) was not asked for)."""
    if not python or not Path(python).exists():
        return {"skipped": f"no inseq interpreter at {python!r} (make a venv with inseq and pass --inseq-python)"}
    import lenscope

    g = lenscope.generate(lm, ids, n_new, explain=())
    full = g.ids.tolist()
    res = {"objective": "logit of the generated token (no foil), zero baseline, 16 Gauss-Legendre steps for ig",
           "lenscope": ours if ours is not None else part_gradients(lm, ids, n_new, repeats)}
    with tempfile.TemporaryDirectory() as d:
        lm.model.save_pretrained(d)
        lm.tokenizer.save_pretrained(d)
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        proc = subprocess.run([python, "-c", INSEQ_CHILD, d, json.dumps(full), str(g.prompt_len), "16", str(threads),
                               str(repeats)], capture_output=True, text=True, env=env, timeout=3600)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("INSEQ-JSON ")), None)
    if line is None:
        res["inseq"] = {"error": f"exit {proc.returncode}: {proc.stderr.strip()[-800:]}"}
        return res
    ins = json.loads(line[len("INSEQ-JSON "):])
    res["inseq"] = ins
    for ours, theirs in (("grad-x-input", "input_x_gradient"), ("ig", "integrated_gradients")):
        t = ins.get(theirs, {})
        if "times_s" in t:
            t["median_s"] = med(t["times_s"])
            t["over_lenscope_batched"] = t["median_s"] / res["lenscope"][ours]["batched_s"]
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--prompt-tokens", type=int, default=30)
    ap.add_argument("--tokens", type=int, default=32, help="tokens to generate")
    ap.add_argument("--repeats", type=int, default=3, help="repeats of (a)-(c)")
    ap.add_argument("--grad-repeats", type=int, default=1,
                    help="repeats of (d) and (e): integrated gradients over 32 steps runs minutes per variant")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--parts", default="alti-logit,gradients,inseq")
    ap.add_argument("--inseq-python", default="/tmp/inseq-venv/bin/python")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "generate-speed.json"))
    args = ap.parse_args(argv)

    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from machine import record

    import lenscope

    torch.set_num_threads(args.threads)
    lm = lenscope.load(args.model)
    ids = prompt_ids(lm, args.prompt_tokens)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    res = {"machine": record(), "model": args.model, "prompt_tokens": args.prompt_tokens, "tokens": args.tokens,
           "repeats": args.repeats, "grad_repeats": args.grad_repeats}
    if "alti-logit" in parts:
        print("[a-c] ALTI-Logit: generate vs one full explain vs explain per step ...", flush=True)
        res["alti_logit"] = part_alti_logit(lm, ids, args.tokens, args.repeats)
        r = res["alti_logit"]
        print(f"  generate (after decoding) {r['generate_alti_logit_s']:.3f}s, loop {r['generation_loop_s']:.3f}s; "
              f"one explain {r['explain_full_s']:.3f}s; per step {r['explain_per_step_s']:.3f}s; "
              f"a/b {r['a_over_b']:.2f} (<= 3), c/a {r['c_over_a']:.1f} (>= 10)", flush=True)
    if "gradients" in parts:
        print("[d] gradient methods: batched vs per step ...", flush=True)
        res["gradients"] = part_gradients(lm, ids, args.tokens, args.grad_repeats)
        for m, r in res["gradients"].items():
            print(f"  {m}: batched {r['batched_s']:.3f}s, per step {r['per_step_s']:.3f}s "
                  f"({r['per_step_over_batched']:.1f}x)", flush=True)
    if "inseq" in parts:
        print("[e] inseq step-wise attribution ...", flush=True)
        res["inseq"] = part_inseq(lm, ids, args.tokens, args.grad_repeats, args.inseq_python, args.threads,
                                  res.get("gradients"))
        print("  " + json.dumps({k: (v if k != "lenscope" else "...") for k, v in res["inseq"].items()})[:600],
              flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
