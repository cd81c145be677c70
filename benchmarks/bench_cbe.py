"""Causal basis extraction: lenscope's time against the tuned-lens library's own CBE, same data, same lens.

Both extract ``k`` directions at one state of a model for a tuned lens, over the same residual states (the
tokens of ``--tokens`` of held-out text, every position but each sequence's first) with the same mean
ablation. lenscope runs :func:`lenscope.lenses.cbe.extract_causal_basis` (factored objective, coarse L-BFGS
on a token subsample, then a few evaluations on all tokens). The reference is ``tuned_lens.causal.
extract_causal_bases`` of ``tuned-lens==0.2.0`` (L-BFGS with strong Wolfe line search on all tokens, up to
``max_iter=100`` evaluations per direction, autograd through the lens and the unembedding), called on a
one-state library ``TunedLens`` whose translator is lenscope's translator of that state.

Also timed: one evaluation of sigma and its gradient on all tokens, both ways, each with its set-up cost stated
separately, and the influence of the reference's directions under lenscope's sigma (both must measure the same
thing):

- lenscope: set-up = building ``InfluenceObjective`` (the base logits and ``p W_U^T``, two ``tokens x d_model x
  vocab`` matmuls, once per state); one evaluation = ``value_and_grad``.
- reference, as the earlier version of this script timed it: one evaluation = decode the base distribution *and*
  run the closure (``reference_eval``), i.e. its set-up charged to every evaluation;
- reference, fair: set-up = what ``extract_causal_bases`` does once per layer before its L-BFGS (the base
  ``log_p`` and ``p``, the lens's unembedding and its SVD), one evaluation = its closure alone (ablate, decode,
  log-softmax, KL, backward).

From these the run reports the per-evaluation ratio both ways and the cost of ``n`` evaluations with the set-ups
included, ``setup + n * eval``, for the ``n`` of lenscope's k-direction run (or ``--n-evals``).

The library is imported from ``--reference-path`` (a folder holding the ``tuned_lens`` package), so it runs
in lenscope's own environment (torch 2.13, transformers 5.23): its ``causal`` and ``nn`` modules import and run
there; its training and data code, which need transformers 4, are not used. Set up::

    .venv/bin/pip install --no-deps --target .venv-tunedlens-cbe tuned-lens==0.2.0

The reference's CBE takes many minutes per direction on a CPU, so the same-data run that compares the two
CBEs end to end uses ``--reference-k`` directions (default 1) over the first ``--reference-tokens`` token
states; both run on exactly those. lenscope's k-direction CBE over all tokens and the one-evaluation
comparison over all tokens are timed too. Prints one JSON line on stdout.

Run (2 cores, ``OMP_NUM_THREADS=1``)::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_cbe.py --lens ../lenses/smollm2 --layer 15 --k 8 \\
        --reference-path .venv-tunedlens-cbe
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def library_lens(lm, lens, layer):
    """A tuned-lens 0.2 TunedLens with one translator: lenscope's translator of ``layer``."""
    from tuned_lens.nn import TunedLens as LibLens
    from tuned_lens.nn import TunedLensConfig, Unembed

    cfg = TunedLensConfig(base_model_name_or_path=lm.name, d_model=lm.anatomy.d_model, num_hidden_layers=1)
    lib = LibLens(Unembed(lm.model), cfg).float()
    with torch.no_grad():
        lib[0].weight.copy_(lens.A[layer].T)  # nn.Linear: h W^T + b; lenscope: h A + b
        lib[0].bias.copy_(lens.b[layer])
    # tuned-lens 0.2.0's extract_causal_bases starts from the singular vectors of the lens's unembedding, which
    # it gets as ``lens.transform_hidden(W_U^T, i)`` with ``W_U^T`` shaped (d_model, vocab): the translator then
    # reads the vocabulary axis and raises ("mat1 and mat2 shapes cannot be multiplied"). The library's earlier
    # code computed ``(I + W^T) W_U^T``; this one patch restores that for the (d_model, vocab) matrix only.
    plain = lib.transform_hidden
    d = lm.anatomy.d_model

    def transform_hidden(h, idx):
        if h.dim() == 2 and h.shape[0] == d and h.shape[1] != d:
            return h + lib[idx].weight.data.T @ h
        return plain(h, idx)

    lib.transform_hidden = transform_hidden
    return lib


