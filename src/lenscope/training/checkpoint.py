"""The files of a training run's checkpoint, whatever it trains: its tensors in ``<stem>.safetensors`` (written to
a temporary file first, then moved into place), its record in ``<stem>.json``, and an optimizer's state as tensors
``opt.<param>.<key>`` plus a record of its parameter groups (:func:`flatten_optimizer`). A tuned lens's checkpoint
(:mod:`lenscope.lenses.training.checkpoint`) and sparse dictionaries' (:mod:`lenscope.features.dictionaries.train`) are
these files with their own tensors and records.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor

from ..errors import InputError


def flatten_optimizer(opt) -> tuple[dict, dict]:
    """An optimizer's state as tensors (``opt.<param>.<key>``) and a JSON-able record (``param_groups``,
    ``state_keys``) for :func:`unflatten_optimizer`."""
    sd = opt.state_dict()
    tensors, meta = {}, {"param_groups": sd["param_groups"], "state_keys": {}}
    for pid, st in sd["state"].items():
        meta["state_keys"][str(pid)] = list(st)
        for k, v in st.items():
            tensors[f"opt.{pid}.{k}"] = v if isinstance(v, Tensor) else torch.tensor(v)
    return tensors, meta


def unflatten_optimizer(opt, tensors: dict, meta: dict) -> None:
    """Load into ``opt`` the state :func:`flatten_optimizer` gave (``tensors``: at least its ``opt.*`` ones)."""
    state = {int(pid): {k: tensors[f"opt.{pid}.{k}"] for k in keys} for pid, keys in meta["state_keys"].items()}
    opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def write_state(path: Path, stem: str, tensors: dict, record: dict) -> None:
    """Write ``tensors`` to ``path/<stem>.safetensors`` (through a temporary file, so an interrupted write leaves
    the previous one) and ``record`` to ``path/<stem>.json``."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    tmp = path / f"{stem}.safetensors.tmp"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
    tmp.replace(path / f"{stem}.safetensors")
    (path / f"{stem}.json").write_text(json.dumps(record))


def read_state(path: Path, stem: str) -> tuple[dict, dict]:
    """``(record, tensors)`` that :func:`write_state` wrote; a one-line :class:`~lenscope.errors.InputError` when
    they cannot be read."""
    from safetensors.torch import load_file

    try:
        record = json.loads((path / f"{stem}.json").read_text())
        tensors = load_file(str(path / f"{stem}.safetensors"))
    except (OSError, ValueError) as e:
        raise InputError(f"cannot resume: no readable checkpoint in {path} ({e})") from None
    return record, tensors


__all__ = ["flatten_optimizer", "read_state", "unflatten_optimizer", "write_state"]
