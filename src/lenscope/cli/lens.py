"""``lenscope lens train | eval | show``."""

from __future__ import annotations

from pathlib import Path

import typer

from ..errors import InputError
from .common import command, load_model, print_json
from .options import (
    EVAL_PART_OPTION,
    JSON_OPTION,
    JSON_SUMMARY_OPTION,
    MODEL_OPTION,
    RESUME_OPTION,
    SEED_OPTION,
    SEQ_LEN_OPTION,
)

lens_app = typer.Typer(
    rich_markup_mode=None, help="Logit, tuned and Patchscope lenses: train, evaluate, show prediction trajectories.",
    no_args_is_help=True)


LENS_NAMES = ("logit", "patchscope")  # lenses named on the command line; anything else is a tuned-lens directory


def get_lens(lm, spec: str | None):
    """``logit``/None -> LogitLens; ``patchscope`` -> PatchscopeLens (the token-identity prompt, each state patched
    at its own layer); a directory -> the TunedLens saved there (checked against the model)."""
    from ..lenses import LogitLens, PatchscopeLens, TunedLens

    if spec is None or spec == "logit":
        return LogitLens(lm.anatomy, model_name=lm.name)
    if spec == "patchscope":
        return PatchscopeLens(lm)
    return TunedLens.load(spec, lm)


def _sequences(lm, data: str, part: str, seq_len: int | None, tokens: int | None):
    from ..data.text import read_text, split_text, token_sequences

    return token_sequences(lm, split_text(read_text(data), part), seq_len, max_tokens=tokens)


