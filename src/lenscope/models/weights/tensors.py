"""Helpers for the Anatomy's tensors: dtype and device copies of its parts, and the moves its math makes (re-exported
by :mod:`lenscope.models.weights.anatomy`)."""

from __future__ import annotations

import torch
from torch import Tensor


def _map_tensors(obj, fn):
    """``obj`` (a tensor, list, tuple or dataclass, recursively) with ``fn`` applied to every tensor; unchanged
    objects are returned as they are (no copies)."""
    import dataclasses

    if isinstance(obj, Tensor):
        return fn(obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(o, fn) for o in obj)
    if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
        return obj
    changes = {}
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        nv = _map_tensors(v, fn)
        if nv is not v:
            changes[f.name] = nv
    return dataclasses.replace(obj, **changes) if changes else obj


def astype(obj, dtype: torch.dtype):
    """A copy of an anatomy part (a dataclass, recursively) with every floating tensor in ``dtype``; the object
    itself when nothing changes. Used to run lenscope's own math in float64 where a method needs it."""
    return _map_tensors(obj, lambda t: t.to(dtype) if t.is_floating_point() else t)


def to_device(obj, device):
    """A copy of an anatomy part (a dataclass, recursively) with every tensor on ``device``; the object itself when
    nothing changes. For a model split across devices a method can bring one layer's weights to where its
    activations are (``to_device(A.layers[l], tr.resid_pre.device)``, one layer at a time); ``load(...,
    math_device=)`` gathers a whole Anatomy with it."""
    device = torch.device(device)
    return _map_tensors(obj, lambda t: t if t.device == device else t.to(device))


def _on(x: Tensor | None, ref: Tensor | None) -> Tensor | None:
    """``x`` on the device of ``ref`` (a no-op when they already share one): lenscope's own math runs where the
    weights of the part sit, so a model split across devices is recomputed layer by layer on each layer's device."""
    if x is None or ref is None or x.device == ref.device:
        return x
    return x.to(ref.device)


def _mix(x: Tensor, W: Tensor) -> tuple[Tensor, Tensor]:
    """``x`` and the weight ``W`` in a common dtype (the more precise one; a no-op when they agree). An Anatomy that
    keeps a bfloat16 model's weights as views (``load(..., anatomy_dtype="model")``) computes in float32 this way,
    one weight at a time."""
    if x.dtype == W.dtype:
        return x, W
    dt = torch.promote_types(x.dtype, W.dtype)
    return x.to(dt), W.to(dt)


def _up(t: Tensor) -> Tensor:
    """A bfloat16 / float16 tensor in float32 (rows of an embedding kept as views in the model's dtype)."""
    return t.float() if t.is_floating_point() and torch.finfo(t.dtype).bits < 32 else t
