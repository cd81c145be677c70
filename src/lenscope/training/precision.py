"""Whether this machine runs bfloat16 natively, which a training run's choice of matmul precision starts from (a
tuned lens's :func:`~lenscope.lenses.training.precision.choose_precision`, sparse dictionaries'
:func:`~lenscope.features.dictionaries.train.precision`): the CPU's features (:func:`cpu_features`), or
``$LENSCOPE_NATIVE_BF16`` in their place (:func:`forced_native_bf16`).
"""

from __future__ import annotations

import torch

from ..errors import InputError


def cpu_features() -> dict:
    """The CPU's name (``lscpu``'s "Model name") and whether it has native bfloat16 (AVX512-BF16, AMX-BF16)."""
    import platform
    import subprocess

    name = platform.processor()
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False, timeout=10).stdout
        name = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), name)
    except (OSError, subprocess.SubprocessError):
        pass

    def probe(fn: str) -> bool:
        try:
            return bool(getattr(torch.cpu, fn)())
        except (AttributeError, RuntimeError):  # private torch API: absent in some versions
            return False

    return {"cpu": name, "avx512_bf16": probe("_is_avx512_bf16_supported"), "amx_bf16": probe("_is_amx_tile_supported")}


# Set to 1 or 0 to decide "the hardware runs bfloat16 natively" instead of asking the CPU, so that both branches
# of a precision choice run (and are tested) on every machine; CI runs the lens tests with both.
NATIVE_BF16_ENV = "LENSCOPE_NATIVE_BF16"


def forced_native_bf16() -> bool | None:
    """``$LENSCOPE_NATIVE_BF16`` as a bool (``1``: native, ``0``: not), None when unset or empty."""
    import os

    v = os.environ.get(NATIVE_BF16_ENV, "").strip()
    if not v:
        return None
    if v not in ("0", "1"):
        raise InputError(
            f"{NATIVE_BF16_ENV} must be 1 (native bfloat16) or 0 (not), not {v!r}; unset it to ask the CPU")
    return v == "1"


__all__ = ["NATIVE_BF16_ENV", "cpu_features", "forced_native_bf16"]
