"""Contrast pairs for circuit discovery (attribution patching, edge attribution, exact patching).

A :class:`ContrastPair` is a clean prompt and a corrupted one of the same token length, a target token and a
foil token; the metric is the logit of the target minus the foil's at the last position, high on the clean
prompt and low (ideally flipped) on the corrupted one. Where pairs come from (:func:`contrast_dataset`):

- a CSV file with the columns ``clean,corrupted,target,foil`` (:func:`read_contrast_csv`; any order, other
  columns go into ``meta``; targets keep their leading space, ``" Mary"``);
- ``ioi-gen`` / ``ioi-gen:swap`` and ``ioi-gen:abc``: indirect-object identification from lenscope's own
  generator (:mod:`lenscope.data.ioi`), corrupted by exchanging the two names or by three new names
  (:func:`ioi_contrasts`);
- ``sva-gen``: subject-verb agreement, corrupted by putting the subject noun in the other number
  (:func:`sva_contrasts`).

Token lengths and single-token targets depend on the model's tokenizer: :func:`check_lengths` checks a list
of pairs, and the generators take the same ``tokenize`` to draw only pairs that fit. ``tokenize(text) ->
list[int]`` must not add special tokens (a BOS would make every target two tokens); :func:`tokenize_with`
makes one from a tokenizer or a loaded model, the way :func:`lenscope.models.loading.load.resolve_token` reads a
target (``add_special_tokens=False``, the text as given, ``"#ID"`` a token id).
"""

from __future__ import annotations

import csv
import random
import re
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import InputError
from .shared import read_csv_rows

COLUMNS = ("clean", "corrupted", "target", "foil")
GENERATORS = ("ioi-gen", "ioi-gen:swap", "ioi-gen:abc", "sva-gen")
DEFAULT_N = 100  # pairs a generator spec gives when no n is passed
_ID = re.compile(r"#\d+")

Tokenize = Callable[[str], list]


@dataclass(frozen=True)
class ContrastPair:
    """One clean/corrupted prompt pair. ``target`` and ``foil`` are token texts with their leading space
    (``" Mary"``) or ``"#ID"``; the metric is ``logit(target) - logit(foil)`` at the last position. ``meta``
    holds where the pair came from (a generator's pattern, template, names; a CSV's extra columns)."""

    clean: str
    corrupted: str
    target: str
    foil: str
    meta: dict = field(default_factory=dict, hash=False)

    def to_dict(self) -> dict:
        return {"clean": self.clean, "corrupted": self.corrupted, "target": self.target, "foil": self.foil,
                "meta": dict(self.meta)}

    @classmethod
    def from_dict(cls, d: Mapping) -> ContrastPair:
        return cls(d["clean"], d["corrupted"], d["target"], d["foil"], dict(d.get("meta") or {}))


# ----------------------------------------------------------------------------------------------
# tokenizing


def tokenize_with(tokenizer) -> Tokenize:
    """``tokenize(text) -> list[int]`` from a transformers tokenizer (or a loaded model: its ``.tokenizer``),
    without special tokens, as :func:`lenscope.models.loading.load.resolve_token` reads a target."""
    tok = getattr(tokenizer, "tokenizer", tokenizer)
    if not callable(tok):
        raise InputError(f"tokenize_with needs a tokenizer or a loaded model, not {type(tokenizer).__name__}")

    def tokenize(text: str) -> list:
        return list(tok(text, add_special_tokens=False)["input_ids"])

    return tokenize


def _as_tokenize(tokenize) -> Tokenize | None:
    """A plain function as given; a tokenizer or a loaded model through :func:`tokenize_with` (calling a
    tokenizer directly returns a dict and adds special tokens, which would make every length wrong)."""
    if tokenize is None:
        return None
    if hasattr(tokenize, "tokenizer") or hasattr(tokenize, "convert_ids_to_tokens"):
        return tokenize_with(tokenize)
    if not callable(tokenize):
        raise InputError(f"tokenize must be a function text -> list of token ids, not {type(tokenize).__name__}")
    return tokenize


def _ids(tokenize: Tokenize, text: str) -> list:
    ids = tokenize(text)
    if isinstance(ids, Mapping):
        ids = ids["input_ids"]
    return list(ids)


