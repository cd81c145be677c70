"""``lenscope steer build | eval``: build a steering direction from contrast pairs, and measure it input by input
(``lenscope generate --steer DIR:ALPHA[@LAYER]`` steers a generation)."""

from __future__ import annotations

import typer

from .common import ModelChoice, command, fail, print_json, stage_progress
from .options import JSON_OPTION, MODEL_OPTION, SAVE_OPTION, table_option

steer_app = typer.Typer(
    rich_markup_mode=None, no_args_is_help=True,
    help="Steering: build a direction from contrast pairs (build); measure how well it steers and what it costs "
         "(eval).")

WHERE = ("all", "prompt", "generated")


def method_help() -> str:
    """``--method``'s help: the direction builders (:mod:`lenscope.steering.builders`, no torch imported), e.g.
    ``actadd (first pair), mean-diff, pca or probe.``"""
    from ..steering import builders

    words = [f"{b.name} ({b.help})" if b.help else b.name for b in builders.builders()]
    return (words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}") + "."


def method_metavar() -> str:
    from ..steering import builders

    return "|".join(builders.names())


def parse_numbers(text: str, what: str, kind=float) -> list:
    """``"-8,-4,0,4"`` -> numbers; a one-line error naming ``what`` otherwise."""
    parts = [p.strip() for p in str(text).split(",")]
    if not parts or any(p == "" for p in parts):
        fail(f"{what} must be a comma-separated list of numbers, e.g. -8,-4,0,4,8; got {text!r}")
    out = []
    for p in parts:
        try:
            out.append(kind(p))
        except ValueError:
            fail(f"{what}: {p!r} is not {'an integer' if kind is int else 'a number'} (in {text!r})")
    return out


def parse_steer(spec: str) -> tuple[str, float, list[int] | None]:
    """``DIR:ALPHA[@LAYER[,LAYER...]]`` -> (folder, alpha, layers or None)."""
    folder, sep, tail = spec.rpartition(":")
    if not sep or not folder or not tail:
        fail(f"--steer takes DIR:ALPHA[@LAYER] (e.g. out/sentiment:4 or out/sentiment:4@6), not {spec!r}")
    alpha_s, at, layer_s = tail.partition("@")
    try:
        alpha = float(alpha_s)
    except ValueError:
        fail(f"--steer {spec!r}: the multiplier {alpha_s!r} is not a number (DIR:ALPHA[@LAYER])")
    if alpha != alpha or alpha in (float("inf"), float("-inf")):
        fail(f"--steer {spec!r}: the multiplier must be a finite number")
    layers = parse_numbers(layer_s, f"--steer {spec!r}: the layers after @", int) if at else None
    return folder, alpha, layers


@command(steer_app, "build", model=True)
def build_cmd(
    data: str = typer.Option(..., "--data", help="CSV with the columns positive,negative (two texts that differ in "
                             "the behaviour)."),
    out: str = typer.Option(..., "--out", help="Folder to write the direction to (direction.json + "
                            "direction.safetensors)."),
    method: str = table_option("mean-diff", "--method", help=method_help, metavar=method_metavar),
    layer: int = typer.Option(None, "--layer", help="Block L: the direction lives in resid_pre.L, the residual "
                              "stream entering block L (default: the middle block)."),
    position: int = typer.Option(-1, "--position", help="Which token's state is read (default -1: the last; "
                                 "negative counts from the end)."),
    model: ModelChoice = MODEL_OPTION,
    as_json: bool = JSON_OPTION,
):
    """Build a steering direction from contrast pairs at resid_pre.LAYER."""
    from ..steering import builders

    if method not in builders.names():
        fail(f"unknown --method {method!r}; choose from {', '.join(builders.names())}")
    from ..data.steering import read_steering_pairs

    pairs = read_steering_pairs(data)
    lm = model.load()
    from ..steering import build_direction

    d = build_direction(lm, pairs, method, layer, position=position, source=data)
    d.save(out)
    cfg = {**d.config(), "data": data, "out": out}
    if as_json:
        print_json(cfg)
        return
    st = d.stats
    extra = "".join(f", {k} {v:.3f}" for k, v in st.items() if k not in ("norm", "agreement") and v is not None)
    typer.echo(f"{d.method} direction at {d.site_name} of {lm.name} from {d.n_pairs} pairs: norm {st['norm']:.4g}, "
               f"agreement {st['agreement']:.3f}{extra}")
    for note in d.notes:
        typer.echo(f"note: {note}")
    typer.echo(f"saved to {out}")


