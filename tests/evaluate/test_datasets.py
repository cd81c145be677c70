"""Dataset loaders: user CSV and SVA files (with errors naming row and column), the IOI generator, the shared
data (skipped when absent)."""

from pathlib import Path

import pytest
import torch

from lenscope.data.datasets import (
    BLIMP11,
    expand_specs,
    load_dataset,
    parse_evidence,
    read_contrastive_csv,
    read_sva,
)
from lenscope.data.ioi import generate_ioi
from lenscope.data.shared import shared_data_dir
from lenscope.errors import InputError

DATA = Path(__file__).with_name("data")
SHARED = shared_data_dir()
needs_shared = pytest.mark.skipif(SHARED is None or not (SHARED / "logit_explanations").is_dir(),
                                  reason="shared data (../shared/data or $LENSCOPE_DATA) not present")


def test_contrastive_csv():
    exs = read_contrastive_csv(DATA / "tiny.csv")
    assert len(exs) == 6 and exs[0].id == "tiny.csv/0" and exs[0].prefix == "The keys to the cabinet"
    assert (exs[0].target, exs[0].foil, exs[0].evidence) == ("are", "is", ("keys",))
    assert exs[4].evidence is None  # "NA"
    assert load_dataset(str(DATA / "tiny.csv"), limit=2) == exs[:2]


def test_malformed_csv_names_row_and_column(tmp_path):
    with pytest.raises(InputError, match=r"row 2, column 'one_prefix_word_bad' is empty"):
        read_contrastive_csv(DATA / "bad_row.csv")
    with pytest.raises(InputError, match=r"column 'one_prefix_word_bad' is missing"):
        read_contrastive_csv(DATA / "bad_header.csv")
    p = tmp_path / "short.csv"
    p.write_text("one_prefix_prefix,one_prefix_word_good,one_prefix_word_bad,target\nThe cat,is,are,cat\nThe dog,is\n")
    with pytest.raises(InputError, match=r"row 2 has 2 fields.*column 'one_prefix_word_bad'"):
        read_contrastive_csv(p)


def test_sva_file_groups_and_errors():
    exs = read_sva(DATA / "sva.tsv")
    assert [e.group for e in exs] == ["1", "1", "2", "2", None, "0"]
    assert exs[2].prefix == "The cat on the mats near the doors" and exs[2].evidence == ("cat",)
    assert exs[4].evidence is None and exs[5].evidence is None  # no evidence column / empty evidence
    assert exs[0].id == "sva:sva.tsv/2"  # line numbers (the comment is line 1)
    with pytest.raises(InputError, match=r"line 2 has 2 tab-separated column"):
        read_sva(DATA / "bad_sva.tsv")
    with pytest.raises(InputError, match="no such file"):
        load_dataset("sva:/nonexistent/file.tsv")


def test_parse_evidence_and_specs():
    assert parse_evidence("keys") == ("keys",) and parse_evidence(" a | the dog ") == ("a", "the dog")
    assert parse_evidence("NA") is None and parse_evidence("") is None and parse_evidence(None) is None
    assert expand_specs(["blimp:all11", "ioi", "ioi"]) == [f"blimp:{b}" for b in BLIMP11] + ["ioi"]
    with pytest.raises(InputError, match="neither a dataset"):
        load_dataset("no-such-thing")


def test_ioi_generator_is_seeded_and_positions_are_right():
    a, b = generate_ioi(50, seed=3), generate_ioi(50, seed=3)
    assert a == b and generate_ioi(50, seed=4) != a
    assert {g["pattern"] for g in a} == {"ABBA", "BABA"}
    for g in a:
        assert g["target"] != g["foil"] and g["prefix"].endswith(" to")
        assert len(g["io_spans"]) == 1 and len(g["s_spans"]) == 2
        (io,) = g["io_spans"]
        s1, s2 = g["s_spans"]
        assert g["prefix"][io[0]:io[1]] == g["io"] and g["prefix"][s1[0]:s1[1]] == g["s"]
        # ABBA: the IO is named before the subject; BABA: after it; the subject is repeated last
        assert (io[0] < s1[0]) == (g["pattern"] == "ABBA") and s2[0] > io[0]
    exs = load_dataset("ioi-gen", limit=10)
    assert len(exs) == 10 and exs[0].id == "ioi-gen/0" and exs[1].group == "BABA"
    assert exs[0].evidence == (exs[0].target,)
    assert load_dataset("ioi-gen:3", limit=2)[0].prefix == a[0]["prefix"]


@needs_shared
def test_shared_blimp_and_ioi():
    exs = load_dataset("blimp:anaphor_gender_agreement")
    assert len(exs) == 1000 and exs[0].prefix == "Katherine can't help" and exs[0].evidence == ("Katherine",)
    assert sum(e.evidence is None for e in exs) == 21  # "NA" rows (SOURCE.md)
    ioi = load_dataset("ioi", limit=3)
    assert ioi[0].target == "Juana" and ioi[0].foil == "Kristi" and ioi[0].evidence == ("Juana",)
    if (SHARED / "blimp" / "data" / "adjunct_island.jsonl").exists():
        other = load_dataset("blimp:adjunct_island", limit=5)
        assert all(e.evidence is None for e in other)
        assert all(e.info.get("sentence_pair") for e in other)  # no one-prefix form in this paradigm
        sva = load_dataset("blimp:npi_present_2", limit=5)
        assert sva[0].target and sva[0].evidence is None
    with pytest.raises(InputError, match="unknown BLiMP paradigm"):
        load_dataset("blimp:not_a_paradigm")


@needs_shared
def test_blimp_paradigm_without_one_prefix_form_is_scored_by_sentence_probability():
    from lenscope.evaluate.alignment import evaluate_examples, sentence_logprob
    from lenscope.evaluate.evidence import sentence_ids

    from ..conftest import get_model

    if not (SHARED / "blimp" / "data" / "adjunct_island.jsonl").exists():
        pytest.skip("blimp/data not present")
    lm = get_model("tiny:gpt2")
    exs = load_dataset("blimp:adjunct_island", limit=3)
    assert all(e.info.get("sentence_pair") and e.evidence is None for e in exs)
    recs = evaluate_examples(lm, exs, ["logit"])
    for e, r in zip(exs, recs):
        assert r["pair"] and r["usable"] and r["skip"] == "sentence pair (accuracy only)"
        ids = sentence_ids(lm.tokenizer, e.target)
        assert ids[0] == lm.tokenizer.eos_token_id  # a start token, so the first word is scored too
        x = torch.tensor(ids)
        with torch.no_grad():
            logp = torch.log_softmax(lm.model(x[None]).logits[0, :-1].double(), -1)
        by_hand = float(sum(logp[k, ids[k + 1]] for k in range(len(ids) - 1)))
        assert sentence_logprob(lm, ids) == pytest.approx(by_hand, abs=1e-6)
        assert r["logit_diff"] == pytest.approx(by_hand - sentence_logprob(lm, sentence_ids(lm.tokenizer, e.foil)))
        assert r["correct"] == (r["logit_diff"] > 0)
