"""The resumable run: records on disk, resume without recomputation, identical summaries, groups and skips."""

import json
from pathlib import Path

import pytest

from lenscope.data.datasets import load_dataset
from lenscope.evaluate.alignment import read_records, run_alignment, summarise

from ..conftest import get_model
from ..tolerances import alignment_rounding, assert_close_nested, assert_same_computation

DATA = Path(__file__).with_name("data")
METHODS = ["logit", "alti-logit", "grad-x-input", "erasure"]


def _strip(summary):
    d = summary.to_dict()
    d.pop("timing")
    d.pop("info")
    return d


def test_resume_gives_identical_results_without_recomputing(tmp_path):
    lm = get_model("tiny:llama")
    specs = [str(DATA / "tiny.csv"), f"sva:{DATA / 'sva.tsv'}"]
    full = run_alignment(lm, specs, METHODS, out=tmp_path / "a", progress=False, batch_size=2)
    lines = (tmp_path / "a" / "records.jsonl").read_text().splitlines(keepends=True)
    assert len(lines) == 12 and full.info["computed_now"] == 12
    # an interrupted run: 5 complete records and half of the 6th
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "run.json").write_text((tmp_path / "a" / "run.json").read_text())
    (tmp_path / "b" / "records.jsonl").write_text("".join(lines[:5]) + lines[5][: len(lines[5]) // 2])
    resumed = run_alignment(lm, specs, METHODS, out=tmp_path / "b", progress=False, batch_size=2)
    assert resumed.info["computed_now"] == 7  # 12 - 5 finished
    recs_a, recs_b = read_records(tmp_path / "a" / "records.jsonl"), read_records(tmp_path / "b" / "records.jsonl")
    assert set(recs_a) == set(recs_b)
    # the 7 recomputed examples ran in other batches (of equal length, two at a time): their scores are another
    # computation, so each record's metrics agree within the rounding of their scores (records keep 7 decimals)
    # and the summary (means and bootstrap intervals of them) within twice the largest
    tol = {k: max([alignment_rounding(s, recs_b[k]["scores"][m], r.get("rankable"), decimals=7)
                   for m, s in r.get("scores", {}).items() if None not in s], default=0.0)
           for k, r in recs_a.items()}
    for k in recs_a:
        assert_close_nested(recs_a[k].get("metrics"), recs_b[k].get("metrics"), tol[k])
    assert_close_nested(_strip(resumed), _strip(full), 2 * max(tol.values()))
    # nothing left to do: a third run computes nothing and writes the same summary
    again = run_alignment(lm, specs, METHODS, out=tmp_path / "b", progress=False)
    assert again.info["computed_now"] == 0
    assert_same_computation(_strip(again), _strip(resumed), why="the same records summarised again")
    saved = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert saved["datasets"].keys() == full.datasets.keys()
    assert (tmp_path / "b" / "table.md").exists() and (tmp_path / "b" / "layers.png").exists()
    # a new method only runs the examples that lack it
    n_align = sum(1 for r in recs_b.values() if r["skip"] is None)
    assert n_align == 9  # 5 of tiny.csv (one has no evidence), 4 of sva.tsv (two have none)
    more = run_alignment(lm, specs, METHODS + ["grad-norm"], out=tmp_path / "b", progress=False)
    assert more.info["computed_now"] == n_align
    # another model in the same folder is refused
    from lenscope.errors import InputError

    with pytest.raises(InputError, match="holds results for"):
        run_alignment(get_model("tiny:gpt2"), specs, METHODS, out=tmp_path / "b", progress=False)


def test_summary_counts_skips_groups_and_accuracy(tmp_path):
    lm = get_model("tiny:gpt2")
    specs = [str(DATA / "tiny.csv"), f"sva:{DATA / 'sva.tsv'}"]
    s = run_alignment(lm, specs, METHODS, out=tmp_path / "all", progress=False)
    records = read_records(tmp_path / "all" / "records.jsonl")
    csv, sva = s.datasets["tiny.csv"], s.datasets["sva:sva.tsv"]
    recs = {}
    for name, exs in (("tiny.csv", load_dataset(specs[0])), ("sva:sva.tsv", load_dataset(specs[1]))):
        assert s.datasets[name]["rows"] == len(exs)
    # tiny.csv: row 4 has evidence "NA" -> skipped for alignment, still counted for accuracy
    assert csv["skip_reasons"].get("no evidence") == 1 and csv["skipped"] == 1 and csv["n"] == 5
    assert csv["n_accuracy"] == 6
    for m in METHODS:
        e = csv["methods"][m]
        for k in ("mrr", "mrr_ci", "n", "skipped", "accuracy", "probes", "dot", "correct"):
            assert k in e
        assert e["n"] == 5 and e["skipped"] == 1
        # the mean of the records' reciprocal ranks, each one over the rank the record holds
        ms = [r["metrics"][m] for r in records.values() if r["dataset"] == "tiny.csv" and r["skip"] is None]
        assert len(ms) == 5 and all(x["rr"] == pytest.approx(1 / x["rank"]) for x in ms)
        assert e["mrr"] == pytest.approx(sum(x["rr"] for x in ms) / 5)
        assert e["mrr_ci"][0] <= e["mrr"] <= e["mrr_ci"][1]
    # sva: groups "0", "1", "2"; the ungrouped line without evidence counts for accuracy only
    assert list(sva["groups"]) == ["0", "1", "2"]
    assert sva["groups"]["1"]["n"] == 2 and sva["groups"]["2"]["n"] == 2 and sva["groups"]["0"]["n"] == 0
    assert sva["groups"]["0"]["n_accuracy"] == 1 and sva["n_accuracy"] == 6 and sva["n"] == 4
    # the dataset mean is the mean of the records' reciprocal ranks, recomputed here by hand
    rs = run_alignment(lm, [specs[1]], ["logit"], out=tmp_path / "r", progress=False)
    recs = read_records(tmp_path / "r" / "records.jsonl")
    rr = [r["metrics"]["logit"]["rr"] for r in recs.values() if r["skip"] is None]
    assert rs.datasets["sva:sva.tsv"]["methods"]["logit"]["mrr"] == pytest.approx(sum(rr) / len(rr))
    acc = [r["correct"] for r in recs.values() if r["usable"]]
    assert rs.datasets["sva:sva.tsv"]["accuracy"] == pytest.approx(sum(acc) / len(acc))
    ok = [r["metrics"]["logit"]["rr"] for r in recs.values() if r["skip"] is None and r["correct"]]
    c = rs.datasets["sva:sva.tsv"]["methods"]["logit"]["correct"]
    assert c["n"] == len(ok) and (c["mrr"] == pytest.approx(sum(ok) / len(ok)) if ok else c["mrr"] is None)
    # summarise is a pure function of the records
    again = summarise(lm.name, {"sva:sva.tsv": load_dataset(specs[1])}, recs, ["logit"])
    assert_same_computation(again.datasets, rs.datasets, why="summarise() of the same records")
    assert "| sva:sva.tsv |" in rs.table() and len(s.to_frame()) == 2 * len(METHODS)
