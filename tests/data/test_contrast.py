"""Contrast pairs for circuit discovery: the CSV reader and writer, the length check, the IOI and subject-verb
agreement generators (their corruptions, determinism, and equal lengths under the tiny and smollm2 tokenizers),
and the one entry point."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import FrozenInstanceError

import pytest

from lenscope.data import (
    ContrastPair,
    check_lengths,
    contrast_dataset,
    ioi_contrasts,
    read_contrast_csv,
    sva_contrasts,
    tokenize_with,
    write_contrast_csv,
)
from lenscope.data.contrast import SVA_NOUNS, SVA_TEMPLATES
from lenscope.data.ioi import NAMES
from lenscope.errors import InputError
from lenscope.models.loading.load import resolve_token
from tests.conftest import get_model

HEADER = "clean,corrupted,target,foil\n"


def words(text: str) -> list[int]:
    """A toy tokenizer: one id per whitespace-separated word, case-blind (" Is" and " is" are one token)."""
    return [int.from_bytes(w.lower().encode()[:8], "big") for w in text.split()]


def name_count(text: str, name: str) -> int:
    return len(re.findall(rf"(?<!\w){name}(?!\w)", text))


def write(tmp_path, text: str, name: str = "pairs.csv"):
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return p


# ---------------------------------------------------------------------------------------------- the pair


def test_pair_is_frozen_hashable_and_round_trips_through_a_dict():
    p = ContrastPair("When A met B, B thanked", "When B met A, A thanked", " A", " B", {"k": "v"})
    with pytest.raises(FrozenInstanceError):
        p.clean = "x"
    assert hash(p) == hash(ContrastPair(p.clean, p.corrupted, p.target, p.foil, {"other": 1}))
    assert ContrastPair.from_dict(p.to_dict()) == p
    assert ContrastPair("a", "b", " c", " d").meta == {}


# ---------------------------------------------------------------------------------------------- CSV


def test_csv_round_trip_keeps_quotes_commas_newlines_spaces_and_meta(tmp_path):
    pairs = [
        ContrastPair('He said "yes, now", then Mary', 'He said "no, later", then John', " Mary", " John",
                     {"source": "hand, written", "note": 'a "quoted" note'}),
        ContrastPair("Line one\nline two, and", "Line uno\nline dos, and", " the", " a", {"source": "x"}),
        ContrastPair("  leading spaces", "  trailing too ", " #", "#12", {}),
    ]
    path = write_contrast_csv(pairs, tmp_path / "rt.csv")
    back = read_contrast_csv(path)
    assert [(b.clean, b.corrupted, b.target, b.foil) for b in back] == [
        (p.clean, p.corrupted, p.target, p.foil) for p in pairs]
    assert back[0].meta == {"source": "hand, written", "note": 'a "quoted" note'}
    assert back[1].meta == {"source": "x", "note": ""}
    assert back[2].meta == {"source": "", "note": ""}
    assert path.read_text(encoding="utf-8").splitlines()[0] == "clean,corrupted,target,foil,source,note"


def test_csv_any_column_order_extra_columns_to_meta_and_blank_lines_skipped(tmp_path):
    p = write(tmp_path, 'id,foil,clean,target,corrupted\n'
                        '7, John,"When Mary and John went out, John gave a book to", Mary,'
                        '"When Mary and John went out, Mary gave a book to"\n'
                        '\n'
                        '8, is,The keys near the door, are,The key near the door\n')
    pairs = read_contrast_csv(p)
    assert len(pairs) == 2
    assert pairs[0] == ContrastPair("When Mary and John went out, John gave a book to",
                                    "When Mary and John went out, Mary gave a book to", " Mary", " John", {"id": "7"})
    assert pairs[1].target == " are" and pairs[1].foil == " is" and pairs[1].meta == {"id": "8"}
    # a byte-order mark (Excel's UTF-8 CSV) is not part of the first column's name
    p2 = write(tmp_path, "\ufeff" + HEADER + "a b,c d, x, y\n", "bom.csv")
    assert read_contrast_csv(p2) == [ContrastPair("a b", "c d", " x", " y")]


def test_csv_errors_name_the_file_and_the_row(tmp_path):
    missing = write(tmp_path, "clean,corrupted,target\na,b,c\n", "missing.csv")
    with pytest.raises(InputError, match=r"missing\.csv: the header has no column 'foil'"):
        read_contrast_csv(missing)

    empty = write(tmp_path, HEADER + "a,b, x, y\nc,d,, y\n", "empty.csv")
    with pytest.raises(InputError, match=r"empty\.csv, row 2: the 'target' field is empty"):
        read_contrast_csv(empty)
    blank_clean = write(tmp_path, HEADER + "  ,b, x, y\n", "blank.csv")
    with pytest.raises(InputError, match=r"blank\.csv, row 1: the 'clean' field is empty"):
        read_contrast_csv(blank_clean)

    fields = write(tmp_path, HEADER + "a,b, x, y\na, b,c, x, y\n", "fields.csv")
    with pytest.raises(InputError, match=r"fields\.csv, row 2: 5 fields, the header has 4; quote fields"):
        read_contrast_csv(fields)

    no_rows = write(tmp_path, HEADER + "\n\n", "norows.csv")
    with pytest.raises(InputError, match=r"norows\.csv has a header but no rows"):
        read_contrast_csv(no_rows)
    with pytest.raises(InputError, match=r"nothing\.csv is empty"):
        read_contrast_csv(write(tmp_path, "", "nothing.csv"))

    with pytest.raises(InputError, match=r"absent\.csv: no such file"):
        read_contrast_csv(tmp_path / "absent.csv")
    (tmp_path / "adir.csv").mkdir()
    with pytest.raises(InputError, match=r"adir\.csv cannot be read"):
        read_contrast_csv(tmp_path / "adir.csv")
    latin = tmp_path / "latin.csv"
    latin.write_bytes(HEADER.encode() + "caf\xe9,b, x, y\n".encode("latin-1"))
    with pytest.raises(InputError, match=r"latin\.csv is not a UTF-8 text file"):
        read_contrast_csv(latin)

    dup = write(tmp_path, "clean,corrupted,target,foil,foil\na,b, x, y, z\n", "dup.csv")
    with pytest.raises(InputError, match=r"dup\.csv: the column 'foil' appears twice"):
        read_contrast_csv(dup)
    # every message is one line
    for bad in (missing, empty, fields, no_rows):
        with pytest.raises(InputError) as e:
            read_contrast_csv(bad)
        assert "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------------- check_lengths


def test_check_lengths_names_the_row_and_both_lengths():
    ok = ContrastPair("one two three", "uno dos tres", " a", " b")
    long = ContrastPair("w " * 12, "w " * 13, " a", " b")
    check_lengths([ok, ok], words)
    with pytest.raises(InputError, match=r"^row 3: clean has 12 tokens, corrupted 13: .*first differ at token 12"):
        check_lengths([ok, ok, long, long], words)
    with pytest.raises(InputError, match=r"^f\.csv, row 1: clean has 12 tokens, corrupted 13"):
        check_lengths([long], words, source="f.csv")


def test_check_lengths_targets_must_be_single_distinct_tokens():
    ok = "one two three", "uno dos tres"
    with pytest.raises(InputError, match=r"row 2: the target ' Mary Ann' is 2 tokens \[\d+, \d+\], not one"):
        check_lengths([ContrastPair(*ok, " a", " b"), ContrastPair(*ok, " Mary Ann", " b")], words)
    with pytest.raises(InputError, match=r"row 1: the foil 'x y' is 2 tokens"):
        check_lengths([ContrastPair(*ok, " a", "x y")], words)
    with pytest.raises(InputError, match=r"row 1: the foil is empty"):
        check_lengths([ContrastPair(*ok, " a", "")], words)
    # the same token for both: words() is case-blind
    with pytest.raises(InputError, match=r"row 1: the target ' Is' and the foil ' is' are the same token"):
        check_lengths([ContrastPair(*ok, " Is", " is")], words)
    with pytest.raises(InputError, match=r"row 1: clean and corrupted are the same 3 tokens"):
        check_lengths([ContrastPair("a b c", "A B C", " a", " bb")], words)
    # '#ID' is a token id, as resolve_token reads it: never tokenized
    check_lengths([ContrastPair(*ok, "#5", "#7"), ContrastPair(*ok, " a", "#7")], words)
    with pytest.raises(InputError, match="needs a tokenize function"):
        check_lengths([ContrastPair(*ok, " a", " b")], None)


def test_tokenize_with_reads_targets_as_resolve_token_does():
    lm = get_model("tiny:gpt2")
    f = tokenize_with(lm)
    assert f(" is") == [resolve_token(lm, " is")]
    assert f("the cat sat") == lm.tokenizer("the cat sat", add_special_tokens=False)["input_ids"]
    # a tokenizer or a loaded model passed as tokenize is wrapped, not called raw (that would give a dict)
    long = ContrastPair("the cat sat", "the cat sat on the mat", " is", " are")
    for given in (lm, lm.tokenizer, f):
        with pytest.raises(InputError, match=rf"row 1: clean has {len(f(long.clean))} tokens, corrupted "
                                             rf"{len(f(long.corrupted))}"):
            check_lengths([long], given)


# ---------------------------------------------------------------------------------------------- IOI


def test_ioi_swap_exchanges_the_two_names_so_the_answer_flips():
    pairs = ioi_contrasts(40, seed=3)
    assert len(pairs) == 40
    assert Counter(p.meta["pattern"] for p in pairs) == {"ABBA": 20, "BABA": 20}
    for p in pairs:
        io, s = p.meta["io"], p.meta["s"]
        assert (p.target, p.foil) == (" " + io, " " + s)
        assert (name_count(p.clean, io), name_count(p.clean, s)) == (1, 2)
        assert (name_count(p.corrupted, io), name_count(p.corrupted, s)) == (2, 1)  # now s is the IO
        swapped = p.clean.replace(io, "\0").replace(s, io).replace("\0", s)
        assert p.corrupted == swapped
        assert p.clean.endswith(" to")


def test_ioi_abc_replaces_each_mention_with_a_different_new_name():
    pairs = ioi_contrasts(40, seed=1, corruption="abc")
    for p in pairs:
        io, s = p.meta["io"], p.meta["s"]
        a, b, c = p.meta["abc"]
        assert len({a, b, c, io, s}) == 5 and {a, b, c} <= set(NAMES)
        assert name_count(p.corrupted, io) == name_count(p.corrupted, s) == 0
        assert [name_count(p.corrupted, x) for x in (a, b, c)] == [1, 1, 1]
        # the IO's mention became a, the subject's first b and its second c, in the clean prompt's places
        first, second = (a, b) if p.meta["pattern"] == "ABBA" else (b, a)
        assert p.corrupted.index(first) < p.corrupted.index(second) < p.corrupted.rindex(c)
        assert (p.target, p.foil) == (" " + io, " " + s)
    # the clean prompts are the swap pairs' clean prompts
    assert [p.clean for p in pairs] == [p.clean for p in ioi_contrasts(40, seed=1)]


def test_generators_are_deterministic_and_seeded():
    for make in (lambda **k: ioi_contrasts(**k), lambda **k: ioi_contrasts(corruption="abc", **k),
                 lambda **k: sva_contrasts(**k)):
        a, b, c = make(n=30, seed=5), make(n=30, seed=5), make(n=30, seed=6)
        assert a == b
        assert a != c and len({p.clean for p in a} & {p.clean for p in c}) < 10
        assert make(n=10, seed=5) == a[:10]  # a longer draw starts with the shorter one
    with pytest.raises(InputError, match="unknown IOI corruption 'abb'"):
        ioi_contrasts(5, corruption="abb")
    with pytest.raises(InputError, match="n must be a positive number"):
        sva_contrasts(0)


# ---------------------------------------------------------------------------------------------- SVA


def test_sva_corrupts_the_subject_number_and_flips_the_verb():
    pairs = sva_contrasts(60, seed=2)
    sing = {n[0]: n[1] for n in SVA_NOUNS}
    plur = {n[1]: n[0] for n in SVA_NOUNS}
    assert Counter(p.meta["number"] for p in pairs) == {"singular": 30, "plural": 30}
    assert set(Counter(p.meta["attractor_number"] for p in pairs)) == {"singular", "plural"}
    for p in pairs:
        template, (v_sing, v_plur) = SVA_TEMPLATES[p.meta["template"]]
        noun, attr = p.meta["noun"], p.meta["attractor"]
        other = sing[noun] if p.meta["number"] == "singular" else plur[noun]
        assert p.clean == template.format(subj=noun, attr=attr)
        assert p.corrupted == template.format(subj=other, attr=attr)
        assert (p.target, p.foil) == ((v_sing, v_plur) if p.meta["number"] == "singular" else (v_plur, v_sing))
        assert noun not in (attr, sing.get(attr), plur.get(attr))  # the attractor is another noun


# ---------------------------------------------------------------------------------------------- real tokenizers


def _assert_fit(pairs, tokenize, n):
    assert len(pairs) == n
    check_lengths(pairs, tokenize)
    for p in pairs:
        assert len(tokenize(p.clean)) == len(tokenize(p.corrupted))
        assert len(tokenize(p.target)) == len(tokenize(p.foil)) == 1


def test_tiny_tokenizer_sva_fits_and_ioi_says_why_not():
    lm = get_model("tiny:gpt2")
    f = tokenize_with(lm)
    pairs = sva_contrasts(20, seed=0, tokenize=lm.tokenizer)
    _assert_fit(pairs, f, 20)
    # the tiny vocabulary (512 tokens) has " is" / " are" as single tokens but not " were" or " has"
    assert {p.target for p in pairs} == {" is", " are"}
    assert pairs == sva_contrasts(20, seed=0, tokenize=f)
    assert pairs[:5] == sva_contrasts(5, seed=0, tokenize=f)
    for corruption in ("swap", "abc"):  # the tiny vocabulary has one name (" Alice") as a single token
        with pytest.raises(InputError, match=r"only 0 of 2000 drawn IOI .* pairs fit this tokenizer .*names"):
            ioi_contrasts(5, corruption=corruption, tokenize=f)


def test_smollm2_tokenizer_fits_50_pairs_of_each_generator():
    lm = get_model("smollm2")
    f = tokenize_with(lm)
    for corruption in ("swap", "abc"):
        pairs = ioi_contrasts(50, tokenize=lm.tokenizer, corruption=corruption)
        _assert_fit(pairs, f, 50)
        assert all(resolve_token(lm, p.target) != resolve_token(lm, p.foil) for p in pairs)
        assert pairs == contrast_dataset(f"ioi-gen:{corruption}", n=50, tokenize=f)
        assert set(Counter(p.meta["pattern"] for p in pairs)) == {"ABBA", "BABA"}
    pairs = sva_contrasts(50, tokenize=lm)
    _assert_fit(pairs, f, 50)
    assert {p.target for p in pairs} == {" is", " are", " was", " were", " has", " have"}
    assert Counter(p.meta["number"] for p in pairs) == {"singular": 25, "plural": 25}


# ---------------------------------------------------------------------------------------------- entry point


def test_contrast_dataset_specs(tmp_path):
    assert contrast_dataset("ioi-gen", n=7, seed=4) == ioi_contrasts(7, seed=4)
    assert contrast_dataset("ioi-gen:swap", n=7, seed=4) == ioi_contrasts(7, seed=4)
    assert contrast_dataset("ioi-gen:abc", n=7) == ioi_contrasts(7, corruption="abc")
    assert contrast_dataset("sva-gen", n=7, seed=1) == sva_contrasts(7, seed=1)
    assert len(contrast_dataset("sva-gen")) == 100

    p = write(tmp_path, HEADER + "a b c,x y z, q, r\none two,one three, q, r\nw w,w w w, q, r\n")
    assert len(contrast_dataset(p)) == 3 and len(contrast_dataset(str(p), n=2)) == 2
    assert contrast_dataset(p, n=2, tokenize=words)[1].corrupted == "one three"
    with pytest.raises(InputError, match=r"pairs\.csv, row 3: clean has 2 tokens, corrupted 3"):
        contrast_dataset(p, tokenize=words)

    with pytest.raises(InputError, match=r"unknown contrast data 'ioi': give a CSV file .* ioi-gen, ioi-gen:swap, "
                                         r"ioi-gen:abc, sva-gen"):
        contrast_dataset("ioi")
    with pytest.raises(InputError, match=r"no such file 'nope\.csv'"):
        contrast_dataset("nope.csv")
    with pytest.raises(InputError, match="at least 1"):
        contrast_dataset("ioi-gen", n=0)
