"""Shared CLI plumbing: error handling, JSON output, model loading with a status line."""

from __future__ import annotations

import functools
import json
import sys

import typer

from ..errors import LenscopeError
from .options import DEVICE_MAP_OPTION, DTYPE_OPTION, MODEL_HELP  # noqa: F401 (re-exported for the commands)


def fail(msg: str, code: int = 2):
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(code)


def at_least_one(**options: int | None) -> None:
    """Fail on the first option (keyword = option name, ``_`` for ``-``) that is given and below 1."""
    for name, value in options.items():
        if value is not None and value < 1:
            fail(f"--{name.replace('_', '-')} must be at least 1")


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


def load_model(name: str, dtype: str | None = None, device_map: str | dict | None = None):
    """Load a model for a command; ``dtype`` / ``device_map`` as given by ``--dtype`` / ``--device-map`` (None:
    float32 on one device, as before)."""
    from ..models.load import load

    if dtype is None and device_map is None:
        return load(name)
    kwargs = {}
    if dtype is not None:
        kwargs["dtype"] = dtype
    if device_map is not None:
        kwargs["device_map"] = device_map
    return load(name, **kwargs)


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
