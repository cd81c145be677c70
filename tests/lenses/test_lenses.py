"""Logit and tuned lens: decoding, the KL objective, training, resuming, files, evaluation."""

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lenscope
from lenscope.lenses import (
    LogitLens,
    TrainSettings,
    TunedLens,
    decode,
    evaluate_lens,
    split_text,
    token_sequences,
    train_tuned_lens,
)
from lenscope.lenses.evaluate import prediction_depth
from lenscope.lenses.training.objective import chunks, kl_backward
from lenscope.models.runtime.trace import residual_states
from tests.conftest import get_model
from tests.tolerances import assert_close_nested, assert_same_computation, kl_tol

TEXT = ("When Mary and John went to the store, John gave a drink to Mary. The capital of France is Paris. "
        "The keys to the cabinet are on the table. ") * 6


def sequences(lm, n_tokens=None, seq_len=32):
    return token_sequences(lm, TEXT, seq_len, max_tokens=n_tokens)


def test_logit_lens_output_state_is_the_model(tiny):
    lm = tiny
    ids = sequences(lm)[:2]
    cap = residual_states(lm, ids)
    out = LogitLens(lm.anatomy).logits(cap["states"][-1], lm.anatomy.n_layers)
    assert torch.allclose(out, cap["logits"], atol=1e-4)


def test_each_state_uses_its_own_norm_statistics():
    lm = get_model("tiny:llama")
    cap = residual_states(lm, sequences(lm)[:1])
    h = cap["states"][1, 0]  # (pos, d)
    norm = lm.anatomy.final_norm
    by_hand = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight) @ lm.anatomy.unembed.W_U
    assert torch.allclose(LogitLens(lm.anatomy).logits(h, 1), by_hand, atol=1e-4)
    # not the last state's scale
    last_scale = norm.scale(cap["states"][-1, 0])
    wrong = (h * last_scale[:, None] * norm.weight) @ lm.anatomy.unembed.W_U
    assert not torch.allclose(by_hand, wrong, atol=1e-3)


def test_tuned_lens_starts_as_identity_and_batches_like_single_layers():
    lm = get_model("tiny:gpt2")
    lens = TunedLens(lm.anatomy)
    h = torch.randn(lm.anatomy.n_layers + 1, 5, lm.anatomy.d_model)
    assert_same_computation(lens.transform_all(h), h, why="an identity lens: h + h @ 0 + 0 is h")
    with torch.no_grad():
        lens.A.normal_(0, 0.1)
        lens.b.normal_(0, 0.1)
    batched = lens.transform_all(h)
    for i in range(h.shape[0]):
        assert torch.allclose(batched[i], lens.transform(h[i], i), atol=1e-5)
    assert_same_computation(batched[-1], h[-1], why="the output state, copied")  # the output state is never translated


def _brute_kl(lm, lens, states, final_logits):
    logp = torch.log_softmax(final_logits, -1)
    kls = []
    for i in range(states.shape[0]):
        logq = torch.log_softmax(decode(lm.anatomy, lens.transform(states[i], i)), -1)
        kls.append((logp.exp() * (logp - logq)).sum(-1).mean())
    return torch.stack(kls).mean()


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma3", "bert"])
def test_kl_objective_and_gradient_match_brute_force(family):
    lm = get_model(f"tiny:{family}")
    cap = residual_states(lm, sequences(lm)[:2])
    states = cap["states"][: lm.anatomy.n_layers].flatten(1, 2)
    final = cap["logits"].flatten(0, 1)
    lens = TunedLens(lm.anatomy)
    with torch.no_grad():
        lens.A.normal_(0, 0.05)
        lens.b.normal_(0, 0.5)
    ref = TunedLens(lm.anatomy)
    ref.load_state_dict(lens.state_dict())
    brute = _brute_kl(lm, ref, states, final)
    brute.backward()
    ours = kl_backward(lm, lens, states, final, bf16=False)
    assert ours == pytest.approx(brute.item(), rel=1e-4, abs=1e-6)
    assert torch.allclose(lens.A.grad, ref.A.grad, rtol=1e-3, atol=1e-6)
    assert torch.allclose(lens.b.grad, ref.b.grad, rtol=1e-3, atol=1e-6)
    lens.zero_grad()
    approx = kl_backward(lm, lens, states, final, bf16=True)  # the fast path stays close
    assert approx == pytest.approx(brute.item(), rel=0.05, abs=1e-3)


