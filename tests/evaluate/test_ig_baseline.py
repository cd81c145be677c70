"""Integrated gradients from the zero, pad and mean baselines: completeness, the one implementation shared by
``lenscope.explain`` and the evaluation, and what the evaluation records and summarises."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

import lenscope
from lenscope.attribution.baselines import ig_baseline, integrated_gradients_rows
from lenscope.data.datasets import Example
from lenscope.errors import InputError
from lenscope.evaluate.alignment import evaluate_examples, read_records, run_alignment

from ..conftest import get_model
from ..tolerances import assert_same_computation
from .test_alignment import DATA

TEXT = "The keys to the cabinet"


@pytest.mark.parametrize("baseline", ["zero", "pad", "mean"])
def test_completeness_holds_for_every_baseline(baseline):
    """tiny:gpt2 (LayerNorm with biases, smooth along every path): with 16 Gauss-Legendre nodes the scores sum to
    f(x) - f(baseline) within 1e-4 relative (measured: 1e-6 to 3e-6)."""
    lm = get_model("tiny:gpt2")
    r = lenscope.explain(lm, TEXT, 5, 7, method="ig", steps=16, baseline=baseline)
    delta = r.info["f_input"] - r.info["f_baseline"]
    assert r.info["baseline"] == baseline
    assert float(r.scores.sum()) == pytest.approx(delta, rel=1e-4, abs=1e-7)
    assert r.info["completeness_error"] < 1e-4
    assert r.info["completeness_abs"] == pytest.approx(abs(r.info["sum_attributions"] - delta), abs=1e-12)
    assert "note" not in r.info


def test_mean_baseline_completeness_on_llama_where_zero_fails():
    """RMSNorm without biases (tiny:llama): the path from zero is too nonlinear near 0 (documented), the path
    from the mean embedding is not: 64 nodes give a relative error below 1e-4 (measured 3e-6)."""
    lm = get_model("tiny:llama")
    r = lenscope.explain(lm, TEXT, 5, 7, method="ig", steps=64, baseline="mean")
    assert r.info["completeness_error"] < 1e-4


def test_pad_and_mean_change_the_scores():
    lm = get_model("tiny:gpt2")
    zero = lenscope.explain(lm, TEXT, 5, 7, method="ig", steps=8)
    assert zero.info["baseline"] == "zero"
    assert_same_computation(zero.scores, lenscope.explain(lm, TEXT, 5, 7, method="ig", steps=8, baseline="zero").scores,
                            why="the same call: the zero baseline is the default")
    for b in ("pad", "mean"):
        other = lenscope.explain(lm, TEXT, 5, 7, method="ig", steps=8, baseline=b)
        assert (other.scores - zero.scores).abs().max() > 1e-4, b
        assert other.info["f_baseline"] != pytest.approx(zero.info["f_baseline"], abs=1e-6)
    # the pad baseline is the pad token's input embedding, the mean one the mean over the embedding matrix
    emb = lm.model.get_input_embeddings()
    pad, info = ig_baseline(lm, "pad")
    assert info["baseline_token_id"] == lm.tokenizer.pad_token_id
    torch.testing.assert_close(pad, emb.weight[lm.tokenizer.pad_token_id].float())
    torch.testing.assert_close(ig_baseline(lm, "mean")[0], emb.weight.float().mean(0), atol=1e-6, rtol=1e-5)


def test_batched_rows_are_the_single_example_method():
    lm = get_model("tiny:qwen2")
    token_ids = lenscope.models.loading.load.token_ids
    ids = torch.tensor([token_ids(lm, t).tolist()[:5] for t in [TEXT, "A dog with the old bones"]])
    t, f = torch.tensor([5, 7]), torch.tensor([9, 4])
    for b in ("zero", "mean"):
        got = integrated_gradients_rows(lm, ids, t, f, steps=4, max_tokens=12, baseline=b, last_only=True)
        for k in range(2):
            ref = lenscope.explain(lm, ids[k].tolist(), int(t[k]), int(f[k]), method="ig", steps=4, baseline=b)
            torch.testing.assert_close(got["ig"][k], ref.scores, atol=1e-5, rtol=1e-4)
            assert float(got["f_baseline"][k]) == pytest.approx(ref.info["f_baseline"], abs=1e-5)


def test_no_pad_nor_unk_token_is_a_clear_error():
    lm = get_model("tiny:gpt2")
    bare = SimpleNamespace(model=lm.model, tokenizer=SimpleNamespace(pad_token_id=None, unk_token_id=None),
                           name="bare", anatomy=lm.anatomy)
    with pytest.raises(InputError, match="neither a pad nor an unk token"):
        ig_baseline(bare, "pad")
    with pytest.raises(InputError, match="unknown integrated-gradients baseline"):
        ig_baseline(lm, "ones")
    with pytest.raises(InputError, match="--baseline"):
        run_alignment(lm, [str(DATA / "tiny.csv")], ["ig"], baseline="ones", progress=False)


def test_records_and_summary_report_completeness(tmp_path):
    lm = get_model("tiny:gpt2")
    ex = Example(id="x/0", dataset="x", prefix=TEXT, target="are", foil="is", evidence=("keys",))
    (r,) = evaluate_examples(lm, [ex], ["ig"], ig_steps=16, baseline="mean")
    info = r["info"]
    assert info["ig_baseline"] == "mean" and info["ig_completeness_error"] < 1e-4
    assert info["ig_completeness_abs"] == pytest.approx(abs(sum(r["scores"]["ig"]) - (info["ig_f_input"] -
                                                                                     info["ig_f_baseline"])), abs=1e-5)
    ref = lenscope.explain(lm, TEXT, " are", " is", method="ig", steps=16, baseline="mean")
    assert r["scores"]["ig"] == pytest.approx(ref.scores.tolist(), abs=1e-5)
    # the summary: median and max per dataset; a folder holds one baseline
    s = run_alignment(lm, [str(DATA / "tiny.csv")], ["ig"], ig_steps=4, baseline="pad", out=tmp_path, progress=False)
    c = s.datasets["tiny.csv"]["ig_completeness"]
    assert c["baseline"] == "pad" and c["n"] == 5
    # median and max of the records' own completeness errors, each recomputed from the record's scores
    recs = [r for r in read_records(tmp_path / "records.jsonl").values() if r["skip"] is None]
    ab = [abs(sum(r["scores"]["ig"]) - (r["info"]["ig_f_input"] - r["info"]["ig_f_baseline"])) for r in recs]
    assert [r["info"]["ig_completeness_abs"] for r in recs] == pytest.approx(ab, abs=1e-6)
    rel = [r["info"]["ig_completeness_error"] for r in recs]
    assert len(recs) == 5 and c["median"] == pytest.approx(float(np.median(rel)))
    assert c["max"] == pytest.approx(max(rel)) and c["median_abs"] == pytest.approx(float(np.median(ab)), abs=1e-6)
    assert c["max_abs"] == pytest.approx(max(ab), abs=1e-6)
    assert s.info["baseline"] == "pad" and "completeness error" in (tmp_path / "table.md").read_text()
    with pytest.raises(InputError, match="holds results for"):
        run_alignment(lm, [str(DATA / "tiny.csv")], ["ig"], ig_steps=4, baseline="mean", out=tmp_path,
                      progress=False)
