"""Alignment error rate: a two-sentence corpus computed by hand, the gold / predicted file readers and their
one-line errors, word alignments from token-level scores, the result's frame and file, and ``lenscope eval aer``.

The hand computation (data/aer_gold.jsonl, data/aer_pred.jsonl; links are (source word, target word)):

- s1 "das Haus ist klein" / "the house is small": S = {00, 11, 33}, P = S + {22, 10};
  A = {00, 11, 22, 13}: |A| = 4, |S| = 3, |A & S| = |{00, 11}| = 2, |A & P| = |{00, 11, 22}| = 3;
  AER(s1) = 1 - (2 + 3) / (4 + 3) = 2/7.
- s2 "ich gehe" / "I am going": S = {00, 12}, P = S + {11}; A = {00, 11}: |A| = 2, |S| = 2, |A & S| = 1,
  |A & P| = 2; AER(s2) = 1 - (1 + 2) / (2 + 2) = 1/4.
- corpus (counts summed first): |A| = 6, |S| = 5, |A & S| = 3, |A & P| = 5: AER = 1 - 8/11 = 3/11,
  precision 5/6, recall 3/5 (not the mean of the sentences' AERs, 15/56).
"""

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from lenscope.cli import app
from lenscope.data.alignments import read_gold_alignments, read_predicted_alignments
from lenscope.errors import InputError
from lenscope.evaluate.aer import (
    AlignmentErrorRate,
    alignment_error_rate,
    sentence_counts,
    word_alignment,
    word_scores,
)

from ..tolerances import assert_same_computation, assert_same_ints

DATA = Path(__file__).with_name("data")
GOLD, PRED = DATA / "aer_gold.jsonl", DATA / "aer_pred.jsonl"


def test_the_readers_read_words_links_and_both_link_forms():
    g = read_gold_alignments(GOLD)
    assert [r.id for r in g] == ["s1", "s2"]
    assert g[0].source == ("das", "Haus", "ist", "klein") and g[1].source == ("ich", "gehe")
    assert g[0].sure == {(0, 0), (1, 1), (3, 3)}
    assert g[0].possible == {(0, 0), (1, 1), (3, 3), (2, 2), (1, 0)}  # sure links are possible too
    assert g[1].sure == {(0, 0), (1, 2)} and g[1].possible == {(0, 0), (1, 2), (1, 1)}
    p = read_predicted_alignments(PRED)
    assert [r.id for r in p] == ["s2", "s1"] and p[0].source is None and p[1].source[1] == "Haus"
    assert p[1].sure == p[1].possible == {(0, 0), (1, 1), (2, 2), (1, 3)}


def test_a_gold_row_may_give_one_list_of_links_or_a_pharaoh_line(tmp_path):
    """Gold rows as many corpora ship them: ``alignment`` (every link sure) and the links as one Pharaoh line."""
    g = read_gold_alignments(_file(tmp_path, ROW | {"alignment": "0-0 1-1"},
                                   ROW | {"sure": "1-0", "possible": [[0, 1]]}))
    assert g[0].sure == g[0].possible == {(0, 0), (1, 1)}
    assert g[1].sure == {(1, 0)} and g[1].possible == {(1, 0), (0, 1)}


def test_aer_of_the_hand_computed_corpus():
    res = alignment_error_rate(read_gold_alignments(GOLD), read_predicted_alignments(PRED), method="hand")
    assert res.ids == ["s1", "s2"]
    assert res.counts.tolist() == [[4, 3, 2, 3], [2, 2, 1, 2]]
    assert res.totals == {"predicted": 6, "sure": 5, "predicted_sure": 3, "predicted_possible": 5}
    assert res.aer == pytest.approx(3 / 11, abs=1e-15)
    assert res.precision == pytest.approx(5 / 6, abs=1e-15) and res.recall == pytest.approx(3 / 5, abs=1e-15)
    assert res.per_sentence().tolist() == pytest.approx([2 / 7, 1 / 4], abs=1e-15)
    assert res.aer != pytest.approx(res.per_sentence().mean().item())  # a corpus ratio, not a mean of ratios
    assert res.to_dict() == {"method": "hand", "sentences": 2, "aer": pytest.approx(3 / 11), "precision":
                             pytest.approx(5 / 6), "recall": pytest.approx(3 / 5), "predicted": 6, "sure": 5,
                             "predicted_sure": 3, "predicted_possible": 5}
    # a dict of links gives the same result
    same = alignment_error_rate(read_gold_alignments(GOLD), {"s1": [(0, 0), (1, 1), (2, 2), (1, 3)],
                                                             "s2": [[0, 0], [1, 1]]})
    assert_same_ints(same.counts, res.counts)


