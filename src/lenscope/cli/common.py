"""Shared CLI plumbing: error handling, JSON output, model loading with a status line."""

from __future__ import annotations

import functools
import inspect
import json
import sys
from dataclasses import dataclass

import typer

from ..errors import LenscopeError
from .options import DEVICE_MAP_OPTION, DTYPE_OPTION, MODEL_HELP, MODEL_OPTION  # noqa: F401 (re-exported)


def fail(msg: str, code: int = 2):
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(code)


def one_of(option: str, value, choices) -> None:
    """Fail unless ``value`` (given as ``option``, e.g. ``--metric``) is one of ``choices``."""
    if value not in choices:
        fail(f"unknown {option} {value!r}; choose one of {', '.join(choices)}")


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


def command(app: typer.Typer, name: str, *, model: bool = False):
    """Register the decorated function as command ``name`` of ``app`` with what every command has: lenscope errors
    as one ``error:`` line (:func:`handle_errors`) and, with ``model=True``, the options ``--model``, ``--dtype`` and
    ``--device-map`` as one :class:`ModelChoice` (:func:`model_options`)."""

    def register(fn):
        return app.command(name)(handle_errors(model_options(fn) if model else fn))

    return register


def stage_progress(what: str):
    """``show(stage, done, total)``: a command's progress on stderr as ``what · stage: done/total`` on one line
    (stdout stays the JSON or the table)."""

    def show(stage: str, done: int, total: int) -> None:
        sys.stderr.write(f"\r{what} · {stage}: {done}/{total}   ")
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()

    return show


def print_json(obj) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")


def load_model(name: str, dtype: str | None = None, device_map: str | dict | None = None):
    """Load a model for a command; ``dtype`` / ``device_map`` as given by ``--dtype`` / ``--device-map`` (None:
    float32 on one device, as before)."""
    from ..models.loading.load import load

    if dtype is None and device_map is None:
        return load(name)
    kwargs = {}
    if dtype is not None:
        kwargs["dtype"] = dtype
    if device_map is not None:
        kwargs["device_map"] = device_map
    return load(name, **kwargs)


@dataclass(frozen=True)
class ModelChoice:
    """The model a command runs, as its options ``--model``, ``--dtype`` and ``--device-map`` give it
    (:func:`model_options`)."""

    name: str
    dtype: str | None = None
    device_map: str | None = None

    def load(self):
        return load_model(self.name, dtype=self.dtype, device_map=self.device_map)


def model_options(fn):
    """Give command ``fn`` the options ``--model``, ``--dtype`` and ``--device-map``, one after the other where ``fn``
    has its parameter ``model`` (whose default is the ``--model`` option, e.g. :data:`MODEL_OPTION`), and call ``fn``
    with ``model`` = the :class:`ModelChoice` they make (:func:`command` with ``model=True``)."""
    sig = inspect.signature(fn)
    params = []
    for p in sig.parameters.values():
        params.append(p.replace(annotation=str) if p.name == "model" else p)
        if p.name == "model":
            params += [inspect.Parameter("dtype", p.kind, default=DTYPE_OPTION, annotation=str),
                       inspect.Parameter("device_map", p.kind, default=DEVICE_MAP_OPTION, annotation=str)]

    @functools.wraps(fn)
    def wrapper(*args, model: str, dtype: str | None = None, device_map: str | None = None, **kwargs):
        return fn(*args, model=ModelChoice(model, dtype, device_map), **kwargs)

    wrapper.__signature__ = sig.replace(parameters=params)
    wrapper.__annotations__ = {**fn.__annotations__, "model": "str", "dtype": "str", "device_map": "str"}
    return wrapper


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