@command(lens_app, "train")
def train_cmd(
    data: str = typer.Option(..., "--data", help="Plain text file (e.g. ../shared/data/wikitext2/wiki.test.raw)."),
    out: str = typer.Option(
        ..., "--out", help="Directory for the lens (config.json + params.safetensors) and checkpoints."),
    model: str = MODEL_OPTION,
    max_minutes: float = typer.Option(None, "--max-minutes",
                                      help="Time budget in minutes, model loading included (default 15 unless --tokens "
                                           "is given): the number of tokens follows from the speed measured in the "
                                           "first steps. With --tokens too, --tokens is the most it will use."),
    tokens: int = typer.Option(None, "--tokens", help="Training token budget (alone: a fixed budget, no time limit)."),
    seq_len: int = SEQ_LEN_OPTION,
    batch_size: int = typer.Option(4, "--batch-size", help="Sequences per optimizer step."),
    part: str = typer.Option(
        "train", "--part", help="Which part of the file: train (first 80%), eval (last 20%), all."),
    optimizer: str = typer.Option("adam", "--optimizer", help="adam (default) or sgd (Nesterov, as in the paper)."),
    lr: float = typer.Option(None, "--lr", help="Peak learning rate (default 2e-3 adam, 1.0 sgd)."),
    precision: str = typer.Option("auto", "--precision",
                                  help="Unembedding matmuls of training: auto (bfloat16 where the CPU runs it natively "
                                       "or a quick measurement says it is faster), bf16 or fp32."),
    mid: bool = typer.Option(False, "--mid/--no-mid", help="Also train translators for the mid-layer "
                                                           "(after-attention) states (twice the work per token)."),
    keep_best: bool = typer.Option(True, "--keep-best/--keep-last",
                                   help="Per layer, keep the translator with the lowest KL on held-out training text "
                                        "(checked about 12 times per run, the identity included) or the last one."),
    patience: int = typer.Option(None, "--patience", help="--keep-best: failed checks in a row before a layer's step "
                                                          "size shrinks (default: TrainSettings' default)."),
    validation_tokens: int = typer.Option(512, "--validation-tokens",
                                          help="Tokens held out of the training text for --keep-best."),
    checkpoint_every: int = typer.Option(10, "--checkpoint-every", help="Save a checkpoint every N steps (0: never)."),
    init: str = typer.Option("least-squares", "--init",
                             help="The translators' start: least-squares (each fitted in closed form to the last "
                                  "state on --init-tokens tokens, a minute or two; default) or identity."),
    init_tokens: int = typer.Option(32768, "--init-tokens", help="Tokens the least-squares start reads."),
    resume: bool = RESUME_OPTION,
    seed: int = SEED_OPTION,
    as_json: bool = JSON_SUMMARY_OPTION,
):
    """Train a tuned lens on a text file (KL to the model's final distribution, model frozen)."""
    import time

    from ..lenses import TrainSettings, train_tuned_lens

    started = time.perf_counter()
    if precision not in ("auto", "bf16", "fp32"):
        raise InputError(f"--precision must be auto, bf16 or fp32, not {precision!r}")
    if max_minutes is None and tokens is None:
        max_minutes = 15.0
    lm = load_model(model)
    seqs = _sequences(lm, data, part, seq_len, None)
    extra = {} if patience is None else {"patience": patience}
    settings = TrainSettings(tokens=tokens or 0, max_minutes=max_minutes, seq_len=seqs.shape[1], batch_size=batch_size,
                             optimizer=optimizer, lr=lr, checkpoint_every=checkpoint_every, seed=seed,
                             keep_best=keep_best, validation_tokens=validation_tokens, mid=mid, init=init,
                             init_tokens=init_tokens,
                             bf16={"auto": None, "bf16": True, "fp32": False}[precision], **extra)
    from ..distributed import ddp

    d = ddp.from_env()  # under `torchrun --nproc-per-node N`: data-parallel over N ranks (gloo on CPU, NCCL on GPU)
    lens = train_tuned_lens(lm, seqs, settings, out=out, resume=resume, started=started, dist=d,
                            log=(lambda msg: typer.echo(msg, err=True)) if d.main else None)
    if not d.main:
        return
    info = lens.training_info
    summary = {"out": str(Path(out)), "model": lm.name, "steps": info["steps"], "tokens_seen": info["tokens_seen"],
               "seconds": info["seconds"], "tokens_per_s": info["tokens_per_s"],
               "final_train_kl": info["history"][-1][1] if info["history"] else None,
               "precision": info.get("precision"), "time_budget": info.get("time_budget"),
               "selection": info.get("selection"), "init": info.get("init"), "ranks": d.world}
    if as_json:
        print_json(summary)
    else:
        prec = info.get("precision") or {}
        typer.echo(f"tuned lens saved to {out}: {info['steps']} steps, {info['tokens_seen']} tokens, "
                   f"{info['seconds']:.0f} s ({info['tokens_per_s']:.0f} tokens/s), "
                   f"last training KL {summary['final_train_kl']:.3f} nats")
        if prec:
            typer.echo(f"unembedding matmuls in {prec.get('unembed_dtype')}: {prec.get('reason')}")
        sel = info.get("selection")
        if sel:
            backed = [i for i, f in enumerate(sel["step_size_factor"]) if f < 1.0]
            start = sel.get("validation_kl_start")
            typer.echo(f"validation KL per layer (identity{' -> least-squares start' if start else ''} -> kept): "
                       + ", ".join(f"{i}: {a:.2f}->" + (f"{start[i]:.2f}->" if start else "") + f"{b:.2f}"
                                   for i, (a, b) in enumerate(zip(sel["validation_kl_identity"],
                                                                  sel["validation_kl"]))))
            if sel.get("mid"):
                m = sel["mid"]
                typer.echo("mid-layer states (identity -> kept): " + ", ".join(
                    f"{i}.mid: {a:.2f}->{b:.2f}"
                    for i, (a, b) in enumerate(zip(m["validation_kl_identity"], m["validation_kl"]))))
            typer.echo(f"layers that backed off to a smaller step: {backed or 'none'}")


