"""lenscope.generate: the tokens of transformers' generate, and every step's explanation equal to ``explain`` on
that step's prefix, from one pass."""

import pytest
import torch

import lenscope
from lenscope.attribution.explanation import METHODS, ROLLOUT_METHODS
from lenscope.errors import InputError, NotApplicableError
from lenscope.generation import Generation, generate
from lenscope.lenses.depth import token_depths
from lenscope.lenses.lenses import LogitLens
from tests.conftest import get_model
from tests.tolerances import assert_same_computation, assert_same_ints

PROMPT = "the cat sat on the"

# Trace-based methods: the same algebra on the full trace as on the prefix's; the two forward passes differ only
# in float rounding (longer matmuls), so 1e-5 absolute (scores are O(0.01..1) on the tiny models).
# Gradient methods and erasure go through the real model's forward (and backward) pass on a longer sequence:
# float32 rounding of every layer compounds (about 1e-7 per operation, a few hundred in a row), so they are
# compared to 1e-4 relative to the largest score of the step, plus 1e-5 absolute: erasure's scores are differences
# of two logits of size O(1), each rounded on its own (measured: <= 1e-6 on every tiny family).
TRACE_ATOL = 1e-5
TRACE_METHODS = ("logit", "alti-logit", "alti", "value-zeroing")
MODEL_RTOL, MODEL_ATOL = 1e-4, 1e-5


def _foil(g: Generation, i: int, method: str):
    return None if method in ROLLOUT_METHODS else int(g.foil_ids[i])


@pytest.mark.parametrize("foil", ["runner-up", None])
def test_every_step_equals_explain_on_its_prefix(tiny_decoder, foil):
    lm = tiny_decoder
    g = generate(lm, PROMPT, max_new_tokens=3, explain=METHODS, foil=foil, steps=8)
    assert g.methods == list(METHODS)
    assert g.scores.shape == (len(METHODS), g.n_steps, len(g.tokens) - 1)
    for i, p in enumerate(g.positions):
        tok = int(g.ids[p])
        for k, m in enumerate(METHODS):
            opts = {"steps": 8} if m == "ig" else {}
            ex = lenscope.explain(lm, g.ids[:p], tok, None if foil is None else _foil(g, i, m), method=m, **opts)
            got = g.scores[k, i]
            assert torch.all(got[p:] == 0), (m, i)  # nothing at or after the step's position
            scale = float(ex.scores.abs().max())
            tol = TRACE_ATOL if m in TRACE_METHODS else MODEL_RTOL * scale + MODEL_ATOL
            err = float((got[:p] - ex.scores).abs().max())
            assert err <= tol, (lm.name, m, i, err, scale)
            inv = float(g.invariant_error[k, i])
            if ex.invariant_error is None:
                assert inv != inv  # NaN: the method has no such check
            else:  # reported per step, and within the model's tolerance
                assert 0 <= inv <= 1e-3
                assert inv == pytest.approx(ex.invariant_error, abs=1e-5)


def test_greedy_tokens_are_transformers_generate(tiny_decoder):
    lm = tiny_decoder
    g = generate(lm, PROMPT, max_new_tokens=6, explain=())
    ids = lm.tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    ref = lm.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                            pad_token_id=lm.tokenizer.pad_token_id)[0]
    assert g.ids.tolist() == ref.tolist()
    assert g.prompt_len == ids.shape[1]
    # statistics of each step from the trace's logits
    logits = lm.model(g.ids[None]).logits[0, g.prompt_len - 1 : -1].double()
    p = logits.softmax(-1)
    assert torch.allclose(g.prob.double(), p[torch.arange(g.n_steps), g.ids[g.prompt_len:]], atol=1e-5)
    ent = -(p * p.clamp_min(1e-300).log()).sum(-1)
    assert torch.allclose(g.entropy.double(), ent, atol=1e-4)
    top2 = logits.topk(2, -1).indices
    assert_same_ints(g.runner_up, top2[:, 1])  # greedy: the generated token is the top-1