def _problem(pair: ContrastPair, tokenize: Tokenize) -> tuple[str, str] | None:
    """``(kind, message)`` of the first thing that makes ``pair`` unusable under ``tokenize``, or None.
    Kinds: ``length``, ``target``, ``same``."""
    c, x = _ids(tokenize, pair.clean), _ids(tokenize, pair.corrupted)
    if len(c) != len(x):
        first = next((i for i, (a, b) in enumerate(zip(c, x)) if a != b), min(len(c), len(x)))
        return "length", (f"clean has {len(c)} tokens, corrupted {len(x)}: {pair.clean!r} vs {pair.corrupted!r} "
                          f"(they first differ at token {first}); reword one so both have the same length")
    if c == x:
        return "same", (f"clean and corrupted are the same {len(c)} tokens ({pair.clean!r}); the corrupted prompt "
                        "must change something")
    tf = []
    for role in ("target", "foil"):
        text = getattr(pair, role)
        if text == "":
            return "target", f"the {role} is empty; give its token text (e.g. ' Mary') or '#ID'"
        if _ID.fullmatch(text):
            tf.append(int(text[1:]))
            continue
        ids = _ids(tokenize, text)
        if len(ids) != 1:
            return "target", (f"the {role} {text!r} is {len(ids)} tokens {ids}, not one; give a single-token word "
                              f"(with its leading space, e.g. ' Mary') or one id as '#ID'")
        tf.append(ids[0])
    if tf[0] == tf[1]:
        return "same", f"the target {pair.target!r} and the foil {pair.foil!r} are the same token (id {tf[0]})"
    return None


def check_lengths(pairs: list[ContrastPair], tokenize, *, source: str | None = None) -> None:
    """Raise :class:`InputError` for the first pair (rows numbered from 1) that cannot be patched: clean and
    corrupted of different token lengths (``"row 3: clean has 12 tokens, corrupted 13: ..."``), a target or foil
    that is not one token, the same token as target and foil, or identical prompts. ``tokenize(text) ->
    list[int]`` without special tokens (:func:`tokenize_with`; a tokenizer or loaded model is wrapped so).
    ``source`` (a file name) starts the message."""
    tokenize = _as_tokenize(tokenize)
    if tokenize is None:
        raise InputError("check_lengths needs a tokenize function (text -> token ids); see tokenize_with")
    for row, pair in enumerate(pairs, start=1):
        bad = _problem(pair, tokenize)
        if bad is not None:
            raise InputError(f"{source + ', ' if source else ''}row {row}: {bad[1]}")


# ----------------------------------------------------------------------------------------------
# CSV


def read_contrast_csv(path: str | Path) -> list[ContrastPair]:
    """Pairs from a CSV whose header has the columns ``clean,corrupted,target,foil`` (any order; other columns
    go into each pair's ``meta`` as strings). Fields are read with the csv module, so quoted commas and
    newlines work; target and foil keep their spaces (``" Mary"``: quote or write ``, Mary``). Blank lines are
    skipped; data rows are numbered from 1 after the header, as :func:`check_lengths` numbers pairs. Errors
    (:class:`InputError`, one line) name the file and the row: an unreadable file, a missing column, a row with
    too few or too many fields, an empty field, no rows."""
    path = Path(path)
    out = []
    for n, vals, meta in read_csv_rows(path, COLUMNS, "pair"):
        for c in COLUMNS:
            if vals[c] == "" or (c in ("clean", "corrupted") and not vals[c].strip()):
                raise InputError(f"{path}, row {n}: the {c!r} field is empty")
        out.append(ContrastPair(vals["clean"], vals["corrupted"], vals["target"], vals["foil"], meta))
    return out


def write_contrast_csv(pairs: list[ContrastPair], path: str | Path) -> Path:
    """Write ``pairs`` as a CSV :func:`read_contrast_csv` reads back: the four columns, then every meta key (first
    seen first; values written with ``str``, read back as strings)."""
    path = Path(path)
    keys: list[str] = []
    for p in pairs:
        keys += [k for k in p.meta if k not in keys and k not in COLUMNS]
    with path.open("w", encoding="utf-8", newline="") as fh:
        w = csv.writer(fh)
        w.writerow([*COLUMNS, *keys])
        for p in pairs:
            w.writerow([p.clean, p.corrupted, p.target, p.foil, *(str(p.meta.get(k, "")) for k in keys)])
    return path


# ----------------------------------------------------------------------------------------------
# drawing until the tokenizer agrees


