"""The report of a translation (encoder-decoder) model: its alignment view's data on the page are pair_scores's for the
pair, its word links model_alignments's, its gold links and AER alignment_error_rate's; one-line errors."""

from __future__ import annotations

import json
import re

import pytest
import torch
from typer.testing import CliRunner

from lenscope.attribution.methods import source_readers
from lenscope.data.alignments import AlignedPair, read_gold_alignments
from lenscope.evaluate.aer import alignment_error_rate, model_alignments, pair_scores
from lenscope.models.runtime.request import token_texts
from lenscope.report import build_report, unpack
from lenscope.report.alignment import gold_pair

from ..conftest import get_model

SOURCE, TARGET = "das Haus ist klein", "the house is small"
GOLD = {"source": SOURCE, "target": TARGET, "sure": [[0, 0], [1, 1], [2, 2]], "possible": [[3, 3], [2, 3]]}
OTHER = {"source": "ein Hund", "target": "a dog", "sure": [[0, 0], [1, 1]]}
# the methods computed here (the view's default is every method that reads a source: test_default_methods)
METHODS = ("logit", "alti-logit")


def page_data(html: str) -> dict:
    """The data block of a written page, as its scripts read it."""
    block = re.search(r'<script type="application/json" id="lenscope-data">(.*?)</script>', html, re.S).group(1)
    return json.loads(block)


def _alignment(html: str) -> dict:
    secs = {s["key"]: s for s in page_data(html)["sections"]}
    return secs["alignment"]["data"]


def _gold_file(tmp_path, *rows) -> str:
    p = tmp_path / "gold.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(p)


@pytest.mark.parametrize("name", ["tiny:marian", "tiny:m2m100"])  # Post-LN (Marian) and Pre-LN (M2M-100)
def test_page_data_equal_pair_scores(name):
    lm = get_model(name)
    rep = build_report(lm, TARGET, source=SOURCE, methods=METHODS)
    assert rep.ok and [s["key"] for s in rep.sections] == ["alignment", "omitted"]
    note = rep.sections[1]["note"]
    assert "encoder-decoder" in note and "prediction, trajectory, components, attribution, mixing, flow" in note
    html = rep.html()
    d = _alignment(html)
    ps = pair_scores(lm, [(SOURCE, TARGET)], METHODS)[0]
    assert list(d["methods"]) == list(METHODS) == list(ps.scores)
    assert d["n_source"] == ps.n_source
    assert d["source_tokens"] == token_texts(lm, ps.source_ids)
    assert d["prefix_tokens"] == token_texts(lm, ps.decoder_ids)
    assert d["target_tokens"] == d["prefix_tokens"][1:]
    for m, want in ps.scores.items():
        got = torch.from_numpy(unpack(d["methods"][m]["scores"]).copy()).double()
        assert got.shape == want.shape == (len(ps.decoder_ids) - 1, ps.n_source + len(ps.decoder_ids))
        torch.testing.assert_close(got, want.double(), rtol=1e-6, atol=1e-9)  # float32 on the page
    # the word links are eval alignment's (model_alignments) on the same words
    g = AlignedPair("0", tuple(SOURCE.split()), tuple(TARGET.split()), frozenset(), frozenset())
    links = model_alignments(lm, [g], METHODS)
    assert d["links"] == {m: sorted(list(x) for x in links[m]["0"]) for m in links}
    assert d["gold"] is None and d["aer"] is None
    assert 'id="sec-omitted"' in html and "aligns its translation" in html
    summary = rep.summary()["sections"][0]["summary"]
    assert summary["links"] == d["links"] and summary["methods"] == list(METHODS)


def test_default_methods_are_the_source_readers():
    from lenscope.report.alignment import view_methods

    assert view_methods() == source_readers() and view_methods(["alti-logit"]) == ("alti-logit",)


def test_gold_links_and_aer_on_the_page(tmp_path):
    lm = get_model("tiny:marian")
    path = _gold_file(tmp_path, OTHER, GOLD)
    rows = read_gold_alignments(path)
    pair = gold_pair(rows, SOURCE, TARGET, path)
    assert pair.id == "2"
    rep = build_report(lm, TARGET, source=SOURCE, gold=pair, methods=METHODS)
    d = _alignment(rep.html())
    assert d["gold"] == {"sure": [[0, 0], [1, 1], [2, 2]], "possible": [[2, 3], [3, 3]]}
    links = model_alignments(lm, [pair], METHODS)
    for m in METHODS:
        want = alignment_error_rate([pair], links[m], method=m)
        got = d["aer"][m]
        assert got["aer"] == pytest.approx(want.aer, abs=1e-15)
        assert got["precision"] == pytest.approx(want.precision, abs=1e-15)
        assert got["recall"] == pytest.approx(want.recall, abs=1e-15)
        assert {k: got[k] for k in want.totals} == want.totals
    # one method chosen: only it
    rep = build_report(lm, TARGET, source=SOURCE, gold=pair, methods=["logit"])
    assert list(_alignment(rep.html())["methods"]) == ["logit"]


def test_cli_writes_the_alignment_page_with_gold(tmp_path):
    from lenscope.cli import app

    path = _gold_file(tmp_path, GOLD)  # a file of one pair: that pair
    out = tmp_path / "page.html"
    r = CliRunner().invoke(app, ["report", TARGET, "--source", SOURCE, "--model", "tiny:marian", "--out", str(out),
                                 "--gold", path, "--json", "--methods", ",".join(METHODS)])
    assert r.exit_code == 0, r.output
    got = json.loads(r.stdout)
    summary = got["sections"][0]["summary"]
    assert summary["gold"]["sure"] == GOLD["sure"] and list(summary["aer"]) == list(METHODS)
    d = _alignment(out.read_text())
    assert d["aer"] == summary["aer"] and d["links"] == summary["links"]


@pytest.mark.parametrize("args, message", [
    (["report", TARGET, "--model", "tiny:marian"], "translation) model: give the source with --source"),
    (["report", TARGET, "--model", "tiny:llama", "--source", SOURCE], "--source is for encoder-decoder"),
    (["report", TARGET, "--model", "tiny:marian", "--source", SOURCE, "--target", " x"], "--target do not apply"),
    (["report", TARGET, "--model", "tiny:marian", "--gold", "GOLD"], "--gold shows gold word alignments"),
    (["report", TARGET, "--model", "tiny:marian", "--source", SOURCE, "--methods", "nope"],
     "unknown or not source-reading method(s) ['nope']"),
    (["report", TARGET, "--model", "tiny:marian", "--source", SOURCE, "--gold", "GOLD"],
     "holds no row whose source and target words are"),
])
def test_one_line_errors(tmp_path, args, message):
    from lenscope.cli import app

    gold = _gold_file(tmp_path, OTHER, {**OTHER, "id": "b"})
    args = [gold if a == "GOLD" else a for a in args] + ["--out", str(tmp_path / "x.html")]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) <= 2 and message in r.output and "Traceback" not in r.output  # the loading line, the error
    assert not (tmp_path / "x.html").exists()


def test_gold_of_one_pair_of_other_words_is_refused(tmp_path):
    from lenscope.errors import InputError

    rows = read_gold_alignments(_gold_file(tmp_path, OTHER))
    with pytest.raises(InputError, match="its pair has 2 source and 2 target words, the texts 4 and 4"):
        gold_pair(rows, SOURCE, TARGET)
