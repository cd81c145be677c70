r"""Speed of lenscope's batched interventions on smollm2 (CPU), against

1. TransformerLens on the same weights and prompt: a full residual-stream patching sweep (every layer x every
   position), denoising, metric = logit(IO) - logit(S) at the last token, two ways in the same run:

   - its own patching utility (``transformer_lens.patching.get_act_patch_resid_pre``): one forward pass per
     patch (what the library's utility does);
   - what a careful TransformerLens user writes: the corrupted prompt repeated ``--tl-batch`` times (default
     64, lenscope's batch), one ``run_with_hooks`` per batch, one hook per layer of ``blocks.{l}.hook_resid_pre``
     that writes the clean activation into row i at its position (the rows whose patch is at that layer).

   transformer_lens is not a lenscope dependency: install it in a separate venv (``.venv-tl``: ``pip install
   torch==2.13.0`` first, then ``transformer_lens``) and pass ``--tl-site .venv-tl/lib/python3.11/site-packages``
   (appended to ``sys.path``); without it the TL entries record the import error. TL 4.x has no
   ``HookedTransformer``; its ``TransformerBridge.boot_transformers`` is used with ``hf_model=`` a deep copy of
   ``lm.model`` (the bridge wraps the modules it is given, so lenscope's own model stays untouched and both
   parts run in one process).
2. ROME-style causal tracing as one forward pass per restored state (a loop written here, with
   ``lenscope.models.runtime.engine.run`` and one edit set per call) against ``causal_trace`` (batched).

One command writes docs/results/interventions/bench.json:

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_interventions.py --short --repeats 1 \
        --samples 2 --fact "The capital of Czech Republic is|Czech Republic| Prague" \
        --tl-site .venv-tl/lib/python3.11/site-packages --out docs/results/interventions/bench.json

(the sizes of the committed file: a 14-token prompt pair, one repeat, 2 noise samples, to fit a loaded 2-core
machine; without ``--short`` the 20-token pair, ``--repeats 2 --samples 10`` the earlier sizes.)

3. ``--reuse``: the same residual sweep (every layer x position, denoising, logit difference at the last token) on a
   64-token prompt pair, three ways in the same run, one repeat of each in turn: the sweep that skips what a patch
   cannot change (``activation_patching``'s default ``reuse=True``: the base run's earlier blocks and positions
   reused), the full recomputation (``reuse=False``, every row the whole model over the whole prompt, logits at
   every position as before), and a plain batched forward of the same rows (the corrupted prompt in batches of 64,
   no hooks, the last position's logits only). Both ratios are to the plain forward; the two sweeps' results are
   compared (max |difference| of the raw logit differences). It writes its own file:

       OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_interventions.py --reuse --repeats 1 \
           --out docs/results/interventions/reuse.json

   (``--short``: the 14-token pair, a quick check.)

Equal results are checked to 1e-4 (patching, raw logit difference) and 1e-5 (causal tracing AIE). The three
sweep timings are interleaved (one repeat of each in turn), best of ``--repeats``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

import lenscope
from lenscope.interventions import activation_patching, causal_trace
from lenscope.interventions.tracing import KINDS, embedding_std, subject_positions, window_layers
from lenscope.models.loading.load import encode, resolve_token
from lenscope.models.runtime.engine import Edit, run

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import record

# a 20-token prompt of the shared IOI set (/work/shared/data/logit_explanations/ioi_with_targets), names swapped
CLEAN = "When David and Carol got a raspberry at the theater, Carol decided to give the raspberry to"
CORRUPTED = "When Carol and David got a raspberry at the theater, David decided to give the raspberry to"
TARGET, FOIL = " David", " Carol"
# a shorter pair (14 tokens) for a loaded machine: --short
SHORT = ("When Mary and John went to the store, John gave a drink to",
         "When John and Mary went to the store, Mary gave a drink to", " Mary", " John")
# a 64-token pair for --reuse (the same names swapped)
LONG = ("After a long day at the office, David and Carol walked down to the old market by the river, where they bought "
        "fresh bread, a basket of red apples, some cheese and a small jar of honey for the weekend. When they got back "
        "home that evening, Carol decided to give the jar of honey to",
        "After a long day at the office, Carol and David walked down to the old market by the river, where they bought "
        "fresh bread, a basket of red apples, some cheese and a small jar of honey for the weekend. When they got back "
        "home that evening, David decided to give the jar of honey to", " David", " Carol")
FACT = ("The Eiffel Tower is located in the city of", "The Eiffel Tower", " Paris")


def timed(fn, repeats: int):
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return out, min(times), times


# ------------------------------------------------------------------------------------ TransformerLens

def load_tl(lm):
    """A TransformerLens model holding the same weights as ``lm.model`` (no weight processing), built on a deep
    copy of ``lm.model`` (the bridge wraps the modules it is given): 3.x's
    ``HookedTransformer.from_pretrained_no_processing(..., hf_model=copy)``, else 4.x's
    ``TransformerBridge.boot_transformers(<the local folder lenscope loaded>, hf_model=copy)``.
    Returns (model, how, errors)."""
    import copy

    import transformer_lens

    hf = copy.deepcopy(lm.model)
    errors = []
    folder = getattr(lm.model.config, "_name_or_path", "")
    try:
        HookedTransformer = transformer_lens.HookedTransformer
    except Exception as e:  # noqa: BLE001 - 4.x raises ImportError on access
        HookedTransformer = None
        errors.append(f"transformer_lens.HookedTransformer: {type(e).__name__}: {str(e)[:300]}")
    if HookedTransformer is not None:
        kw = {"hf_model": hf, "tokenizer": lm.tokenizer, "device": "cpu", "dtype": torch.float32}
        for name in ("HuggingFaceTB/SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M"):
            try:
                m = HookedTransformer.from_pretrained_no_processing(name, **kw)
                how = f"HookedTransformer.from_pretrained_no_processing({name!r}, hf_model=copy of lm.model)"
                return m, how, errors
            except Exception as e:  # noqa: BLE001 - recorded in the JSON
                errors.append(f"from_pretrained_no_processing({name!r}): {type(e).__name__}: {str(e)[:400]}")
    try:
        from transformer_lens.model_bridge import TransformerBridge

        m = TransformerBridge.boot_transformers(folder, hf_model=hf, tokenizer=lm.tokenizer, device="cpu",
                                                dtype=torch.float32)
        return m, "TransformerBridge.boot_transformers(<lenscope's smollm2 folder>, hf_model=copy of lm.model)", errors
    except Exception as e:  # noqa: BLE001
        errors.append(f"TransformerBridge.boot_transformers({folder!r}): {type(e).__name__}: {str(e)[:400]}")
    return None, None, errors


def tl_resid_sweep(tl, c_ids, x_ids, tid, fid):
    from transformer_lens import patching

    def metric(logits):
        return logits[0, -1, tid] - logits[0, -1, fid]

    def go():
        _, cache = tl.run_with_cache(c_ids[None])
        return patching.get_act_patch_resid_pre(tl, x_ids[None], cache, metric)

    return go


def tl_resid_sweep_batched(tl, c_ids, x_ids, tid, fid, L, P, batch):
    """The same sweep as a careful TransformerLens user batches it: the corrupted prompt repeated ``batch`` times,
    one ``run_with_hooks`` per batch, one hook per layer that writes the clean ``hook_resid_pre`` into the rows
    patched at that layer, each at its own position. Returns ``(layer, pos)`` logit differences."""
    names = [f"blocks.{layer}.hook_resid_pre" for layer in range(L)]

    @torch.no_grad()
    def go():
        _, cache = tl.run_with_cache(c_ids[None], names_filter=lambda n: n in names)
        clean = {n: cache[n][0] for n in names}  # (pos, d_model)
        patches = torch.tensor([(layer, p) for layer in range(L) for p in range(P)])
        out = torch.empty(L * P)
        for start in range(0, len(patches), batch):
            chunk = patches[start : start + batch]
            hooks = []
            for layer in chunk[:, 0].unique().tolist():
                rows = (chunk[:, 0] == layer).nonzero().flatten()
                pos = chunk[rows, 1]

                def hook(act, hook, rows=rows, pos=pos, src=clean[names[layer]]):
                    act[rows, pos] = src[pos].to(act.dtype)
                    return act

                hooks.append((names[layer], hook))
            logits = tl.run_with_hooks(x_ids[None].expand(len(chunk), -1), fwd_hooks=hooks)
            out[start : start + len(chunk)] = (logits[:, -1, tid] - logits[:, -1, fid]).float()
        return out.view(L, P)

    return go


# ------------------------------------------------------------------------------- causal tracing loop

@torch.no_grad()
def trace_loop(lm, prompt, subject, target, samples=10, window=10, seed=0):
    """ROME's way: one forward pass per (sample, restored state), same noise and restorations as
    ``causal_trace`` (same generator draws), via ``hooks.run`` with one edit set per call."""
    ids = encode(lm, prompt)
    P, L = ids.numel(), lm.anatomy.n_layers
    subj = subject_positions(lm, prompt, subject)
    nu = 3.0 * embedding_std(lm)
    tid = resolve_token(lm, target)
    keys = [(s, layer) for s in ("resid", "attn", "mlp") for layer in range(L)]
    _, clean = run(lm, ids[None], capture=keys)
    clean = {k: v[0] for k, v in clean.items()}
    d = clean[("resid", 0)].shape[-1]
    eps = torch.randn(samples, len(subj), d, generator=torch.Generator().manual_seed(seed)) * nu
    subj_t, zero = torch.tensor(subj), torch.zeros(len(subj), dtype=torch.long)
    one = torch.zeros(1, dtype=torch.long)

    def prob(edits):
        lg, _ = run(lm, ids[None], edits)
        return float(lg[0, -1].float().softmax(-1)[tid])

    p_corr = sum(prob([Edit("resid", 0, zero, subj_t, eps[s], mode="add")]) for s in range(samples)) / samples
    maps = {k: torch.zeros(L, P) for k in KINDS}
    first = min(subj)
    n_runs = samples
    for kind in KINDS:
        for layer in range(L):
            for p in range(first, P):
                pt = torch.tensor([p])
                acc = 0.0
                for s in range(samples):
                    edits = [Edit("resid", 0, zero, subj_t, eps[s], mode="add")]
                    if kind == "resid":
                        edits.append(Edit("resid", layer, one, pt, clean[("resid", layer)][pt]))
                    else:
                        edits += [Edit(kind, lw, one, pt, clean[(kind, lw)][pt])
                                  for lw in window_layers(layer, window, L)]
                    acc += prob(edits)
                    n_runs += 1
                maps[kind][layer, p] = acc / samples - p_corr
    return maps, p_corr, n_runs


def run_sweep(args, lm, res, c_ids, x_ids, tid, fid, L, P) -> None:
    clean, corrupted, target, foil = args.pair

    def ours():
        return activation_patching(lm, clean, corrupted, target, foil, what="resid", batch_size=64)

    sweep = {"prompt_clean": clean, "prompt_corrupted": corrupted, "target": target, "foil": foil,
             "n_tokens": P, "patches": L * P,
             "lenscope_batch_size": 64, "tl_batch_size": args.tl_batch, "repeats": args.repeats}
    runners = {"lenscope": ours}
    try:
        import transformer_lens

        sweep["transformer_lens_version"] = getattr(transformer_lens, "__version__", None)
        try:
            from importlib.metadata import version

            sweep["transformer_lens_version"] = version("transformer_lens")
        except Exception:  # noqa: BLE001, S110 - keep the module's own __version__
            pass
        tl, how, errs = load_tl(lm)
        sweep["tl_load_errors"] = errs
        if tl is not None:
            sweep["tl_loaded_with"] = how
            runners["transformer_lens_loop"] = tl_resid_sweep(tl, c_ids, x_ids, tid, fid)
            runners["transformer_lens_batched"] = tl_resid_sweep_batched(tl, c_ids, x_ids, tid, fid, L, P,
                                                                         args.tl_batch)
    except Exception as e:  # noqa: BLE001
        sweep["transformer_lens_error"] = f"{type(e).__name__}: {e}"
        sweep["traceback"] = traceback.format_exc()[-1500:]
    times = {k: [] for k in runners}
    outs = {}
    for _ in range(args.repeats):  # interleaved: one of each in turn
        for k, fn in runners.items():
            t0 = time.perf_counter()
            outs[k] = fn()
            times[k].append(time.perf_counter() - t0)
            print(f"  {k}: {times[k][-1]:.1f} s", flush=True)
    sweep["lenscope_s"], sweep["lenscope_all_s"] = min(times["lenscope"]), times["lenscope"]
    raw = outs["lenscope"].raw
    for k, name in (("transformer_lens_loop", "transformer_lens"),
                    ("transformer_lens_batched", "transformer_lens_batched")):
        if k not in outs:
            continue
        o = outs[k].detach().float().cpu()
        diff = float((o - raw).abs().max())
        suffix = "" if name == "transformer_lens" else "_batched"
        sweep.update({f"{name}_s": min(times[k]), f"{name}_all_s": times[k],
                      f"max_abs_diff_logit_diff{suffix}": diff, f"equal_to_1e_4{suffix}": diff <= 1e-4,
                      f"speedup{suffix}": min(times[k]) / sweep["lenscope_s"]})
    res["resid_patching_sweep"] = sweep
    print(json.dumps(sweep, indent=1), flush=True)


def run_reuse(args, lm, res) -> None:
    """The skipping sweep and the full recomputation against a plain batched forward of the same rows."""
    clean, corrupted, target, foil = SHORT if args.short else LONG
    x_ids = encode(lm, corrupted)
    L, P = lm.anatomy.n_layers, x_ids.numel()
    n, batch = L * P, 64

    @torch.no_grad()
    def plain():
        for s in range(0, n, batch):
            run(lm, x_ids[None].expand(min(batch, n - s), P), last_only=True)

    runners = {
        "skipping": lambda: activation_patching(lm, clean, corrupted, target, foil, what="resid", batch_size=batch),
        "full": lambda: activation_patching(lm, clean, corrupted, target, foil, what="resid", batch_size=batch,
                                            reuse=False),
        "plain_forward": plain,
    }
    times, outs = {k: [] for k in runners}, {}
    for _ in range(args.repeats):  # interleaved: one of each in turn
        for k, fn in runners.items():
            t0 = time.perf_counter()
            outs[k] = fn()
            times[k].append(time.perf_counter() - t0)
            print(f"  {k}: {times[k][-1]:.1f} s (load {os.getloadavg()[0]:.1f})", flush=True)
    best = {k: min(v) for k, v in times.items()}
    res["resid_sweep_reuse"] = {
        "prompt_clean": clean, "prompt_corrupted": corrupted, "target": target, "foil": foil, "n_tokens": P,
        "layers": L, "rows": n, "batch_size": batch, "repeats": args.repeats,
        **{f"{k}_s": v for k, v in best.items()}, **{f"{k}_all_s": v for k, v in times.items()},
        "ratio_skipping": best["skipping"] / best["plain_forward"], "ratio_full": best["full"] / best["plain_forward"],
        "speedup_vs_full": best["full"] / best["skipping"],
        "max_abs_diff_logit_diff": float((outs["skipping"].raw - outs["full"].raw).abs().max()),
        "logit_diff_range": [outs["full"].corrupted_metric, outs["full"].clean_metric],
    }
    print(json.dumps(res["resid_sweep_reuse"], indent=1), flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="docs/results/interventions/bench.json")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--samples", type=int, default=10)
    ap.add_argument("--fact", default="|".join(FACT), help="prompt|subject|target")
    ap.add_argument("--skip-trace", action="store_true")
    ap.add_argument("--skip-sweep", action="store_true", help="only the causal-tracing comparison")
    ap.add_argument("--short", action="store_true", help="the 14-token Mary/John pair instead of the 20-token one")
    ap.add_argument("--reuse", action="store_true",
                    help="only the skipping sweep vs the full recomputation vs a plain forward (3. above)")
    ap.add_argument("--tl-batch", type=int, default=64,
                    help="rows per run_with_hooks of the batched TransformerLens sweep")
    ap.add_argument("--tl-site", default=None,
                    help="site-packages of a venv holding transformer_lens (appended to sys.path)")
    args = ap.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if args.tl_site:
        sys.path.append(str(Path(args.tl_site).resolve()))
    res = {"machine": record(), "model": "smollm2 (SmolLM2-135M-Instruct, float32)"}
    lm = lenscope.load("smollm2")
    if args.reuse:
        run_reuse(args, lm, res)
        res["loadavg_end"] = os.getloadavg()
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1))
        return
    args.pair = SHORT if args.short else (CLEAN, CORRUPTED, TARGET, FOIL)
    c_ids, x_ids = encode(lm, args.pair[0]), encode(lm, args.pair[1])
    tid, fid = resolve_token(lm, args.pair[2]), resolve_token(lm, args.pair[3])
    L, P = lm.anatomy.n_layers, c_ids.numel()

    # 2. causal tracing: batched vs one forward per restored state
    if not args.skip_trace:
        prompt, subject, target = args.fact.split("|")
        tr, b_t, _ = timed(lambda: causal_trace(lm, prompt, subject, target, samples=args.samples, batch_size=64), 1)
        t0 = time.perf_counter()
        maps, p_corr, n_runs = trace_loop(lm, prompt, subject, target, samples=args.samples)
        loop_t = time.perf_counter() - t0
        diff = max(float((maps[k] - getattr(tr, k)).abs().max()) for k in KINDS)
        res["causal_trace"] = {"prompt": prompt, "subject": subject, "target": target, "samples": args.samples,
                               "window": 10, "n_tokens": len(tr.tokens), "forward_rows": n_runs,
                               "batched_s": b_t, "batched_batch_size": 64, "loop_one_forward_per_state_s": loop_t,
                               "speedup": loop_t / b_t, "max_abs_diff_aie": diff,
                               "p_corrupted_batched": tr.p_corrupted, "p_corrupted_loop": p_corr}
        print(json.dumps(res["causal_trace"], indent=1), flush=True)

    # 1. residual patching sweep (after the tracing: TransformerLens is imported only here)
    if not args.skip_sweep:
        run_sweep(args, lm, res, c_ids, x_ids, tid, fid, L, P)
    res["loadavg_end"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    sys.exit(main())
