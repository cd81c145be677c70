"""What every benchmark records about the machine it ran on."""

from __future__ import annotations

import platform
import subprocess

import torch


def cpu_name() -> str:
    """``lscpu``'s "Model name" (the processor string where lscpu is missing)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return platform.processor()
    return next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")),
                platform.processor())


def bf16_native() -> bool:
    """Whether this CPU runs bfloat16 natively (AVX512-BF16)."""
    return bool(torch.cpu._is_avx512_bf16_supported())
