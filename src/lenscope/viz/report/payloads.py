"""The numbers of the views' data: floats rounded to 5 significant digits (None for a non-finite value, which JSON
lacks), large arrays :func:`packed` (base64 float32). Each view's conversion of its result into its data lives in
the view's folder (:mod:`lenscope.viz.views`); these helpers are what they share with the report's sections
(:mod:`lenscope.report.sections`) and ``lenscope serve``.
"""

from __future__ import annotations

import base64
import math

import numpy as np
import torch
from torch import Tensor


def packed(x: Tensor | np.ndarray, digits: int | None = None) -> dict:
    """A float tensor for the page: ``{"shape": [...], "f32": base64 of little-endian float32}`` (4 bytes a
    number before base64, far smaller than JSON text for the large maps). Non-finite values are refused."""
    a = x.detach().cpu().float().numpy() if isinstance(x, Tensor) else np.asarray(x, dtype=np.float32)
    if not np.isfinite(a).all():
        raise ValueError("a report array holds NaN or infinity")
    a = np.ascontiguousarray(a, dtype="<f4")
    return {"shape": list(a.shape), "f32": base64.b64encode(a.tobytes()).decode("ascii")}


def unpack(d: dict) -> np.ndarray:
    """Inverse of :func:`packed` (for tests and for reading a report's data back)."""
    return np.frombuffer(base64.b64decode(d["f32"]), dtype="<f4").reshape(d["shape"])


def rounded(x: float, digits: int = 5) -> float | None:
    """``x`` to ``digits`` significant digits; None for NaN or infinity (JSON has neither)."""
    x = float(x)
    if not math.isfinite(x):
        return None
    return float(f"{x:.{digits}g}")


def rounded_list(t, digits: int = 5) -> list:
    """A tensor or sequence, flattened, each value :func:`rounded`."""
    return [rounded(v, digits) for v in torch.as_tensor(t).reshape(-1).tolist()]



def rounded_tree(x, digits: int = 5):
    """Dicts and lists with every float :func:`rounded` (tensors as lists)."""
    if isinstance(x, bool) or x is None or isinstance(x, (int, str)):
        return x
    if isinstance(x, float):
        return rounded(x, digits)
    if isinstance(x, dict):
        return {k: rounded_tree(v, digits) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [rounded_tree(v, digits) for v in x]
    if hasattr(x, "tolist"):
        return rounded_tree(x.tolist(), digits)
    return x
