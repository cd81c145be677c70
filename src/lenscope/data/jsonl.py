"""Reading JSON-lines files: one JSON value per line, blank lines skipped, a bad line named by its number."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from ..errors import InputError


def jsonl_rows(path: Path) -> Iterator[tuple[int, object]]:
    """``(line number, value)`` for each non-blank line of ``path`` (lines counted from 1); a line that is not
    JSON raises an InputError naming the file and the line."""
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{path}, line {n}: not JSON ({e.msg})") from None
        yield n, row