def test_aer_limits():
    assert sentence_counts({(0, 0), (1, 1)}, {(0, 0), (1, 1)}) == [2, 2, 2, 2]  # perfect: AER 0
    assert sentence_counts({(0, 1)}, {(0, 0)}, {(1, 1)}) == [1, 1, 0, 0]  # all wrong: AER 1
    # a possible-only link predicted costs nothing: AER = 1 - (1 + 2) / (2 + 1) = 0
    gold = read_gold_alignments(GOLD)[1:]
    assert alignment_error_rate(gold, {"s2": {(0, 0), (1, 2)}}).aer == 0.0
    assert alignment_error_rate(gold, {"s2": {(0, 1)}}).aer == 1.0
    r = alignment_error_rate(gold, {"s2": {(0, 0), (1, 2), (1, 1)}})
    assert r.aer == pytest.approx(0.0, abs=1e-15) and r.precision == 1.0 and r.recall == 1.0
    # no predicted link: precision undefined (NaN, None in JSON), recall 0, AER 1
    r = alignment_error_rate(gold, {"s2": []})
    assert r.aer == 1.0 and r.recall == 0.0 and r.precision != r.precision


def test_result_frame_and_file_round_trip(tmp_path):
    res = alignment_error_rate(read_gold_alignments(GOLD), read_predicted_alignments(PRED), method="hand")
    df = res.to_frame()
    assert list(df["id"]) == ["s1", "s2"] and list(df["predicted_possible"]) == [3, 2]
    assert df["aer"].tolist() == pytest.approx([2 / 7, 1 / 4])
    back = AlignmentErrorRate.load(res.save(tmp_path / "aer.safetensors"))
    assert back.ids == res.ids and back.method == "hand"
    assert_same_ints(back.counts, res.counts)
    assert_same_computation(back.aer, res.aer, why="the AER of the same counts read back")
    assert "aer=0.2727" in repr(back)
    fig = res.plot()  # one bar per sentence at its own AER, the corpus AER as a line
    ax = fig.axes[0]
    assert [b.get_height() for b in ax.patches] == pytest.approx([2 / 7, 1 / 4])
    assert ax.lines[0].get_ydata()[0] == pytest.approx(3 / 11) and "precision 0.833" in ax.get_title()
    assert "<svg" in res._repr_html_()


def _file(tmp_path, *rows) -> Path:
    p = tmp_path / "a.jsonl"
    p.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return p


ROW = {"source": "a b", "target": "x y"}


@pytest.mark.parametrize(("rows", "match"), [
    ([ROW | {"sure": [[0, 2]]}], r"line 1: 'sure' links target word 2, but the target has 2 words"),
    ([ROW | {"sure": [[2, 0]]}], r"links source word 2, but the source has 2 words"),
    ([ROW | {"sure": [[0, 0]], "possible": ["1-x"]}], r"'possible' holds '1-x', not a link"),
    ([ROW | {"sure": [[0, -1]]}], r"not a link"),
    ([ROW | {"sure": [[0, 0], "0-0"]}], r"lists the link \[0, 0\] twice"),
    ([ROW | {"sure": [], "extra": 1}], r"unknown field 'extra'"),
    ([{"source": "a", "sure": []}], r"a gold row needs 'source' and 'target'"),
    ([ROW | {"possible": []}], r"no 'sure' list"),
    ([{"source": "", "target": "x", "sure": []}], r"'source' has no words"),
    ([ROW | {"sure": [], "id": "a"}, ROW | {"sure": [], "id": "a"}], r"line 2: id 'a' appears twice"),
    ([ROW | {"alignment": [[0, 0]], "possible": []}], r"give 'sure' \(and 'possible'\), or 'alignment' alone"),
    ([ROW | {"sure": 3}], r"must be a list of links or a Pharaoh line"),
    ([ROW | {"sure": []}, "{not json"], r"line 2: not JSON"),
    (["[1, 2]"], r"expected a JSON object"),
])
def test_gold_file_errors_are_one_line(tmp_path, rows, match):
    with pytest.raises(InputError, match=match) as e:
        read_gold_alignments(_file(tmp_path, *rows))
    assert len(str(e.value).splitlines()) == 1


