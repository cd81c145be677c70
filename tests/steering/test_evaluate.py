"""The steering evaluation: the batched sweep against one steered forward pass per (input, layer, multiplier), the
statistics against their definitions, the damage against a brute-force loss and KL, the JSON layout, the files,
and the refusals."""

import json

import numpy as np
import pytest
import torch

from lenscope.data.steering import read_steering_inputs
from lenscope.errors import InputError
from lenscope.steering import SteeringEvaluation, evaluate_steering, steered_logits
from lenscope.steering.evaluate import fit_slopes

from ..conftest import get_model
from ..tolerances import assert_same_computation
from .helpers import INPUTS, direction

# Rows of a batch against the same rows run alone: float32 logits of O(1..10) summed in another order; 1e-4 absolute
# is well above that rounding (about 1e-6) and well below the effects measured (1e-2 and more).
ATOL = 1e-4
LAYER_KEYS = {"multipliers", "mean_effect", "effect_ci", "steerable_fraction", "anti_steerable_fraction",
              "unmoved_fraction", "fraction_ci", "wrong_way_fraction", "mean_slope", "mean_slope_ci", "delta_loss",
              "kl", "slopes", "slope_ci", "effects"}


def _measure(lm, logits, a, b):
    tok = lm.tokenizer
    return float(logits[-1, tok(a)["input_ids"][0]] - logits[-1, tok(b)["input_ids"][0]])


def test_sweep_is_one_forward_per_setting(tiny_decoder):
    lm = tiny_decoder
    d = direction(lm, 0)
    layers = list(range(lm.anatomy.n_layers))
    mults = [-3.0, 0.0, 1.5, 4.0]
    ev = evaluate_steering(lm, d, INPUTS, mults, layers, damage_data=None, bootstrap=50, max_tokens=40)
    assert ev.effects.shape == (len(layers), len(INPUTS), len(mults))
    assert torch.all(ev.effects[:, :, 1] == 0)  # multiplier 0: exactly 0, no run
    for i, (text, a, b) in enumerate(INPUTS):
        base = _measure(lm, steered_logits(lm, text, d, 0.0), a, b)
        assert ev.base_measure[i] == pytest.approx(base, abs=ATOL)
        for k, layer in enumerate(layers):
            for j, alpha in enumerate(mults):
                m = _measure(lm, steered_logits(lm, text, d, alpha, layers=[layer]), a, b)
                assert float(ev.effects[k, i, j]) == pytest.approx(m - base, abs=ATOL), (lm.name, i, layer, alpha)
    assert float(ev.effects.abs().max()) > 100 * ATOL
    # the chunk size changes nothing but rounding
    one = evaluate_steering(lm, d, INPUTS, mults, layers, damage_data=None, bootstrap=50, max_tokens=100_000)
    assert torch.allclose(one.effects, ev.effects, atol=ATOL)


