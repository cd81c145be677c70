"""Saving and loading results: one ``.safetensors`` file whose header metadata holds the non-tensor
fields as JSON. Loading never unpickles anything."""

from __future__ import annotations

import dataclasses
import html
import io
import json
import math
from pathlib import Path

import torch

from .errors import InputError, LenscopeError


def finite_json(x):
    """``x`` (dicts, lists, tuples, floats) with every non-finite float as None (strict JSON); tuples become
    lists."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: finite_json(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite_json(v) for v in x]
    return x


def field_values(res) -> dict:
    """``{name: value}`` of a dataclass's fields, the values as they are (``dataclasses.asdict`` copies them
    deeply and turns nested dataclasses into dicts)."""
    return {f.name: getattr(res, f.name) for f in dataclasses.fields(res)}


def axis_size(field: str, dim: int, doc: str = "") -> property:
    """A read-only property: the size of axis ``dim`` of the tensor attribute ``field`` (``n_pos =
    axis_size("top_ids", 1)``), for the shape accessors of results and weights."""

    def get(self) -> int:
        return int(getattr(self, field).shape[dim])

    return property(get, doc=doc or f"size of {field}'s axis {dim}")


class Result:
    """Mixin for dataclass results: ``save(path)`` / ``Cls.load(path)``, and ``_repr_html_`` for notebooks."""

    def _repr_html_(self) -> str:
        """In a notebook: the result's ``plot()`` as an inline SVG, or a table of its fields where it has no plot
        (results with a report view override this with that view: :mod:`lenscope.viz.notebook`)."""
        plot = getattr(self, "plot", None)
        if callable(plot):
            try:
                svg = figure_svg(plot())
            except LenscopeError:  # a plot that does not apply to this result
                svg = None
            if svg is not None:
                return f'<div class="lenscope-plot">{svg}</div>'
        return fields_table(self)

    def save(self, path: str | Path) -> Path:
        from safetensors.torch import save_file

        path = Path(path)
        tensors, meta = {}, {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                tensors[f.name] = v.detach().cpu().contiguous()
            else:
                meta[f.name] = v
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path), metadata={"lenscope_type": type(self).__name__, "fields": json.dumps(meta)})
        return path

    @classmethod
    def load(cls, path: str | Path):
        from safetensors import safe_open

        path = Path(path)
        if not path.exists():
            raise InputError(f"no such file: {path}")
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except Exception as e:  # safetensors raises several kinds for a corrupt header
            raise InputError(f"{path} is not a lenscope result file ({e})") from None
        if meta.get("lenscope_type") != cls.__name__:
            raise InputError(f"{path} holds a {meta.get('lenscope_type')!r}, not a {cls.__name__}")
        return cls(**tensors, **json.loads(meta["fields"]))


def figure_svg(fig) -> str | None:
    """A matplotlib figure (or axes) as inline SVG markup (text kept as text), the figure closed so that a
    notebook does not show it a second time; None when ``fig`` is not a figure."""
    fig = getattr(fig, "figure", fig)
    if not hasattr(fig, "savefig"):
        return None
    import matplotlib
    import matplotlib.pyplot as plt

    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none"}):
        fig.savefig(buf, format="svg", bbox_inches="tight")
    plt.close(fig)
    text = buf.getvalue()
    return text[text.index("<svg"):]


def _cell(v) -> str:
    if isinstance(v, torch.Tensor):
        return f"tensor {tuple(v.shape)} {str(v.dtype).removeprefix('torch.')}"
    if isinstance(v, (list, tuple)) and len(v) > 8:
        return f"{type(v).__name__} of {len(v)}: {', '.join(repr(x) for x in v[:6])}, ..."
    if isinstance(v, dict) and len(v) > 8:
        return f"dict of {len(v)}: {', '.join(repr(k) for k in list(v)[:6])}, ..."
    text = repr(v)
    return text if len(text) <= 300 else text[:297] + "..."


def fields_table(res) -> str:
    """A small HTML table of a dataclass result's fields (tensors by shape and dtype, long lists shortened)."""
    rows = "".join(f"<tr><th style=\"text-align: left\">{html.escape(f.name)}</th>"
                   f"<td style=\"text-align: left\"><code>{html.escape(_cell(getattr(res, f.name)))}</code></td></tr>"
                   for f in dataclasses.fields(res))
    return f'<div class="lenscope-result"><b>{html.escape(type(res).__name__)}</b><table>{rows}</table></div>'


def read_summary(out_dir: str | Path, what: str) -> dict:
    """The fields a dataset run saved as ``summary.json`` in ``out_dir``; an InputError naming ``what`` (e.g.
    ``"study"``) when the file is missing."""
    p = Path(out_dir) / "summary.json"
    if not p.exists():
        raise InputError(f"no {what} in {out_dir} (summary.json missing)")
    return json.loads(p.read_text())