@settings(max_examples=30, deadline=None)
@given(n_states=st.integers(1, 40), n_tokens=st.integers(1, 3000), vocab=st.integers(10, 300_000),
       budget=st.sampled_from([1e6, 1e8, 1.5e9]))
def test_chunks_cover_the_grid_once(n_states, n_tokens, vocab, budget):
    seen = torch.zeros(n_states, n_tokens, dtype=torch.int32)
    for ss, ts in chunks(n_states, n_tokens, vocab, budget):
        seen[ss, ts] += 1
    assert bool((seen == 1).all())


@pytest.mark.parametrize("family", ["gpt2", "gemma3"])
def test_training_beats_the_logit_lens_on_held_out_text(family):
    lm = get_model(f"tiny:{family}")
    train = token_sequences(lm, split_text(TEXT * 4, "train"), 32)
    held = token_sequences(lm, split_text(TEXT * 4, "eval"), 32)
    lens = train_tuned_lens(lm, train, TrainSettings(tokens=4096, seq_len=32, batch_size=4, lr=1e-2), progress=False)
    tuned = evaluate_lens(lm, lens, held, progress=False)
    logit = evaluate_lens(lm, LogitLens(lm.anatomy), held, progress=False)
    assert tuned.mean_kl < 0.8 * logit.mean_kl
    assert all(float(t) < float(g) for t, g in zip(tuned.kl[:-1], logit.kl[:-1]))
    # the output state is read as the model reads it: a KL of 0 but for float32 rounding (tests/tolerances.py)
    with torch.no_grad():
        z_max = float(lm.model(input_ids=held).logits.abs().max())
    assert float(tuned.kl[-1]) == pytest.approx(0.0, abs=kl_tol(lm.anatomy.vocab_size, z_max))
    info = lens.training_info
    assert info["steps"] == 32 and info["complete"] and info["history"][-1][1] < info["history"][0][1]


def test_keep_best_never_ends_worse_than_the_identity_on_validation():
    """A learning rate far too high wrecks some translators; per-state selection must fall back to the best
    validation point (the identity at worst), and the recorded validation KLs must be the lens's real ones."""
    from lenscope.lenses.training.selection import BestPerState

    lm = get_model("tiny:gpt2")
    train = token_sequences(lm, TEXT * 2, 32)
    s = TrainSettings(tokens=1024, seq_len=32, batch_size=2, lr=2.0, validation_tokens=96, validate_every=4,
                      init="identity")  # (the least-squares start: tests/lenses/training/test_warmstart.py)
    last = train_tuned_lens(lm, train, TrainSettings(**{**s.__dict__, "keep_best": False}), progress=False)
    best = train_tuned_lens(lm, train, s, progress=False)
    sel = best.training_info["selection"]
    ident = torch.tensor(sel["validation_kl_identity"])
    val = BestPerState(lm, best, train[-3:], bf16=True, backoff=s.backoff)
    assert torch.allclose(val.state_kl(best), torch.tensor(sel["validation_kl"]), atol=1e-3)
    assert bool((torch.tensor(sel["validation_kl"]) <= ident + 1e-6).all())
    assert bool((val.state_kl(last) > ident).any())  # without selection, this lr does make some state worse
    assert min(sel["step_size_factor"]) < 1.0  # ... and with it, those states backed off
    for i, step in enumerate(sel["selected_step"]):
        if step == 0:
            assert not best.A[i].any() and not best.b[i].any()


