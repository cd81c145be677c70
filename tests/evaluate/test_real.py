"""eval alignment on the embedded smollm2 and on a handful of shared-data examples; the docs' example runs."""

import re
from pathlib import Path

import pytest

import lenscope
from lenscope.data.datasets import Example
from lenscope.data.shared import shared_data_dir
from lenscope.evaluate import evaluate_examples, load_dataset
from lenscope.evaluate.alignment import read_records

from ..conftest import get_model
from ..tolerances import assert_same_computation

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_smollm2_keys_example_matches_explain():
    """"The keys to the cabinet" -> " are" vs " is": the record holds lenscope.explain's numbers, and the Logit
    explanation ranks the subject " keys" first (docs/attribution.md)."""
    lm = get_model("smollm2")
    ex = Example(id="k/0", dataset="k", prefix="The keys to the cabinet", target="are", foil="is", evidence=("keys",))
    (r,) = evaluate_examples(lm, [ex], ["logit", "alti-logit", "grad-x-input", "erasure"])
    assert r["tokens"] == ["The", " keys", " to", " the", " cabinet"] and r["evidence"] == [1]
    ref = lenscope.explain(lm, ex.prefix, " are", " is", method="logit")
    assert r["scores"]["logit"] == pytest.approx(ref.scores.tolist(), abs=1e-5)
    assert r["logit_diff"] == pytest.approx(ref.info["logit"], abs=1e-3) and r["correct"]
    assert r["metrics"]["logit"]["rr"] == 1.0
    assert sum(r["scores"]["alti-logit"]) == pytest.approx(sum(r["scores"]["logit"]), abs=1e-3)


@pytest.mark.slow
@pytest.mark.skipif(shared_data_dir() is None, reason="shared data not present")
def test_smollm2_on_a_few_blimp_and_ioi_examples():
    """Four determiner-noun and four IOI rows: the evidence positions, ranks and reciprocal ranks are the ones
    written here by hand from the tokens, and every number matches the committed smollm2 records
    (docs/results/evaluation/smollm2/records.jsonl, computed by the full run)."""
    lm = get_model("smollm2")
    exs = load_dataset("blimp:determiner_noun_agreement_1", limit=4) + load_dataset("ioi", limit=4)
    recs = evaluate_examples(lm, exs, ["logit", "alti-logit", "first", "recent"])
    for ex, r in zip(exs, recs):
        assert r["usable"] and r["skip"] is None
        # the evidence token is the determiner / the indirect object, in the prefix
        assert "".join(r["tokens"][k] for k in r["evidence"]).strip() == ex.evidence[0]
    # "Raymond is selling this" -> the determiner " this" is the last of 5 tokens (position 4), ...
    assert [r["evidence"] for r in recs] == [[4], [3], [4], [4], [1, 2], [6, 7], [1, 2], [5]]
    assert [len(r["tokens"]) for r in recs] == [5, 5, 5, 5, 18, 23, 17, 19]
    assert [r["metrics"]["logit"]["rank"] for r in recs] == [1, 2, 3, 1, 1, 1, 1, 1]
    assert_same_computation([r["metrics"]["logit"]["rr"] for r in recs], [1.0, 0.5, 1 / 3, 1.0, 1.0, 1.0, 1.0, 1.0],
                            why="1 / rank, as written here")
    assert [r["metrics"]["alti-logit"]["rank"] for r in recs] == [3, 4, 5, 4, 1, 1, 1, 1]
    # the positional rankings, by hand: recent ranks position 4 of 5 first, position 3 second; first ranks
    # the earliest evidence position e at rank e + 1 (every position is rankable: smollm2 has no BOS)
    assert [r["metrics"]["recent"]["rank"] for r in recs] == [1, 2, 1, 1, 16, 16, 15, 14]
    assert [r["metrics"]["first"]["rank"] for r in recs] == [5, 4, 5, 5, 2, 7, 2, 6]
    committed = read_records(ROOT / "docs" / "results" / "evaluation" / "smollm2" / "records.jsonl")
    for r in recs:
        c = committed[r["id"]]
        assert r["tokens"] == c["tokens"] and r["evidence"] == c["evidence"] and r["correct"] == c["correct"]
        assert r["logit_diff"] == pytest.approx(c["logit_diff"], abs=1e-3)
        for m in ("logit", "alti-logit"):
            assert r["metrics"][m]["rank"] == c["metrics"][m]["rank"]
            assert r["metrics"][m]["dot"] == pytest.approx(c["metrics"][m]["dot"], abs=1e-4)
    assert [r["correct"] for r in recs] == [True, False, True, True, True, True, False, True]


@pytest.mark.slow
def test_docs_python_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "evaluation.md").read_text(), flags=re.DOTALL)
    assert blocks
    for code in blocks:
        exec(compile(code, "evaluation.md", "exec"), {})  # noqa: S102 (the docs example, as tests/test_docs.py does)
