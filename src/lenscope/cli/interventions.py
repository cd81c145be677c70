"""``lenscope patch``, ``path-patch``, ``causal-trace`` and ``neurons``: interventions on the real model's
forward pass."""

from __future__ import annotations

import typer

from .common import ModelChoice, at_least_one, command, emit, fail, one_of, print_json
from .options import JSON_OPTION, MODEL_OPTION, SAVE_OPTION, SEED_OPTION
from .sweeps import ray_address_option, ray_option, ray_target, workers_option

# what ``patch`` and ``path-patch`` share: the two prompts, the foil, the metric and the direction
CLEAN_ARGUMENT = typer.Argument(..., help="The clean prompt.")
CORRUPTED_ARGUMENT = typer.Argument(..., help="The corrupted prompt (same number of tokens).")
FOIL_OPTION = typer.Option(None, "--foil", "-f", help="Foil token (needed for --metric logit_diff).")
METRIC_OPTION = typer.Option("logit_diff", "--metric", help="logit_diff (share restored) | prob")
NOISING_OPTION = typer.Option(False, "--noising", help="Patch corrupted -> clean (default: clean -> corrupted).")


def register(app: typer.Typer) -> None:
    command(app, "patch", model=True)(patch_cmd)
    command(app, "causal-trace", model=True)(causal_trace_cmd)
    command(app, "causal-trace-sweep", model=True)(causal_trace_sweep_cmd)
    command(app, "path-patch", model=True)(path_patch_cmd)
    command(app, "neurons", model=True)(neurons_cmd)


def patch_cmd(
    clean: str = CLEAN_ARGUMENT,
    corrupted: str = CORRUPTED_ARGUMENT,
    model: ModelChoice = MODEL_OPTION,
    target: str = typer.Option(..., "--target", "-t", help="Target token: its text (e.g. ' Mary') or #ID."),
    foil: str = FOIL_OPTION,
    what: str = typer.Option("resid", "--what", help="resid | attn | mlp | heads"),
    metric: str = METRIC_OPTION,
    noising: bool = NOISING_OPTION,
    position: int = typer.Option(
        -1, "--position", help="Token position whose prediction is measured (default: last)."),
    head_position: int = typer.Option(None, "--head-position", help="--what heads: patch at this position only."),
    batch_size: int = typer.Option(32, "--batch-size", help="Patches per forward pass."),
    png: str = typer.Option(None, "--png", help="Write the heat map (layer × position, or layer × head)."),
    save: str = SAVE_OPTION,
    as_json: bool = JSON_OPTION,
):
    """Patch every (layer, position) — or (layer, head) — from one prompt's run into the other's."""
    from ..interventions.patching import METRICS, WHATS, activation_patching

    one_of("--what", what, WHATS)
    one_of("--metric", metric, METRICS)
    _run_patching(model, batch_size, png, save, as_json, lambda lm: activation_patching(
        lm, clean, corrupted, target, foil, what=what, metric=metric, noising=noising, position=position,
        head_position=head_position, batch_size=batch_size))


def causal_trace_cmd(
    prompt: str = typer.Argument(..., help="The prompt, e.g. 'The Eiffel Tower is located in the city of'."),
    subject: str = typer.Option(..., "--subject", "-s", help="The subject (a substring of the prompt) to corrupt."),
    target: str = typer.Option(
        None, "--target", "-t", help="Target token (text or #ID; default: the model's top prediction)."),
    model: ModelChoice = MODEL_OPTION,
    samples: int = typer.Option(10, "--samples", help="Noise samples (each restoration is averaged over them)."),
    window: int = typer.Option(10, "--window", help="Layers restored together for the MLP and attention traces."),
    noise: float = typer.Option(
        None, "--noise", help="Noise scale ν (default: 3 × the std of the input embeddings on the corpus)."),
    corpus: str = typer.Option(
        None, "--corpus", help="Text file whose embeddings give the std (default: the package's tiny corpus)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the noise."),
    batch_size: int = typer.Option(64, "--batch-size", help="Rows per forward pass."),
    png: str = typer.Option(None, "--png", help="Write the three heat maps (layer × position)."),
    save: str = SAVE_OPTION,
    as_json: bool = JSON_OPTION,
):
    """Causal tracing (Meng et al. 2022): corrupt the subject with noise, restore one clean state at a time."""
    from ..interventions.tracing import causal_trace

    at_least_one(samples=samples, window=window, batch_size=batch_size)
    lm = model.load()
    res = causal_trace(lm, prompt, subject, target, samples=samples, window=window, noise=noise, corpus=corpus,
                       seed=seed, batch_size=batch_size)
    if emit(res, png=png, save=save, as_json=as_json):
        return
    _table_trace(lm, res, png)


