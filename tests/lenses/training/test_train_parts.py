"""The parts of tuned-lens training, each alone: the planner, the precision decision, checkpoints, the batch order,
the held-out split (``train_tuned_lens`` composing them is tested in test_lenses.py and test_train_budget.py)."""

import json
from types import SimpleNamespace

import pytest
import torch

import lenscope
from lenscope.lenses import TrainSettings, TunedLens
from lenscope.lenses.training import precision as PR
from lenscope.lenses.training.checkpoint import load_checkpoint, read_checkpoint_info, save_checkpoint
from lenscope.lenses.training.selection import split_validation
from lenscope.lenses.training.train import BatchOrder, _optimizer
from lenscope.training.plan import BUDGET_MARGIN, CALIBRATION_STEPS, Planner, TrainState, fit_steps, lr_at, warmup_steps
from tests.conftest import get_model
from tests.tolerances import assert_same_computation, assert_same_ints

# ------------------------------------------------------------------ the planner


def test_token_budget_plan():
    s = TrainSettings(tokens=1000, seq_len=16, batch_size=4)
    plan = Planner(s, 16, started=0.0, clock=lambda: 0.0, validates=True, checkpoints=False)
    assert plan.per_step == 64 and plan.cap == 16 and not plan.budgeted  # ceil(1000 / 64) = 16 steps
    state = TrainState()
    plan.start(state)
    assert (state.n_steps, state.every) == (16, 1)  # round(16 / 12) = 1 validation interval
    assert plan.calibrated(state)
    assert plan.after_step(state, [1.0], 1.0) is None and plan.record(state, [1.0]) == {}
    resumed = TrainState(every=5)  # a resumed run keeps its validation interval
    plan.start(resumed)
    assert (resumed.n_steps, resumed.every) == (16, 5)
    s2 = TrainSettings(tokens=64 * 120, seq_len=16, batch_size=4, validate_every=7)
    state2 = TrainState()
    Planner(s2, 16, started=0.0, clock=lambda: 0.0, validates=True, checkpoints=False).start(state2)
    assert (state2.n_steps, state2.every) == (120, 7)


STEPS = "a rate of 1 times (step + 1) / warm: one correctly rounded division, as the literal's"


def test_learning_rate_schedule():
    s = TrainSettings(lr=1.0, warmup_fraction=0.1)
    assert warmup_steps(100, s) == 10 and warmup_steps(3, s) == 1
    # linear warm-up over 10 steps
    assert_same_computation([lr_at(k, 100, s) for k in (0, 4, 9)], [0.1, 0.5, 1.0], why=STEPS)
    assert lr_at(10, 100, s) == pytest.approx(1.0) and lr_at(55, 100, s) == pytest.approx(0.5)  # linear decay
    assert lr_at(100, 100, s) == 0.0
    assert_same_computation(lr_at(1, 100, s, warm=4), 0.5, why=STEPS)  # a warm-up fixed by the plan
    assert_same_computation((TrainSettings(optimizer="sgd").base_lr(), TrainSettings().base_lr()), (1.0, 2e-3),
                            why="the defaults, returned as they are")


def test_fit_steps_pays_for_checkpoints():
    # 100 s at 1 s per step, a checkpoint (2 s) every 10 steps and a final save: n + 2 (n / 10 + 1) <= 100
    n = fit_steps(0, 100.0, 1.0, ckpt_s=2.0, ckpt_every=10)
    assert n + 2.0 * (n / 10 + 1) <= 100.0 + 1e-9 < (n + 1) + 2.0 * ((n + 1) / 10 + 1)


