"""Resumable ``records.jsonl`` files: the one runner behind every sweep that resumes.

A sweep computes one result per item (a sentence, a fact, a batch of examples) and appends the JSON records of
each finished item to ``records.jsonl``, one record per line, in input order. :class:`Records` owns that file:

- **append**: the records of one item are written with one ``write`` call and flushed when the item finishes
  (``fsync=True`` also asks the OS to put them on disk before the next item starts);
- **resume**: the existing records are read back; :meth:`Records.todo` says which items are left, by each
  record's key (``"index"``, ``"id"``, or a function of the record);
- **a torn line**: a run killed while writing leaves its last line cut short (or without its newline). That
  line is dropped, and cut from the file, so its item is computed and written again. A line that is not a JSON
  object anywhere else means the file was damaged, not interrupted: :class:`RecordsError` names the file and
  the line, and nothing is overwritten;
- **order**: :meth:`Records.run` takes results in whatever order they complete (a Ray pool, see
  :func:`lenscope.distributed.run_sweep`) and writes and yields them in input order, so the file is the one a
  sequential run writes and an interrupted parallel run resumes from the same place;
- **code version**: :meth:`Records.check_version` refuses to add records to a file holding records of
  another code version (:func:`lenscope.version.code_version`) unless forced.

Who computes is the caller's choice: ``compute(todo)`` gets the list of item positions left and returns
``(position, result)`` pairs in any order; the runner decides what is left and writes.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from ..errors import InputError
from ..version import code_version

RECORDS = "records.jsonl"


class RecordsError(InputError):
    """A ``records.jsonl`` file is damaged (a line other than the last is not a JSON record), or a sweep's
    results do not match the items it was given."""


def read_records(path: str | Path) -> list[dict]:
    """The records of ``path`` in file order (``[]`` if there is no file). A last line cut short by an
    interrupted run (not JSON, or no final newline) is dropped and cut from the file; any other line that is
    not a JSON object raises :class:`RecordsError` naming the file and the line."""
    return _read(Path(path))[0]


def _read(path: Path) -> tuple[list[dict], list[int]]:
    """``(records, ends)``: ``ends[k]`` is the byte offset just after record ``k``'s line."""
    if not path.exists():
        return [], []
    data = path.read_bytes()
    lines = data.splitlines(keepends=True)
    recs: list[dict] = []
    ends: list[int] = []
    good = 0
    for k, line in enumerate(lines):
        last = k == len(lines) - 1
        try:
            r = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            r = None
        if last and (r is None or not line.endswith(b"\n")):  # the line a killed run was writing
            with path.open("r+b") as fh:
                fh.truncate(good)
            break
        if not isinstance(r, dict):
            raise RecordsError(f"{path}: line {k + 1} is not a JSON record; the file is damaged (remove it, or "
                               "use another --out)")
        good += len(line)
        recs.append(r)
        ends.append(good)
    return recs, ends


def in_order(pairs: Iterable[tuple[int, Any]], order: Sequence[int]) -> Iterator[tuple[int, Any]]:
    """Release ``(position, result)`` pairs that complete in any order as ``order[0], order[1], ...``: results
    that arrive early wait in a buffer until every position before them has been released."""
    it = iter(pairs)
    want = list(order)
    expected = set(want)
    done: dict[int, Any] = {}
    nxt = 0
    try:
        for i, r in it:
            if i not in expected or i in done:
                raise RecordsError(f"a result for item {i}, which was not asked for (or came twice)")
            done[i] = r
            while nxt < len(want) and want[nxt] in done:
                yield want[nxt], done.pop(want[nxt])
                nxt += 1
    finally:
        close = getattr(it, "close", None)
        if close is not None:  # stop a parallel map (its workers) when the caller stops reading
            close()
    if nxt < len(want):
        raise RecordsError(f"no result for item {want[nxt]}: the sweep ended early")


