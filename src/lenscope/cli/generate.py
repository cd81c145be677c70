"""``lenscope generate``: generate a continuation and explain every generated token (from one pass)."""

from __future__ import annotations

import typer

from .common import ModelChoice, at_least_one, command, fail, print_json, stage_progress
from .options import IG_STEPS_OPTION, JSON_OPTION, MODEL_OPTION, SAVE_OPTION, SOURCE_OPTION, table_option


def explain_help() -> str:
    """``--explain``'s help: the method table's names (:mod:`lenscope.attribution.methods`, no torch imported)."""
    from ..attribution import methods as table

    return (f"Comma-separated methods of `lenscope explain`: {', '.join(table.names())} (none: an empty string). "
            "Default alti-logit; none with --steer.")


def register(app: typer.Typer) -> None:
    @command(app, "generate", model=True)
    def generate_cmd(
        prompt: str = typer.Argument(..., help="The prompt (with --chat: the user's message; with --source: the "
                                     "target prefix, may be \"\")."),
        model: ModelChoice = MODEL_OPTION,
        max_new_tokens: int = typer.Option(16, "--max-new-tokens", "-n", help="Tokens to generate (at most)."),
        explain: str = table_option(None, "--explain", help=explain_help),
        foil: str = typer.Option("runner-up", "--foil", help="runner-up (default), a token (text or #ID), or none."),
        chat: bool = typer.Option(False, "--chat", help="Wrap the prompt in the tokenizer's chat template."),
        sample: bool = typer.Option(False, "--sample", help="Sample instead of greedy decoding."),
        seed: int = typer.Option(None, "--seed", help="Seed of --sample (reproducible)."),
        temperature: float = typer.Option(1.0, "--temperature", help="Softmax temperature of --sample."),
        lens: str = typer.Option(None, "--lens", help="A tuned lens folder: its prediction depth too."),
        steps: int = IG_STEPS_OPTION,
        html: str = typer.Option(None, "--html", help="Write the page (text strip, matrices, per-token views)."),
        png: str = typer.Option(None, "--png", help="Write the (generated token × source) matrix of the first method."),
        save: str = SAVE_OPTION,
        steer: list[str] = typer.Option(None, "--steer", help="DIR:ALPHA[@LAYER]: add ALPHA times the direction in "
                                        "folder DIR (lenscope steer build) at resid_pre of its block (or LAYER; "
                                        "comma-separated for several) at every decoding step; repeatable."),
        steer_where: str = typer.Option("all", "--steer-where", help="Positions steered: all (default), prompt or "
                                        "generated.", metavar="all|prompt|generated"),
        source: str = SOURCE_OPTION,
        as_json: bool = JSON_OPTION,
    ):
        """Generate up to N tokens after PROMPT and explain each generated token by the tokens before it."""
        at_least_one(max_new_tokens=max_new_tokens, steps=steps)
        if seed is not None and not sample:
            fail("--seed applies with --sample only")
        if temperature <= 0:
            fail("--temperature must be positive")
        if explain is None:
            explain = "" if steer else "alti-logit"
        methods = [m.strip() for m in explain.split(",") if m.strip()]
        if steer and methods:
            fail("the explanations decompose the unsteered model, so --explain does not apply with --steer; leave it "
                 "out")
        from .steer import WHERE, parse_steer

        if steer_where not in WHERE:
            fail(f"--steer-where must be one of {', '.join(WHERE)}, not {steer_where!r}")
        specs = [parse_steer(s) for s in steer or ()]
        if source is not None:
            _source_refusals(sample=sample, chat=chat, lens=lens, steer=steer, html=html, png=png)
        from ..attribution import methods as table

        for m in methods:
            if m not in table.names():
                fail(f"unknown method {m!r} in --explain; choose from {', '.join(table.names())}")
        takers = table.taking("steps")
        if steps is not None and not any(m in takers for m in methods):
            fail(f"--steps applies to the {' or '.join(takers)} method only")
        lm = model.load()
        from ..generation import generate

        edits, steering = _steering(lm, specs, steer_where)
        opts = {"steps": steps} if steps is not None else {}
        g = generate(lm, prompt, max_new_tokens, explain=methods, foil=None if foil == "none" else foil, chat=chat,
                     sample=sample, seed=seed, temperature=temperature, lens=lens, progress=stage_progress("generate"),
                     edits=edits, **({"source": source} if source is not None else {}), **opts)
        if steering:
            g.settings["steer"] = steering
        if html:
            g.to_html(html)
        if png:
            if not g.methods:
                fail("--png draws a method's matrix; give --explain")
            from ..viz.plots import save_figure

            save_figure(g.plot(), png)
        if save:
            g.save(save)
        if as_json:
            print_json(g.to_dict())
            return
        _table(g, html, png, save)


def _source_refusals(**given) -> None:
    """What generation with a source does not do yet, refused in one line each (before the model loads)."""
    why = {"sample": "generation with a source is greedy for now; leave out --sample",
           "chat": "--chat wraps a decoder's prompt in a chat template; with --source the text is the target prefix: "
                   "leave out --chat",
           "lens": "a tuned lens reads a decoder-only model's states; with --source leave out --lens",
           "steer": "--steer with --source is not supported yet (the engine's key/value cache reads no source)",
           "html": "--html does not draw a generation with a source yet; use --json or --save",
           "png": "--png does not draw a generation with a source yet; use --json or --save"}
    for k, v in given.items():
        if v:
            fail(why[k])


def _steering(lm, specs, where: str):
    """The edits of the --steer options (a function of the prompt's and the longest sequence's lengths) and their
    record for the result's settings; (None, []) without --steer."""
    if not specs:
        return None, []
    from ..steering import Direction, generation_edits

    parts, record = [], []
    for folder, alpha, layers in specs:
        d = Direction.load(folder)
        layers = d.check(lm, layers)
        parts.append(generation_edits(d, alpha, layers=layers, where=where))
        record.append({"direction": folder, "method": d.method, "site": "resid_pre", "layers": layers,
                       "alpha": alpha, "where": where})

    def edits(prompt_len: int, max_len: int) -> list:
        return [e for f in parts for e in f(prompt_len, max_len)]

    return edits, record


def _table(g, html, png, save) -> None:
    src = f"{g.n_source} source tokens ({g.source!r}), " if g.n_source else ""
    typer.echo(f"{g.model}: {src}{g.prompt_len} prompt tokens + {g.n_steps} generated: {g.text!r}")
    for s in g.settings.get("steer", ()):
        typer.echo(f"steered: {s['alpha']:+g} x {s['method']} direction {s['direction']} at resid_pre "
                   f"{','.join(map(str, s['layers']))} ({s['where']} positions)")
    for i, p in enumerate(g.positions):
        parts = [f"{p:4d} {g.tokens[p]!r:14} p={float(g.prob[i]):.3f} H={float(g.entropy[i]):.2f}"
                 f" depth={int(g.depth[i]) if int(g.depth[i]) >= 0 else '-'}"]
        ctx, S = g.context_tokens, g.n_source
        for k, m in enumerate(g.methods):
            sc = g.scores[k, i, : S + p]
            j = int(sc.abs().argmax()) if S + p else 0
            side = ("source " if j < S else "target ") if S else ""
            parts.append(f"{m}: {side}{ctx[j]!r} ({float(sc[j]):+.3f})")
        typer.echo("  ".join(parts))
    for note in g.notes:
        typer.echo(f"note: {note}")
    for what, path in (("page", html), ("plot", png), ("result", save)):
        if path:
            typer.echo(f"{what} saved to {path}")