def causal_trace_sweep_cmd(
    data: str = typer.Option("facts", "--data", help="facts (the shared fact set) or a JSON-lines file of "
                             "{prompt, subject, target[, relation]}."),
    model: ModelChoice = MODEL_OPTION,
    limit: int = typer.Option(None, "--limit", help="The first N facts (taken round-robin over relations).", min=1),
    samples: int = typer.Option(10, "--samples", help="Noise samples per fact.", min=1),
    window: int = typer.Option(10, "--window", help="Layers restored together for MLP and attention.", min=1),
    seed: int = SEED_OPTION,
    out: str = typer.Option(None, "--out", help="Folder for records.jsonl (one line per fact, as it goes), "
                            "summary.safetensors and the figure."),
    resume: bool = typer.Option(False, "--resume", help="Continue an interrupted sweep in --out."),
    ray: bool = ray_option(),
    ray_address: str = ray_address_option(),
    workers: int = workers_option(),
    as_json: bool = typer.Option(False, "--json", help="Print the averages as JSON."),
):
    """Causal tracing averaged over a fact set (per layer and ROME's position groups), resumable, on Ray."""
    from ..sweeps.causal_trace import causal_trace_sweep, load_facts

    if resume and out is None:
        fail("--resume needs the --out folder of the interrupted sweep")
    facts = load_facts(data, limit)
    lm = model.load()
    res = causal_trace_sweep(lm, facts, out, data=data, samples=samples, window=window, seed=seed,
                             resume=resume, ray=ray_target(ray, ray_address), workers=workers)
    if out:
        from pathlib import Path

        from ..viz.plots import save_figure

        res.save(Path(out) / "summary.safetensors")
        save_figure(res.plot(), Path(out) / "average.png")
    if as_json:
        print_json(res.to_dict())
        return
    from rich.console import Console

    con = Console()
    con.print(f"{lm.name}: {res.n_facts} facts traced ({res.skipped} skipped); mean p_clean "
              f"{res.mean_p_clean:.3f}, p_corrupted {res.mean_p_corrupted:.3f}")
    for k in ("resid", "mlp", "attn"):
        m = getattr(res, k).nan_to_num(-1e9)
        layer, g = divmod(int(m.argmax()), m.shape[1])
        con.print(f"  {k}: strongest at layer {layer}, {res.groups[g]} (AIE {float(m[layer, g]):.3f})")
    if out:
        con.print(f"records, summary and figure in {out}")


def path_patch_cmd(
    clean: str = CLEAN_ARGUMENT,
    corrupted: str = CORRUPTED_ARGUMENT,
    model: ModelChoice = MODEL_OPTION,
    target: str = typer.Option(..., "--target", "-t", help="Target token: its text or #ID."),
    foil: str = FOIL_OPTION,
    senders: str = typer.Option("heads", "--senders", help="heads | attn | mlp"),
    receiver: str = typer.Option(None, "--receiver", help="LAYER.HEAD.q|k|v (default: the logits)."),
    metric: str = METRIC_OPTION,
    noising: bool = NOISING_OPTION,
    batch_size: int = typer.Option(32, "--batch-size", help="Senders per forward pass."),
    png: str = typer.Option(None, "--png", help="Write the heat map."),
    save: str = SAVE_OPTION,
    as_json: bool = JSON_OPTION,
):
    """Path patching: each sender's effect on the logits (or on one head's q/k/v) through the residual stream."""
    from ..interventions.paths import SENDERS, path_patching

    one_of("--senders", senders, SENDERS)
    rec = None
    if receiver is not None:
        parts = receiver.split(".")
        if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit() or parts[2] not in ("q", "k", "v"):
            fail(f"--receiver must look like 9.3.q (layer.head.q|k|v), not {receiver!r}")
        rec = (int(parts[0]), int(parts[1]), parts[2])
    _run_patching(model, batch_size, png, save, as_json, lambda lm: path_patching(
        lm, clean, corrupted, target, foil, senders=senders, receiver=rec, metric=metric, noising=noising,
        batch_size=batch_size))


