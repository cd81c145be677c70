"""Where the shared data folder is (``$LENSCOPE_DATA``, else ``shared/data`` next to the repository)."""

from __future__ import annotations

import os
from pathlib import Path


def shared_data_dir() -> Path | None:
    """Where the shared evaluation data lives: ``$LENSCOPE_DATA``, else ``../shared/data`` next to the
    repository or the working directory."""
    cands = [os.environ.get("LENSCOPE_DATA")]
    here = Path(__file__).resolve()
    cands += [str(p / "shared" / "data") for p in list(here.parents)[:6]]
    cands += [str(Path.cwd().parent / "shared" / "data"), str(Path.cwd() / "shared" / "data")]
    for c in cands:
        if c and Path(c).is_dir():
            return Path(c)
    return None
