"""lenscope.generate on the real smollm2 (an instruction model with a chat template)."""

import pytest
import torch

from lenscope.generation import generate


@pytest.mark.slow
def test_smollm2_greedy_is_transformers_generate_and_explains_each_step(smollm2):
    lm = smollm2
    prompt = "The capital of France is"
    g = generate(lm, prompt, max_new_tokens=6, explain=("alti-logit",))
    ids = lm.tokenizer(prompt, return_tensors="pt")["input_ids"]
    ref = lm.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)[0]
    assert g.ids.tolist() == ref.tolist()
    assert g.text == lm.tokenizer.decode(ref[ids.shape[1]:])
    d = g.to_dict()
    assert [s["id"] for s in d["generated"]] == ref[ids.shape[1]:].tolist()
    # prediction depth: the logit lens's (and a tuned lens's) from the trace equal token_depths' own pass
    from lenscope.lenses.depth import token_depths
    from lenscope.lenses.lenses import LogitLens, TunedLens

    lens = TunedLens(lm.anatomy, model_name=lm.name)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        lens.A.copy_(torch.randn(lens.A.shape, generator=gen) * 0.05 / lens.d_model**0.5)
    t = generate(lm, prompt, max_new_tokens=6, explain=(), lens=lens)
    depths, _, _ = token_depths(lm, {"logit": LogitLens(lm.anatomy), "tuned": lens}, g.ids[None])
    P = g.prompt_len
    assert t.depth.tolist() == g.depth.tolist() == depths["logit"][0, P - 1 : -1].tolist()
    assert t.tuned_depth.tolist() == depths["tuned"][0, P - 1 : -1].tolist()
    assert any(x > 0 for x in g.depth.tolist())  # real depths, not only "never settles"
    # each step's statistics recomputed from the real model's logits (float64 softmax). Both are float32 passes of
    # the same model, so the logits differ by at most verify's LOGIT_TOL (1e-3): a probability then moves by a
    # factor within exp(+-2 LOGIT_TOL), an entropy by at most 2 LOGIT_TOL sum_i p_i |log p_i + H|
    from lenscope.models.runtime.verify import LOGIT_TOL

    logits = lm.model(g.ids[None]).logits[0, g.prompt_len - 1 : -1].double()
    logp = logits.log_softmax(-1)
    p = logp.exp()
    ent = -(p * logp).sum(-1)
    for i, s in enumerate(d["generated"]):
        e = s["explanations"]["alti-logit"]
        assert len(e["scores"]) == s["position"] and e["invariant_error"] < 1e-4
        want = float(p[i, s["id"]])
        assert s["prob"] == pytest.approx(want, rel=2.5 * LOGIT_TOL), (i, s["prob"], want)
        bound = 2 * LOGIT_TOL * float((p[i] * (logp[i] + ent[i]).abs()).sum())
        assert abs(s["entropy"] - float(ent[i])) <= bound + 1e-12, (i, s["entropy"], float(ent[i]), bound)
        top3 = logits[i].topk(3)
        assert s["id"] == int(top3.indices[0])  # greedy
        if float(top3.values[1] - top3.values[2]) > 2 * LOGIT_TOL:  # a runner-up the rounding cannot swap
            assert s["runner_up"]["id"] == int(top3.indices[1])


@pytest.mark.slow
def test_smollm2_chat_applies_the_template(smollm2):
    lm = smollm2
    g = generate(lm, "What is 2+2?", max_new_tokens=4, explain=(), chat=True)
    text = lm.tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True,
                                            tokenize=False)
    prompt_ids = lm.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert g.ids[: g.prompt_len].tolist() == prompt_ids
    assert g.tokens[g.prompt_len - 3 :g.prompt_len] == lm.tokenizer.batch_decode([[i] for i in prompt_ids[-3:]])
    assert "assistant" in "".join(g.tokens[: g.prompt_len])
    ref = lm.model.generate(torch.tensor([prompt_ids]), max_new_tokens=4, do_sample=False)[0]
    assert g.ids.tolist() == ref.tolist()