def _draw(what: str, n: int, make: Callable[[int, int], ContrastPair], tokenize, hint: str) -> list[ContrastPair]:
    """The first ``n`` pairs of ``make(k, accepted)`` for ``k = 0, 1, ...`` (``accepted``: how many fitted so far)
    that fit ``tokenize`` (every pair without one). Gives up with an InputError after ``max(2000, 50 n)`` draws."""
    if not isinstance(n, int) or n < 1:
        raise InputError(f"n must be a positive number of pairs, not {n!r}")
    tokenize = _as_tokenize(tokenize)
    out: list[ContrastPair] = []
    why: Counter = Counter()
    limit = max(2000, 50 * n)
    for k in range(limit):
        pair = make(k, len(out))
        bad = _problem(pair, tokenize) if tokenize is not None else None
        if bad is None:
            out.append(pair)
            if len(out) == n:
                return out
        else:
            why[bad[0]] += 1
    reasons = {"length": "clean and corrupted of different lengths", "target": "target or foil not one token",
               "same": "nothing changed"}
    said = ", ".join(f"{reasons[k]}: {v}" for k, v in why.most_common())
    raise InputError(f"only {len(out)} of {limit} drawn {what} pairs fit this tokenizer ({said}); {hint}")


# ----------------------------------------------------------------------------------------------
# IOI


def _replace_spans(text: str, spans: list[tuple[int, int, str]]) -> str:
    out, last = [], 0
    for a, b, word in sorted(spans):
        out += [text[last:a], word]
        last = b
    return "".join(out + [text[last:]])


def ioi_contrasts(n: int, seed: int = 0, corruption: str = "swap", tokenize=None) -> list[ContrastPair]:
    """``n`` IOI pairs from :func:`lenscope.data.ioi.generate_ioi` (``seed``). The clean prompt is the generated
    one; target = the indirect object's name with a leading space, foil = the subject's.

    - ``corruption="swap"``: the two names exchanged everywhere, so the corrupted prompt's answer is the foil
      (the metric flips sign);
    - ``corruption="abc"``: the IO's mention and the subject's two mentions each replaced by a different new
      name from :data:`lenscope.data.ioi.NAMES` (Wang et al.'s ABC distribution: no name is repeated, so the
      prompt says nothing about the IO).

    With ``tokenize`` (see :func:`tokenize_with`), sentences are drawn until ``n`` have clean and corrupted
    prompts of equal token length and single-token target and foil; the same seed and tokenizer give the same
    pairs. ``meta``: ``pattern`` (ABBA/BABA), ``template`` (index), ``io``, ``s``, ``corruption``, and for abc
    ``abc`` (the three new names: IO's, the first and the second subject mention's)."""
    from .ioi import NAMES, generate_ioi

    if corruption not in ("swap", "abc"):
        raise InputError(f"unknown IOI corruption {corruption!r}; choose 'swap' (the two names exchanged) or 'abc' "
                         "(three new names)")
    cache: list[dict] = []

    def make(k: int, accepted: int) -> ContrastPair:
        if k >= len(cache):  # generate_ioi(m)[:k] == generate_ioi(k): one stream per seed, grown by doubling
            cache[:] = generate_ioi(max(2 * len(cache), n, 16), seed)
        g = cache[k]
        io, s = g["io"], g["s"]
        if len(g["io_spans"]) != 1 or len(g["s_spans"]) != 2:
            raise InputError(f"IOI sentence {k} names the IO {len(g['io_spans'])} and the subject "
                             f"{len(g['s_spans'])} times (expected 1 and 2): {g['prefix']!r}")
        meta = {"pattern": g["pattern"], "template": g["template"], "io": io, "s": s, "corruption": corruption}
        if corruption == "swap":
            new = [(a, b, s) for a, b in g["io_spans"]] + [(a, b, io) for a, b in g["s_spans"]]
        else:
            c = random.Random(f"ioi-abc:{seed}:{k}").sample([x for x in NAMES if x not in (io, s)], 3)
            new = [(*g["io_spans"][0], c[0]), (*g["s_spans"][0], c[1]), (*g["s_spans"][1], c[2])]
            meta["abc"] = list(c)
        return ContrastPair(g["prefix"], _replace_spans(g["prefix"], new), " " + io, " " + s, meta)

    return _draw(f"IOI ({corruption})", n, make, tokenize,
                 "the names in lenscope.data.ioi.NAMES must be single tokens (with a leading space) for this model")


# ----------------------------------------------------------------------------------------------
# subject-verb agreement

# Written for lenscope. {subj} is the subject noun phrase's noun, {attr} an attractor noun between it and the
# verb; the prompt stops right before the verb, given as (singular, plural).
SVA_TEMPLATES = (
    ("The {subj} near the {attr}", (" is", " are")),
    ("The {subj} behind the old {attr}", (" was", " were")),
    ("I heard that the {subj} beside the {attr}", (" has", " have")),
    ("Everyone knows the {subj} across from the {attr}", (" is", " are")),
    ("Last winter the {subj} by the {attr}", (" was", " were")),
    ("The {subj} that the {attr} painted", (" is", " are")),
    ("In the village, the {subj} next to the {attr}", (" has", " have")),
    ("According to the paper, the {subj} of the {attr}", (" was", " were")),
)

