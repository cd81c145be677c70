"""lenscope's dictionary trainer against SAELens on the same activations and hyperparameters: tokens per CPU-second
(and per wall second) of the training, and explained variance on the same held-out rows at equal tokens.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_dict_saelens.py \\
        --out docs/results/features/bench-dict-saelens.json

(``--smoke``: 20,000 tokens, width 512, a small activations file; the check that it runs, in about a minute.)

SAELens runs in its own virtual environment (its dependencies are not lenscope's)::

    python3 -m venv /work/saelens-env
    /work/saelens-env/bin/pip install torch==2.13.0 && /work/saelens-env/bin/pip install sae-lens

**Activations.** ``--site`` (``resid_post.5``) of ``--model`` (smollm2) on the corpus's train part, as lenscope's
trainer streams them (:class:`lenscope.features.dictionaries.sources.StreamSource`, sequences of 256 tokens, BOS
dropped), the
first ``--rows`` rows saved once to ``--cache`` (safetensors,
:func:`lenscope.features.dictionaries.synthetic.save_activations`;
a JSON beside it says what they are) and reused. The last ``--held-out`` rows are held out; both trainers see
only the rows before them.

**The same batches.** Both sides get the same batches in the same order: lenscope's :class:`FileSource` reads
blocks of ``--buffer`` rows in order (cycling over the training rows) and the trainer shuffles each block with
``torch.randperm`` from a generator seeded with the seed; ``benchmarks/saelens_side.py`` builds the same blocks
and permutations (same torch version on both sides) and hands SAELens's trainer the batches as its data provider
(checked bit for bit against the batches ``train_dictionaries`` steps on, partial blocks included).

**The same normalisation.** lenscope's fixed factor (its form of SAELens's ``expected_average_only_in``: the mean
squared norm of the first block's rows becomes ``d``; SAELens's own estimate is ``sqrt(d)`` over the mean norm) is
computed here once and given to SAELens's own
``ActivationScaler`` (``scaling_factor``), which scales each batch in ``SAETrainer.step`` and folds the factor into
the weights at the end of ``fit`` (``fold_activation_norm_scaling_factor``), as lenscope folds it
(``Dictionary.folded``).

**SAELens's side** (``benchmarks/saelens_side.py``, run with ``--saelens-python``): ``TopKTrainingSAE`` /
``TopKTrainingSAEConfig`` (its defaults: ``apply_b_dec_to_input=True``, ``rescale_acts_by_decoder_norm=True``,
``decoder_init_norm=0.1``) trained by ``SAETrainer(SAETrainerConfig(...), sae, data_provider).fit()``: its loss
(MSE summed over dimensions, mean over tokens, plus its AuxK), its Adam and its learning-rate schedule, its
dead-latent bookkeeping; the hyperparameters set to lenscope's (the results' ``settings``), what could not be
made equal listed under ``differences``. Its weights are written by SAELens itself
(``save_inference_model``: the decoder norms folded into the encoder; its ``cfg.json`` keeps
``rescale_acts_by_decoder_norm=True``) and read by lenscope's
:meth:`~lenscope.models.dictionaries.dictionary.Dictionary.load`,
which honours that setting as SAELens's inference ``TopKSAE`` does (``TopK(k)(((x - b_dec) @ W_enc + b_enc) * n)``,
``TopK`` keeping the k largest, ReLU'd, 0 elsewhere, and ``decode`` ``(z / n) @ W_dec + b_dec``, ``n`` the decoder
rows' norms, 1 here after SAELens's fold) by folding ``n`` into the weights: lenscope's TopK dictionary
(:meth:`Dictionary.encode` / ``decode``) then computes SAELens's function, so one function scores both.

**Measured.** Each trainer runs in its own process with ``--threads`` threads (``OMP_NUM_THREADS`` and
``torch.set_num_threads``); wall seconds (``time.perf_counter``) and CPU seconds (``time.process_time``, every
thread of the process) around the training only (the activations already in memory; the model, the imports, the
file and the first ``torch.optim.Adam``'s import of ``torch._dynamo`` excluded on both sides). Explained variance
``1 - sum |x - x̂|² / sum |x - mean x|²`` and L0 on the held-out rows (:mod:`lenscope.features.dictionaries.evaluate`'s
running
statistics, float64 sums); SAELens's side also reports the explained variance its own inference ``SAE`` gets on
those rows, which must agree (to 1e-4). Sides (``--sides``): ``lenscope`` (its default precision: bfloat16 matmuls
where the CPU runs them natively), ``lenscope-fp32`` (``bf16=False``, the equal-precision comparison), ``saelens``
(float32), optionally ``saelens-autocast`` (SAELens's ``autocast``: ``torch.autocast`` to bfloat16) and
``saelens-mean-init`` (SAELens with ``b_dec`` started at the mean of the first block, as lenscope starts it: the
initialisation separated from the rest). The results carry ``benchmarks/machine.py``'s ``record()`` under
``"machine"``; what could not be made equal is listed under ``"differences"``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
SAELENS_PYTHON = "/work/saelens-env/bin/python"
SIDES = ("lenscope", "lenscope-fp32", "saelens", "saelens-autocast", "saelens-mean-init")
INSTALL = ("python3 -m venv /work/saelens-env && /work/saelens-env/bin/pip install torch==2.13.0 && "
           "/work/saelens-env/bin/pip install sae-lens")


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--saelens-python", default=SAELENS_PYTHON, help="the python of the environment with sae-lens")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--site", default="resid_post.5")
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "corpus"))
    ap.add_argument("--rows", type=int, default=None, help="activation rows to collect (default 600,000)")
    ap.add_argument("--held-out", type=int, default=None, help="the last rows, for evaluation (default 50,000)")
    ap.add_argument("--cache", default=None,
                    help="the activations file (default /work/runs/acts-smollm2-resid5.safetensors)")
    ap.add_argument("--tokens", type=int, default=None, help="training tokens of each side (default 1,000,000)")
    ap.add_argument("--width", type=int, default=None, help="latents (default 4608)")
    ap.add_argument("--k", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=4096)
    ap.add_argument("--buffer", type=int, default=65_536, help="rows in the shuffle buffer (a block)")
    ap.add_argument("--lr", type=float, default=None, help="default lenscope's: 2e-4 sqrt(16384 / width)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--forward-batch", type=int, default=8)
    ap.add_argument("--sides", default="lenscope,lenscope-fp32,saelens", help=f"comma-separated, of {SIDES}")
    ap.add_argument("--smoke", action="store_true", help="20,000 tokens, width 512, 24,000 rows: that it runs")
    ap.add_argument("--out", default=None, help="default docs/results/features/bench-dict-saelens.json "
                    "(smoke: bench-dict-saelens_smoke.json)")
    ap.add_argument("--child-lenscope", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    smoke = a.smoke
    defaults = {"rows": (24_000, 600_000), "held_out": (4_000, 50_000), "tokens": (20_000, 1_000_000),
                "width": (512, 4608),
                "cache": ("/work/runs/acts-smollm2-resid5-smoke.safetensors",
                          "/work/runs/acts-smollm2-resid5.safetensors"),
                "out": (str(ROOT / "docs/results/features/bench-dict-saelens_smoke.json"),
                        str(ROOT / "docs/results/features/bench-dict-saelens.json"))}
    for name, (small, full) in defaults.items():
        if getattr(a, name) is None:
            setattr(a, name, small if smoke else full)
    a.sides = [s.strip() for s in a.sides.split(",") if s.strip()]
    bad = [s for s in a.sides if s not in SIDES]
    if bad or not a.sides:
        ap.error(f"unknown side(s) {bad}; sides: {', '.join(SIDES)}")
    if not 0 < a.held_out < a.rows or a.rows - a.held_out < a.batch_size:
        ap.error(f"need 0 < --held-out < --rows with at least --batch-size training rows; got rows {a.rows}, "
                 f"held-out {a.held_out}")
    return a


# -- the activations ---------------------------------------------------------------------------------------------


def activations(a):
    """The first ``a.rows`` rows ``(rows, d)`` at ``a.site``: from ``a.cache`` when it holds enough rows of the same
    model, site, text and sequence length, else streamed through the model and saved there."""
    import torch
    from safetensors import safe_open

    from lenscope.features.dictionaries.synthetic import save_activations

    cache = Path(a.cache)
    meta_path = cache.with_suffix(".json")
    want = {"model": a.model, "site": a.site, "data": str(Path(a.data).resolve()), "part": "train",
            "seq_len": a.seq_len}
    if cache.is_file() and meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        if {k: meta.get(k) for k in want} == want and meta.get("rows", 0) >= a.rows:
            with safe_open(str(cache), "pt") as f:
                x = f.get_slice("activations")[:a.rows]
            print(f"activations: {a.rows} rows from {cache}", file=sys.stderr, flush=True)
            return x
    import lenscope
    from lenscope.features.dictionaries.sources import StreamSource

    t0 = time.perf_counter()
    lm = lenscope.load(a.model)
    src = StreamSource(lm, [a.site], a.data, seq_len=a.seq_len, forward_batch=a.forward_batch, part="train")
    parts, start, have = [], 0, 0
    with torch.no_grad():
        while have < a.rows:
            rows, start = src.read(start, min(65_536, a.rows - have))
            if rows is None:
                raise SystemExit(f"error: the text at {a.data} has only {have} rows at {a.site}; ask for fewer --rows")
            parts.append(rows[:, 0])
            have += len(rows)
            print(f"activations: {have}/{a.rows} rows ({time.perf_counter() - t0:.0f} s)", file=sys.stderr,
                  flush=True)
    x = torch.cat(parts)[:a.rows].contiguous()
    save_activations(cache, x)
    meta_path.write_text(json.dumps({**want, "rows": a.rows, "sequences": start, "d": x.shape[1],
                                     "seconds": round(time.perf_counter() - t0, 1)}, indent=1) + "\n")
    return x


# -- the plan both sides follow ----------------------------------------------------------------------------------


def plan(a, d: int) -> dict:
    """lenscope's run of ``a.tokens`` tokens as numbers SAELens's trainer takes: steps (``ceil(tokens / batch)``),
    warm-up steps (lenscope's planner), the base learning rate, AuxK's ``k_aux`` (SAELens's ``d_in // 2``, which
    lenscope takes as a setting), the dead window."""
    from lenscope.features.dictionaries.train import AUX_COEF, DictSettings
    from lenscope.lenses.training.settings import TrainSettings
    from lenscope.training.plan import warmup_steps

    s = DictSettings(kind="topk", width=a.width, k=a.k, tokens=a.tokens, batch_size=a.batch_size, buffer=a.buffer,
                     lr=a.lr, seed=a.seed, k_aux=d // 2)
    s.check(d)
    n_steps = max(1, math.ceil(a.tokens / a.batch_size))
    warm = warmup_steps(n_steps, TrainSettings(tokens=a.tokens, seq_len=2, batch_size=a.batch_size,
                                               warmup_fraction=s.warmup_fraction))
    return {"steps": n_steps, "tokens": n_steps * a.batch_size, "warmup_steps": warm, "lr": s.base_lr(),
            "width": a.width, "k": a.k, "k_aux": d // 2, "batch_size": a.batch_size, "buffer": a.buffer,
            "seed": a.seed, "dead_after_tokens": s.dead_after, "aux_coefficient": AUX_COEF,
            "dead_window_steps": math.ceil(s.dead_after / a.batch_size) - 1,
            "adam_betas": [0.9, 0.999], "threads": a.threads, "d": d}


def first_block_scale(x_train, p: dict) -> float:
    """lenscope's normalisation factor: from the first block the trainer reads (its first ``min(buffer, tokens)``
    rows, cycling over the training rows)."""
    import torch

    from lenscope.features.dictionaries.train import _scale

    n = min(p["buffer"], p["steps"] * p["batch_size"])
    return _scale(x_train[torch.arange(n) % len(x_train)])


# -- the two trainers, each in its own process ---------------------------------------------------------------------


def child_env(threads: int) -> dict:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TQDM_DISABLE="1",
               WANDB_MODE="disabled")
    return env


def run_child(cmd: list[str], threads: int, name: str) -> None:
    print(f"{name}: {' '.join(cmd)}", file=sys.stderr, flush=True)
    r = subprocess.run(cmd, env=child_env(threads), check=False)
    if r.returncode != 0:
        raise SystemExit(f"error: the {name} side failed (exit {r.returncode}); its output is above")


def lenscope_child(cfg_path: str) -> int:
    """The lenscope side (this file run with ``--child-lenscope CONFIG``): train on the file's training rows,
    save the dictionary and the timings."""
    cfg = json.loads(Path(cfg_path).read_text())
    import torch

    torch.set_num_threads(cfg["threads"])
    from safetensors import safe_open

    from lenscope.features.dictionaries.sources import FileSource, Target
    from lenscope.features.dictionaries.train import DictSettings, train_dictionaries
    from lenscope.models.dictionaries.dictionary import Dictionary

    with safe_open(cfg["activations"], "pt") as f:
        x = f.get_slice("activations")[:cfg["n_train"]].contiguous()
    like = Dictionary.init(2, 2, kind="topk", k=1, role="sae")
    s = DictSettings(kind="topk", width=cfg["width"], k=cfg["k"], tokens=cfg["tokens"],
                     batch_size=cfg["batch_size"], buffer=cfg["buffer"], lr=cfg["lr"], seed=cfg["seed"],
                     k_aux=cfg["k_aux"], bf16=cfg["bf16"])
    source = FileSource(x[:, None])
    torch.optim.Adam([torch.zeros(1, requires_grad=True)])  # the first Adam imports torch._dynamo: not timed
    w0, c0 = time.perf_counter(), time.process_time()
    (D,) = train_dictionaries(source, [Target(like, 0, 0)], s, progress=True)
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    D.save(cfg["out_dir"])
    tr = D.info["training"]
    Path(cfg["result"]).write_text(json.dumps({
        "tokens": tr["tokens"], "steps": tr["steps"], "wall_s": wall, "cpu_s": cpu,
        "precision": tr["precision"]["matmul_dtype"], "scale": tr["scale_in"], "lr": tr["lr"],
        "threads": torch.get_num_threads(), "torch": torch.__version__, "final_batch": tr["final"]}))
    return 0


def run_side(side: str, a, p: dict, cache: str, n_train: int, scale: float, work: Path) -> tuple[dict, Path]:
    """Train one side; its timings and the folder of its dictionary."""
    out_dir, result = work / side, work / f"{side}.json"
    cfg = {**p, "activations": cache, "n_train": n_train, "held_out": a.held_out, "scale": scale,
           "out_dir": str(out_dir), "result": str(result)}
    if side.startswith("lenscope"):
        cfg["bf16"] = False if side == "lenscope-fp32" else None
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child-lenscope"]
    else:
        cfg["autocast"], cfg["mean_init"] = side == "saelens-autocast", side == "saelens-mean-init"
        cmd = [a.saelens_python, str(HERE / "saelens_side.py")]
    cfg_path = work / f"{side}-config.json"
    cfg_path.write_text(json.dumps(cfg))
    run_child(cmd + [str(cfg_path)], a.threads, side)
    return json.loads(result.read_text()), out_dir


# -- scoring -------------------------------------------------------------------------------------------------------


def score(D, x) -> dict:
    """Explained variance and L0 of dictionary ``D`` reconstructing the rows ``x``, and the fraction of its latents
    that never fire on them (:func:`lenscope.features.dictionaries.evaluate.reconstruction`)."""
    from lenscope.features.dictionaries.evaluate import reconstruction

    r = reconstruction(D, x)
    return {"explained_variance": round(r["explained_variance"], 5), "l0": round(r["l0"], 3),
            "never_fired_fraction": round(r["dead_fraction"], 5), "rows": r["rows"]}


def lr_gap(p: dict, rates: list[float]) -> float:
    """The largest relative difference between SAELens's learning rate of each step and lenscope's."""
    from lenscope.features.dictionaries.train import _lr

    if len(rates) != p["steps"]:
        raise SystemExit(f"error: SAELens ran {len(rates)} steps, not {p['steps']}")
    return max(abs(r - _lr(i, p["steps"], p["warmup_steps"], p["lr"])) / p["lr"] for i, r in enumerate(rates))


def differences(p: dict, gap: float | None) -> list[str]:
    """What could not be made equal between the two trainers (and what was set to make the rest equal)."""
    lr = ("Learning rate: the same at every step (SAELens's 'constant' scheduler with lr_warm_up_steps = "
          f"{p['warmup_steps']} and lr_decay_steps = {p['steps'] - p['warmup_steps']} is lenscope's linear warm-up "
          f"and linear decay to 0; largest relative difference {gap:.1e})." if gap is not None and gap < 1e-6 else
          "Learning rate: SAELens's scheduler (linear warm-up over lr_warm_up_steps, linear decay over "
          "lr_decay_steps) differs from lenscope's linear warm-up and decay to 0 by up to "
          f"{gap if gap is not None else float('nan'):.3g} of the base rate at some step.")
    return [
        "Gradient clipping: SAELens's SAETrainer clips the gradient norm to 1.0 at every step (not configurable); "
        "lenscope does not clip.",
        "Decoder norm: SAELens's TopKTrainingSAE (rescale_acts_by_decoder_norm=True, its default) divides by the "
        "decoder row norms inside the forward pass (the rows themselves free); lenscope keeps the rows at unit "
        "norm (the gradient's component along each row removed, rows renormalised after each step). The same "
        "function class; different optimisation paths.",
        "Initialisation: SAELens's own (decoder rows Kaiming-uniform scaled to norm 0.1 by decoder_init_norm, "
        "encoder their transpose, biases 0); lenscope's (decoder rows random unit vectors, encoder their "
        "transpose, b_enc 0, b_dec the mean of the first block). Side saelens-mean-init: SAELens with b_dec "
        "started at that mean, the rest its own.",
        "Dead latents: SAELens counts the steps since a latent fired before the current step (dead when more than "
        f"dead_feature_window = {p['dead_window_steps']}); lenscope counts tokens including the current batch "
        f"(dead after {p['dead_after_tokens']} tokens = {p['dead_after_tokens'] / p['batch_size']:.1f} steps): the "
        "same window, one step apart.",
        f"AuxK: both k_aux = d_in // 2 = {p['k_aux']} (SAELens's fixed value; lenscope's default, "
        "min(width // 2, 512), set to it) and coefficient 1/32 (SAELens's aux_loss_coefficient, default 1.0, set "
        "to lenscope's).",
        "Normalisation: one fixed factor for both, lenscope's (the mean squared norm of the first block's rows "
        "becomes d), given to SAELens's ActivationScaler; SAELens's own estimate would be sqrt(d) / mean norm "
        "over n_batches_for_norm_estimate batches (mean norm, not root mean square).",
        lr,
        "Matmul precision: SAELens trains in float32 (side saelens-autocast: torch.autocast to bfloat16); "
        "lenscope in bfloat16 where the CPU runs it natively (side lenscope), in float32 with bf16=False (side "
        "lenscope-fp32).",
        "Sparse kernels: lenscope decodes the k picked latents as a weighted sum of decoder rows (embedding_bag) "
        "and takes the encoder's gradient through the picked entries only; SAELens computes the dense (batch, "
        "width) products (its use_sparse_activations=True, a sparse COO decode, fails in the backward pass on "
        "the CPU with sae-lens 6.54.12 and torch 2.13: aten::view has no SparseCPU kernel; not measured).",
    ]


def main(argv=None) -> int:
    a = parse(argv)
    if a.child_lenscope:
        return lenscope_child(a.child_lenscope)
    if any(s.startswith("saelens") for s in a.sides) and not Path(a.saelens_python).is_file():
        raise SystemExit(f"error: no SAELens python at {a.saelens_python}; create it with: {INSTALL} "
                         "(or give --saelens-python PATH)")
    from machine import record

    machine = record()
    import torch

    from lenscope.models.dictionaries.dictionary import Dictionary

    x = activations(a)
    n_train = a.rows - a.held_out
    x_train, x_held = x[:n_train], x[n_train:]
    p = plan(a, x.shape[1])
    scale = first_block_scale(x_train, p)
    versions = {"lenscope_torch": torch.__version__}
    res = {"machine": machine, "model": a.model, "site": a.site, "data": a.data, "part": "train",
           "rows": a.rows, "train_rows": n_train, "held_out_rows": a.held_out, "activations": str(a.cache),
           "settings": {**p, "scale": scale, "normalisation": "expected_average_only_in (fixed factor, first block)"},
           "smoke": a.smoke, "versions": versions, "sides": {}}
    gaps: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench-dict-saelens-") as tmp:
        work = Path(tmp)
        for side in a.sides:
            t, folder = run_side(side, a, p, str(a.cache), n_train, scale, work)
            D = Dictionary.load(folder)
            s = score(D, x_held)
            entry = {"tokens": t["tokens"], "steps": t["steps"], "wall_s": round(t["wall_s"], 2),
                     "cpu_s": round(t["cpu_s"], 2), "tokens_per_s": round(t["tokens"] / t["wall_s"], 1),
                     "tokens_per_cpu_s": round(t["tokens"] / t["cpu_s"], 1), **s, "precision": t["precision"],
                     "threads": t["threads"], "torch": t["torch"]}
            entry.update({k: v for k, v in t.items() if k not in entry and k not in ("wall_s", "cpu_s")})
            if t["tokens"] != p["tokens"]:
                raise SystemExit(f"error: the {side} side trained on {t['tokens']} tokens, not {p['tokens']}")
            if side.startswith("lenscope") and not math.isclose(t["scale"], scale, rel_tol=1e-6):
                raise SystemExit(f"error: lenscope's normalisation {t['scale']} differs from {scale}")
            own = t.get("saelens_own_explained_variance")
            if own is not None and abs(own - s["explained_variance"]) > 1e-4:
                raise SystemExit(f"error: lenscope reads the {side} dictionary with explained variance "
                                 f"{s['explained_variance']}, SAELens runs it with {own}")
            if "lr_schedule" in t:
                entry.pop("lr_schedule", None)
                entry["lr_max_rel_diff_vs_lenscope"] = gaps[side] = lr_gap(p, t["lr_schedule"])
            res["sides"][side] = entry
            if "sae_lens" in t:
                versions["sae_lens"], versions["saelens_torch"] = t["sae_lens"], t["torch"]
            print(f"{side}: {json.dumps({k: entry[k] for k in ('tokens', 'wall_s', 'cpu_s', 'tokens_per_cpu_s', 'explained_variance', 'l0', 'precision')})}",  # noqa: E501
                  file=sys.stderr, flush=True)
    res["differences"] = differences(p, max(gaps.values()) if gaps else None)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps({side: {k: e[k] for k in ("tokens_per_cpu_s", "tokens_per_s", "explained_variance", "l0",
                                               "precision")} for side, e in res["sides"].items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