def test_time_budget_plan_with_a_fake_clock():
    """A provisional plan after step 0, the plan fixed after CALIBRATION_STEPS steps, a refit when the speed
    changes, the time_budget record: arithmetic only, no model."""
    now = [100.0]
    s = TrainSettings(tokens=0, max_minutes=1.0, seq_len=8, batch_size=2)
    plan = Planner(s, 8, started=100.0, clock=lambda: now[0], validates=False, checkpoints=False)
    assert plan.budgeted and plan.cap is None and plan.deadline == 160.0
    state = TrainState()
    plan.start(state)
    assert state.n_steps == 10**9 and not plan.calibrated(state)  # provisional until the first step
    usable = 60.0 * (1 - BUDGET_MARGIN)  # 58.8 s
    now[0] += 2.0  # the first step took 2 s
    plan.first_step(state, 0, 100.0)
    assert state.n_steps == 28 and state.fits == [[0, 28, 2.0]]  # floor((58.8 s - 2 s spent) / 2 s)
    times = [2.0]
    for _ in range(CALIBRATION_STEPS - 1):  # 1 s per step from then on
        state.step += 1
        now[0] += 1.0
        times.append(1.0)
        assert plan.after_step(state, times, now[0]) is None
    state.step += 1
    now[0] += 1.0
    times.append(1.0)
    msg = plan.after_step(state, times, now[0])  # calibrated: the mean of steps 2..3 (1 s), 5 s spent
    assert state.n_steps == CALIBRATION_STEPS + int(usable - 5.0) == 56 and plan.calibrated(state)
    assert state.every == max(1, round(state.n_steps / 12)) and state.warm == warmup_steps(state.n_steps, s)
    assert msg == (f"time budget 1 min: 1.0 s per step of 16 tokens -> {state.n_steps} steps "
                   f"({state.n_steps * 16} tokens), warm-up {state.warm}, validation every {state.every}")
    planned = state.n_steps
    for _ in range(12):  # on schedule: no refit
        state.step += 1
        now[0] += 1.0
        times.append(1.0)
        plan.after_step(state, times, now[0])
    assert state.n_steps == planned
    for _ in range(4):  # a burst of four 2 s steps: the speed (the median of the recent steps) stays 1 s per step,
        state.step += 1  # and the plan only pays the 4 s the burst cost
        now[0] += 2.0
        times.append(2.0)
        plan.after_step(state, times, now[0])
    assert state.n_steps == planned - 4 and state.fits[-1] == [state.step, planned - 4, 1.0]
    for _ in range(10):  # the machine slows down to 2 s per step for good: the plan shrinks to that speed
        state.step += 1
        now[0] += 2.0
        times.append(2.0)
        plan.after_step(state, times, now[0])
    left = 100.0 + usable - now[0]
    assert state.n_steps == state.step + int(left / 2.0) and state.fits[-1][2] == 2.0
    rec = plan.record(state, times)
    assert rec["max_minutes"] == 1.0 and rec["token_cap"] is None and rec["fits"] is state.fits
    assert rec["warmup_steps"] == state.warm
    assert_same_computation((rec["wall_s"], rec["seconds_per_step"]),
                            (round(now[0] - 100.0, 2), round(sum(times[1:]) / (len(times) - 1), 4)),
                            why="the same rounded sums of the fake clock's seconds")
    # a resumed run keeps its plan
    frozen = Planner(s, 8, started=100.0, clock=lambda: now[0], validates=False, checkpoints=False, refit=False)
    n = state.n_steps
    state.step += 1
    times.append(10.0)
    frozen.after_step(state, times, now[0] + 10.0)
    assert state.n_steps == n


# ------------------------------------------------------------------ the precision decision (no model runs)


def _fake_model(vocab=64, d=16):
    """Just what the precision decision reads: an unembedding ``W_U (d_model, vocab)`` on the CPU."""
    W = torch.randn(d, vocab, generator=torch.Generator().manual_seed(0))
    return SimpleNamespace(anatomy=SimpleNamespace(unembed=SimpleNamespace(W_U=W)))


def _features():
    return {"cpu": "Test CPU", "avx512_bf16": False, "amx_bf16": False}


