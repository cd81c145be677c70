"""Shared CLI plumbing: error handling, JSON output, model loading with a status line."""

from __future__ import annotations

import functools
import json
import sys

import typer

from ..errors import LenscopeError

MODEL_HELP = "Model: smollm2 (default), gemma3-270m, minilm, tiny:<family>, a transformers folder or a .gguf file."


def fail(msg: str, code: int = 2):
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(code)


def handle_errors(fn):
    """Turn lenscope errors into a one-line message and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except LenscopeError as e:
            fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
        except KeyboardInterrupt:
            fail("interrupted", 130)

    return wrapper


def print_json(obj) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")


def load_model(name: str):
    from ..models.load import load

    return load(name)


def emit(res, *, png: str | None = None, save: str | None = None, as_json: bool = False, figure=None) -> bool:
    """The outputs every analysis command shares: a PNG (``figure()`` or ``res.plot()``), a result file, and
    the JSON line. Returns True when JSON was printed (the command then prints nothing else)."""
    if png:
        from ..viz.plots import save_figure

        save_figure(figure() if figure is not None else res.plot(), png)
    if save:
        res.save(save)
    if as_json:
        print_json(res.to_dict())
    return as_json
