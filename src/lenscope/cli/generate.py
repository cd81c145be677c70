"""``lenscope generate``: generate a continuation and explain every generated token (from one pass)."""

from __future__ import annotations

import sys

import typer

from .common import at_least_one, fail, handle_errors, load_model, print_json
from .options import DEVICE_MAP_OPTION, DTYPE_OPTION, JSON_OPTION, MODEL_OPTION

METHODS_HELP = ("Comma-separated methods of `lenscope explain`: logit, alti-logit, alti, grad-norm, grad-x-input, ig, "
                "erasure, value-zeroing (none: an empty string).")


def _progress(stage: str, done: int, total: int) -> None:
    """Progress of the stages on stderr (stdout stays the JSON or the table)."""
    sys.stderr.write(f"\rgenerate · {stage}: {done}/{total}   ")
    if done >= total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def register(app: typer.Typer) -> None:
    @app.command("generate")
    @handle_errors
    def generate_cmd(
        prompt: str = typer.Argument(..., help="The prompt (with --chat: the user's message)."),
        model: str = MODEL_OPTION,
        dtype: str = DTYPE_OPTION,
        device_map: str = DEVICE_MAP_OPTION,
        max_new_tokens: int = typer.Option(16, "--max-new-tokens", "-n", help="Tokens to generate (at most)."),
        explain: str = typer.Option("alti-logit", "--explain", help=METHODS_HELP),
        foil: str = typer.Option("runner-up", "--foil", help="runner-up (default), a token (text or #ID), or none."),
        chat: bool = typer.Option(False, "--chat", help="Wrap the prompt in the tokenizer's chat template."),
        sample: bool = typer.Option(False, "--sample", help="Sample instead of greedy decoding."),
        seed: int = typer.Option(None, "--seed", help="Seed of --sample (reproducible)."),
        temperature: float = typer.Option(1.0, "--temperature", help="Softmax temperature of --sample."),
        lens: str = typer.Option(None, "--lens", help="A tuned lens folder: its prediction depth too."),
        steps: int = typer.Option(None, "--steps", help="Integrated gradients: quadrature steps (default 16)."),
        html: str = typer.Option(None, "--html", help="Write the page (text strip, matrices, per-token views)."),
        png: str = typer.Option(None, "--png", help="Write the (generated token × source) matrix of the first method."),
        save: str = typer.Option(None, "--save", help="Save the result (.safetensors) to reload later."),
        as_json: bool = JSON_OPTION,
    ):
        """Generate up to N tokens after PROMPT and explain each generated token by the tokens before it."""
        at_least_one(max_new_tokens=max_new_tokens, steps=steps)
        if seed is not None and not sample:
            fail("--seed applies with --sample only")
        if temperature <= 0:
            fail("--temperature must be positive")
        methods = [m.strip() for m in explain.split(",") if m.strip()]
        from ..attribution.explanation import METHODS

        for m in methods:
            if m not in METHODS:
                fail(f"unknown method {m!r} in --explain; choose from {', '.join(METHODS)}")
        if steps is not None and "ig" not in methods:
            fail("--steps applies to the ig method only")
        lm = load_model(model, dtype=dtype, device_map=device_map)
        from ..generation import generate

        opts = {"steps": steps} if steps is not None else {}
        g = generate(lm, prompt, max_new_tokens, explain=methods, foil=None if foil == "none" else foil, chat=chat,
                     sample=sample, seed=seed, temperature=temperature, lens=lens, progress=_progress, **opts)
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


def _table(g, html, png, save) -> None:
    typer.echo(f"{g.model}: {g.prompt_len} prompt tokens + {g.n_steps} generated: {g.text!r}")
    for i, p in enumerate(g.positions):
        parts = [f"{p:4d} {g.tokens[p]!r:14} p={float(g.prob[i]):.3f} H={float(g.entropy[i]):.2f}"
                 f" depth={int(g.depth[i]) if int(g.depth[i]) >= 0 else '-'}"]
        for k, m in enumerate(g.methods):
            sc = g.scores[k, i, :p]
            j = int(sc.abs().argmax()) if p else 0
            parts.append(f"{m}: {g.tokens[j]!r} ({float(sc[j]):+.3f})")
        typer.echo("  ".join(parts))
    for note in g.notes:
        typer.echo(f"note: {note}")
    for what, path in (("page", html), ("plot", png), ("result", save)):
        if path:
            typer.echo(f"{what} saved to {path}")