def test_statistics_are_their_definitions():
    lm = get_model("tiny:llama")
    d = direction(lm, 1)
    mults = [-8.0, -4.0, -2.0, 0.0, 2.0, 4.0, 8.0]
    ev = evaluate_steering(lm, d, INPUTS, mults, [0, 1], damage_data=None, bootstrap=400, seed=1, min_effect=0.05)
    E = ev.effects.numpy()
    for k in range(2):
        for i in range(len(INPUTS)):
            assert float(ev.slopes[k, i]) == pytest.approx(np.polyfit(mults, E[k, i], 1)[0], abs=1e-9)
    top = 8.0
    moved = np.abs(ev.slopes.numpy()) * top >= 0.05
    r = ev.to_dict()["layers"]["1"]
    assert set(r) == LAYER_KEYS
    s = ev.slopes[1].numpy()
    assert r["steerable_fraction"] == pytest.approx(np.mean(moved[1] & (s > 0)))
    assert r["anti_steerable_fraction"] == pytest.approx(np.mean(moved[1] & (s < 0)))
    assert r["unmoved_fraction"] == pytest.approx(np.mean(~moved[1]))
    assert r["steerable_fraction"] + r["anti_steerable_fraction"] + r["unmoved_fraction"] == pytest.approx(1)
    assert r["mean_effect"] == pytest.approx(E[1].mean(0).tolist())
    assert r["mean_slope"] == pytest.approx(float(s.mean()))
    assert r["effect_ci"][3] == [0.0, 0.0]
    assert np.allclose(np.array(r["effects"]), E[1], atol=1e-12)
    sign = np.sign(mults)
    assert r["wrong_way_fraction"] == pytest.approx(((E[1] * sign <= -0.05) & (sign != 0)).mean(0).tolist())
    assert r["wrong_way_fraction"][3] == 0
    for (lo, hi), m in zip(r["effect_ci"], r["mean_effect"]):
        assert lo <= hi and lo - 1e-12 <= m <= hi + 1e-12
    for (lo, hi), sl in zip(r["slope_ci"], r["slopes"]):
        assert lo <= sl + 1e-12 and sl <= hi + 1e-12  # residual bootstrap around the fitted line
    again = evaluate_steering(lm, d, INPUTS, mults, [0, 1], damage_data=None, bootstrap=400, seed=1, min_effect=0.05)
    assert_same_computation((again.effect_ci, again.slope_ci), (ev.effect_ci, ev.slope_ci),
                            why="the same seed, the same calls")
    other = evaluate_steering(lm, d, INPUTS, mults, [0, 1], damage_data=None, bootstrap=400, seed=2, min_effect=0.05)
    assert bool((other.effect_ci != ev.effect_ci).any())  # another seed draws other resamples
    # a line through the points: its slope, and a zero-width interval
    alphas = torch.tensor(mults, dtype=torch.float64)
    assert float(fit_slopes(alphas, 0.3 * alphas)) == pytest.approx(0.3)


def test_damage_is_the_loss_and_kl_of_steered_runs(tmp_path):
    lm = get_model("tiny:gpt2")
    d = direction(lm, 1)
    text = tmp_path / "held_out.txt"
    text.write_text(" ".join(["the cat sat on the mat and the dog ran to the man"] * 40))
    mults = [-20.0, 0.0, 30.0]
    ev = evaluate_steering(lm, d, INPUTS[:2], mults, [0, 1], damage_data=str(text), damage_tokens=96,
                           damage_seq_len=32, bootstrap=20)
    assert ev.damage["data"] == str(text) and ev.damage["tokens"] == 96 and ev.damage["sequences"] == 3
    from lenscope.data.text import token_sequences

    seqs = token_sequences(lm, text.read_text(), 32, max_tokens=96)
    with torch.no_grad():
        base = torch.log_softmax(lm.model(seqs).logits.double(), -1)
    tgt = seqs[:, 1:]
    base_loss = float(-base[:, :-1].gather(2, tgt[..., None]).mean())
    assert ev.damage["base_loss"] == pytest.approx(base_loss, abs=1e-5)
    for k, layer in enumerate([0, 1]):
        for j, alpha in enumerate(mults):
            lp = torch.stack([torch.log_softmax(steered_logits(lm, s, d, alpha, layers=[layer]).double(), -1)
                              for s in seqs])
            loss = float(-lp[:, :-1].gather(2, tgt[..., None]).mean())
            kl = float((base.exp() * (base - lp)).sum(-1).mean())
            assert float(ev.delta_loss[k, j]) == pytest.approx(loss - base_loss, abs=1e-5)
            assert float(ev.kl[k, j]) == pytest.approx(kl, abs=1e-5)
    assert torch.all(ev.delta_loss[:, 1] == 0) and torch.all(ev.kl[:, 1] == 0)
    assert float(ev.kl.max()) > 1e-3