def test_precision_forced_native(monkeypatch):
    monkeypatch.setattr(PR, "cpu_features", _features)
    monkeypatch.setenv(PR.NATIVE_BF16_ENV, "1")
    calls = []
    rec = PR.choose_precision(_fake_model(), None, timer=lambda W, x, r: calls.append(W.dtype) or 1.0)
    assert calls == []  # native: nothing is timed
    assert rec == {"cpu": "Test CPU", "avx512_bf16": False, "amx_bf16": False,
                   "native_bf16_from": "LENSCOPE_NATIVE_BF16=1", "native_bf16": True,
                   "unembed_dtype": "bfloat16", "bf16": True, "reason": "the hardware runs bfloat16 natively"}
    assert PR.describe(rec) == ("unembedding matmuls in bfloat16: the hardware runs bfloat16 natively "
                                "(Test CPU; avx512_bf16=False, amx_bf16=False)")
    assert PR.choose_precision(_fake_model(), False)["reason"] == "set by the user"


FAKE = "Python float arithmetic on the fake timer's numbers: the same operations on every CPU (no kernel)"


def test_precision_forced_not_native(monkeypatch):
    monkeypatch.setattr(PR, "cpu_features", lambda: {**_features(), "amx_bf16": True})  # the variable wins
    monkeypatch.setenv(PR.NATIVE_BF16_ENV, "0")
    lm = _fake_model()
    rows = max(16, min(256, int(2e8 // (64 * 16))))
    slow = PR.choose_precision(lm, None, timer=lambda W, x, r: (8.0 if W.dtype == torch.bfloat16 else 1.0))
    part = rows // PR.PROBE_FIRST_PART
    assert not slow["native_bf16"] and slow["native_bf16_from"] == "LENSCOPE_NATIVE_BF16=0"
    assert slow["unembed_dtype"] == "float32" and not slow["bf16"]
    assert_same_computation(slow["measured_s"], {"bfloat16": 8.0 * rows / part, "float32": 1.0, "rows": rows,
                                                 "bfloat16_from_rows": part}, why=FAKE)
    fast = PR.choose_precision(lm, None, timer=lambda W, x, r: (0.5 if W.dtype == torch.bfloat16 else 1.0) *
                               x.shape[0] / rows)
    assert fast["bf16"]
    assert_same_computation(fast["measured_s"], {"bfloat16": 0.5, "float32": 1.0, "rows": rows}, why=FAKE)
    assert fast["reason"] == f"no native bfloat16; measured one {rows}-row block: bfloat16 0.500 s, float32 1.000 s"


def test_forced_native_bf16_parsing(monkeypatch):
    monkeypatch.delenv(PR.NATIVE_BF16_ENV, raising=False)
    assert PR.forced_native_bf16() is None
    monkeypatch.setenv(PR.NATIVE_BF16_ENV, " ")
    assert PR.forced_native_bf16() is None
    monkeypatch.setenv(PR.NATIVE_BF16_ENV, "1")
    assert PR.forced_native_bf16() is True
    monkeypatch.setenv(PR.NATIVE_BF16_ENV, "true")
    with pytest.raises(lenscope.InputError, match="LENSCOPE_NATIVE_BF16"):
        PR.forced_native_bf16()


def test_resumed_precision(monkeypatch):
    monkeypatch.setattr(PR, "cpu_features", _features)
    monkeypatch.setenv(PR.NATIVE_BF16_ENV, "1")
    lm = _fake_model()
    kept = {"bf16": False, "unembed_dtype": "float32", "reason": "whatever the interrupted run measured"}
    assert_same_computation(PR.resumed_precision(lm, {"state": {"precision": kept}}), kept,
                            why="the kept record, returned as it is")
    old = PR.resumed_precision(lm, {"state": {}, "settings": {"bf16": False}})  # before the automatic choice
    assert not old["bf16"] and old["reason"] == "kept from the interrupted run"
    assert PR.resumed_precision(lm, {})["bf16"]  # nothing saved: decided anew (natively here)


# ------------------------------------------------------------------ checkpoints


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_checkpoint_round_trip(tmp_path, optimizer):
    lm = get_model("tiny:llama")
    s = TrainSettings(tokens=64, seq_len=8, batch_size=2, optimizer=optimizer, mid=True)
    lens = TunedLens(lm.anatomy, model_name=lm.name, mid_translators=True)
    opt = _optimizer(lens, s)
    with torch.no_grad():
        for p in lens.parameters():
            p.grad = torch.randn_like(p)
    opt.step()  # an optimizer with state (Adam's moments, SGD's momentum)
    state = TrainState(step=3, seconds=1.5, history=[[1, 2.0, 0.5]], n_steps=8, warm=1, every=2,
                       precision={"bf16": False}, timing={"step_s": [0.5]}, fits=[[0, 8, 0.5]])
    save_checkpoint(tmp_path, lens, opt, state, s, "fp")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.json", "checkpoint.safetensors"]
    info = read_checkpoint_info(tmp_path)
    assert set(info) == {"state", "settings", "fingerprint", "optimizer"} and info["settings"]["optimizer"] == optimizer
    assert read_checkpoint_info(tmp_path / "nothing") == {}

    lens2 = TunedLens(lm.anatomy, model_name=lm.name, mid_translators=True)
    opt2 = _optimizer(lens2, s)
    state2 = load_checkpoint(tmp_path, lens2, opt2, s, "fp")
    assert_same_computation(state2, state, why="saved and read back")
    for a, b in zip(lens.parameters(), lens2.parameters(), strict=True):
        assert_same_computation(a, b, why="saved and read back")
    sd, sd2 = opt.state_dict(), opt2.state_dict()
    assert json.loads(json.dumps(sd["param_groups"])) == json.loads(json.dumps(sd2["param_groups"]))
    for pid, st in sd["state"].items():
        for k, v in st.items():
            assert_same_computation(torch.as_tensor(v), torch.as_tensor(sd2["state"][pid][k]),
                                    why="saved and read back")
    with pytest.raises(lenscope.InputError, match="another model"):
        load_checkpoint(tmp_path, lens2, opt2, s, "other")
    with pytest.raises(lenscope.InputError, match="settings differ"):
        load_checkpoint(tmp_path, lens2, opt2, TrainSettings(tokens=64, seq_len=8, batch_size=3, mid=True), "fp")
    with pytest.raises(lenscope.InputError, match="no readable checkpoint"):
        load_checkpoint(tmp_path / "nothing", lens2, opt2, s, "fp")


# ------------------------------------------------------------------ batches and the held-out split


def test_batch_order_is_one_permutation_per_epoch():
    order = BatchOrder(5, 2, seed=3)
    batches = [order(k) for k in range(5)]  # two epochs of 5 sequences
    first, second = torch.cat(batches)[:5], torch.cat(batches)[5:10]
    assert sorted(first.tolist()) == sorted(second.tolist()) == list(range(5))
    for a, b in zip(batches, [BatchOrder(5, 2, seed=3)(k) for k in range(5)], strict=True):
        assert_same_ints(a, b)
    later = BatchOrder(5, 2, seed=3)
    assert_same_ints(later(4), batches[4])  # step k's batch without the steps before it (a resume)


def test_split_validation():
    seqs = torch.arange(40).reshape(10, 4)
    train, val = split_validation(seqs, 6)  # ceil(6 / 4) = 2 sequences
    assert_same_ints(train, seqs[:8])
    assert_same_ints(val, seqs[8:])
    train, val = split_validation(seqs, 400)  # never more than a fifth of the text
    assert val.shape[0] == 2
    assert split_validation(seqs, 0)[1] is None and split_validation(seqs[:4], 8)[1] is None
