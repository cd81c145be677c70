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
    for s in d["generated"]:
        e = s["explanations"]["alti-logit"]
        assert len(e["scores"]) == s["position"] and e["invariant_error"] < 1e-4
        assert 0 < s["prob"] <= 1 and s["entropy"] >= 0 and s["runner_up"]["id"] != s["id"]


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