@command(steer_app, "eval", model=True)
def eval_cmd(
    vector: str = typer.Option(..., "--vector", help="A direction folder (lenscope steer build --out)."),
    data: str = typer.Option(..., "--data", help="CSV with the columns text,answer_positive,answer_negative."),
    multipliers: str = typer.Option("-8,-4,-2,0,2,4,8", "--multipliers", help="Comma-separated multipliers "
                                    "(write --multipliers=-8,-4,0,4,8 or --multipliers -8,-4,0,4,8)."),
    layers: str = typer.Option(None, "--layers", help="Comma-separated blocks to steer at (default: the "
                               "direction's own)."),
    damage_data: str = typer.Option(None, "--damage-data", help="Held-out text file for the damage (default: the "
                                    "start of the shared data's wikitext2/wiki.test.raw)."),
    damage_tokens: int = typer.Option(2048, "--damage-tokens", help="Tokens of held-out text for the damage."),
    no_damage: bool = typer.Option(False, "--no-damage", help="Measure no damage (delta_loss and kl are null)."),
    bootstrap: int = typer.Option(1000, "--bootstrap", help="Bootstrap draws for the intervals."),
    seed: int = typer.Option(0, "--seed", help="Seed of the bootstrap."),
    min_effect: float = typer.Option(0.1, "--min-effect", help="Logits the fitted line must move an input at the "
                                     "largest multiplier for it to count as moved."),
    max_tokens: int = typer.Option(4096, "--max-tokens", help="Tokens per forward pass (rows x positions)."),
    html: str = typer.Option(None, "--html", help="Write a self-contained page of the evaluation."),
    png: str = typer.Option(None, "--png", help="Write the effect-against-multiplier plot."),
    save: str = SAVE_OPTION,
    model: ModelChoice = MODEL_OPTION,
    as_json: bool = JSON_OPTION,
):
    """Measure a direction on held-out inputs: per-input slopes, anti-steerable share, damage, per layer."""
    alphas = parse_numbers(multipliers, "--multipliers")
    blocks = parse_numbers(layers, "--layers", int) if layers is not None else None
    for name, v in (("damage-tokens", damage_tokens), ("bootstrap", bootstrap), ("max-tokens", max_tokens)):
        if v < 1:
            fail(f"--{name} must be at least 1")
    if damage_tokens < 2:
        fail("--damage-tokens must be at least 2")
    if no_damage and damage_data is not None:
        fail("--no-damage and --damage-data exclude each other")
    if min_effect < 0:
        fail("--min-effect must be at least 0")
    from ..data.steering import read_steering_inputs
    from ..steering import Direction

    inputs = read_steering_inputs(data)
    direction = Direction.load(vector)
    lm = model.load()
    from ..steering import evaluate_steering

    ev = evaluate_steering(lm, direction, inputs, alphas, blocks,
                           damage_data=None if no_damage else (damage_data or "default"), damage_tokens=damage_tokens,
                           bootstrap=bootstrap, seed=seed, min_effect=min_effect, max_tokens=max_tokens, source=data,
                           progress=None if as_json else stage_progress("steer eval"))
    if html:
        ev.to_html(html)
    if png:
        from ..viz.plots import save_figure

        save_figure(ev.plot("effect"), png)
    if save:
        ev.save(save)
    d = ev.to_dict()
    d["vector"], d["data"] = vector, data
    if as_json:
        print_json(d)
        return
    _table(ev)
    for what, path in (("page", html), ("plot", png), ("result", save)):
        if path:
            typer.echo(f"{what} saved to {path}")


def _fmt(x) -> str:
    return "–" if x is None else f"{x:+.3f}"


def _table(ev) -> None:
    d = ev.to_dict()
    typer.echo(f"{ev.model}: {d['direction']['method']} direction from {d['direction']['site']}, {ev.n_inputs} inputs")
    for layer, r in d["layers"].items():
        typer.echo(f"layer {layer}: steerable {r['steerable_fraction']:.3f}, anti-steerable "
                   f"{r['anti_steerable_fraction']:.3f}, unmoved {r['unmoved_fraction']:.3f}; mean slope "
                   f"{_fmt(r['mean_slope'])} [{_fmt(r['mean_slope_ci'][0])}, {_fmt(r['mean_slope_ci'][1])}]")
        for k, a in enumerate(r["multipliers"]):
            lo, hi = r["effect_ci"][k]
            dl = None if r["delta_loss"] is None else r["delta_loss"][k]
            kl = None if r["kl"] is None else r["kl"][k]
            typer.echo(f"  α {a:+7.3g}: effect {_fmt(r['mean_effect'][k])} [{_fmt(lo)}, {_fmt(hi)}]  Δloss "
                       f"{_fmt(dl)}  KL {'–' if kl is None else f'{kl:.4f}'}")
    for note in d["notes"]:
        typer.echo(f"note: {note}")


def register(app: typer.Typer) -> None:
    app.add_typer(steer_app, name="steer")