def test_no_held_out_text_is_said(monkeypatch):
    import lenscope.data.shared as shared

    lm = get_model("tiny:llama")
    monkeypatch.setattr(shared, "shared_file", lambda rel: None)
    ev = evaluate_steering(lm, direction(lm), INPUTS[:3], [0, 2], bootstrap=10)
    r = ev.to_dict()
    assert r["layers"]["1"]["delta_loss"] is None and r["layers"]["1"]["kl"] is None
    assert r["damage"]["data"] is None and "no held-out text" in r["damage"]["note"]
    assert any("no held-out text" in n for n in r["notes"])


def test_json_files_frame_plots_page(tmp_path):
    lm = get_model("tiny:qwen2")
    ev = evaluate_steering(lm, direction(lm), INPUTS, [-2, 0, 2], [0, 1], damage_tokens=64, damage_seq_len=32,
                           bootstrap=30)
    d = ev.to_dict()
    assert set(d["layers"]) == {"0", "1"} and d["n_inputs"] == len(INPUTS) and d["multipliers"] == [-2.0, 0.0, 2.0]
    assert_same_computation(json.loads(json.dumps(d)), d, why="written as JSON and read back")
    assert [x["row"] for x in d["inputs"]] == list(range(1, len(INPUTS) + 1))
    e2 = SteeringEvaluation.load(ev.save(tmp_path / "ev.safetensors"))
    assert_same_computation(e2.to_dict(), d, why="saved and read back")
    df = ev.to_frame()
    assert len(df) == 2 * len(INPUTS) * 3 and list(df.columns)[:5] == ["layer", "input", "row", "text", "multiplier"]
    for kind in ("effect", "damage", "slopes"):
        assert ev.plot(kind) is not None
    page = ev.to_html(tmp_path / "p.html")
    assert "lenscope-data" in page and "LS.sections.steering" in page and (tmp_path / "p.html").is_file()
    # in a notebook (and lenscope.show): the same view with the same data, on the same report page
    from lenscope.viz import notebook

    def data(p):
        return json.loads(p.split('id="lenscope-data">')[1].split("</script>")[0])["sections"]

    framed = ev._repr_html_()
    assert framed.startswith('<div class="lenscope-view"><iframe') and 'sandbox="allow-scripts"' in framed
    assert_same_computation(data(notebook.view(ev).page), data(page), why="one view of the same result")


def test_bad_inputs(tmp_path):
    lm = get_model("tiny:llama")
    d = direction(lm)
    with pytest.raises(InputError, match=r"row 2: answer_positive: ' catastrophe' is not exactly one token"):
        evaluate_steering(lm, d, [INPUTS[0], ("a dog is", " catastrophe", " a")], damage_data=None)
    with pytest.raises(InputError, match="row 1: answer_positive and answer_negative are the same token"):
        evaluate_steering(lm, d, [("a dog", " a", "#" + str(lm.tokenizer(" a")["input_ids"][0]))], damage_data=None)
    for mults, msg in (([1, 1], "repeated"), ([2], "at least two"), (["x", 1], "numbers"), ([0, float("nan")],
                                                                                              "finite")):
        with pytest.raises(InputError, match=msg):
            evaluate_steering(lm, d, INPUTS, mults, damage_data=None)
    with pytest.raises(InputError, match="built on"):
        evaluate_steering(get_model("tiny:gpt2"), d, INPUTS, damage_data=None)
    p = tmp_path / "in.csv"
    p.write_text("text,answer_positive,answer_negative\nthe cat, the, a\n,x,y\n")
    with pytest.raises(InputError, match="row 2: the 'text' field is empty"):
        read_steering_inputs(p)
    p.write_text("text,answer_positive,answer_negative\nthe cat, the, the\n")
    with pytest.raises(InputError, match="row 1: answer_positive and answer_negative are the same"):
        read_steering_inputs(p)
    p.write_text("text,answer_positive\nthe cat, the\n")
    with pytest.raises(InputError, match="no column 'answer_negative'"):
        read_steering_inputs(p)
