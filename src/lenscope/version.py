"""The code version that results record: ``lenscope.__version__``, plus the git commit when the package runs
from a git checkout."""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

__version__ = "0.1.0"
"""The package version (``lenscope.__version__`` is this one)."""


@functools.lru_cache(maxsize=1)
def code_version() -> str:
    """``"0.1.0+git.<12-hex commit>"`` when the installed package lives in a git checkout (an editable install
    of this repository), else just ``"0.1.0"``. Uncommitted changes are not part of it. Computed once per
    process."""
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "-C", str(here), "rev-parse", "--show-toplevel", "HEAD"], capture_output=True,
                             text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return __version__
    lines = out.stdout.split()
    if out.returncode != 0 or len(lines) != 2:
        return __version__
    top, commit = Path(lines[0]).resolve(), lines[1]
    tracked = subprocess.run(["git", "-C", str(here), "ls-files", "--error-unmatch", "__init__.py"],
                             capture_output=True, text=True, timeout=10, check=False)
    if tracked.returncode != 0 or (here != top and top not in here.parents):  # e.g. an ignored site-packages
        return __version__
    return f"{__version__}+git.{commit[:12]}"
