"""Knowledge neurons refined across paraphrases: the kept set is the prompts' coarse sets filtered by how many
prompts share them; one prompt gives knowledge_neurons' own set and probabilities; the edits match a hand-made
edit of the same units."""

import pytest

from lenscope.errors import InputError
from lenscope.interventions import knowledge_neurons, refined_knowledge_neurons
from lenscope.interventions.neurons import _edit_probs
from lenscope.models.loading.load import encode, resolve_token

from ..conftest import get_model
from ..tolerances import assert_same_computation, assert_same_ints

PROMPTS = ["The capital of France is", "France has its capital in the city of", "The French capital is"]


def _sets(lm, steps):
    return [{tuple(x) for x in knowledge_neurons(lm, p, " capital", steps=steps).neurons.tolist()} for p in PROMPTS]


def test_kept_set_is_shared_coarse_neurons():
    lm = get_model("tiny:llama")
    steps = 4
    sets = _sets(lm, steps)
    for share in (1 / 3, 2 / 3, 1.0):
        r = refined_knowledge_neurons(lm, PROMPTS, " capital", share=share, steps=steps)
        want = {n for n in set().union(*sets) if sum(n in s for s in sets) >= share * len(sets) - 1e-9}
        assert {tuple(x) for x in r.neurons.tolist()} == want
        assert r.coarse_sizes == [len(s) for s in sets]
        for n, c in zip(r.neurons.tolist(), r.counts.tolist()):
            assert c == sum(tuple(n) in s for s in sets)
        assert r.counts.tolist() == sorted(r.counts.tolist(), reverse=True)
        ctrl = {tuple(x) for x in r.control.tolist()}
        assert len(ctrl) == len(r.neurons) and not ctrl & set().union(*sets)
        assert sorted(r.control[:, 0].tolist()) == sorted(r.neurons[:, 0].tolist())


def test_one_prompt_equals_knowledge_neurons_and_hand_edits():
    lm = get_model("tiny:llama")
    kn = knowledge_neurons(lm, PROMPTS[0], " capital", steps=4)
    r = refined_knowledge_neurons(lm, PROMPTS[:1], " capital", share=1.0, steps=4)
    assert {tuple(x) for x in r.neurons.tolist()} == {tuple(x) for x in kn.neurons.tolist()}
    assert float(r.p_base[0]) == pytest.approx(kn.p_base, abs=1e-6)
    assert float(r.p_suppressed[0]) == pytest.approx(kn.p_suppressed, abs=1e-6)
    assert float(r.p_amplified[0]) == pytest.approx(kn.p_amplified, abs=1e-6)
    ids = encode(lm, PROMPTS[0])
    tid = resolve_token(lm, " capital")
    cs, ca = _edit_probs(lm, ids, tid, ids.numel() - 1, [r.control, r.control], [0.0, 2.0])
    assert float(r.p_control_suppressed[0]) == pytest.approx(cs, abs=1e-6)
    assert float(r.p_control_amplified[0]) == pytest.approx(ca, abs=1e-6)


def test_files_and_errors(tmp_path):
    lm = get_model("tiny:llama")
    r = refined_knowledge_neurons(lm, PROMPTS[:2], " capital", share=0.5, steps=2)
    from lenscope.interventions import RefinedNeurons

    back = RefinedNeurons.load(r.save(tmp_path / "r.safetensors"))
    assert_same_ints(back.neurons, r.neurons)
    assert back.prompts == r.prompts
    assert_same_computation(r.to_dict()["share"], 0.5, why="the option, copied")
    assert "RefinedNeurons(" in repr(r)
    with pytest.raises(InputError):
        refined_knowledge_neurons(lm, [], " capital")
    with pytest.raises(InputError):
        refined_knowledge_neurons(lm, PROMPTS, " capital", share=0)