def neurons_cmd(
    prompt: str = typer.Argument(..., help="The prompt, e.g. 'The capital of France is'."),
    target: str = typer.Option(
        None, "--target", "-t", help="Target token (text or #ID; default: the top prediction)."),
    model: ModelChoice = MODEL_OPTION,
    steps: int = typer.Option(20, "--steps", help="Integrated-gradient steps."),
    threshold: float = typer.Option(0.2, "--threshold", help="Keep neurons with attribution >= threshold × max."),
    max_neurons: int = typer.Option(None, "--max-neurons", help="Keep at most this many neurons."),
    seed: int = typer.Option(0, "--seed", help="Seed of the random control neurons."),
    batch_size: int = typer.Option(20, "--batch-size", help="Rows (layer, step) per forward/backward pass."),
    png: str = typer.Option(None, "--png", help="Write a bar plot of the largest attribution per layer."),
    save: str = SAVE_OPTION,
    as_json: bool = JSON_OPTION,
):
    """Knowledge neurons (Dai et al. 2022): IG over MLP hidden units, then suppress / amplify vs random ones."""
    from ..interventions.neurons import knowledge_neurons
    from ..models.runtime.sites import display_name

    if steps < 1 or batch_size < 1:
        fail("--steps and --batch-size must be at least 1")
    lm = model.load()
    res = knowledge_neurons(lm, prompt, target, steps=steps, threshold=threshold, max_neurons=max_neurons,
                            seed=seed, batch_size=batch_size)
    if emit(res, png=png, save=save, as_json=as_json):
        return
    from rich.console import Console

    con = Console()
    con.print(f"{lm.name}: {len(res.neurons)} knowledge neurons of {res.target!r} (P = {res.p_base:.4f})")
    for layer, unit in res.neurons[:10].tolist():
        con.print(f"  {display_name('neuron', layer, unit=unit)}  {float(res.attributions[layer, unit]):.4g}")
    con.print(f"suppressed: P = {res.p_suppressed:.4f} (random control {res.p_control_suppressed:.4f}); "
              f"amplified: P = {res.p_amplified:.4f} (control {res.p_control_amplified:.4f})")
    if png:
        con.print(f"plot saved to {png}")


def _run_patching(model, batch_size: int, png, save, as_json: bool, run) -> None:
    """What ``patch`` and ``path-patch`` do once their options are checked: load the model, ``run(lm)``, then the
    outputs (the table of the largest effects unless --json)."""
    at_least_one(batch_size=batch_size)
    lm = model.load()
    res = run(lm)
    if emit(res, png=png, save=save, as_json=as_json):
        return
    _table_patch(lm, res, png)


def _table_patch(lm, res, png) -> None:
    from rich.console import Console

    con = Console()
    direction = "noising" if res.noising else "denoising"
    con.print(f"{lm.name}: patching {res.what} ({direction}), metric {res.metric}: clean {res.clean_metric:+.4f}, "
              f"corrupted {res.corrupted_metric:+.4f}")
    cols = res.columns
    for layer, c, v in res.top(10):
        col = f"head {c}" if res.what == "heads" else f"pos {c} {cols[c]!r}"
        con.print(f"  layer {layer:3d}  {col:24s} {v:+.4f}")
    if png:
        con.print(f"plot saved to {png}")


def _table_trace(lm, res, png) -> None:
    from rich.console import Console

    con = Console()
    con.print(f"{lm.name}: causal trace of {res.target!r}; subject tokens {res.subject_positions}; "
              f"p_clean {res.p_clean:.4f}, p_corrupted {res.p_corrupted:.4f} (noise {res.noise_scale:.4g})")
    for kind in ("resid", "mlp", "attn"):
        vals = getattr(res, kind)
        i = int(vals.flatten().argmax())
        layer, p = divmod(i, vals.shape[1])
        con.print(f"  {kind:5s} largest AIE {float(vals[layer, p]):+.4f} at layer {layer}, token {p} {res.tokens[p]!r}")
    if png:
        con.print(f"plot saved to {png}")
