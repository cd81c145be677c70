"""Lens training within a time budget, the bfloat16 decision, mid-layer translators (issue 11).

The time budget is tested with an injected clock: every training step "costs" a fixed number of fake
seconds (the test wraps ``kl_backward``), every validation another number, so the number of steps the
trainer plans must follow from those measured costs, never from how fast the test machine is.
"""

import dataclasses
import json
import math

import pytest
import torch

import lenscope
from lenscope.lenses import (
    LogitLens,
    TrainSettings,
    TunedLens,
    decode,
    evaluate_lens,
    evaluate_lenses,
    split_text,
    token_sequences,
    train_tuned_lens,
)
from lenscope.lenses.training import checkpoint as C
from lenscope.lenses.training import objective as O
from lenscope.lenses.training import precision as PR
from lenscope.lenses.training import selection as SEL
from lenscope.lenses.training import train as T
from lenscope.lenses.trajectory import prediction_trajectory
from lenscope.models.runtime.trace import residual_states
from lenscope.training import plan as PL
from tests.conftest import get_model
from tests.tolerances import assert_same_computation

TEXT = ("When Mary and John went to the store, John gave a drink to Mary. The capital of France is Paris. "
        "The keys to the cabinet are on the table. ") * 6


class FakeClock:
    """A clock that only moves when the trainer does work: ``step_s`` per training step, ``val_s`` per validation."""

    def __init__(self, monkeypatch, step_s, val_s=0.0, start=1000.0):
        self.now = start
        self.step_s = step_s  # a number, or a function of the number of steps done so far
        self.val_s = val_s
        self.steps = 0
        real_kl, real_val = T.kl_backward, SEL.BestPerState.state_kl

        def kl_backward(*a, **k):
            self.now += self.step_s(self.steps) if callable(self.step_s) else self.step_s
            self.steps += 1
            return real_kl(*a, **k)

        def state_kl(sel, lens):
            self.now += self.val_s
            return real_val(sel, lens)

        monkeypatch.setattr(T, "kl_backward", kl_backward)
        monkeypatch.setattr(SEL.BestPerState, "state_kl", state_kl)

    def __call__(self) -> float:
        return self.now


def _data(lm):
    return token_sequences(lm, TEXT * 4, 16)


def _budgeted(minutes, **kw):
    base = {"tokens": 0, "max_minutes": minutes, "seq_len": 16, "batch_size": 2, "lr": 1e-2, "validation_tokens": 32}
    return TrainSettings(**{**base, **kw})


def test_token_budget_follows_the_measured_speed(monkeypatch):
    lm = get_model("tiny:llama")
    seqs = _data(lm)
    plans = {}
    for step_s in (10.0, 20.0):
        clock = FakeClock(monkeypatch, step_s=step_s, val_s=2.0)
        lens = train_tuned_lens(lm, seqs, _budgeted(5.0), clock=clock, progress=False)
        info = lens.training_info
        budget = info["time_budget"]
        assert info["complete"] and budget["seconds_per_step"] == pytest.approx(step_s)
        # the plan is what fits 300 s at the measured cost: steps, validations, and the 2% margin
        n = info["n_steps"]
        every = info["selection"]["validate_every"]
        used = n * step_s + (math.ceil(n / every) + 1) * 2.0
        assert used <= 300.0 * (1 - PL.BUDGET_MARGIN) + 1e-6
        assert used + step_s + 2.0 > 300.0 * (1 - PL.BUDGET_MARGIN) - step_s  # ... and not much less
        assert clock.now - 1000.0 <= 300.0  # the run really ended inside the budget
        assert info["tokens_seen"] == n * 2 * 16
        assert budget["warmup_steps"] == max(1, round(0.1 * n))  # the schedule is fitted to the plan
        plans[step_s] = n
        monkeypatch.undo()
    assert plans[20.0] == pytest.approx(plans[10.0] / 2, abs=2)  # a machine half as fast gets half the tokens
    assert plans[10.0] >= 20