@command(lens_app, "eval")
def eval_cmd(
    data: str = typer.Option(..., "--data", help="Plain text file."),
    model: str = MODEL_OPTION,
    lens: str = typer.Option("logit", "--lens", help="'logit', 'patchscope' or a tuned-lens directory."),
    tokens: int = typer.Option(8192, "--tokens", help="Evaluation token budget."),
    seq_len: int = SEQ_LEN_OPTION,
    part: str = EVAL_PART_OPTION,
    png: str = typer.Option(None, "--png", help="Save a per-layer KL plot."),
    mid: bool = typer.Option(False, "--mid", help="Also the mid-layer (after-attention) states, through the lens's "
                                                  "mid-layer translators where it has them."),
    as_json: bool = JSON_OPTION,
):
    """Per-layer KL to the final distribution, cross-entropy, entropy and top-1 agreement on held-out text."""
    from ..lenses import evaluate_lens

    lm = load_model(model)
    the_lens = get_lens(lm, lens)
    seqs = _sequences(lm, data, part, seq_len, tokens)
    ev = evaluate_lens(lm, the_lens, seqs, name=lens, mid=mid)
    if png:
        from ..viz.plots import save_figure

        save_figure(ev.plot(), png)
    if as_json:
        print_json(ev.to_dict())
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{lens} lens on {lm.name}: {ev.n_tokens} tokens (nats)")
    for col in ("layer", "KL", "CE", "entropy", "top-1 agree"):
        table.add_column(col, justify="right")
    rows = [(str(r["layer"]), r) for r in ev.layers()]
    if mid:  # interleave "l.mid" after "l"
        rows = [x for i, r in enumerate(ev.layers()) for x in
                [(str(i), r)] + ([(f"{i}.mid", ev.mid_layers()[i])] if i < len(ev.mid_layers()) else [])]
    for label, r in rows:
        table.add_row(label, f"{r['kl']:.3f}", f"{r['ce']:.3f}", f"{r['entropy']:.3f}", f"{r['top1_agreement']:.2%}")
    con = Console()
    con.print(table)
    con.print(f"mean KL over layers {ev.mean_kl:.3f} nats; mean prediction depth {ev.mean_depth:.2f}"
              + (f"; mean KL over mid-layer states {ev.mean_mid_kl:.3f} nats" if mid else ""))


@command(lens_app, "show")
def show_cmd(
    text: str = typer.Argument(..., help="Text whose prediction trajectory to show."),
    model: str = MODEL_OPTION,
    lens: str = typer.Option(None, "--lens", help="'patchscope' or a tuned-lens directory (shown beside the logit "
                                                  "lens)."),
    html: str = typer.Option(None, "--html", help="Write an interactive HTML page."),
    png: str = typer.Option(None, "--png", help="Write a static heat map."),
    value: str = typer.Option("entropy", "--value", help="Colour by entropy, kl or prob."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
):
    """Prediction trajectory: the lens's top token, probability, entropy and KL per layer and position."""
    from ..lenses import LogitLens
    from ..lenses.trajectory import prediction_trajectory

    if value not in ("entropy", "kl", "prob"):
        raise InputError(f"--value must be entropy, kl or prob, not {value!r}")
    lm = load_model(model)
    trajs = []
    if lens is not None and lens != "logit":  # a tuned/Patchscope lens beside the logit lens; the logit lens once
        trajs.append(prediction_trajectory(lm, text, get_lens(lm, lens)))
    trajs.append(prediction_trajectory(lm, text, LogitLens(lm.anatomy, model_name=lm.name)))
    if html:
        from ..viz.html import trajectory_html

        trajectory_html(trajs, html)
    if png:
        from ..viz.lens_plots import plot_trajectories
        from ..viz.plots import save_figure

        save_figure(plot_trajectories(trajs, value=value), png)
    from ..lenses.depth import trajectory_depth  # prediction depth per position (None: never settles)

    if as_json:
        print_json([{**t.to_dict(), "depth": trajectory_depth(t)} for t in trajs])
        return
    from rich.console import Console
    from rich.table import Table

    con = Console()
    for t in trajs:
        table = Table(title=f"{t.lens} lens on {lm.name}: top token per layer (rows) and position (columns)")
        table.add_column("layer")
        for tok in t.tokens:
            table.add_column(repr(tok)[1:-1][:10])
        for i in reversed(range(len(t.state_labels))):
            table.add_row(t.state_labels[i], *[repr(s)[1:-1][:10] for s in t.top_tokens[i]])
        table.add_row("depth", *["-" if d is None else str(d) for d in trajectory_depth(t)])
        con.print(table)
    for p in (html, png):
        if p:
            con.print(f"written: {p}")


def register(app: typer.Typer) -> None:
    from . import lens_analysis, lens_detect

    lens_analysis.register(lens_app)   # lens cbe, lens depth
    lens_detect.register(lens_app)     # lens detect
    app.add_typer(lens_app, name="lens")