def reference_eval(lib, H, v):
    """One evaluation of the reference's objective and its gradient (its closure, without the optimizer)."""
    from tuned_lens.causal import remove_subspace

    with torch.no_grad():
        log_p = lib(H, 0).log_softmax(-1)
        p = log_p.exp()
    v = v.clone().requires_grad_(True)
    h_ = remove_subspace(H, v / v.norm(), mode="mean", orthonormal=True)
    log_q = lib(h_, 0).log_softmax(-1)
    loss = -torch.sum(p * (log_p - log_q), dim=-1).mean()
    loss.backward()
    return -float(loss.detach()), v.grad


@torch.no_grad()
def reference_setup(lib, H):
    """What ``extract_causal_bases`` computes once per layer before its L-BFGS: the base distribution (``log_p``,
    ``p``) and the initial directions (SVD of the lens's unembedding)."""
    log_p = lib(H, 0).log_softmax(-1)
    p = log_p.exp()
    U = lib.transform_hidden(lib.unembed.unembedding.weight.data.T, 0)
    torch.linalg.svd(U, full_matrices=False)
    return log_p, p


def reference_closure(lib, H, v, log_p, p):
    """The reference's closure alone: ablate, decode, log-softmax, KL against the precomputed base, backward."""
    from tuned_lens.causal import remove_subspace

    v = v.clone().requires_grad_(True)
    h_ = remove_subspace(H, v / v.norm(), mode="mean", orthonormal=True)
    log_q = lib(h_, 0).log_softmax(-1)
    loss = -torch.sum(p * (log_p - log_q), dim=-1).mean()
    loss.backward()
    return -float(loss.detach()), v.grad


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--lens", required=True, help="lenscope tuned-lens directory, or 'identity' (an untrained "
                    "tuned lens: A = 0, b = 0; the timings do not depend on the translator's values)")
    ap.add_argument("--data", default=str(ROOT.parent / "shared/data/wikitext2/wiki.test.raw"))
    ap.add_argument("--layer", type=int, default=15)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--reference-path", default=None, help="folder holding the tuned_lens package (0.2.0)")
    ap.add_argument("--reference-k", type=int, default=1, help="directions both extract in the same-data run")
    ap.add_argument("--reference-tokens", type=int, default=None,
                    help="token states of the same-data run (default: all); both run on the same ones")
    ap.add_argument("--reference-max-iter", type=int, default=100, help="the library's max_iter (its default)")
    ap.add_argument("--repeats", type=int, default=2, help="repeats of the one-evaluation timing")
    ap.add_argument("--no-full", action="store_true", help="skip lenscope's k-direction CBE over all tokens")
    ap.add_argument("--n-evals", type=int, default=None,
                    help="evaluations for the set-up-included totals (default: those of lenscope's k-direction run)")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from machine import record

    machine = record()

    import lenscope
    from lenscope.lenses import TunedLens, read_text, split_text, token_sequences
    from lenscope.lenses.cbe import InfluenceObjective, extract_causal_basis, layer_states

    torch.manual_seed(0)
    lm = lenscope.load(args.model)
    lens = TunedLens(lm.anatomy) if args.lens == "identity" else TunedLens.load(args.lens, lm)
    seqs = token_sequences(lm, split_text(read_text(args.data), "eval"), args.seq_len, max_tokens=args.tokens)
    H = layer_states(lm, seqs, args.layer)
    log(f"{lm.name}, state {args.layer}: {H.shape[0]} token states")
    res: dict = {"machine": machine, "model": lm.name, "lens": args.lens, "layer": args.layer, "k": args.k,
                 "n_tokens": H.shape[0], "torch_threads": torch.get_num_threads()}

    # wall-clock and CPU seconds (process_time: what one idle core would take, when others share the machine)
    t0, c0 = time.perf_counter(), time.process_time()
    obj = InfluenceObjective(lm, lens, args.layer, H)
    t_prep, c_prep = time.perf_counter() - t0, time.process_time() - c0
    res["lenscope"] = {"setup_seconds": t_prep, "setup_cpu_seconds": c_prep}
    if args.no_full:
        from lenscope.lenses.cbe import _pca

        v = _pca(obj.Hc, 1)[0][0]
    else:
        cbe = extract_causal_basis(obj, args.k)
        t_ours, c_ours = time.perf_counter() - t0, time.process_time() - c0
        res["lenscope"].update({"seconds": t_ours, "cpu_seconds": c_ours, "sigma": cbe["sigma"].tolist(),
                                "evals": cbe["evals"], "pca_sigma": cbe["pca_sigma"].tolist()})
        log(f"lenscope CBE k={args.k}: {t_ours:.1f} s, {c_ours:.1f} CPU s (setup {t_prep:.1f} s); "
            f"sigma {cbe['sigma'].tolist()}")
        v = cbe["vectors"][0]
    times, cpu = [], []
    for _ in range(args.repeats):
        t, c = time.perf_counter(), time.process_time()
        val, g = obj.value_and_grad(v)
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    sub = obj.subset(max(1, obj.N // 1024))
    c = time.process_time()
    sub.value_and_grad(v)
    res["lenscope"].update({"eval_seconds": min(times), "eval_cpu_seconds": min(cpu),
                            "coarse_eval_cpu_seconds": time.process_time() - c, "coarse_tokens": sub.N})

    if args.reference_path:
        sys.path.insert(0, str(Path(args.reference_path).resolve()))
    try:
        import importlib.metadata

        import tuned_lens  # noqa: F401
        from tuned_lens.causal import extract_causal_bases

        try:
            version = importlib.metadata.version("tuned-lens")
        except importlib.metadata.PackageNotFoundError:
            version = "unknown"
        res["reference_version"] = version
    except Exception as e:  # noqa: BLE001 (not installed, or not importable here: report why)
        res["reference"] = None
        res["reference_error"] = f"{type(e).__name__}: {e}"
        log("reference not run:", res["reference_error"])
        _finish(res, args)
        return
    lib = library_lens(lm, lens, args.layer)
    times, cpu = [], []
    for _ in range(args.repeats):
        t, c = time.perf_counter(), time.process_time()
        ref_val, ref_g = reference_eval(lib, H, v)  # all tokens
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    res["reference_eval_seconds"], res["reference_eval_cpu_seconds"] = min(times), min(cpu)
    # fair: the reference's once-per-layer set-up timed on its own, then its closure alone per evaluation
    setups, setup_cpu, times, cpu = [], [], [], []
    for _ in range(args.repeats):
        t, c = time.perf_counter(), time.process_time()
        base = reference_setup(lib, H)
        setups.append(time.perf_counter() - t)
        setup_cpu.append(time.process_time() - c)
        t, c = time.perf_counter(), time.process_time()
        closure_val, _ = reference_closure(lib, H, v, *base)
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    ours = res["lenscope"]
    ref = {"setup_seconds": min(setups), "setup_cpu_seconds": min(setup_cpu), "eval_seconds": min(times),
           "eval_cpu_seconds": min(cpu), "eval_value": closure_val}
    n_evals = args.n_evals or (sum(sum(e) for e in ours["evals"]) if "evals" in ours else 17 * args.k)
    ref_total = ref["setup_cpu_seconds"] + n_evals * ref["eval_cpu_seconds"]
    ours_total = ours["setup_cpu_seconds"] + n_evals * ours["eval_cpu_seconds"]
    gap = ref["eval_cpu_seconds"] - ours["eval_cpu_seconds"]
    res["fair"] = {
        "reference": ref, "eval_ratio": ref["eval_seconds"] / ours["eval_seconds"],
        "eval_cpu_ratio": ref["eval_cpu_seconds"] / ours["eval_cpu_seconds"],
        "n_evals": n_evals, "n_evals_from": ("--n-evals" if args.n_evals else
                                             "lenscope's k-direction run (coarse + full)" if "evals" in ours
                                             else "17 per direction x k"),
        "note": "lenscope's n evaluations mix coarse (token subsample) and full ones; the totals charge every one "
                "at the full-token price, i.e. they overstate lenscope's cost",
        "total_cpu_seconds_lenscope": ours_total, "total_cpu_seconds_reference": ref_total,
        "total_cpu_ratio": ref_total / ours_total,
        "break_even_evals": ((ours["setup_cpu_seconds"] - ref["setup_cpu_seconds"]) / gap) if gap > 0 else None,
    }
    log(f"fair: reference set-up {ref['setup_cpu_seconds']:.2f} CPU s, closure {ref['eval_cpu_seconds']:.2f} CPU s; "
        f"lenscope set-up {ours['setup_cpu_seconds']:.2f} CPU s, eval {ours['eval_cpu_seconds']:.2f} CPU s; "
        f"per eval {res['fair']['eval_cpu_ratio']:.1f}x; "
        f"{n_evals} evals with set-ups {res['fair']['total_cpu_ratio']:.1f}x")
    res["eval_value_lenscope"], res["eval_value_reference"] = val, ref_val
    # the reference differentiates -sigma(v / |v|): compare with lenscope's gradient on the sphere's tangent
    tangent = g - (g @ v) * v
    res["eval_grad_cosine"] = float(torch.nn.functional.cosine_similarity(tangent, -ref_g, dim=0))
    res["eval_ratio"] = res["reference_eval_seconds"] / res["lenscope"]["eval_seconds"]
    res["eval_cpu_ratio"] = res["reference_eval_cpu_seconds"] / res["lenscope"]["eval_cpu_seconds"]
    log(f"one sigma+gradient evaluation: lenscope {res['lenscope']['eval_seconds']:.2f} s, reference "
        f"{res['reference_eval_seconds']:.2f} s ({res['eval_ratio']:.1f}x); values {val:.5f} vs {ref_val:.5f}")

    kref = min(args.reference_k, args.k)
    n = min(args.reference_tokens or H.shape[0], H.shape[0])
    Hs = H[:n]
    t, c = time.perf_counter(), time.process_time()
    small = extract_causal_basis(InfluenceObjective(lm, lens, args.layer, Hs), kref)
    t_small, c_small = time.perf_counter() - t, time.process_time() - c
    t, c = time.perf_counter(), time.process_time()
    basis = next(iter(extract_causal_bases(lib, [Hs, Hs], kref, max_iter=args.reference_max_iter, mode="mean")))
    t_ref, c_ref = time.perf_counter() - t, time.process_time() - c
    obj_s = InfluenceObjective(lm, lens, args.layer, Hs)
    ref_sigma_ours = obj_s.sigma(basis.vectors.T.float())
    res["same_data"] = {
        "reference_patch": "initialisation: (I + W^T) W_U^T instead of transform_hidden(W_U^T), which raises",
        "n_tokens": n, "k": kref, "max_iter": args.reference_max_iter,
        "lenscope_seconds": t_small, "lenscope_sigma": small["sigma"].tolist(),
        "reference_seconds": t_ref, "reference_energies": basis.energies.tolist(),
        "reference_sigma_by_lenscope": ref_sigma_ours.tolist(), "ratio": t_ref / t_small,
        "lenscope_cpu_seconds": c_small, "reference_cpu_seconds": c_ref, "cpu_ratio": c_ref / c_small,
    }
    log(f"same {n} tokens, k={kref}: lenscope {t_small:.1f} s, sigma {small['sigma'].tolist()}; reference "
        f"{t_ref:.1f} s, its sigma {basis.energies.tolist()} (lenscope's sigma of its vectors "
        f"{ref_sigma_ours.tolist()}); ratio {t_ref / t_small:.1f}x (CPU time {c_ref / c_small:.1f}x)")
    _finish(res, args)


def _finish(res, args):
    line = json.dumps(res)
    print(line)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