def test_a_machine_that_slows_down_still_ends_in_time(monkeypatch):
    lm = get_model("tiny:llama")
    clock = FakeClock(monkeypatch, step_s=lambda k: 5.0 if k < 10 else 15.0)  # others start using the CPU
    lens = train_tuned_lens(lm, _data(lm), _budgeted(4.0, keep_best=False), clock=clock, progress=False)
    fits = lens.training_info["time_budget"]["fits"]
    assert fits[1][1] > lens.training_info["n_steps"]  # the plan after calibration was cut ...
    assert clock.now - 1000.0 <= 240.0 * 1.02  # ... so that the run ends about on time
    assert lens.training_info["complete"]


def test_budget_counts_time_spent_before_training(monkeypatch):
    lm = get_model("tiny:llama")
    clock = FakeClock(monkeypatch, step_s=10.0)
    a = train_tuned_lens(lm, _data(lm), _budgeted(5.0, keep_best=False), clock=clock, progress=False)
    clock2 = FakeClock(monkeypatch, step_s=10.0)
    clock2.now = 1150.0  # e.g. loading the model took 150 s of the budget
    b = train_tuned_lens(lm, _data(lm), _budgeted(5.0, keep_best=False), clock=clock2, started=1000.0,
                         progress=False)
    assert b.training_info["n_steps"] == pytest.approx(a.training_info["n_steps"] / 2, abs=2)


def test_token_cap_and_fit_steps():
    assert PL.fit_steps(0, 100.0, 10.0) == 10
    assert PL.fit_steps(0, 100.0, 10.0, cap=4) == 4
    assert PL.fit_steps(7, 0.0, 10.0) == 7  # never fewer than done
    assert PL.fit_steps(0, 1.0, 10.0) == 1  # at least one step
    # validations every 5 steps at 5 s each: 100 s -> n steps + (n / 5 + 1) validations
    n = PL.fit_steps(0, 100.0, 5.0, val_s=5.0, every=5)
    assert n * 5 + (n / 5 + 1) * 5 <= 100 < (n + 1) * 5 + ((n + 1) / 5 + 1) * 5
    with pytest.raises(lenscope.InputError, match="max_minutes"):
        TrainSettings(max_minutes=0).check()
    with pytest.raises(lenscope.InputError):
        TrainSettings(tokens=0).check()  # no limit only with a time budget


def test_time_budgeted_run_resumes_to_the_same_lens(monkeypatch, tmp_path):
    lm = get_model("tiny:llama")
    seqs = _data(lm)
    s = _budgeted(2.0, checkpoint_every=3)
    straight = train_tuned_lens(lm, seqs, s, clock=FakeClock(monkeypatch, step_s=4.0, val_s=1.0), progress=False)
    n = straight.training_info["n_steps"]
    part = train_tuned_lens(lm, seqs, s, out=tmp_path, clock=FakeClock(monkeypatch, step_s=4.0, val_s=1.0),
                            progress=False, max_steps=7)
    assert not part.training_info["complete"]
    # resumed much later, on a clock that runs differently: the plan of the interrupted run is kept
    resumed = train_tuned_lens(lm, seqs, s, out=tmp_path, resume=True,
                               clock=FakeClock(monkeypatch, step_s=9.0, start=5e6), progress=False)
    assert resumed.training_info["n_steps"] == n and resumed.training_info["complete"]
    assert torch.allclose(resumed.A, straight.A, atol=1e-6) and torch.allclose(resumed.b, straight.b, atol=1e-6)
    # the resumed run keeps the interrupted run's precision record (its timings included), never a new measurement
    assert_same_computation(resumed.training_info["precision"], part.training_info["precision"],
                            why="the interrupted run's record, kept")
    assert resumed.training_info["precision"]["bf16"] == straight.training_info["precision"]["bf16"]


# ------------------------------------------------------------------ precision


FAKE = "Python float arithmetic on the fake timer's numbers: the same operations on every CPU (no kernel)"


