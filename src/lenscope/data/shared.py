"""Where the shared data folder is (``$LENSCOPE_DATA``, else ``shared/data`` next to the repository), and reading a
user's text file with one-line errors."""

from __future__ import annotations

import csv
import os
from collections import Counter
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


def read_csv_rows(path: Path, columns: tuple[str, ...], what: str = "row") -> list[tuple[int, dict, dict]]:
    """The rows of a CSV whose header has ``columns`` (any order; other columns are kept apart), as ``(n, values,
    extra)``: ``n`` numbers the data rows from 1 after the header (blank lines skipped), ``values`` maps each of
    ``columns`` to its field (as written: spaces kept), ``extra`` the other named columns. Fields are read with the
    csv module (quoted commas and newlines work). One-line :class:`InputError` naming the file (and the row): an
    unreadable file, no header, a missing or repeated column, invalid CSV, a row with too few or too many fields, no
    rows. ``what`` names one row in the messages (``"pair"``)."""
    path = Path(path)
    need = ",".join(columns)
    text = read_text(path, f"give a CSV with the columns {need}")
    reader = csv.reader(text.splitlines(keepends=True))
    rows = []
    try:
        header = next(reader, None)
        if header is None or not any(h.strip() for h in header):
            raise InputError(f"{path} is empty; it needs a header line {need} and one {what} per row")
        header = [h.strip() for h in header]
        missing = [c for c in columns if c not in header]
        if missing:
            raise InputError(f"{path}: the header has no column {missing[0]!r} (it has {','.join(header)}; "
                             f"needed: {need})")
        dup = next((h for h, k in Counter(header).items() if k > 1 and h), None)
        if dup is not None:
            raise InputError(f"{path}: the column {dup!r} appears twice in the header; keep one")
        for row in reader:
            if not row or all(not f.strip() for f in row):
                continue
            rows.append((len(rows) + 1, row))
    except csv.Error as e:
        raise InputError(f"{path}: row {len(rows) + 1} is not valid CSV ({e})") from None
    if not rows:
        raise InputError(f"{path} has a header but no rows; add one {what} per row ({need})")
    col = {h: i for i, h in enumerate(header)}
    out = []
    for n, row in rows:
        if len(row) != len(header):
            raise InputError(f"{path}, row {n}: {len(row)} fields, the header has {len(header)}; quote fields that "
                             "contain commas (\"a, b\")")
        out.append((n, {c: row[col[c]] for c in columns},
                    {h: row[i] for i, h in enumerate(header) if h not in columns and h}))
    return out
