"""Saving and loading results: one ``.safetensors`` file whose header metadata holds the non-tensor
fields as JSON. Loading never unpickles anything."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from .errors import InputError


def axis_size(field: str, dim: int, doc: str = "") -> property:
    """A read-only property: the size of axis ``dim`` of the tensor attribute ``field`` (``n_pos =
    axis_size("top_ids", 1)``), for the shape accessors of results and weights."""

    def get(self) -> int:
        return int(getattr(self, field).shape[dim])

    return property(get, doc=doc or f"size of {field}'s axis {dim}")


class Result:
    """Mixin for dataclass results: ``save(path)`` / ``Cls.load(path)``."""

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


def read_summary(out_dir: str | Path, what: str) -> dict:
    """The fields a dataset run saved as ``summary.json`` in ``out_dir``; an InputError naming ``what`` (e.g.
    ``"study"``) when the file is missing."""
    p = Path(out_dir) / "summary.json"
    if not p.exists():
        raise InputError(f"no {what} in {out_dir} (summary.json missing)")
    return json.loads(p.read_text())