def test_precision_decision(monkeypatch):
    lm = get_model("tiny:llama")
    native = PR.choose_precision(lm, None, native=True)
    assert native["bf16"] and native["unembed_dtype"] == "bfloat16" and "natively" in native["reason"]
    rows = []

    def timer(per_block16, per_block32):  # seconds proportional to the rows timed, as a real block's are
        def t(W, x, r):
            rows.append((W.dtype, x.shape[0]))
            return (per_block16 if W.dtype == torch.bfloat16 else per_block32) * x.shape[0] / n_rows
        return t

    n_rows = max(16, min(256, int(2e8 // (lm.anatomy.vocab_size * 16))))  # the probe's block
    slow16 = PR.choose_precision(lm, None, native=False, timer=timer(2.0, 0.5))
    assert not slow16["bf16"] and slow16["unembed_dtype"] == "float32"
    # clearly slower on the first 64th already: the probe stopped there and scaled it up
    part = n_rows // PR.PROBE_FIRST_PART
    assert_same_computation(slow16["measured_s"], {"bfloat16": 2.0, "float32": 0.5, "rows": n_rows,
                                                   "bfloat16_from_rows": part}, why=FAKE)
    assert rows == [(torch.float32, n_rows), (torch.bfloat16, part)]
    rows.clear()
    fast16 = PR.choose_precision(lm, None, native=False, timer=timer(0.2, 0.5))
    assert fast16["bf16"]
    assert_same_computation(fast16["measured_s"], {"bfloat16": 0.2, "float32": 0.5, "rows": n_rows}, why=FAKE)
    assert rows == [(torch.float32, n_rows), (torch.bfloat16, part), (torch.bfloat16, n_rows)]
    close = PR.choose_precision(lm, None, native=False, timer=timer(0.6, 0.5))  # not clearly slower: the whole block
    assert not close["bf16"] and close["measured_s"]["bfloat16"] == pytest.approx(0.6)
    user = PR.choose_precision(lm, False, native=True)
    assert not user["bf16"] and user["reason"] == "set by the user"
    rec = PR.choose_precision(lm, None)  # this machine, for real: a complete record either way
    assert {"cpu", "avx512_bf16", "amx_bf16", "native_bf16", "unembed_dtype", "reason"} <= set(rec)
    assert PR._time_block(O._unembed_weight(lm, True), torch.randn(8, lm.anatomy.d_model),
                         torch.zeros(8, dtype=torch.long)) > 0


def test_a_cpu_without_native_bf16_trains_in_float32(monkeypatch, tmp_path):
    lm = get_model("tiny:llama")
    monkeypatch.delenv(PR.NATIVE_BF16_ENV, raising=False)  # the CPU's answer, not the forced one
    monkeypatch.setattr(PR, "cpu_features", lambda: {"cpu": "Test CPU", "avx512_bf16": False, "amx_bf16": False})
    monkeypatch.setattr(PR, "_time_block", lambda W, x, r: 2.06 if W.dtype == torch.bfloat16 else 0.49)
    seen = []
    real = O._unembed_weight
    for module in (O, SEL):  # the objective's and the selection's
        monkeypatch.setattr(module, "_unembed_weight", lambda lm_, bf16: seen.append(bf16) or real(lm_, bf16))
    lens = train_tuned_lens(lm, _data(lm), TrainSettings(tokens=64, seq_len=16, batch_size=2), out=tmp_path,
                            progress=False)
    prec = lens.training_info["precision"]
    assert prec["unembed_dtype"] == "float32" and prec["cpu"] == "Test CPU" and not prec["native_bf16"]
    assert set(seen) == {False}
    saved = json.loads((tmp_path / "config.json").read_text())["training"]["precision"]
    assert_same_computation(saved, prec, why="written as JSON and read back")


def test_float32_fast_path_is_exact():
    """Training's float32 path (log-partition read at the final top token) equals logsumexp, gradients too."""
    lm = get_model("tiny:gpt2")
    cap = residual_states(lm, _data(lm)[:2])
    states = cap["states"][: lm.anatomy.n_layers].flatten(1, 2)
    final = cap["logits"].flatten(0, 1)
    lens = TunedLens(lm.anatomy)
    with torch.no_grad():
        lens.A.normal_(0, 0.05)
        lens.b.normal_(0, 0.5)
    c, pbar = O.kl_to_final_terms(lm, final)
    W = lm.anatomy.unembed.W_U
    exact = O.lens_kl(lm, lens, states, c, pbar, W)
    fast = O.lens_kl(lm, lens, states, c, pbar, W, ref=final.argmax(-1))
    assert torch.allclose(fast, exact, atol=1e-4)
    # a reference token whose probability underflows falls back to the most probable one
    x = torch.tensor([[0.0, 200.0, -200.0]])
    W3 = torch.eye(3)
    assert torch.allclose(O.LogPartition.apply(x, W3, None, torch.tensor([2])), torch.logsumexp(x, -1), atol=1e-5)


def test_a_checkpoint_from_before_issue_11_resumes(tmp_path):
    """Checkpoints written before the time budget (no plan, precision or new settings in them) still resume."""
    lm = get_model("tiny:llama")
    seqs = _data(lm)
    s = TrainSettings(tokens=8 * 2 * 16, seq_len=16, batch_size=2, checkpoint_every=3, lr=1e-2, validation_tokens=32,
                      validate_every=2)
    # before issue 11 every run multiplied in bfloat16 (the old default, bf16=True): the interrupted run and the
    # straight run it must reproduce both did, on any CPU; the resume (automatic precision) keeps it
    old = dataclasses.replace(s, bf16=True)
    straight = train_tuned_lens(lm, seqs, old, progress=False)
    train_tuned_lens(lm, seqs, old, out=tmp_path, progress=False, max_steps=5)
    info = json.loads((tmp_path / "checkpoint.json").read_text())
    for k in ("max_minutes", "mid"):
        del info["settings"][k]
    info["settings"]["bf16"] = True  # the old default
    info["state"] = {k: info["state"][k] for k in ("step", "seconds", "history")}
    (tmp_path / "checkpoint.json").write_text(json.dumps(info))
    resumed = train_tuned_lens(lm, seqs, s, out=tmp_path, resume=True, progress=False)
    assert resumed.training_info["precision"]["reason"] == "kept from the interrupted run"
    assert resumed.training_info["precision"]["bf16"] is True
    assert torch.allclose(resumed.A, straight.A, atol=1e-6)
    assert "tokens" in C._settings_match(info["settings"], TrainSettings(tokens=65))


# ------------------------------------------------------------------ mid-layer translators


def test_mid_objective_matches_brute_force():
    lm = get_model("tiny:llama")
    L = lm.anatomy.n_layers
    cap = residual_states(lm, _data(lm)[:2], mid=True)
    states = O._training_states(cap, L, True)
    assert states.shape[0] == 2 * L
    final = cap["logits"].flatten(0, 1)
    lens = TunedLens(lm.anatomy, mid_translators=True)
    with torch.no_grad():
        for p in (lens.A, lens.b, lens.A_mid, lens.b_mid):
            p.normal_(0, 0.05)
    ref = TunedLens(lm.anatomy, mid_translators=True)
    ref.load_state_dict(lens.state_dict())
    logp = torch.log_softmax(final, -1)
    kls = []
    for i in range(2 * L):
        h = ref.transform(states[i], i) if i < L else ref.transform_mid(states[i], i - L)
        logq = torch.log_softmax(decode(lm.anatomy, h), -1)
        kls.append((logp.exp() * (logp - logq)).sum(-1).mean())
    brute = torch.stack(kls).mean()
    brute.backward()
    ours = O.kl_backward(lm, lens, states, final, bf16=False, budget_bytes=2e5)  # small blocks: many chunks
    assert ours == pytest.approx(brute.item(), rel=1e-4)
    for a, b in ((lens.A_mid, ref.A_mid), (lens.b_mid, ref.b_mid), (lens.A, ref.A)):
        assert torch.allclose(a.grad, b.grad, rtol=1e-3, atol=1e-6)


def test_mid_translators_trained_evaluated_saved_and_used(tmp_path):
    lm = get_model("tiny:gemma3")
    train = token_sequences(lm, split_text(TEXT * 4, "train"), 32)
    held = token_sequences(lm, split_text(TEXT * 4, "eval"), 32)
    # from the identity: on this tiny model's repeated text the least-squares start fits the training text so well
    # (validation KL 1e-4) that the last mid state's held-out KL ties the logit lens's 2e-3 (the start itself, mid
    # states included, is tested on every family in tests/lenses/test_warmstart.py)
    s = TrainSettings(tokens=2048, seq_len=32, batch_size=4, lr=1e-2, mid=True, validation_tokens=64, init="identity")
    lens = train_tuned_lens(lm, train, s, out=tmp_path / "lens", progress=False)
    assert lens.has_mid_translators and lens.A_mid.abs().sum() > 0
    assert len(lens.training_info["selection"]["mid"]["validation_kl"]) == lm.anatomy.n_layers
    evs = evaluate_lenses(lm, {"tuned": lens, "logit": LogitLens(lm.anatomy)}, held, mid=True, progress=False)
    t, g = evs["tuned"], evs["logit"]
    assert t.mid_kl.shape == (lm.anatomy.n_layers,)
    assert all(float(a) < float(b) for a, b in zip(t.mid_kl, g.mid_kl))  # every mid state beats the logit lens
    assert t.to_dict()["mid_layers"][0]["kl"] == pytest.approx(float(t.mid_kl[0]))
    plain = evaluate_lens(lm, lens, held, progress=False)
    assert plain.mid_kl is None and "mid_layers" not in plain.to_dict()
    assert torch.allclose(plain.kl, t.kl, atol=1e-5)
    # saved and read back (an extended file: older readers ignore the extra tensors)
    back = TunedLens.load(tmp_path / "lens", lm)
    assert back.has_mid_translators
    assert_same_computation(back.A_mid, lens.A_mid, why="saved and read back")
    assert json.loads((tmp_path / "lens" / "config.json").read_text())["mid_translators"] is True
    # trajectories use them: each mid row is the decoded translated mid state
    text = "When Mary and John went to the store"
    traj = prediction_trajectory(lm, text, back, mid=True)
    ids = lenscope.models.loading.load.encode(lm, text)
    cap = residual_states(lm, ids[None], mid=True)
    logp = torch.log_softmax(cap["logits"][0].float(), -1)
    for i in range(lm.anatomy.n_layers):
        logq = torch.log_softmax(decode(lm.anatomy, back.transform_mid(cap["mid"][i, 0], i)).float(), -1)
        kl = (logp.exp() * (logp - logq)).sum(-1).clamp_min(0)
        row = traj.state_labels.index(f"{i}.mid")
        assert torch.allclose(traj.kl[row], kl, atol=1e-4)
    logit = prediction_trajectory(lm, text, mid=True)
    mids = [i for i, lab in enumerate(traj.state_labels) if lab.endswith(".mid")]
    assert (traj.kl[mids] - logit.kl[mids]).abs().max() > 1e-4


def test_lens_without_mid_translators_loads_as_before(tmp_path):
    lm = get_model("tiny:llama")
    lens = TunedLens(lm.anatomy, model_name=lm.name)
    lens.save(tmp_path)
    back = TunedLens.load(tmp_path, lm)
    assert not back.has_mid_translators and back.A_mid is None
    h = torch.randn(3, lm.anatomy.d_model)
    assert_same_computation(back.transform_mid(h, 0), h, why="no mid translator: the state, returned as it is")
    with pytest.raises(lenscope.InputError):
        TunedLens(lm.anatomy, mid=True, mid_translators=True)


def test_cli_time_budget_precision_and_mid(tmp_path):
    from typer.testing import CliRunner

    from lenscope.cli import app

    data = tmp_path / "corpus.txt"
    data.write_text(TEXT.replace(". ", ".\n") * 10)
    out = tmp_path / "lens"
    r = CliRunner().invoke(app, [str(a) for a in (
        "lens", "train", "--model", "tiny:gpt2", "--data", data, "--max-minutes", 0.05, "--tokens", 2048, "--seq-len",
        32, "--out", out, "--precision", "fp32", "--mid", "--json")])
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["precision"]["unembed_dtype"] == "float32" and summary["precision"]["reason"] == "set by the user"
    assert_same_computation(summary["time_budget"]["max_minutes"], 0.05, why="the option, copied")
    assert summary["tokens_seen"] <= 2048
    assert "unembedding matmuls in float32" in r.stderr
    assert TunedLens.load(out, get_model("tiny:gpt2")).has_mid_translators
    r = CliRunner().invoke(app, [str(a) for a in ("lens", "eval", "--model", "tiny:gpt2", "--data", data, "--lens", out,
                                                  "--tokens", 128, "--seq-len", 32, "--mid", "--json")])
    assert r.exit_code == 0, r.output
    assert len(json.loads(r.stdout)["mid_layers"]) == get_model("tiny:gpt2").anatomy.n_layers
    r = CliRunner().invoke(app, ["lens", "train", "--data", str(data), "--out", str(out), "--precision", "fp16"])
    assert r.exit_code != 0 and "--precision" in r.output + (r.stderr or "")


# ------------------------------------------------------------------ both precision branches on every CPU


@pytest.mark.parametrize("forced", ["0", "1"])
def test_native_bf16_can_be_forced_either_way(monkeypatch, forced):
    """``LENSCOPE_NATIVE_BF16`` decides the hardware question, so both branches run on any CPU."""
    lm = get_model("tiny:llama")
    monkeypatch.setenv(PR.NATIVE_BF16_ENV, forced)
    rows = max(16, min(256, int(2e8 // (lm.anatomy.vocab_size * 16))))
    timer = lambda W, x, r: (2.0 if W.dtype == torch.bfloat16 else 0.5) * x.shape[0] / rows  # noqa: E731
    rec = PR.choose_precision(lm, None, timer=timer)
    assert rec["native_bf16"] is (forced == "1") and rec["native_bf16_from"] == f"LENSCOPE_NATIVE_BF16={forced}"
    if forced == "1":
        assert rec["bf16"] and "natively" in rec["reason"] and "measured_s" not in rec
    else:
        assert not rec["bf16"]
        assert_same_computation((rec["measured_s"]["bfloat16"], rec["measured_s"]["float32"]), (2.0, 0.5),
                                why="the fake timer's seconds: 2.0 * rows / rows, exact")
    lens = train_tuned_lens(lm, _data(lm), TrainSettings(tokens=64, seq_len=16, batch_size=2), progress=False)
    assert lens.training_info["precision"]["native_bf16"] is (forced == "1")
    if forced == "1":
        assert lens.training_info["precision"]["unembed_dtype"] == "bfloat16"
    monkeypatch.setenv(PR.NATIVE_BF16_ENV, "yes")
    with pytest.raises(lenscope.InputError, match="LENSCOPE_NATIVE_BF16"):
        PR.choose_precision(lm, None)


def test_precision_probe_runs_once_per_model(monkeypatch):
    """Two automatic decisions in one process (a run and its resume) rest on one measurement, so they agree."""
    lm = get_model("tiny:gpt2")
    monkeypatch.setenv(PR.NATIVE_BF16_ENV, "0")
    calls = []
    real = PR._time_block
    monkeypatch.setattr(PR, "_time_block", lambda W, x, r: calls.append(W.dtype) or real(W, x, r))
    PR._PROBES.clear()
    a = PR.choose_precision(lm, None)
    n = len(calls)
    b = PR.choose_precision(lm, None)
    assert_same_computation(a, b, why="measured once, the record kept")
    assert n in (2, 3) and len(calls) == n  # float32 and bfloat16 (a part, maybe all), measured once


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_bf16_training_gradient_matches_float32(family):
    """The bfloat16 path (which trained the headline lenses) gives the float32 path's loss and gradient, to
    bfloat16's precision: relative error of the gradient below 2e-2, of the loss below 1e-3 nats + 2%."""
    lm = get_model(f"tiny:{family}")
    cap = residual_states(lm, _data(lm)[:2])
    states = cap["states"][: lm.anatomy.n_layers].flatten(1, 2)
    final = cap["logits"].flatten(0, 1)
    grads, losses = [], []
    for bf16 in (False, True):
        lens = TunedLens(lm.anatomy)
        with torch.no_grad():
            g = torch.Generator().manual_seed(1)
            lens.A.copy_(torch.randn(lens.A.shape, generator=g) * 0.3)
            lens.b.copy_(torch.randn(lens.b.shape, generator=g) * 2.0)
        losses.append(O.kl_backward(lm, lens, states, final, bf16=bf16))
        grads.append(torch.cat([lens.A.grad.flatten(), lens.b.grad.flatten()]))
    rel = (grads[1] - grads[0]).norm() / grads[0].norm()
    assert losses[0] > 0.01  # (tiny random models' distributions are close to each other's: small KLs)
    assert abs(losses[1] - losses[0]) <= 1e-3 + 2e-2 * losses[0]  # nats
    assert 0 < rel < 2e-2, rel  # not zero: the bfloat16 path really ran in bfloat16
