"""Speed and memory of ``lenscope.explain``, and integrated gradients beside captum and inseq.

Five parts (``--parts``, default the first four), one JSON file (``--out``) and a printed table:

1. ``methods``: on a ~30-token sentence, the median time of every method of ``lenscope.explain`` (each doing
   its own trace / forward passes) divided by the median time of one plain forward pass
   (``lm.model(ids, use_cache=False)`` under ``torch.no_grad``), measured interleaved in the same run after a
   warm-up. The trace-based methods are also timed on a shared precomputed ``lenscope.trace``.
   Targets (issue): logit <= 2x a forward pass, alti-logit <= 3x.
   lenscope loads models with eager attention (the trace needs the attention probabilities), so that forward
   pass is the eager one. The same run also times the forward pass of a second copy of the weights loaded
   with the model's default attention implementation (``AutoModelForCausalLM.from_pretrained(folder)``:
   SDPA for smollm2), interleaved in the same rounds, and reports every ratio against both (``ratio`` and
   ``ratio_sdpa``): the SDPA forward is what a user of the plain model pays.
2. ``alti1024``: ALTI-Logit on 1,024 WikiText tokens in a fresh subprocess (this script with ``--child``):
   wall time, the child's peak RSS and its RSS right after loading the model. Target: peak < 2 GB (the whole
   process, the model's weights included).
3. ``ig``: integrated gradients (16 Gauss-Legendre steps, zero embedding baseline, f = logit[target] -
   logit[foil] at the last position) on 128 WikiText tokens: lenscope beside captum's IntegratedGradients and
   inseq's ``integrated_gradients`` (interleaved), and the largest difference of the per-token attributions.
4. ``sweep``: logit and alti-logit time vs input length (``--lengths``), as ratios to a forward pass (eager and
   SDPA, as in part 1).
5. ``altiphases``: ALTI-Logit split into its phases at ``--phase-lengths`` (trace, logit parts, ALTI's
   contribution matrices, carry_back, and the full rollout it replaces), each a ratio to a forward pass in the
   same rounds: where the time goes as inputs grow.

Part 3 needs captum and inseq next to lenscope (a throwaway venv; torch first, or pip pulls a CUDA build)::

    python3 -m venv .venv-bench
    .venv-bench/bin/pip install torch==2.13.0
    .venv-bench/bin/pip install -e . && .venv-bench/bin/pip install captum inseq==0.7.1
    .venv-bench/bin/python benchmarks/bench_explain.py --threads 1 --out docs/results/bench-explain.json

Without them part 3 still times lenscope and records why the references were skipped.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from machine import bf16_native, cpu_name, record  # benchmarks/machine.py

import lenscope

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TEXT = ROOT.parent / "shared" / "data" / "wikitext2" / "wiki.test.raw"
SENTENCE = ("When Mary and John went to the little store on the corner after a long and tiring day at work in the "
            "city, John gave a bottle of milk to")
TARGET, FOIL = " Mary", " John"
METHODS = ("logit", "alti-logit", "alti", "value-zeroing", "grad-norm", "grad-x-input", "ig", "erasure")
TRACE_METHODS = ("logit", "alti-logit", "alti", "value-zeroing")  # can share one precomputed trace
TARGET_RATIOS = {"logit": 2.0, "alti-logit": 3.0}
MEMORY_TARGET_BYTES = 2 * 10**9  # issue 21 (it was 4 GB before the lean trace)


# ----------------------------------------------------------------------------------------------
# helpers


def seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def med(xs) -> float:
    return float(statistics.median(xs))


def machine_info(threads: int) -> dict:
    versions = {}
    for pkg in ("torch", "transformers", "captum", "inseq", "lenscope"):
        try:
            versions[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            versions[pkg] = None
    return {
        "cpu_model_name": cpu_name(), "avx512_bf16": bf16_native(),
        "cpu_count": os.cpu_count(), "torch_threads": threads, "load_average_at_start": os.getloadavg(),
        "python": platform.python_version(), "versions": versions,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def wikitext_ids(lm, path: Path, n: int) -> torch.Tensor:
    """The first ``n`` token ids of the WikiText file (blank lines and the leading heading dropped)."""
    lines = [ln.strip() for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
    text = " ".join(ln for ln in lines if not ln.startswith("="))
    ids = lm.tokenizer(text[: 12 * n], return_tensors="pt")["input_ids"][0]
    if ids.numel() < n:
        raise SystemExit(f"{path} gave only {ids.numel()} tokens; need {n}")
    return ids[:n]


def forward(lm, ids: torch.Tensor):
    """One plain forward pass: the unit every ratio divides by."""
    with torch.no_grad():
        lm.model(ids[None], use_cache=False)


class DefaultAttention:
    """The same weights loaded with the model's default attention implementation (no ``attn_implementation``
    argument: SDPA for the Llama-style decoders), for the second baseline; ``.model`` quacks like ``lm.model``."""

    def __init__(self, lm):
        from transformers import AutoModelForCausalLM

        folder = lm.model.config._name_or_path
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=next(lm.model.parameters()).dtype).eval()
        self.attn_implementation = self.model.config._attn_implementation
        with torch.no_grad():  # the same logits as lenscope's eager model
            ids = torch.arange(5, 21)[None]
            self.max_abs_logit_diff = float((self.model(ids).logits - lm.model(ids).logits).abs().max())


def proc_status_kib(field: str) -> int | None:
    try:
        for ln in Path("/proc/self/status").read_text().splitlines():
            if ln.startswith(field + ":"):
                return int(ln.split()[1])
    except OSError:
        pass
    return None


# ----------------------------------------------------------------------------------------------
# part 1: every method vs one forward pass


def bench_methods(lm, repeats: int, sdpa: DefaultAttention) -> dict:
    ids = lenscope.trace(lm, SENTENCE).input_ids
    run = {m: (lambda m=m: lenscope.explain(lm, ids, TARGET, FOIL, method=m)) for m in METHODS}
    for m in METHODS:  # warm-up: every code path once, then a few forwards
        run[m]()
    for _ in range(3):
        forward(lm, ids)
        forward(sdpa, ids)

    fwd, own, shared, paired = [], {m: [] for m in METHODS}, {m: [] for m in TRACE_METHODS}, {m: [] for m in METHODS}
    fwd_sdpa = []
    trace_times = []
    for _ in range(repeats):  # interleaved: an eager and an SDPA forward pass right before each measured call
        for m in METHODS:
            f = seconds(lambda: forward(lm, ids))
            fwd_sdpa.append(seconds(lambda: forward(sdpa, ids)))
            t = seconds(run[m])
            fwd.append(f)
            own[m].append(t)
            paired[m].append(t / f)
        f = seconds(lambda: forward(lm, ids))
        fwd.append(f)
        fwd_sdpa.append(seconds(lambda: forward(sdpa, ids)))
        box = {}
        trace_times.append(seconds(lambda: box.setdefault("tr", lenscope.trace(lm, ids))))
        for m in TRACE_METHODS:
            shared[m].append(seconds(lambda m=m: lenscope.explain(lm, ids, TARGET, FOIL, method=m, tr=box["tr"])))
    f_med, s_med = med(fwd), med(fwd_sdpa)
    rows = {}
    for m in METHODS:
        rows[m] = {"median_s": med(own[m]), "ratio": med(own[m]) / f_med, "ratio_sdpa": med(own[m]) / s_med,
                   "paired_ratio_median": med(paired[m]), "times_s": own[m]}
        if m in TRACE_METHODS:
            rows[m]["with_shared_trace_s"] = med(shared[m])
            rows[m]["with_shared_trace_ratio"] = med(shared[m]) / f_med
            rows[m]["with_shared_trace_ratio_sdpa"] = med(shared[m]) / s_med
        if m in TARGET_RATIOS:
            rows[m]["target_ratio"] = TARGET_RATIOS[m]
            rows[m]["target_met"] = rows[m]["ratio"] <= TARGET_RATIOS[m]
            rows[m]["target_met_sdpa"] = rows[m]["ratio_sdpa"] <= TARGET_RATIOS[m]
    return {"text": SENTENCE, "n_tokens": int(ids.numel()), "target": TARGET, "foil": FOIL, "repeats": repeats,
            "forward_median_s": f_med, "forward_times_s": fwd, "forward_sdpa_median_s": s_med,
            "forward_sdpa_times_s": fwd_sdpa, "sdpa_attn_implementation": sdpa.attn_implementation,
            "sdpa_max_abs_logit_diff_vs_eager": sdpa.max_abs_logit_diff, "trace_median_s": med(trace_times),
            "trace_ratio": med(trace_times) / f_med, "trace_ratio_sdpa": med(trace_times) / s_med, "methods": rows}


# ----------------------------------------------------------------------------------------------
# part 2: ALTI-Logit on 1,024 tokens, memory of a fresh process


def child_alti(args) -> None:
    """Runs in the subprocess: load, reset the RSS high-water mark, one ALTI-Logit, print one JSON line."""
    torch.set_num_threads(args.threads)
    lm = lenscope.load(args.model)
    ids = wikitext_ids(lm, args.text, args.alti_tokens + 1)
    rss_loaded = proc_status_kib("VmRSS")
    peak_loading = proc_status_kib("VmHWM")
    try:  # Linux: "5" resets VmHWM, so the next reading is the peak of the explanation alone
        Path("/proc/self/clear_refs").write_text("5")
        hwm_reset = True
    except OSError:
        hwm_reset = False
    t0 = time.perf_counter()
    ex = lenscope.explain(lm, ids[:-1], int(ids[-1]), method="alti-logit")
    wall = time.perf_counter() - t0
    print(json.dumps({
        "n_tokens": int(ids.numel() - 1), "wall_s": wall, "rss_after_load_kib": rss_loaded,
        "peak_while_loading_kib": peak_loading, "hwm_reset": hwm_reset,
        "peak_during_explain_kib": proc_status_kib("VmHWM") if hwm_reset else None,
        "invariant_error": float(ex.invariant_error),
    }))


def bench_alti_1024(args) -> dict:
    cmd = [sys.executable, __file__, "--child", "alti1024", "--model", args.model, "--text", str(args.text),
           "--alti-tokens", str(args.alti_tokens), "--threads", str(args.threads)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    total = time.perf_counter() - t0
    if proc.returncode != 0:
        return {"error": proc.stderr[-4000:]}
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # KiB on Linux; max over our children
    res |= {"process_wall_s": total, "peak_rss_bytes": peak, "rss_after_load_bytes": res["rss_after_load_kib"] * 1024,
            "peak_minus_loaded_bytes": peak - res["rss_after_load_kib"] * 1024,
            "target_peak_bytes": MEMORY_TARGET_BYTES, "target_met": peak < MEMORY_TARGET_BYTES}
    return res


# ----------------------------------------------------------------------------------------------
# part 3: integrated gradients vs captum and inseq


def captum_ig(lm, ids, t_id, f_id, steps):
    from captum.attr import IntegratedGradients

    model = lm.model

    def f(x):  # the same scalar lenscope explains, per batch row
        logits = model(inputs_embeds=x, attention_mask=torch.ones(x.shape[:2], dtype=torch.long),
                       use_cache=False).logits[:, -1]
        return logits[:, t_id] - logits[:, f_id]

    ig = IntegratedGradients(f)

    def run():
        e = model.get_input_embeddings()(ids[None]).detach()
        attr = ig.attribute(e, baselines=torch.zeros_like(e), method="gausslegendre", n_steps=steps,
                            internal_batch_size=steps)
        return attr[0].sum(-1).detach()

    return run


def inseq_ig(lm, ids, t_id, f_id, steps):
    """inseq on its own copy of the same converted weights (captum's default, Gauss-Legendre, underneath). Two
    settings are changed so that the method is the one lenscope and captum run: the target function (a
    registered step function, logit[target] - logit[foil]) and the baseline (inseq embeds the unk token by
    default; here its baseline embeddings are zeroed)."""
    import inseq
    from inseq.attr.step_functions import STEP_SCORES_MAP
    from inseq.models import decoder_only

    def logit_diff(args, foil_id: int):
        logits = args.attribution_model.output2logits(args.forward_output)
        tgt = args.target_ids.reshape(logits.shape[0], 1).to(logits.device)
        return logits.gather(-1, tgt).squeeze(-1) - logits[:, foil_id]

    if "lenscope_logit_diff" not in STEP_SCORES_MAP:
        inseq.register_step_function(logit_diff, "lenscope_logit_diff")
    original = decoder_only.get_batch_from_inputs
    if not getattr(original, "_zero_baseline", False):
        def zero_baseline(*a, **kw):
            batch = original(*a, **kw)
            batch.embedding.baseline_embeds = torch.zeros_like(batch.embedding.baseline_embeds)
            return batch
        zero_baseline._zero_baseline = True
        decoder_only.get_batch_from_inputs = zero_baseline

    model = inseq.load_model(lm.model.name_or_path, "integrated_gradients")
    text = lm.tokenizer.decode(ids)
    full = lm.tokenizer.decode(torch.cat([ids, torch.tensor([t_id])]))
    n = ids.numel()

    def run():
        out = model.attribute(text, full, n_steps=steps, internal_batch_size=steps,
                              attributed_fn="lenscope_logit_diff", foil_id=f_id, attr_pos_start=n,
                              show_progress=False, pretty_progress=False)
        seq = out.sequence_attributions[0]
        got = [t.id for t in seq.target]
        if got != ids.tolist() + [t_id]:
            raise RuntimeError("inseq tokenized the text differently from lenscope")
        return seq.target_attributions[:n, -1].sum(-1).detach().float()

    return run


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> dict:
    """max_j |a_j - b_j| / max_j |b_j| (relative to the attributions' scale), and the plain max difference."""
    a, b = a.double().flatten(), b.double().flatten()
    d = (a - b).abs().max()
    return {"max_abs_diff": float(d), "max_rel_diff": float(d / b.abs().max().clamp_min(1e-30))}


def bench_ig(lm, args) -> dict:
    tok = lm.tokenizer
    n = args.ig_tokens
    ids = wikitext_ids(lm, args.text, n + 40)
    # the reference libraries take text: cut where decoding and re-encoding gives back the same ids
    while tok(tok.decode(ids[: n + 1]), return_tensors="pt")["input_ids"][0].tolist() != ids[: n + 1].tolist():
        ids = ids[1:]
        if ids.numel() <= n:
            raise SystemExit("found no WikiText window whose text re-encodes to the same token ids")
    t_id = int(ids[n])
    ids = ids[:n]
    f_id = int(tok(" the")["input_ids"][0]) if tok.decode([t_id]) != " the" else int(tok(" a")["input_ids"][0])
    steps = args.ig_steps
    runners = {"lenscope": lambda: lenscope.explain(lm, ids, t_id, f_id, method="ig", steps=steps).scores}
    skipped = {}
    for name, make in (("captum", captum_ig), ("inseq", inseq_ig)):
        try:
            runners[name] = make(lm, ids, t_id, f_id, steps)
            runners[name]()  # warm-up, and fail here rather than mid-timing
        except Exception as e:  # record why a reference could not run, keep benchmarking the rest
            runners.pop(name, None)
            skipped[name] = f"{type(e).__name__}: {e}"
    runners["lenscope"]()
    times = {k: [] for k in runners}
    scores = {}
    for _ in range(args.ig_repeats):  # interleaved
        for k, fn in runners.items():
            box = {}
            times[k].append(seconds(lambda: box.setdefault("s", fn())))
            scores[k] = box["s"]
    ex = lenscope.explain(lm, ids, t_id, f_id, method="ig", steps=steps)
    res = {"n_tokens": n, "steps": steps, "target": tok.decode([t_id]), "foil": tok.decode([f_id]),
           "repeats": args.ig_repeats, "median_s": {k: med(v) for k, v in times.items()}, "times_s": times,
           "lenscope_completeness_error": ex.info["completeness_error"], "skipped": skipped,
           "scores": {k: v.tolist() for k, v in scores.items()}}
    res["vs_lenscope"] = {k: rel_diff(scores["lenscope"], v) | {"time_ratio": med(times[k]) / med(times["lenscope"])}
                          for k, v in scores.items() if k != "lenscope"}
    if "captum" in scores and "inseq" in scores:
        res["inseq_vs_captum"] = rel_diff(scores["inseq"], scores["captum"])
    return res


# ----------------------------------------------------------------------------------------------
# part 4: time vs length


def bench_sweep(lm, args, sdpa: DefaultAttention) -> dict:
    ids_all = wikitext_ids(lm, args.text, max(args.lengths) + 1)
    out = {}
    for n in args.lengths:
        ids, t_id = ids_all[:n], int(ids_all[n])
        fwd, fwd_sdpa, t = [], [], {"logit": [], "alti-logit": []}
        forward(lm, ids)
        forward(sdpa, ids)
        for _ in range(args.sweep_repeats):
            for m in t:
                fwd.append(seconds(lambda: forward(lm, ids)))
                fwd_sdpa.append(seconds(lambda: forward(sdpa, ids)))
                t[m].append(seconds(lambda m=m: lenscope.explain(lm, ids, t_id, method=m)))
        f, fs = med(fwd), med(fwd_sdpa)
        out[str(n)] = {"forward_median_s": f, "forward_sdpa_median_s": fs} | {
            m: {"median_s": med(v), "ratio": med(v) / f, "ratio_sdpa": med(v) / fs, "times_s": v} for m, v in t.items()}
        print(f"  {n:5d} tokens: forward {f:.3f}s (sdpa {fs:.3f}s)  logit {out[str(n)]['logit']['ratio']:.2f}x "
              f"({out[str(n)]['logit']['ratio_sdpa']:.2f}x sdpa)  alti-logit {out[str(n)]['alti-logit']['ratio']:.2f}x "
              f"({out[str(n)]['alti-logit']['ratio_sdpa']:.2f}x sdpa)", flush=True)
    return out


# ----------------------------------------------------------------------------------------------
# part 5: where ALTI-Logit's time goes


def bench_alti_phases(lm, args) -> dict:
    """ALTI-Logit in its phases, each as a ratio to a forward pass measured in the same rounds: the trace (lean
    above ``trace.KEEP_BYTES``: probabilities recomputed when read), the logit explanation on that trace
    (the per-layer logit parts), ``mixing_matrices(rollout=False)`` (ALTI's contributions), ``carry_back`` of
    one row per layer, the former full rollout (which carry_back replaces), and the whole explanation."""
    from lenscope.mixing.alti import carry_back, mixing_matrices, rollout
    from lenscope.models.runtime.trace import recompute_probs

    ids_all = wikitext_ids(lm, args.text, max(args.phase_lengths) + 1)
    out = {}
    for n in args.phase_lengths:
        ids, t_id = ids_all[:n], int(ids_all[n])
        forward(lm, ids)
        t = {k: [] for k in ("forward", "trace", "logit_on_trace", "mixing", "carry_back", "rollout", "alti_logit")}
        tr = mm = None
        for _ in range(args.phase_repeats):
            tr = mm = None  # the previous round's trace and matrices go first
            t["forward"].append(seconds(lambda: forward(lm, ids)))
            t0 = time.perf_counter()
            tr = lenscope.trace(lm, ids)
            t["trace"].append(time.perf_counter() - t0)
            t["logit_on_trace"].append(seconds(lambda: lenscope.explain(lm, ids, t_id, method="logit", tr=tr)))
            t0 = time.perf_counter()
            mm = mixing_matrices(lm.anatomy, tr, "alti", rollout=False)
            t["mixing"].append(time.perf_counter() - t0)
            deltas = torch.randn(mm.contributions.shape[0], 1, n, dtype=torch.float64)
            t["carry_back"].append(seconds(lambda: carry_back(mm.contributions, deltas)))
            t["rollout"].append(seconds(lambda: rollout(mm.contributions)))
            tr = mm = None
            t["alti_logit"].append(seconds(lambda: lenscope.explain(lm, ids, t_id, method="alti-logit")))
        f = med(t["forward"])
        out[str(n)] = {"forward_median_s": f, "lean_trace": recompute_probs(lm, n)} | {
            k: {"median_s": med(v), "ratio": med(v) / f, "times_s": v} for k, v in t.items() if k != "forward"}
        r = out[str(n)]
        print(f"  {n:5d} tokens: forward {f:.3f}s; x forward: trace {r['trace']['ratio']:.2f}, logit on trace "
              f"{r['logit_on_trace']['ratio']:.2f}, ALTI matrices {r['mixing']['ratio']:.2f}, carry_back "
              f"{r['carry_back']['ratio']:.3f} (rollout {r['rollout']['ratio']:.2f}); "
              f"ALTI-Logit {r['alti_logit']['ratio']:.2f}", flush=True)
    return out


# ----------------------------------------------------------------------------------------------
# report


def print_report(res: dict) -> None:
    m = res["machine"]
    print(f"\nCPU: {m['cpu_model_name']}  avx512_bf16={m['avx512_bf16']}  threads={m['torch_threads']}  "
          f"torch {m['versions']['torch']}  transformers {m['versions']['transformers']}  {m['date']}")
    if "methods" in res:
        p = res["methods"]
        print(f"\n[1] {p['n_tokens']} tokens, forward {p['forward_median_s'] * 1e3:.1f} ms eager, "
              f"{p['forward_sdpa_median_s'] * 1e3:.1f} ms {p['sdpa_attn_implementation']} (median), "
              f"trace {p['trace_ratio']:.2f}x")
        print(f"{'method':15}{'median s':>10}{'x eager':>9}{'x sdpa':>8}{'paired x':>10}{'shared trace x':>16}"
              f"{'target':>9}")
        for name, r in p["methods"].items():
            sh = f"{r['with_shared_trace_ratio']:.2f}" if "with_shared_trace_ratio" in r else "-"
            tg = (f"<={r['target_ratio']:g} {'ok' if r['target_met'] else 'MISS'}") if "target_ratio" in r else ""
            print(f"{name:15}{r['median_s']:>10.3f}{r['ratio']:>9.2f}{r['ratio_sdpa']:>8.2f}"
                  f"{r['paired_ratio_median']:>10.2f}{sh:>16}{tg:>9}")
    if "alti1024" in res:
        p = res["alti1024"]
        if "error" in p:
            print(f"\n[2] ALTI-Logit 1024 tokens failed:\n{p['error']}")
        else:
            gb = {k: p[k] / 1e9 for k in ("peak_rss_bytes", "rss_after_load_bytes", "peak_minus_loaded_bytes")}
            print(f"\n[2] ALTI-Logit on {p['n_tokens']} tokens: {p['wall_s']:.1f} s; "
                  f"peak RSS {gb['peak_rss_bytes']:.2f} GB (after load {gb['rss_after_load_bytes']:.2f} GB, "
                  f"+{gb['peak_minus_loaded_bytes']:.2f} GB); "
                  f"target < {MEMORY_TARGET_BYTES / 1e9:g} GB: {'met' if p['target_met'] else 'MISSED'}")
    if "ig" in res:
        p = res["ig"]
        print(f"\n[3] IG, {p['steps']} steps, {p['n_tokens']} tokens, target {p['target']!r} foil {p['foil']!r}")
        for k, s in p["median_s"].items():
            extra = p["vs_lenscope"].get(k)
            cmp = (f"  {extra['time_ratio']:.2f}x lenscope's time, max rel diff {extra['max_rel_diff']:.1e}"
                   if extra else "")
            print(f"  {k:10}{s:8.2f} s{cmp}")
        for k, why in p["skipped"].items():
            print(f"  {k}: skipped ({why})")
    if "sweep" in res:
        print("\n[4] length sweep (x forward: eager / sdpa)")
        print(f"{'tokens':>8}{'fwd s':>8}{'sdpa s':>8}{'logit':>8}{'/sdpa':>7}{'alti-logit':>12}{'/sdpa':>7}")
        for n, r in res["sweep"].items():
            print(f"{n:>8}{r['forward_median_s']:>8.3f}{r['forward_sdpa_median_s']:>8.3f}{r['logit']['ratio']:>8.2f}"
                  f"{r['logit']['ratio_sdpa']:>7.2f}{r['alti-logit']['ratio']:>12.2f}{r['alti-logit']['ratio_sdpa']:>7.2f}")
    if "altiphases" in res:
        print("\n[5] ALTI-Logit phases (x forward)")
        cols = ("trace", "logit_on_trace", "mixing", "carry_back", "rollout", "alti_logit")
        print(f"{'tokens':>8}{'fwd s':>8}" + "".join(f"{c:>16}" for c in cols))
        for n, r in res["altiphases"].items():
            print(f"{n:>8}{r['forward_median_s']:>8.3f}" + "".join(f"{r[c]['ratio']:>16.3f}" for c in cols))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--parts", default="methods,alti1024,ig,sweep")
    ap.add_argument("--repeats", type=int, default=5, help="measured rounds of part 1")
    ap.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    ap.add_argument("--alti-tokens", type=int, default=1024)
    ap.add_argument("--ig-tokens", type=int, default=128)
    ap.add_argument("--ig-steps", type=int, default=16)
    ap.add_argument("--ig-repeats", type=int, default=3)
    ap.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[16, 32, 64, 128, 256, 512])
    ap.add_argument("--sweep-repeats", type=int, default=3)
    ap.add_argument("--phase-lengths", type=lambda s: [int(x) for x in s.split(",")], default=[128, 512, 1024])
    ap.add_argument("--phase-repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(),
                    help="torch threads (on a machine shared with other jobs, 1 gives steadier timings)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child == "alti1024":
        return child_alti(args)

    torch.set_num_threads(args.threads)
    parts = args.parts.split(",")
    exe = os.path.relpath(sys.executable) if sys.executable.startswith(os.getcwd()) else sys.executable
    res = {"command": " ".join([exe] + sys.argv), "machine": record() | machine_info(args.threads)}
    if "alti1024" in parts:  # first: the only child process, so RUSAGE_CHILDREN is its peak
        print("[2] ALTI-Logit on 1024 tokens (subprocess) ...", flush=True)
        res["alti1024"] = bench_alti_1024(args)
    lm = lenscope.load(args.model)
    sdpa = DefaultAttention(lm) if ("methods" in parts or "sweep" in parts) else None
    if "methods" in parts:
        print("[1] methods vs forward ...", flush=True)
        res["methods"] = bench_methods(lm, args.repeats, sdpa)
    if "ig" in parts:
        print("[3] integrated gradients vs captum / inseq ...", flush=True)
        res["ig"] = bench_ig(lm, args)
    if "sweep" in parts:
        print("[4] length sweep ...", flush=True)
        res["sweep"] = bench_sweep(lm, args, sdpa)
    if "altiphases" in parts:
        print("[5] ALTI-Logit phases ...", flush=True)
        res["altiphases"] = bench_alti_phases(lm, args)
    res["machine"]["load_average_at_end"] = os.getloadavg()
    print_report(res)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1) + "\n")
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
