"""Memory budgets: how much memory a computation may take, read from the machine or given as ``"8GB"``, and bytes
written for people. Commands that can grow past the machine (``lenscope graph``, ``dict train``, ``dict eval``)
estimate their peak before they start and refuse in one line when it exceeds the budget, instead of being killed.

The default budget is :data:`SAFE_SHARE` of the memory available now: Linux's ``MemAvailable`` (``/proc/meminfo``),
or less where a cgroup (a container) limits this process to less (``memory.max - memory.current``); where neither
can be read, :data:`FALLBACK` bytes. Standard library only (the CLI parses ``--max-memory`` without torch).
"""

from __future__ import annotations

import re
from pathlib import Path

from .errors import InputError

SAFE_SHARE = 0.8  # of the available memory: the rest for the interpreter, libraries and what the estimates leave out
FALLBACK = 8 * 10**9  # bytes, when the available memory cannot be read
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
          "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def available_memory() -> int | None:
    """Bytes this process can still allocate: ``MemAvailable`` of ``/proc/meminfo``, lowered to what the cgroup
    (v2 ``memory.max`` minus ``memory.current``) leaves; None when neither can be read."""
    free = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                free = int(line.split()[1]) * 1024
                break
    except (OSError, ValueError, IndexError):
        free = None
    try:
        cg = Path("/sys/fs/cgroup")
        limit = (cg / "memory.max").read_text().strip()
        if limit != "max":
            left = int(limit) - int((cg / "memory.current").read_text().strip())
            free = left if free is None else min(free, left)
    except (OSError, ValueError):
        pass
    return None if free is None else max(0, free)


def default_budget() -> int:
    """The default memory budget in bytes: :data:`SAFE_SHARE` of :func:`available_memory`, or :data:`FALLBACK`."""
    free = available_memory()
    return FALLBACK if free is None else int(SAFE_SHARE * free)


def parse_size(text: str | int) -> int:
    """Bytes from ``"8GB"``, ``"500MB"``, ``"1.5GiB"``, ``"64k"`` or a plain number of bytes (decimal units: 1 GB
    = 10^9 bytes; binary ones with ``iB``)."""
    if isinstance(text, int):
        value = text
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
        if not m or m.group(2).lower() not in _UNITS:
            raise InputError(f"a memory size is a number with an optional unit (B, KB, MB, GB, TB, KiB, MiB, GiB, "
                             f"TiB), e.g. 8GB or 500MB; got {text!r}")
        value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value < 1:
        raise InputError(f"a memory size must be positive; got {text!r}")
    return value


def budget(max_memory: int | str | None) -> int:
    """The budget in bytes: ``max_memory`` (bytes, or a size such as ``"8GB"``), else :func:`default_budget`."""
    return default_budget() if max_memory is None else parse_size(max_memory)


def format_bytes(n: float) -> str:
    """``n`` bytes in decimal units, three significant figures: ``"21.7 GB"``, ``"512 kB"``, ``"12 B"``; what
    :func:`parse_size` reads back (without the space)."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{int(n)} B"


__all__ = ["FALLBACK", "SAFE_SHARE", "available_memory", "budget", "default_budget", "format_bytes", "parse_size"]
