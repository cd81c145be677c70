"""The positional rankings ``first`` and ``recent``: hand-computed reciprocal ranks, records, and summaries
derived from records written before these methods existed."""

import json

import pytest

from lenscope.data.datasets import Example, load_dataset
from lenscope.evaluate.alignment import (
    POSITIONAL,
    evaluate_examples,
    positional_scores,
    read_records,
    run_alignment,
    summarise,
)
from lenscope.evaluate.metrics import alignment, positional_metrics

from ..conftest import get_model
from ..tolerances import assert_same_computation
from .test_alignment import DATA

POSITIONAL_WHY = "the positional scores: a function of the token count alone"


def test_hand_made_example():
    # 5 tokens, the evidence at position 1
    assert positional_scores(5, "first") == [5.0, 4.0, 3.0, 2.0, 1.0]
    assert positional_scores(5, "recent") == [1.0, 2.0, 3.0, 4.0, 5.0]
    # every position rankable: first ranks 0 then 1 -> rank 2; recent ranks 4, 3, 2, then 1 -> rank 4
    first = alignment(positional_scores(5, "first"), [1])
    recent = alignment(positional_scores(5, "recent"), [1])
    assert first == {"rr": 0.5, "probes": 1, "dot": pytest.approx(4 / 15), "rank": 2}
    assert recent == {"rr": 0.25, "probes": 3, "dot": pytest.approx(2 / 15), "rank": 4}
    # position 0 not rankable (a BOS): the evidence is now the earliest rankable token (dot: 4 / (4+3+2+1))
    assert alignment(positional_scores(5, "first"), [1], [1, 2, 3, 4]) == {"rr": 1.0, "probes": 0,
                                                                           "dot": pytest.approx(4 / 10), "rank": 1}
    assert_same_computation(alignment(positional_scores(5, "recent"), [1], [1, 2, 3, 4])["rr"], 0.25,
                            why="1 / rank: 1 / 4, exact")
    # the evidence is the last token: recent ranks it first, first last
    rec = {"tokens": ["a", "b", "c"], "evidence": [2], "rankable": [0, 1, 2]}
    assert_same_computation((positional_metrics(rec, "recent")["rr"], positional_metrics(rec, "first")["rr"]),
                            (1.0, 1 / 3), why="1 / rank, as written here")
    with pytest.raises(ValueError):
        positional_scores(3, "middle")


def test_records_hold_positional_methods():
    lm = get_model("tiny:gpt2")
    ex = Example(id="x/0", dataset="x", prefix="The keys to the cabinet", target="are", foil="is", evidence=("keys",))
    (r,) = evaluate_examples(lm, [ex], ["logit", "first", "recent"])
    n = len(r["tokens"])
    assert_same_computation(r["scores"]["first"], positional_scores(n, "first"), why=POSITIONAL_WHY)
    assert_same_computation(r["scores"]["recent"], positional_scores(n, "recent"), why=POSITIONAL_WHY)
    # the tiny tokenizer splits " keys" into positions 2 and 3 (test_batched): first reaches 2 after 0 and 1
    assert r["evidence"] == [2, 3]
    assert r["metrics"]["first"]["rr"] == pytest.approx(1 / 3)
    assert r["metrics"]["recent"]["rr"] == pytest.approx(1 / (n - 3))
    assert {"rr", "probes", "dot", "rank"} == set(r["metrics"]["first"])


def test_summary_derives_positional_from_old_records(tmp_path):
    lm = get_model("tiny:gpt2")
    specs = [str(DATA / "tiny.csv")]
    run_alignment(lm, specs, ["logit"], out=tmp_path / "a", progress=False)
    recs = read_records(tmp_path / "a" / "records.jsonl")
    assert all("first" not in r.get("metrics", {}) for r in recs.values())
    datasets = {"tiny.csv": load_dataset(specs[0])}
    s = summarise(lm.name, datasets, recs, ["logit", "first", "recent"])
    assert all("first" not in r.get("metrics", {}) for r in recs.values())  # the records are not changed
    # the same numbers as records computed with the methods
    fresh = run_alignment(lm, specs, ["logit", "first", "recent"], out=tmp_path / "b", progress=False)
    for m in POSITIONAL:
        assert_same_computation(s.datasets["tiny.csv"]["methods"][m], fresh.datasets["tiny.csv"]["methods"][m],
                                why=POSITIONAL_WHY)
        e = s.datasets["tiny.csv"]["methods"][m]
        for k in ("mrr", "mrr_ci", "probes", "probes_ci", "dot", "dot_ci", "n", "skipped", "errors", "accuracy",
                  "correct"):
            assert k in e
        assert e["n"] == 5
        # the derived records' reciprocal ranks: the positional ranking recomputed here from each record's
        # evidence and rankable positions (1 / rank of the evidence's best position)
        rr = []
        for r in recs.values():
            if r["dataset"] == "tiny.csv" and r["skip"] is None:
                want = alignment(positional_scores(len(r["tokens"]), m), r["evidence"], rankable=r["rankable"])
                rr.append(want["rr"])
        assert len(rr) == 5 and e["mrr"] == pytest.approx(sum(rr) / 5)
    # ALTI-Logit's paired difference covers them too
    assert "paired" in s.datasets["tiny.csv"]
    # adding the positional methods to a finished folder computes nothing
    again = run_alignment(lm, specs, ["logit", "first", "recent"], out=tmp_path / "a", progress=False)
    assert again.info["computed_now"] == 0
    assert_same_computation(again.datasets["tiny.csv"]["methods"]["recent"],
                            s.datasets["tiny.csv"]["methods"]["recent"], why=POSITIONAL_WHY)
    # in the table beside random, not in bold
    head = "| dataset | n | skipped | accuracy | logit | first | recent | random |"
    assert head in again.table() and "**" not in again.table().split("\n")[2].split("|")[6]
    assert json.loads((tmp_path / "a" / "summary.json").read_text())["methods"] == ["logit", "first", "recent"]