def test_stops_at_eos():
    lm = get_model("tiny:llama")
    g = generate(lm, PROMPT, max_new_tokens=1, explain=())
    eos = int(g.ids[-1])
    lm.model.generation_config.eos_token_id, old = eos, lm.model.generation_config.eos_token_id
    try:
        g2 = generate(lm, PROMPT, max_new_tokens=5, explain=())
    finally:
        lm.model.generation_config.eos_token_id = old
    assert g2.n_steps == 1 and int(g2.ids[-1]) == eos


def test_sampling_is_reproducible_and_leaves_the_global_rng_alone():
    lm = get_model("tiny:gpt2")
    state = torch.random.get_rng_state()
    a = generate(lm, PROMPT, max_new_tokens=8, explain=(), sample=True, seed=3)
    assert_same_ints(torch.random.get_rng_state(), state)
    b = generate(lm, PROMPT, max_new_tokens=8, explain=(), sample=True, seed=3)
    others = [generate(lm, PROMPT, max_new_tokens=8, explain=(), sample=True, seed=s).ids.tolist() for s in (4, 5)]
    assert a.ids.tolist() == b.ids.tolist()
    assert any(o != a.ids.tolist() for o in others)  # the tiny model's distributions are broad
    greedy = generate(lm, PROMPT, max_new_tokens=8, explain=())
    assert a.settings["sample"] and not greedy.settings["sample"]


def test_given_foil_and_the_step_that_generated_it():
    lm = get_model("tiny:llama")
    g = generate(lm, PROMPT, max_new_tokens=4, explain=("logit",))
    first = int(g.ids[g.prompt_len])
    h = generate(lm, PROMPT, max_new_tokens=4, explain=("logit",), foil=f"#{first}")
    same = (h.ids[h.prompt_len:] == first)
    assert bool(same[0])
    assert_same_ints(h.foil_ids[same], h.runner_up[same])  # that step is contrasted with its runner-up
    assert torch.all(h.foil_ids[~same] == first)
    assert h.notes and "runner-up" in h.notes[0]
    d = h.to_dict()
    assert d["generated"][0]["foil"] == {"token": lm.tokenizer.decode([int(h.runner_up[0])]),
                                         "id": int(h.runner_up[0])}


def test_depth_is_the_logit_lens_prediction_depth(tiny_decoder):
    lm = tiny_decoder
    g = generate(lm, PROMPT, max_new_tokens=4, explain=())
    depths, _, top = token_depths(lm, {"logit": LogitLens(lm.anatomy)}, g.ids[None])  # its own forward pass
    assert g.depth.tolist() == depths["logit"][0, g.prompt_len - 1 : -1].tolist()
    assert top[0, g.prompt_len - 1 : -1].tolist() == g.ids[g.prompt_len:].tolist()  # greedy


def test_tuned_lens_depth_is_token_depths_under_that_lens(tmp_path):
    from lenscope.lenses.lenses import TunedLens

    lm = get_model("tiny:gpt2")
    lens = TunedLens(lm.anatomy, model_name=lm.name)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a lens that disagrees with the logit lens
        lens.A.copy_(torch.randn(lens.A.shape, generator=g) * 0.5 / lens.d_model**0.5)
        lens.b.copy_(torch.randn(lens.b.shape, generator=g) * 0.5)
    out = generate(lm, PROMPT, max_new_tokens=5, explain=(), lens=lens)
    depths, _, _ = token_depths(lm, {"tuned": lens}, out.ids[None])
    assert out.tuned_depth.tolist() == depths["tuned"][0, out.prompt_len - 1 : -1].tolist()
    steps = out.to_dict()["generated"]
    assert [s["tuned_depth"] for s in steps] == [None if d < 0 else d for d in out.tuned_depth.tolist()]


