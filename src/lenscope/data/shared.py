"""Where the shared data folder is (``$LENSCOPE_DATA``, else ``shared/data`` next to the repository), and reading a
user's text file with one-line errors."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import InputError


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


def shared_file(rel: str) -> Path | None:
    """The file ``rel`` under the shared data folder, or None when the folder or the file is absent."""
    root = shared_data_dir()
    return root / rel if root is not None and (root / rel).is_file() else None


def require_shared(rel: str, what: str, alternative: str = "") -> Path:
    """The file ``rel`` under the shared data folder; an InputError saying that ``what`` needs it (and the
    ``alternative``, e.g. ``", or pass a file"``) when it is absent."""
    path = shared_file(rel)
    if path is None:
        raise InputError(f"{what} needs {rel} under the shared data folder; set LENSCOPE_DATA to the folder that "
                         f"holds it (e.g. ../shared/data){alternative}")
    return path


def read_text(path: Path, hint: str = "") -> str:
    """A UTF-8 text file (a byte-order mark is dropped), or a one-line :class:`InputError` for a missing, undecodable
    or unreadable file; ``hint`` says what the file should be (e.g. "give a CSV with the columns ...")."""
    tail = f"; {hint}" if hint else ""
    try:
        return Path(path).read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise InputError(f"{path}: no such file{tail}") from None
    except UnicodeDecodeError:
        raise InputError(f"{path} is not a UTF-8 text file; save it as UTF-8") from None
    except OSError as e:
        raise InputError(f"{path} cannot be read ({e.strerror or e})") from None
