"""Contrast sets for steering (:mod:`lenscope.steering`), read from CSV files.

- pairs a direction is built from: the columns ``positive,negative``, two texts that differ in the behaviour
  (:func:`read_steering_pairs`);
- inputs a direction is measured on: ``text,answer_positive,answer_negative``; the behaviour's measure on an
  input is ``logit(answer_positive) - logit(answer_negative)`` at the text's last position
  (:func:`read_steering_inputs`). Answers are token texts with their leading space (``" good"``) or ``"#ID"``;
  that each is one token of the model is checked where the model is known
  (:func:`lenscope.steering.resolve_inputs`).

Other columns are kept as each row's ``meta``; rows are numbered from 1 after the header in every message.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import InputError
from .shared import read_csv_rows

PAIR_COLUMNS = ("positive", "negative")
INPUT_COLUMNS = ("text", "answer_positive", "answer_negative")


@dataclass(frozen=True)
class SteeringPair:
    """Two texts that differ in the behaviour: ``positive`` shows it, ``negative`` its opposite. ``row``: the
    CSV row (from 1), 0 when made in Python."""

    positive: str
    negative: str
    row: int = 0
    meta: dict = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class SteeringInput:
    """A held-out input: ``text`` and the two answers whose logit difference at its last position measures the
    behaviour. ``row``: the CSV row (from 1), 0 when made in Python."""

    text: str
    answer_positive: str
    answer_negative: str
    row: int = 0
    meta: dict = field(default_factory=dict, compare=False)


def read_steering_pairs(path: str | Path) -> list[SteeringPair]:
    """The pairs of a CSV with the columns ``positive,negative``; a one-line :class:`InputError` naming the file
    and the row for an unreadable file, a missing column, a row with the wrong number of fields or an empty text."""
    path = Path(path)
    out = []
    for n, vals, meta in read_csv_rows(path, PAIR_COLUMNS, "pair"):
        for c in PAIR_COLUMNS:
            if not vals[c].strip():
                raise InputError(f"{path}, row {n}: the {c!r} text is empty")
        out.append(SteeringPair(vals["positive"], vals["negative"], n, meta))
    return out


def read_steering_inputs(path: str | Path) -> list[SteeringInput]:
    """The inputs of a CSV with the columns ``text,answer_positive,answer_negative`` (answers keep their spaces:
    quote ``" good"`` or write ``, good``); a one-line :class:`InputError` naming the file and the row for an
    unreadable file, a missing column, a wrong number of fields, an empty field or two equal answers."""
    path = Path(path)
    out = []
    for n, vals, meta in read_csv_rows(path, INPUT_COLUMNS, "input"):
        if not vals["text"].strip():
            raise InputError(f"{path}, row {n}: the 'text' field is empty")
        for c in INPUT_COLUMNS[1:]:
            if vals[c] == "":
                raise InputError(f"{path}, row {n}: the {c!r} field is empty; give the answer's token text "
                                 "(e.g. ' good') or '#ID'")
        if vals["answer_positive"] == vals["answer_negative"]:
            raise InputError(f"{path}, row {n}: answer_positive and answer_negative are the same token "
                             f"{vals['answer_positive']!r}; the measure would be 0")
        out.append(SteeringInput(vals["text"], vals["answer_positive"], vals["answer_negative"], n, meta))
    return out


def data_hash(rows) -> str:
    """A short SHA-256 of the rows' texts (pairs or inputs), in order: which data a direction was built from."""
    payload = [[getattr(r, c) for c in (PAIR_COLUMNS if isinstance(r, SteeringPair) else INPUT_COLUMNS)]
               for r in rows]
    return hashlib.sha256(json.dumps(payload, ensure_ascii=False).encode()).hexdigest()[:16]


__all__ = ["INPUT_COLUMNS", "PAIR_COLUMNS", "SteeringInput", "SteeringPair", "data_hash", "read_steering_inputs",
           "read_steering_pairs"]
