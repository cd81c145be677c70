"""eval alignment on the embedded smollm2 and on a handful of shared-data examples; the docs' example runs."""

import re
from pathlib import Path

import pytest

import lenscope
from lenscope.evaluate import evaluate_examples, load_dataset
from lenscope.evaluate.datasets import Example
from lenscope.mixing.study import shared_data_dir

from ..conftest import get_model

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
    lm = get_model("smollm2")
    exs = load_dataset("blimp:determiner_noun_agreement_1", limit=4) + load_dataset("ioi", limit=4)
    recs = evaluate_examples(lm, exs, ["logit", "alti-logit"])
    for ex, r in zip(exs, recs):
        assert r["usable"] and r["skip"] is None
        # the evidence token is the determiner / the indirect object, in the prefix
        assert "".join(r["tokens"][k] for k in r["evidence"]).strip() == ex.evidence[0]
        assert 0 < r["metrics"]["logit"]["rr"] <= 1
    assert sum(r["correct"] for r in recs) >= 6  # smollm2 gets these easy pairs right


@pytest.mark.slow
def test_docs_python_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "evaluation.md").read_text(), flags=re.DOTALL)
    assert blocks
    for code in blocks:
        exec(compile(code, "evaluation.md", "exec"), {})  # noqa: S102 (the docs example, as tests/test_docs.py does)
