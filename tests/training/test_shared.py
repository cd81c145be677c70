"""The training core (issue 43): what tuned-lens and dictionary training share lives once, in lenscope.training, and
both trainers use it (no copy of the planner, the checkpoint files or the bfloat16 detection under lenses/ or
features/)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from lenscope.errors import InputError
from lenscope.lenses import TrainSettings
from lenscope.training import (
    Planner,
    PlanSettings,
    TrainState,
    flatten_optimizer,
    linear_lr,
    lr_at,
    read_state,
    unflatten_optimizer,
    warmup_steps,
    write_state,
)
from tests.tolerances import assert_same_computation

SRC = Path(__file__).resolve().parents[2] / "src" / "lenscope"


def test_plan_settings_plan_as_a_lens_settings_does():
    """The planner reads only PlanSettings' fields, so a tuned lens's TrainSettings and the bare PlanSettings (what
    dictionary training passes) with the same values give the same plan and schedule."""
    lens = TrainSettings(tokens=1000, seq_len=16, batch_size=4, lr=0.5, warmup_fraction=0.2, checkpoint_every=3)
    bare = PlanSettings(tokens=1000, seq_len=16, batch_size=4, lr=0.5, warmup_fraction=0.2, checkpoint_every=3)
    plans = []
    for s in (lens, bare):
        plan = Planner(s, started=0.0, clock=lambda: 0.0, validates=False, checkpoints=True)
        state = TrainState()
        plan.start(state)
        plans.append((plan.per_step, plan.cap, plan.ckpt_every, state.n_steps, state.every, warmup_steps(100, s),
                      [lr_at(k, state.n_steps, s) for k in range(state.n_steps + 1)]))
    assert_same_computation(plans[0], plans[1], why="the same schedule formula on equal settings")
    assert plans[0][:3] == (64, 16, 3)
    assert_same_computation(lr_at(3, 16, bare), linear_lr(3, 16, 3, 0.5), why="lr_at is linear_lr of the settings")


def test_checkpoint_files_round_trip(tmp_path):
    p = torch.nn.Parameter(torch.arange(3.0))
    opt = torch.optim.Adam([p], lr=0.1)
    p.grad = torch.ones(3)
    opt.step()
    tensors, meta = flatten_optimizer(opt)
    write_state(tmp_path / "ck", "state", {**tensors, "w": p.detach()}, {"optimizer": meta, "step": 1})
    assert sorted(f.name for f in (tmp_path / "ck").iterdir()) == ["state.json", "state.safetensors"]
    record, back = read_state(tmp_path / "ck", "state")
    assert record["step"] == 1
    opt2 = torch.optim.Adam([torch.nn.Parameter(torch.zeros(3))], lr=0.1)
    unflatten_optimizer(opt2, back, record["optimizer"])
    assert_same_computation(opt2.state_dict()["state"], opt.state_dict()["state"], why="the same tensors reloaded")
    with pytest.raises(InputError, match="cannot resume: no readable checkpoint"):
        read_state(tmp_path / "nothing", "state")


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add("." * node.level + node.module)
    return found


def test_the_trainers_share_the_core_not_each_other():
    """Dictionary training takes the planner, the optimizer's checkpoint form and the bfloat16 detection from the
    core, not from the tuned lens's trainer; the lens trainer has no copy of them."""
    features = _imports(SRC / "features" / "dictionaries" / "train.py")
    assert not [m for m in features if "lenses" in m], features
    assert {"...training.plan", "...training.checkpoint", "...training.precision"} <= features
    lens_defs = {n.name for p in (SRC / "lenses" / "training").glob("*.py")
                 for n in ast.walk(ast.parse(p.read_text(encoding="utf-8")))
                 if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    shared = {"Planner", "TrainState", "fit_steps", "lr_at", "warmup_steps", "flatten_optimizer", "unflatten_optimizer",
              "_flatten_optimizer", "_unflatten_optimizer", "cpu_features", "forced_native_bf16"}
    assert not lens_defs & shared, lens_defs & shared