class Records:
    """One resumable ``records.jsonl`` (``path=None``: records kept in memory only).

    ``key``: a record field (``"index"``, ``"id"``) or a function ``record -> key`` that names the item a record
    belongs to. ``resume=False`` starts afresh (an existing file is removed); otherwise the file's records are
    read (:func:`read_records`). ``records`` lists them in file order, then those appended by this run.
    """

    def __init__(self, path: str | Path | None, *, key: str | Callable[[dict], Hashable] = "index",
                 resume: bool = True, fsync: bool = False):
        self.path = Path(path) if path is not None else None
        self.key = (lambda r, k=key: r.get(k)) if isinstance(key, str) else key
        self.fsync = fsync
        self.records: list[dict] = []
        self._ends: list[int] = []
        if self.path is not None:
            if resume:
                self.records, self._ends = _read(self.path)
            elif self.path.exists():
                self.path.unlink()

    def __len__(self) -> int:
        return len(self.records)

    def __repr__(self) -> str:
        return f"Records({self.path}, {len(self.records)} records)"

    def by_key(self) -> dict:
        """``{key: record}``; a later record for the same key wins."""
        return {self.key(r): r for r in self.records}

    def keep(self, n: int) -> list[dict]:
        """Keep only the first ``n`` records (cutting the file after them): for a sweep whose own saved state
        counts how many records it includes. Returns the records kept."""
        if not 0 <= n <= len(self.records):
            raise RecordsError(f"{self.path} holds {len(self.records)} records, fewer than the {n} its run state "
                               "counts; the folder is damaged (use another --out)")
        if n < len(self.records):
            if self.path is not None and self._ends:
                with self.path.open("r+b") as fh:
                    fh.truncate(self._ends[n - 1] if n else 0)
                self._ends = self._ends[:n]
            self.records = self.records[:n]
        return self.records

    def todo(self, keys: Sequence[Hashable], done: Callable[[dict, int], bool] | None = None) -> list[int]:
        """The positions ``i`` of ``keys`` (one key per item, in input order) still to compute: those with no
        record, or whose latest record fails ``done(record, i)``."""
        have = self.by_key()
        return [i for i, k in enumerate(keys) if k not in have or (done is not None and not done(have[k], i))]

    def check_version(self, pending: bool, *, force: bool = False, version: str | None = None,
                      where: str | Path | None = None) -> str:
        """Refuse (:class:`InputError`) to add records when ``pending`` and the file's records (the latest per
        key) carry another code version (``"unrecorded"``: no ``version`` field), unless ``force``. Returns
        this code version (default :func:`lenscope.version.code_version`)."""
        version = version or code_version()
        others = Counter(r.get("version") or "unrecorded" for r in self.by_key().values()
                         if r.get("version") != version)
        if pending and others and not force:
            have = ", ".join(f"{n} of version {v}" for v, n in others.most_common())
            where = where if where is not None else (self.path.parent if self.path is not None else "the records")
            raise InputError(f"{where} holds records of another code version ({have}; this is {version}): resuming "
                             "would mix versions in one table. Use another --out, --restart to discard them, or "
                             "--force to add to them anyway")
        return version

    def append(self, records: Iterable[dict]) -> None:
        """Append records (one JSON line each, written at once, then flushed)."""
        records = list(records)
        if self.path is not None and records:
            lines = [(json.dumps(r) + "\n").encode("utf-8") for r in records]
            with self.path.open("ab") as fh:
                end = fh.tell()
                fh.write(b"".join(lines))
                fh.flush()
                if self.fsync:
                    os.fsync(fh.fileno())
            for line in lines:
                end += len(line)
                self._ends.append(end)
        self.records += records

    def run(self, todo: Sequence[int], compute: Callable[[list[int]], Iterable[tuple[int, Any]]], *,
            to_records: Callable[[Any], Iterable[dict]] = lambda r: [r]) -> Iterator[tuple[int, Any]]:
        """Compute the items at positions ``todo`` and yield ``(position, result)`` in the order of ``todo``,
        each after its records (``to_records(result)``, default ``[result]``) were appended.

        ``compute(todo)`` returns ``(position, result)`` pairs in any order (sequentially, or from a Ray pool:
        :func:`lenscope.distributed.sweep.sweep_map`); early results wait until the ones before them are written.
        """
        todo = list(todo)
        for i, r in in_order(compute(todo), todo):
            self.append(to_records(r))
            yield i, r
