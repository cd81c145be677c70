"""Contrastive datasets with linguistic evidence: every example is a prefix, the word the model should
continue with (target), the word it should not (foil), and optionally the evidence words in the prefix that
decide between them.

Dataset specs (``load_dataset``):

- ``blimp:SUBSET``: one of the 11 BLiMP subsets of Yin & Neubig (2022) / Ferrando et al. (2023) with evidence
  (``logit_explanations/blimp_with_targets/SUBSET.csv``), or any other BLiMP paradigm (``blimp/data/SUBSET.jsonl``,
  target/foil pairs without evidence: model accuracy only; pairs that differ in more than one word are compared
  by whole-sentence log-probability, BLiMP's own method);
- ``blimp:all11``: the 11 subsets with evidence;
- ``ioi``: ``logit_explanations/ioi_with_targets/ioi_dataset.csv`` (evidence: the indirect object);
- ``ioi-gen`` / ``ioi-gen:SEED``: lenscope's own IOI sentences (:mod:`lenscope.data.ioi`), 1000 per seed
  (default seed 0), grouped by pattern (ABBA / BABA);
- ``sva:FILE``: subject-verb agreement, one example per line,
  ``prefix<TAB>correct verb<TAB>wrong verb[<TAB>evidence[<TAB>group]]``;
- ``FILE``: a CSV with the columns of the logit_explanations files: ``one_prefix_prefix``,
  ``one_prefix_word_good``, ``one_prefix_word_bad`` and ``target`` (the evidence).

Evidence is one or more words or phrases separated by ``|``; each is looked up as a whole word (case-sensitive)
everywhere in the prefix. An empty evidence field, ``NA`` or ``NaN`` means no evidence: the example counts for
model accuracy only. The shared data are found with :func:`lenscope.data.shared.shared_data_dir`
(``$LENSCOPE_DATA`` or ``../shared/data``).
"""

from __future__ import annotations

import csv
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import InputError
from .shared import read_text, require_shared, shared_data_dir

BLIMP11 = (
    "anaphor_gender_agreement", "anaphor_number_agreement", "animate_subject_passive", "determiner_noun_agreement_1",
    "determiner_noun_agreement_irregular_1", "determiner_noun_agreement_with_adj_irregular_1",
    "determiner_noun_agreement_with_adjective_1", "distractor_agreement_relational_noun",
    "irregular_plural_subject_verb_agreement_1", "npi_present_1", "regular_plural_subject_verb_agreement_1",
)
CSV_COLUMNS = ("one_prefix_prefix", "one_prefix_word_good", "one_prefix_word_bad", "target")
NO_EVIDENCE = ("", "NA", "NaN", "nan", "N/A")
SPEC_HELP = "blimp:SUBSET, blimp:all11, ioi, ioi-gen[:SEED], sva:FILE or a CSV FILE"


@dataclass
class Example:
    """One contrastive example. ``id`` is stable across runs (``<dataset>/<row>``); ``evidence`` is a tuple of
    words/phrases or None; ``group`` breaks results down (e.g. the number of attractors, the IOI pattern)."""

    id: str
    dataset: str
    prefix: str
    target: str
    foil: str
    evidence: tuple | None = None
    group: str | None = None
    info: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["evidence"] = list(self.evidence) if self.evidence is not None else None
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Example:
        d = dict(d)
        if d.get("evidence") is not None:
            d["evidence"] = tuple(d["evidence"])
        return cls(**d)


def parse_evidence(value) -> tuple | None:
    """``"a|b"`` -> ``("a", "b")``; empty / NA / NaN -> None."""
    if value is None:
        return None
    s = str(value).strip()
    if s in NO_EVIDENCE:
        return None
    items = tuple(w.strip() for w in s.split("|") if w.strip() and w.strip() not in NO_EVIDENCE)
    return items or None


# ----------------------------------------------------------------------------------------------
# file formats


