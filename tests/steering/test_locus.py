"""Where a steering vector acts, read by lenscope's own lens trajectory and direct logit attribution on the engine's
steered trace: the parts (with the vector's own direct effect) add up to the model's measure in both runs on every
decoder family, so the differences add up to the change the vector made; the lens reads the model's output at the
last state; the depths are the trajectories'."""

import pytest

from lenscope.lenses.trajectory import prediction_trajectory
from lenscope.models.runtime.trace import trace
from lenscope.models.weights.readout import Readout
from lenscope.steering import SteeringLocus, steered_logits, steering_edits, steering_locus

from ..conftest import get_model
from ..tolerances import assert_same_computation
from .helpers import direction

TEXT, POS, NEG = "the cat sat on the", " the", " a"


def _measure(lm, logits):
    tok = lm.tokenizer
    return float(logits[-1, tok(POS)["input_ids"][0]] - logits[-1, tok(NEG)["input_ids"][0]])


@pytest.mark.parametrize("layer", [0, 1])
def test_parts_add_up_in_both_runs(tiny_decoder, layer):
    lm = tiny_decoder
    d = direction(lm, layer)
    alpha = 3.0
    loc = steering_locus(lm, d, TEXT, POS, NEG, alpha)
    # float32 parts of O(1) logits: their sum matches to 1e-5 (the DLA tests' bound)
    assert float(loc.completeness_error.max()) < 1e-5
    steered = _measure(lm, steered_logits(lm, TEXT, d, alpha))
    plain = _measure(lm, steered_logits(lm, TEXT, d, 0.0))
    readout = Readout.from_anatomy(lm.anatomy)
    if readout.softcap is None:  # the measure is read before any soft-cap (the parts add up to that)
        assert float(loc.measure[1]) == pytest.approx(steered, abs=1e-5)
        assert float(loc.measure[0]) == pytest.approx(plain, abs=1e-5)
    assert float(loc.difference.sum()) == pytest.approx(float(loc.measure[1] - loc.measure[0]), abs=2e-5)
    assert loc.names[-1] == "steering vector" and float(loc.dla[0, -1]) == 0
    assert abs(float(loc.dla[1, -1])) > 0
    # the lens at the last state reads the model's own output
    assert float(loc.lens_measure[1, -1]) == pytest.approx(steered, abs=1e-4)
    # depths and top tokens are the trajectories' of the two traces
    tr = trace(lm, TEXT, edits=steering_edits(d, alpha, len(loc.tokens)))
    traj = prediction_trajectory(lm, tr=tr, k=1)
    assert loc.top_tokens[1] == [row[-1] for row in traj.top_tokens]


def test_result_round_trip_and_plot(tmp_path):
    lm = get_model("tiny:llama")
    loc = steering_locus(lm, direction(lm, 1), TEXT, POS, NEG, -4.0)
    d = loc.to_dict()
    assert set(d) >= {"measure", "depth", "lens_measure", "top_tokens", "components", "completeness_error"}
    assert len(d["lens_measure"]["steered"]) == lm.anatomy.n_layers + 1
    assert_same_computation(SteeringLocus.load(loc.save(tmp_path / "l.safetensors")).to_dict(), d,
                            why="saved and read back")
    assert_same_computation(loc.top(3)[0]["change"], max((c["change"] for c in d["components"]), key=abs),
                            why="the largest change, copied")
    assert loc.plot() is not None
    assert len(loc.to_frame()) == len(loc.names)
    assert_same_computation(loc.difference, loc.dla[1] - loc.dla[0], why="the same subtraction of the same rows")
