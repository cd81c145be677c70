"""The batched methods compute, row by row, what ``lenscope.explain`` computes for one example, on every
decoder family; records carry the right numbers."""

import pytest
import torch

import lenscope
from lenscope.attribution.baselines import erasure_rows, gradient_rows, integrated_gradients_rows
from lenscope.attribution.explain import explain
from lenscope.data.datasets import Example
from lenscope.evaluate.alignment import evaluate_example, evaluate_examples
from lenscope.evaluate.metrics import alignment
from lenscope.models.runtime.trace import batch_traces

from ..conftest import DECODERS, get_model, tiny_with_layers
from ..tolerances import alignment_rounding, assert_close_nested

TEXTS = ["The keys to the cabinet", "A dog with the old bones", "The cat sat on the mat"]


def _same_length_ids(lm, n=None):
    rows = [lenscope.models.loading.load.token_ids(lm, t).tolist() for t in TEXTS]
    n = n or min(len(r) for r in rows)
    return torch.tensor([r[:n] for r in rows])


@pytest.mark.parametrize("family", DECODERS)
def test_batched_rows_equal_single_example_methods(family):
    lm = tiny_with_layers(family, 2)
    ids = _same_length_ids(lm, 6)
    t, f = torch.tensor([5, 7, 9]), torch.tensor([11, 13, 4])
    trs = batch_traces(lm, ids)
    g = gradient_rows(lm, ids, t, f, last_only=True)
    ig = integrated_gradients_rows(lm, ids, t, f, steps=4, max_tokens=20, last_only=True)  # several chunks
    er = erasure_rows(lm, ids, t, f, max_tokens=12, last_only=True)
    for b in range(ids.shape[0]):
        row = ids[b].tolist()
        ref_tr = lenscope.trace(lm, row)
        torch.testing.assert_close(trs[b].resid_post, ref_tr.resid_post, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(trs[b].pattern, ref_tr.pattern, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(trs[b].logits[-1], ref_tr.logits[-1], atol=1e-5, rtol=1e-5)
        assert torch.isnan(trs[b].logits[:-1]).all()
        for m in ("logit", "alti-logit"):
            got = explain(lm, None, int(t[b]), int(f[b]), method=m, tr=trs[b]).scores
            ref = explain(lm, row, int(t[b]), int(f[b]), method=m).scores
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)
        for m, got in (("grad-norm", g["grad-norm"][b]), ("grad-x-input", g["grad-x-input"][b]),
                       ("erasure", er["erasure"][b])):
            ref = explain(lm, row, int(t[b]), int(f[b]), method=m).scores
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)
        ref = explain(lm, row, int(t[b]), int(f[b]), method="ig", steps=4)
        torch.testing.assert_close(ig["ig"][b], ref.scores, atol=1e-5, rtol=1e-4)
        assert float(ig["completeness_error"][b]) == pytest.approx(ref.info["completeness_error"], rel=1e-2, abs=1e-5)


def test_record_of_one_example():
    lm = get_model("tiny:gpt2")
    ex = Example(id="x/0", dataset="x", prefix="The keys to the cabinet", target="are", foil="is", evidence=("keys",))
    r = evaluate_example(lm, ex, ["logit", "alti-logit", "erasure"])
    assert r["skip"] is None and r["evidence"] == [2, 3] and set(r["metrics"]) == {"logit", "alti-logit", "erasure"}
    ref = explain(lm, ex.prefix, " are", " is", method="logit")
    assert r["scores"]["logit"] == pytest.approx(ref.scores.tolist(), abs=1e-6)
    assert r["logit_diff"] == pytest.approx(ref.info["logit"], abs=1e-5) and r["correct"] == (ref.info["logit"] > 0)
    # another computation of the scores (the records' batched rows): the metrics within their rounding
    assert_close_nested(r["metrics"]["logit"], alignment(ref.scores.tolist(), [2, 3]),
                        alignment_rounding(r["scores"]["logit"], ref.scores, decimals=7))
    # per-layer updates: the attention and MLP updates plus embedding and bias terms add up to the logit
    lay = r["layers"]
    total = sum(lay["attention"]) + sum(lay["mlp"]) + lay["embed"] + lay["bias"]
    assert total == pytest.approx(lay["logit"], abs=1e-4)
    # batching does not change a record's numbers
    other = Example(id="x/1", dataset="x", prefix="The cat sat on the mat", target="is", foil="are", evidence=("cat",))
    both = evaluate_examples(lm, [other, ex], ["logit", "alti-logit", "erasure"])
    for m in r["scores"]:
        assert both[1]["scores"][m] == pytest.approx(r["scores"][m], abs=1e-6)
        tol = alignment_rounding(both[1]["scores"][m], r["scores"][m], r["rankable"], decimals=7)
        assert_close_nested(both[1]["metrics"][m], r["metrics"][m], tol)
    assert set(both[1]["metrics"]) == set(r["metrics"])


def test_encoders_are_refused():
    from lenscope.errors import NotApplicableError

    with pytest.raises(NotApplicableError, match="causal decoder"):
        evaluate_examples(get_model("tiny:bert"), [], ["logit"])