def read_contrastive_csv(path: str | Path, dataset: str | None = None) -> list[Example]:
    """A CSV with the columns of the logit_explanations files (``one_prefix_prefix``, ``one_prefix_word_good``,
    ``one_prefix_word_bad``, ``target``; others are ignored). Rows are numbered from 1 after the header;
    a missing column, a row with the wrong number of fields or an empty prefix/word raises an
    :class:`InputError` naming the row and column."""
    path = Path(path)
    name = dataset or path.name
    text = read_text(path)
    reader = csv.reader(text.splitlines())
    try:
        header = next(reader)
    except StopIteration:
        raise InputError(f"{path} is empty; it needs a header with the columns {', '.join(CSV_COLUMNS)}") from None
    missing = [c for c in CSV_COLUMNS if c not in header]
    if missing:
        raise InputError(f"{path}: column {missing[0]!r} is missing from the header (needed: {', '.join(CSV_COLUMNS)})")
    col = {c: header.index(c) for c in header}
    out = []
    try:
        for row_no, row in enumerate(reader, start=1):
            if not row or all(not c.strip() for c in row):
                continue
            if len(row) != len(header):
                bad = header[len(row)] if len(row) < len(header) else f"extra field {len(header) + 1}"
                raise InputError(f"{path}: row {row_no} has {len(row)} fields, the header {len(header)} "
                                 f"(column {bad!r}); quote fields that contain commas")
            vals = {c: row[col[c]] for c in CSV_COLUMNS}
            for c in CSV_COLUMNS[:3]:
                if not vals[c].strip():
                    raise InputError(f"{path}: row {row_no}, column {c!r} is empty")
            idx = row[0] if header[0] == "" and row[0].strip() else str(row_no - 1)
            group = row[col["group"]].strip() or None if "group" in col else None
            out.append(Example(id=f"{name}/{idx}", dataset=name, prefix=vals["one_prefix_prefix"],
                               target=vals["one_prefix_word_good"].strip(), foil=vals["one_prefix_word_bad"].strip(),
                               evidence=parse_evidence(vals["target"]), group=group, info={"row": row_no}))
    except csv.Error as e:
        raise InputError(f"{path}: row {reader.line_num - 1} is not valid CSV ({e})") from None
    return out


SVA_FIELDS = ("prefix", "correct verb", "wrong verb", "evidence", "group")


