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


def record(argv: list[str] | None = None) -> dict:
    """Everything a results file says about its run: the command, the CPU (lscpu model name), whether it has
    native bfloat16, torch's threads, the 1-minute load average when the run started, and the date (UTC).

    Every results file a benchmark writes carries this under the key ``"machine"``, so each number in the
    README and docs traces to the command that made it and the machine it ran on."""
    import datetime
    import os
    import shlex
    import sys

    argv = sys.argv if argv is None else argv
    try:
        load = round(os.getloadavg()[0], 2)
    except OSError:
        load = None
    return {
        "command": "python " + " ".join(shlex.quote(a) for a in argv),
        "cpu": cpu_name(),
        "bf16_native": bf16_native(),
        "threads": torch.get_num_threads(),
        "cores": os.cpu_count(),
        "load_1min": load,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "torch": torch.__version__,
    }