@pytest.mark.parametrize("patience", [1, 2])
def test_a_state_that_gets_worse_goes_back_and_then_backs_off(patience):
    from lenscope.lenses.training.selection import BestPerState

    lm = get_model("tiny:llama")
    lens = TunedLens(lm.anatomy)
    opt = torch.optim.AdamW([lens.A, lens.b])
    sel = BestPerState(lm, lens, sequences(lm)[:2], bf16=False, backoff=0.5, patience=patience)
    sel.update(lens, opt, 0)
    assert_same_computation(sel.kl, sel.identity_kl, why="the identity lens's own KL, kept as its best")
    assert bool((sel.kl > 0).all())
    g = torch.Generator().manual_seed(0)
    for check in (1, 2):
        with torch.no_grad():  # wreck state 0's translator, nudge nothing else
            lens.A[0] = torch.randn(lens.A.shape[1:], generator=g) * 5
        sel.update(lens, opt, check)
        assert not lens.A[0].any()  # went back to its best: the identity
        expected = 0.5 ** (check // patience)
        assert_same_computation(float(sel.lr_scale[0]), expected, why="halvings: powers of two, exact")
    assert int(sel.step[0]) == 0


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_resume_gives_the_same_result(tmp_path, optimizer):
    lm = get_model("tiny:llama")
    seqs = sequences(lm, seq_len=32)
    s = TrainSettings(tokens=8 * 2 * 32, seq_len=32, batch_size=2, checkpoint_every=3, optimizer=optimizer,
                      lr=1e-2 if optimizer == "adam" else 0.5, validation_tokens=64, validate_every=2)
    straight = train_tuned_lens(lm, seqs, s, progress=False)
    part = train_tuned_lens(lm, seqs, s, out=tmp_path, progress=False, max_steps=5)  # "interrupted"
    assert part.training_info["steps"] == 5 and not (tmp_path / "config.json").exists()
    resumed = train_tuned_lens(lm, seqs, s, out=tmp_path, resume=True, progress=False)
    assert resumed.training_info["steps"] == 8
    assert torch.allclose(resumed.A, straight.A, atol=1e-6) and torch.allclose(resumed.b, straight.b, atol=1e-6)
    # the validation KLs, kept to 4 decimals, of weights within 1e-6: a value at a rounding boundary may land one
    # step (1e-4) to either side
    assert_close_nested(resumed.training_info["selection"], straight.training_info["selection"], 1e-4)
    assert float(straight.A.abs().max()) > 1e-3  # trained: AdamW moves each entry by about its rate per step
    assert (tmp_path / "config.json").exists()
    with pytest.raises(lenscope.InputError, match="settings differ"):
        train_tuned_lens(lm, seqs, TrainSettings(tokens=999, seq_len=32, batch_size=2, checkpoint_every=3),
                         out=tmp_path, resume=True, progress=False)
    with pytest.raises(lenscope.InputError, match="no readable checkpoint"):
        train_tuned_lens(lm, seqs, s, out=tmp_path / "nothing", resume=True, progress=False)


def test_lens_files_round_trip_and_refuse_the_wrong_model(tmp_path):
    lm = get_model("tiny:qwen2")
    lens = TunedLens(lm.anatomy, model_name=lm.name)
    with torch.no_grad():
        lens.A.normal_()
        lens.b.normal_()
    lens.save(tmp_path / "lens")
    cfg = json.loads((tmp_path / "lens" / "config.json").read_text())
    assert cfg["model"] == "tiny:qwen2" and cfg["fingerprint"] and cfg["n_layers"] == 2
    back = TunedLens.load(tmp_path / "lens", lm)
    assert_same_computation(back.A, lens.A, why="saved and read back")
    assert_same_computation(back.b, lens.b, why="saved and read back")
    with pytest.raises(lenscope.InputError, match="trained on 'tiny:qwen2'"):
        TunedLens.load(tmp_path / "lens", get_model("tiny:llama"))
    (tmp_path / "lens" / "params.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(lenscope.InputError, match="cannot read"):
        TunedLens.load(tmp_path / "lens", lm)
    with pytest.raises(lenscope.InputError, match="not found"):
        TunedLens.load(tmp_path / "missing", lm)


@pytest.mark.parametrize("prefix", ["", "layer_translators."])
def test_reads_tuned_lens_library_files(tmp_path, prefix):
    lm = get_model("tiny:gpt2")
    L, d = lm.anatomy.n_layers, lm.anatomy.d_model
    g = torch.Generator().manual_seed(1)
    sd = {}
    for i in range(L):
        sd[f"{prefix}{i}.weight"] = torch.randn(d, d, generator=g)
        sd[f"{prefix}{i}.bias"] = torch.randn(d, generator=g)
    torch.save(sd, tmp_path / "params.pt")
    (tmp_path / "config.json").write_text(json.dumps(
        {"base_model_name_or_path": "gpt2", "d_model": d, "num_hidden_layers": L, "bias": True,
         "lens_type": "linear_tuned_lens"}))
    lens = TunedLens.load(tmp_path, lm)
    h = torch.randn(3, d)
    # the library's translator: h + Linear(h) = h + h W^T + b
    expected = h + h @ sd[f"{prefix}1.weight"].T + sd[f"{prefix}1.bias"]
    assert torch.allclose(lens.transform(h, 1), expected, atol=1e-5)
    # a pickle with code in it is refused (weights_only)
    import pickle

    class Evil:
        def __reduce__(self):
            return (print, ("should not run",))

    (tmp_path / "params.pt").write_bytes(pickle.dumps({f"{prefix}0.weight": Evil()}))
    with pytest.raises(lenscope.InputError, match="cannot read"):
        TunedLens.load(tmp_path, lm)


def test_prediction_depth_by_hand():
    agree = torch.tensor([[0, 1, 1], [1, 0, 1], [1, 1, 1], [1, 1, 1]])  # (state, tokens)
    # token 0: agrees from state 1 on -> depth 1; token 1: from state 2; token 2: from state 0
    assert prediction_depth(agree).tolist() == [1, 2, 0]


def test_evaluation_metrics_by_hand():
    lm = get_model("tiny:llama")
    seqs = sequences(lm)[:1]
    ev = evaluate_lens(lm, LogitLens(lm.anatomy), seqs, progress=False)
    cap = residual_states(lm, seqs)
    h = cap["states"][1, 0, :-1]
    logq = torch.log_softmax(decode(lm.anatomy, h), -1)
    logp = torch.log_softmax(cap["logits"][0, :-1], -1)
    # two float32 KLs by different formulas, each within kl_tol of the exact one (tests/tolerances.py)
    tol = 2 * kl_tol(lm.anatomy.vocab_size, float(cap["logits"].abs().max()))
    assert float(ev.kl[1]) == pytest.approx(float((logp.exp() * (logp - logq)).sum(-1).mean()), abs=tol)
    assert float(ev.ce[1]) == pytest.approx(float(-logq.gather(-1, seqs[0, 1:, None]).mean()), rel=1e-4)
    assert float(ev.entropy[1]) == pytest.approx(float(-(logq.exp() * logq).sum(-1).mean()), rel=1e-4)
    assert_same_computation(float(ev.top1[-1]), 1.0, why="every token agrees: a mean of ones")
    assert ev.n_tokens == seqs.shape[1] - 1
    assert ev.depth_hist.sum() == ev.n_tokens
    d = ev.to_dict()
    assert {"layer", "kl", "ce", "entropy", "top1_agreement"} <= set(d["layers"][0]) and "mean_kl" in d
    ev.ce[0] = 500.0  # gemma3-270m's logit lens at layer 0: perplexity overflows, and JSON has no infinity
    strict = json.loads(ev.to_json(), parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    assert strict["layers"][0]["perplexity"] is None
    assert strict["layers"][1]["perplexity"] == pytest.approx(math.exp(float(ev.ce[1])), rel=1e-5)


def test_encoder_sequences_keep_special_tokens_and_minilm_cannot_be_decoded():
    lm = get_model("tiny:bert")
    seqs = token_sequences(lm, TEXT, 16)
    tok = lm.tokenizer
    assert seqs[0, 0] == tok.convert_tokens_to_ids("<s>") and seqs[0, -1] == tok.convert_tokens_to_ids("</s>")
    with pytest.raises(lenscope.InputError, match="fewer than one sequence"):
        token_sequences(lm, "short", 64)


@pytest.mark.slow
def test_minilm_has_no_head():
    lm = get_model("minilm")
    with pytest.raises(lenscope.NotApplicableError, match="no language-model head"):
        decode(lm.anatomy, torch.zeros(1, lm.anatomy.d_model))