def test_result_dict_frame_matrix_and_file(tmp_path):
    lm = get_model("tiny:qwen2")
    g = generate(lm, PROMPT, max_new_tokens=3, explain=("alti-logit", "alti"))
    d = g.to_dict()
    assert set(d) >= {"text", "prompt_tokens", "generated", "model", "prompt", "tokens", "methods", "seconds"}
    assert d["text"] == lm.tokenizer.decode(g.ids[g.prompt_len:]) and d["prompt"] == PROMPT
    assert d["prompt_tokens"] == d["tokens"][: g.prompt_len]
    for i, s in enumerate(d["generated"]):
        assert set(s) == {"position", "token", "id", "prob", "entropy", "runner_up", "depth", "foil", "explanations"}
        assert s["position"] == g.prompt_len + i and s["id"] == int(g.ids[s["position"]])
        assert set(s["runner_up"]) == {"token", "id"} and set(s["foil"]) == {"token", "id"}
        for m in ("alti-logit", "alti"):
            e = s["explanations"][m]
            assert len(e["scores"]) == s["position"] and e["invariant_error"] < 1e-3
        assert sum(s["explanations"]["alti"]["scores"]) == pytest.approx(1, abs=1e-5)  # a rollout row
    only_alti = generate(lm, PROMPT, max_new_tokens=2, explain=("alti",)).to_dict()
    assert all(s["foil"] is None for s in only_alti["generated"])  # no contrastive method asked
    df = g.to_frame()
    assert list(df.columns) == ["step", "position", "token", "source", "source_token", "method", "score"]
    assert len(df) == 2 * sum(g.positions)
    m = g.matrix("alti-logit")
    assert m.shape == (3, len(g.tokens) - 1)
    assert float(m[0, g.prompt_len:].abs().sum()) == 0
    with pytest.raises(InputError, match="not computed"):
        g.matrix("logit")
    g2 = Generation.load(g.save(tmp_path / "g.safetensors"))
    assert_same_computation(g2.to_dict(), d, why="saved and read back")


def test_bad_inputs():
    lm = get_model("tiny:llama")
    with pytest.raises(InputError, match="positive"):
        generate(lm, PROMPT, max_new_tokens=0)
    with pytest.raises(InputError, match="context"):
        generate(lm, PROMPT, max_new_tokens=lm.anatomy.n_ctx)
    with pytest.raises(InputError, match="unknown method"):
        generate(lm, PROMPT, max_new_tokens=2, explain=("nope",))
    with pytest.raises(InputError):
        generate(lm, PROMPT, max_new_tokens=2, foil="cat sat")  # several tokens
    with pytest.raises(InputError, match="chat template"):
        generate(lm, PROMPT, max_new_tokens=2, chat=True)
    with pytest.raises(InputError, match="unknown option"):
        generate(lm, PROMPT, max_new_tokens=2, bogus=1)
    with pytest.raises(InputError, match="sample"):
        generate(lm, PROMPT, max_new_tokens=2, seed=1)
    with pytest.raises(NotApplicableError):
        generate(get_model("tiny:bert"), PROMPT, max_new_tokens=2)


def test_erasure_runs_one_copy_per_source_and_gradients_one_batch(monkeypatch):
    from lenscope.attribution import baselines

    lm = get_model("tiny:llama")
    calls = []
    real = baselines.model_logits

    def counting(lm_, *, input_ids=None, inputs_embeds=None, **kw):
        x = input_ids if input_ids is not None else inputs_embeds
        calls.append(tuple(x.shape[:2]))
        return real(lm_, input_ids=input_ids, inputs_embeds=inputs_embeds, **kw)

    monkeypatch.setattr(baselines, "model_logits", counting)
    g = generate(lm, PROMPT, max_new_tokens=5, explain=("erasure",))
    n = len(g.tokens)
    # the last step reads position n - 2: every token 0..n-2 is erased once, each copy n - 2 tokens long
    assert sum(b for b, _ in calls) == n - 1 and {t for _, t in calls} == {n - 2}
    calls.clear()
    generate(lm, PROMPT, max_new_tokens=5, explain=("grad-x-input", "grad-norm"))
    assert len(calls) == 1 and calls[0][0] == 5  # both gradient methods: one pass, one row per step