def test_file_and_pairing_errors(tmp_path):
    with pytest.raises(InputError, match="no such alignment file"):
        read_gold_alignments(tmp_path / "missing.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(InputError, match="holds no alignment rows"):
        read_predicted_alignments(tmp_path / "empty.jsonl")
    gold = read_gold_alignments(GOLD)
    with pytest.raises(InputError, match="gold sentence 's2' has no predicted alignment"):
        alignment_error_rate(gold, {"s1": []})
    with pytest.raises(InputError, match="predicted sentence 's3' has no gold alignment"):
        alignment_error_rate(gold, {"s1": [], "s2": [], "s3": []})
    with pytest.raises(InputError, match=r"sentence 's2': predicted link \[2, 0\] is outside the sentence"):
        alignment_error_rate(gold, {"s1": [], "s2": [(2, 0)]})
    pred = read_predicted_alignments(_file(tmp_path, {"id": "s1", "source": "a b", "alignment": []},
                                           {"id": "s2", "alignment": []}))
    with pytest.raises(InputError, match="sentence 's1': the prediction's source has 2 words, the gold's 4"):
        alignment_error_rate(gold, pred)
    empty = read_gold_alignments(_file(tmp_path, ROW | {"sure": [], "possible": [[0, 0]]}))
    with pytest.raises(InputError, match="the AER is undefined"):
        alignment_error_rate(empty, {"1": []})


def test_word_alignment_from_token_scores():
    # source tokens "▁das ▁Ha us </s>" -> words 0, 1, 1, none; target tokens "▁the ▁ho use" -> words 0, 1, 1
    scores = torch.tensor([[0.5, 0.2, 0.1, 9.0],  # "the": das 0.5, Haus 0.2 + 0.1 = 0.3 (</s> left out)
                           [0.1, 0.3, 0.3, 0.0],  # "ho": das 0.1, Haus 0.6
                           [0.9, 0.0, 0.0, 0.0]])  # "use": das 0.9, Haus 0
    src, tgt = [0, 1, 1, None], [0, 1, 1]
    first = word_scores(scores, src, tgt)
    torch.testing.assert_close(first, torch.tensor([[0.5, 0.3], [0.1, 0.6]], dtype=torch.float64))
    assert word_alignment(first) == {(0, 0), (1, 1)}
    mean = word_scores(scores, src, tgt, target_token="mean")  # "house": ((0.1 + 0.9) / 2, (0.6 + 0) / 2)
    torch.testing.assert_close(mean[1], torch.tensor([0.5, 0.3], dtype=torch.float64))
    assert word_alignment(mean) == {(0, 0), (0, 1)}
    assert word_alignment(torch.tensor([[1.0, 1.0]])) == {(0, 0)}  # ties: the first source word
    # a null column (the source's end token): a target word it wins gets no link; the others keep theirs
    assert word_alignment(torch.tensor([[0.1, 0.2, 0.7], [0.5, 0.2, 0.3]]), null=2) == {(0, 1)}
    with pytest.raises(InputError, match="do not match 3 target and 3 source tokens"):
        word_scores(scores, [0, 1, None], tgt)
    with pytest.raises(InputError, match="must name every word 0..n-1"):
        word_scores(scores, [0, 2, 2, None], tgt)
    with pytest.raises(InputError, match="unknown target_token"):
        word_scores(scores, src, tgt, target_token="last")
    with pytest.raises(InputError, match="NaN or infinite"):
        word_alignment(torch.tensor([[float("nan"), 1.0]]))


def test_cli_eval_aer(tmp_path):
    runner = CliRunner()
    r = runner.invoke(app, ["eval", "aer", "--gold", str(GOLD), "--predicted", str(PRED), "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["aer"] == pytest.approx(3 / 11) and d["sentences"] == 2 and d["predicted_possible"] == 5
    r = runner.invoke(app, ["eval", "aer", "--gold", str(GOLD), "--predicted", str(PRED)])
    assert r.exit_code == 0 and r.stdout.startswith("AER 0.2727  precision 0.8333  recall 0.6000  (2 sentences")
    bad = _file(tmp_path, {"id": "s1", "alignment": [[0, 9]]}, {"id": "s2", "alignment": []})
    r = runner.invoke(app, ["eval", "aer", "--gold", str(GOLD), "--predicted", str(bad)])
    err = r.stderr.strip()
    assert r.exit_code == 2 and err.startswith("error: sentence 's1': predicted link [0, 9]") and "\n" not in err
