"""Context attribution on the embedded real models: the invariants hold on real weights, and the
explanations say something sensible about agreement."""

import pytest
import torch

import lenscope
from lenscope.mixing.alti import mixing_matrices

from ..conftest import get_model

KEYS = "The keys to the cabinet"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2", "gemma3-270m"])
def test_real_decoders_invariants(name):
    lm = get_model(name)
    tr = lenscope.trace(lm, KEYS)
    lg = lenscope.explain(lm, KEYS, " are", " is", method="logit", tr=tr)
    al = lenscope.explain(lm, KEYS, " are", " is", method="alti-logit", tr=tr)
    assert lg.invariant_error < 1e-4 and al.invariant_error < 1e-4
    assert lg.info["completeness_error"] < 1e-3 * max(1.0, abs(lg.info["logit"]))
    torch.testing.assert_close(al.layer_scores.sum(-1), lg.layer_scores.sum(-1), atol=1e-3, rtol=1e-4)
    mm = mixing_matrices(lm.anatomy, tr, "alti")
    assert mm.completeness_error < 1e-4 and mm.row_sum_error < 1e-5 and mm.degenerate_rows == 0
    assert (mm.rollout >= 0).all()


@pytest.mark.slow
def test_smollm2_agreement_points_at_the_subject():
    """" are" vs " is" after "The keys to the cabinet": the plural subject " keys" is what the Logit
    explanation credits most, and the model prefers " are"."""
    lm = get_model("smollm2")
    e = lenscope.explain(lm, KEYS, " are", " is", method="logit")
    assert e.info["logit"] > 0
    assert e.tokens[int(e.scores.argmax())] == " keys"


@pytest.mark.slow
def test_minilm_alti_and_value_zeroing():
    lm = get_model("minilm")
    text = "The keys to the cabinet are on the table."
    tr = lenscope.trace(lm, text)
    for method in ("alti", "value-zeroing"):
        mm = mixing_matrices(lm.anatomy, tr, method)
        assert mm.row_sum_error < 1e-5 and mm.completeness_error < 1e-4
        assert (mm.contributions.triu(1) > 0).any()  # bidirectional
    with pytest.raises(lenscope.NotApplicableError, match="language-model head"):
        lenscope.explain(lm, text, " the", method="logit")
