"""Word alignments of sentence pairs (source, target): gold files with sure and possible links, and files of
predicted links (``lenscope eval aer``; format in docs/encoder-decoder.md).

One JSON object per line::

    {"id": "s1", "source": "das Haus ist klein", "target": "the house is small",
     "sure": [[0, 0], [1, 1]], "possible": [[2, 2], "3-3"]}

``source`` / ``target``: text split into words on whitespace, or lists of words. A link is ``[i, j]`` or the
Pharaoh string ``"i-j"``: source word ``i``, target word ``j``, both 0-based. ``possible`` may be left out; a sure
link is always possible too (Och & Ney 2003). A predicted file has one list ``alignment`` instead of ``sure`` /
``possible``, and ``source`` / ``target`` are optional there (used to check the links' range when given).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError
from .jsonl import jsonl_rows

Link = tuple[int, int]  # (source word, target word)


@dataclass(frozen=True)
class AlignedPair:
    """One sentence pair's words and links. ``sure`` and ``possible`` (which holds ``sure``) for gold rows; a
    predicted row has its links in ``sure`` and ``possible`` alike. ``source`` / ``target`` are None when a
    predicted row gives no words."""

    id: str
    source: tuple[str, ...] | None
    target: tuple[str, ...] | None
    sure: frozenset[Link]
    possible: frozenset[Link]


def _words(value, where: str, key: str) -> tuple[str, ...]:
    if isinstance(value, str):
        words = tuple(value.split())
    elif isinstance(value, list) and all(isinstance(w, str) for w in value):
        words = tuple(value)
    else:
        raise InputError(f"{where}: {key!r} must be a text or a list of words")
    if not words:
        raise InputError(f"{where}: {key!r} has no words")
    return words


def _link(x, where: str, key: str) -> Link:
    if isinstance(x, str):
        a, sep, b = x.partition("-")
        if sep and a.strip().isdigit() and b.strip().isdigit():
            return int(a), int(b)
    elif (isinstance(x, list) and len(x) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in x)
          and min(x) >= 0):
        return x[0], x[1]
    raise InputError(f"{where}: {key!r} holds {x!r}, not a link [source word, target word] or \"i-j\" "
                     "(0-based word indices)")


def _links(row: dict, key: str, where: str, n_src: int | None, n_tgt: int | None) -> frozenset[Link]:
    value = row.get(key, [])
    if isinstance(value, str):  # one Pharaoh line: "0-0 1-1 2-3"
        value = value.split()
    if not isinstance(value, list):
        raise InputError(f"{where}: {key!r} must be a list of links or a Pharaoh line \"i-j i-j ...\"")
    links = [_link(x, where, key) for x in value]
    if len(set(links)) != len(links):
        dup = next(x for x in links if links.count(x) > 1)
        raise InputError(f"{where}: {key!r} lists the link {list(dup)} twice")
    for i, j in links:
        if n_src is not None and i >= n_src:
            raise InputError(f"{where}: {key!r} links source word {i}, but the source has {n_src} words")
        if n_tgt is not None and j >= n_tgt:
            raise InputError(f"{where}: {key!r} links target word {j}, but the target has {n_tgt} words")
    return frozenset(links)


def _row(row, keys: tuple[str, ...], words_required: bool, where: str, rid: str) -> AlignedPair:
    if not isinstance(row, dict):
        raise InputError(f"{where}: expected a JSON object with {', '.join(keys)}")
    if keys[0] == "sure" and "sure" not in row and "alignment" in row:  # a gold file of one kind of link
        if "possible" in row:
            raise InputError(f"{where}: give 'sure' (and 'possible'), or 'alignment' alone")
        row = {**{k: v for k, v in row.items() if k != "alignment"}, "sure": row["alignment"]}
    unknown = sorted(set(row) - {"id", "source", "target", *keys})
    if unknown:
        raise InputError(f"{where}: unknown field {unknown[0]!r}; the fields are id, source, target, "
                         + ", ".join(keys))
    if words_required and not {"source", "target"} <= set(row):
        raise InputError(f"{where}: a gold row needs 'source' and 'target'")
    if keys[0] not in row:
        alt = " (or one 'alignment' list)" if keys[0] == "sure" else ""
        raise InputError(f"{where}: no {keys[0]!r} list{alt}")
    src = _words(row["source"], where, "source") if "source" in row else None
    tgt = _words(row["target"], where, "target") if "target" in row else None
    n_src, n_tgt = (None if src is None else len(src)), (None if tgt is None else len(tgt))
    links = [_links(row, k, where, n_src, n_tgt) for k in keys]
    sure = links[0]
    possible = sure | links[1] if len(links) > 1 else sure
    return AlignedPair(rid, src, tgt, sure, possible)


def gold_row(row: dict, where: str = "gold", rid: str = "0") -> AlignedPair:
    """One gold row given as a dict (``source``, ``target``, ``sure``, optional ``possible``, as a gold file's
    line), checked as :func:`read_gold_alignments` checks a file's rows (errors name ``where``)."""
    return _row(row, ("sure", "possible"), True, where, rid)


def _rows(path: str | Path, keys: tuple[str, ...], words_required: bool) -> list[AlignedPair]:
    path = Path(path)
    if not path.is_file():
        raise InputError(f"no such alignment file: {path}")
    out: list[AlignedPair] = []
    seen: set[str] = set()
    for n, row in jsonl_rows(path):
        pair = _row(row, keys, words_required, f"{path}, line {n}", str(row.get("id", n)) if isinstance(row, dict)
                    else str(n))
        if pair.id in seen:
            raise InputError(f"{path}, line {n}: id {pair.id!r} appears twice")
        seen.add(pair.id)
        out.append(pair)
    if not out:
        raise InputError(f"{path} holds no alignment rows")
    return out


def read_gold_alignments(path: str | Path) -> list[AlignedPair]:
    """The rows of a gold alignment file (``source``, ``target``, ``sure``, optional ``possible``, optional
    ``id``: the line number by default), in file order; a row may give its links as ``alignment`` instead (all
    sure), and links as ``[i, j]`` pairs, ``"i-j"`` strings or one Pharaoh line ``"i-j i-j ..."``. Any malformed
    row is an InputError naming its line."""
    return _rows(path, ("sure", "possible"), words_required=True)


def read_predicted_alignments(path: str | Path) -> list[AlignedPair]:
    """The rows of a predicted alignment file (``alignment``, optional ``id``, ``source``, ``target``); the
    links are in both ``sure`` and ``possible`` of each row."""
    return _rows(path, ("alignment",), words_required=False)


def write_predicted_alignments(path: str | Path, gold: list[AlignedPair], links: dict[str, frozenset[Link]]) -> None:
    """A predicted alignment file (:func:`read_predicted_alignments` reads it) of ``links`` (``id -> links``) on
    the sentence pairs of ``gold``, in its order, with their words."""
    import json

    with Path(path).open("w") as f:
        for g in gold:
            row = {"id": g.id, "source": list(g.source), "target": list(g.target),
                   "alignment": [list(x) for x in sorted(links[g.id])]}
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