def read_sva(path: str | Path, dataset: str | None = None) -> list[Example]:
    """Subject-verb agreement, one example per line: ``prefix<TAB>correct<TAB>wrong[<TAB>evidence[<TAB>group]]``.
    Blank lines and lines starting with ``#`` are ignored. Errors name the line and the column."""
    path = Path(path)
    name = dataset or f"sva:{path.name}"
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise InputError(f"no such file: {path}") from None
    except UnicodeDecodeError:
        raise InputError(f"{path} is not a UTF-8 text file") from None
    out = []
    for line_no, line in enumerate(lines, start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        parts = line.split("\t")
        if len(parts) < 3:
            raise InputError(f"{path}: line {line_no} has {len(parts)} tab-separated column(s); expected "
                             "prefix<TAB>correct verb<TAB>wrong verb[<TAB>evidence[<TAB>group]]")
        if len(parts) > 5:
            raise InputError(f"{path}: line {line_no} has {len(parts)} columns, at most 5 (prefix, correct verb, "
                             "wrong verb, evidence, group)")
        for k in range(3):
            if not parts[k].strip():
                raise InputError(f"{path}: line {line_no}, column {k + 1} ({SVA_FIELDS[k]}) is empty")
        ev = parse_evidence(parts[3]) if len(parts) > 3 else None
        group = parts[4].strip() or None if len(parts) > 4 else None
        out.append(Example(id=f"{name}/{line_no}", dataset=name, prefix=parts[0], target=parts[1].strip(),
                           foil=parts[2].strip(), evidence=ev, group=group, info={"line": line_no}))
    if not out:
        raise InputError(f"{path} holds no examples (one per line: prefix<TAB>correct verb<TAB>wrong verb)")
    return out


# ----------------------------------------------------------------------------------------------
# named datasets


def _blimp_paradigm(subset: str) -> list[Example]:
    p = require_shared(f"blimp/data/{subset}.jsonl", f"blimp:{subset}")
    name = f"blimp:{subset}"
    out = []
    for k, line in enumerate(p.read_text(encoding="utf-8").splitlines()):
        if not line.strip():
            continue
        r = json.loads(line)
        pid = r.get("pairID", str(k))
        if not r.get("one_prefix_method") or "one_prefix_word_good" not in r:
            # the pair differs in more than one place: no single next-word contrast; the model is right when it
            # gives the good sentence the higher log-probability (BLiMP's own full-sentence method)
            out.append(Example(id=f"{name}/{pid}", dataset=name, prefix="", target=r["sentence_good"],
                               foil=r["sentence_bad"], info={"sentence_pair": True}))
            continue
        out.append(Example(id=f"{name}/{pid}", dataset=name, prefix=r["one_prefix_prefix"],
                           target=r["one_prefix_word_good"], foil=r["one_prefix_word_bad"]))
    return out


def blimp_paradigms() -> list[str]:
    """Every BLiMP paradigm in the shared data (empty when the data is absent)."""
    root = shared_data_dir()
    d = root / "blimp" / "data" if root else None
    return sorted(p.stem for p in d.glob("*.jsonl")) if d and d.is_dir() else []


def _ioi_gen(seed: int) -> list[Example]:
    from .ioi import generate_ioi

    name = "ioi-gen" if seed == 0 else f"ioi-gen:{seed}"
    return [Example(id=f"{name}/{k}", dataset=name, prefix=g["prefix"], target=g["target"], foil=g["foil"],
                    evidence=(g["io"],), group=g["pattern"],
                    info={k2: g[k2] for k2 in ("pattern", "io_spans", "s_spans", "template")})
            for k, g in enumerate(generate_ioi(1000, seed))]


def expand_specs(specs: list[str]) -> list[str]:
    """``blimp:all11`` -> the 11 subsets; other specs unchanged; duplicates dropped."""
    out: list[str] = []
    for s in specs:
        for x in ([f"blimp:{b}" for b in BLIMP11] if s == "blimp:all11" else [s]):
            if x not in out:
                out.append(x)
    return out


def load_dataset(spec: str, limit: int | None = None) -> list[Example]:
    """The examples of one dataset spec (see the module docstring), the first ``limit`` rows."""
    if limit is not None and limit < 1:
        raise InputError("--limit must be at least 1")
    spec = spec.strip()
    if spec == "blimp:all11":
        raise InputError("blimp:all11 names 11 datasets; expand it with expand_specs")
    if spec.startswith("blimp:"):
        subset = spec.split(":", 1)[1]
        if subset in BLIMP11:
            p = require_shared(f"logit_explanations/blimp_with_targets/{subset}.csv", spec)
            ex = read_contrastive_csv(p, spec)
        else:
            known = blimp_paradigms()
            if known and subset not in known:
                raise InputError(f"unknown BLiMP paradigm {subset!r}; choose one of the 11 with evidence "
                                 f"({', '.join(BLIMP11)}), all11, or any of the {len(known)} in blimp/data")
            ex = _blimp_paradigm(subset)
    elif spec == "ioi":
        ex = read_contrastive_csv(require_shared("logit_explanations/ioi_with_targets/ioi_dataset.csv", "ioi"), "ioi")
    elif spec == "ioi-gen" or spec.startswith("ioi-gen:"):
        seed = spec.split(":", 1)[1] if ":" in spec else "0"
        if not seed.isdigit():
            raise InputError(f"ioi-gen takes an integer seed (ioi-gen:SEED), not {seed!r}")
        ex = _ioi_gen(int(seed))
    elif spec.startswith("sva:"):
        p = Path(spec[4:]).expanduser()
        if not p.is_file():
            raise InputError(f"{spec!r}: no such file {p}; sva:FILE reads prefix<TAB>correct<TAB>wrong lines")
        ex = read_sva(p)
    else:
        p = Path(spec).expanduser()
        if not p.is_file():
            raise InputError(f"{spec!r} is neither a dataset ({SPEC_HELP}) nor an existing file")
        ex = read_contrastive_csv(p)
    return ex[:limit] if limit else ex