# (singular, plural) nouns for subjects; attractors are drawn from the same list (never the subject's noun).
SVA_NOUNS = (
    ("dog", "dogs"), ("teacher", "teachers"), ("house", "houses"), ("key", "keys"), ("farmer", "farmers"),
    ("window", "windows"), ("student", "students"), ("bird", "birds"), ("doctor", "doctors"), ("car", "cars"),
    ("painting", "paintings"), ("tree", "trees"), ("singer", "singers"), ("bridge", "bridges"), ("lamp", "lamps"),
    ("neighbor", "neighbors"), ("tower", "towers"), ("boat", "boats"), ("player", "players"), ("road", "roads"),
    ("child", "children"), ("woman", "women"), ("man", "men"), ("table", "tables"), ("garden", "gardens"),
    ("engine", "engines"), ("officer", "officers"), ("cat", "cats"), ("book", "books"), ("river", "rivers"),
)
NUMBERS = ("singular", "plural")


def sva_contrasts(n: int, seed: int = 0, tokenize=None) -> list[ContrastPair]:
    """``n`` subject-verb agreement pairs (templates and nouns written for lenscope: :data:`SVA_TEMPLATES`,
    :data:`SVA_NOUNS`). The clean prompt stops before the verb ("The dog near the cars" -> target ``" is"``, foil
    ``" are"``); the corrupted prompt has the subject noun in the other number ("The dogs near the cars"), so the
    metric flips. Subjects alternate singular / plural; the attractor's number is drawn independently, so about
    half the prompts have an attractor of the other number. With ``tokenize``, drawn until ``n`` pairs have equal
    token lengths and single-token verbs (same seed, same pairs). ``meta``: ``template`` (index), ``number`` (of the
    clean subject), ``noun``, ``attractor``, ``attractor_number``."""
    rng = random.Random(seed)

    def make(k: int, accepted: int) -> ContrastPair:
        t = rng.randrange(len(SVA_TEMPLATES))
        template, verbs = SVA_TEMPLATES[t]
        subj, attr = rng.sample(SVA_NOUNS, 2)
        a_num = rng.randrange(2)
        num = accepted % 2  # alternate by accepted pairs: a rejected draw leaves the turn as it was
        clean = template.format(subj=subj[num], attr=attr[a_num])
        corrupted = template.format(subj=subj[1 - num], attr=attr[a_num])
        return ContrastPair(clean, corrupted, verbs[num], verbs[1 - num],
                            {"template": t, "number": NUMBERS[num], "noun": subj[num], "attractor": attr[a_num],
                             "attractor_number": NUMBERS[a_num]})

    return _draw("subject-verb agreement", n, make, tokenize,
                 "the verbs (is/are, was/were, has/have) must be single tokens for this model")


# ----------------------------------------------------------------------------------------------
# one entry point


def contrast_dataset(spec: str | Path, n: int | None = None, seed: int = 0, tokenize=None) -> list[ContrastPair]:
    """The pairs of ``spec``: a CSV file (:func:`read_contrast_csv`; its first ``n`` rows, checked with
    :func:`check_lengths` when ``tokenize`` is given), or a generator: ``ioi-gen`` (= ``ioi-gen:swap``),
    ``ioi-gen:abc``, ``sva-gen`` (``n`` pairs, default 100, from ``seed``, drawn to fit ``tokenize``)."""
    if n is not None and (not isinstance(n, int) or n < 1):
        raise InputError(f"the number of pairs must be at least 1, not {n!r}")
    name = str(spec).strip()
    if name in ("ioi-gen", "ioi-gen:swap", "ioi-gen:abc"):
        return ioi_contrasts(n or DEFAULT_N, seed, "abc" if name.endswith(":abc") else "swap", tokenize)
    if name == "sva-gen":
        return sva_contrasts(n or DEFAULT_N, seed, tokenize)
    path = Path(name).expanduser()
    if not path.is_file():
        what = "no such file" if path.suffix.lower() == ".csv" else "unknown contrast data"
        raise InputError(f"{what} {name!r}: give a CSV file with the columns {','.join(COLUMNS)} or one of "
                         f"{', '.join(GENERATORS)}")
    pairs = read_contrast_csv(path)[:n]
    if tokenize is not None:
        check_lengths(pairs, tokenize, source=str(path))
    return pairs
