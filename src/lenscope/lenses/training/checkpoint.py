"""Checkpoints of tuned-lens training: save and resume the whole training state.

A checkpoint is two files in the run's output directory (:mod:`lenscope.training.checkpoint`'s, the stem
``checkpoint``): ``checkpoint.safetensors`` (the translators
``A, b`` and, with mid-layer translators, ``A_mid, b_mid``; the optimizer's state as ``opt.<param>.<key>``;
with ``keep_best`` the selection's ``best.*`` tensors) and ``checkpoint.json`` (``state``: the
:class:`~lenscope.training.plan.TrainState`, ``settings``, the model's ``fingerprint``, ``optimizer``: the
optimizer's parameter groups and state keys). A resume must use the same model and settings.
"""

from __future__ import annotations

import json
from dataclasses import asdict, fields
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ...errors import InputError
from ...training.checkpoint import flatten_optimizer, read_state, unflatten_optimizer, write_state
from ...training.plan import TrainState
from ..lenses import TunedLens
from .settings import TrainSettings

if TYPE_CHECKING:
    from .selection import BestPerState

CHECKPOINT = "checkpoint"  # the files' stem: checkpoint.safetensors, checkpoint.json


def _settings_match(saved: dict, s: TrainSettings) -> dict:
    """Settings that differ between a checkpoint and now; a setting the checkpoint predates matches its default,
    and an automatic precision (``bf16=None``) matches whatever the checkpoint chose."""
    now = asdict(s)
    defaults = asdict(TrainSettings())
    return {k: (saved.get(k, defaults[k]), v) for k, v in now.items()
            if saved.get(k, defaults[k]) != v and not (k == "bf16" and v is None)}


def save_checkpoint(path: Path, lens: TunedLens, opt, state: TrainState, settings: TrainSettings, fp: str,
                    best: BestPerState | None = None) -> None:
    tensors, meta = flatten_optimizer(opt)
    tensors.update({"A": lens.A.detach().contiguous(), "b": lens.b.detach().contiguous()})
    if lens.has_mid_translators:
        tensors.update({"A_mid": lens.A_mid.detach().contiguous(), "b_mid": lens.b_mid.detach().contiguous()})
    if best is not None:
        tensors.update(best.tensors())
    write_state(path, CHECKPOINT, tensors,
                {"state": asdict(state), "settings": asdict(settings), "fingerprint": fp, "optimizer": meta})


def load_checkpoint(path: Path, lens: TunedLens, opt, settings: TrainSettings, fp: str,
                    best: BestPerState | None = None) -> TrainState:
    info, tensors = read_state(path, CHECKPOINT)
    if info["fingerprint"] != fp:
        raise InputError(f"cannot resume: the checkpoint in {path} was made for another model")
    diff = _settings_match(info["settings"], settings)
    if diff:
        raise InputError(f"cannot resume: settings differ from the checkpoint's (checkpoint, now): {diff}")
    with torch.no_grad():
        lens.A.copy_(tensors["A"])
        lens.b.copy_(tensors["b"])
        if lens.has_mid_translators:
            lens.A_mid.copy_(tensors["A_mid"])
            lens.b_mid.copy_(tensors["b_mid"])
    unflatten_optimizer(opt, tensors, info["optimizer"])
    if best is not None:
        best.load(tensors)
    known = {f.name for f in fields(TrainState)}
    return TrainState(**{k: v for k, v in info["state"].items() if k in known})


def read_checkpoint_info(path: Path) -> dict:
    """``checkpoint.json`` in ``path`` as a dict; ``{}`` when there is none or it cannot be read."""
    try:
        return json.loads((path / f"{CHECKPOINT}.json").read_text())
    except (OSError, ValueError):
        return {}


__all__ = ["load_checkpoint", "read_checkpoint_info", "save_checkpoint"]
