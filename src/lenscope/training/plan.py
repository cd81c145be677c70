"""The plan of a training run (a tuned lens, sparse dictionaries): how many steps, the warm-up, the validation
interval, the learning rate.

A token budget fixes the number of steps (``tokens`` over the tokens per step, ``batch_size x seq_len``). A time
budget (``max_minutes``) fits it to the measured speed: :class:`Planner` times the first :data:`CALIBRATION_STEPS`
steps, :func:`fit_steps` says how many steps fit the time left (validations and checkpoints included), and the plan
is refitted while the run goes on when the speed changes. The plan is written into the run's :class:`TrainState`,
so a checkpoint keeps it. The planner reads the run's settings through the fields of :class:`PlanSettings` (a
tuned lens's :class:`~lenscope.lenses.training.settings.TrainSettings` has them all).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

# The time budget: steps timed before the number of steps is fixed (the first one, which also pays one-off
# costs, is left out of the estimate), and the margin kept free for what the estimate cannot see.
CALIBRATION_STEPS = 3
RECENT_STEPS = 15  # the steps whose median speed a refit uses
BUDGET_MARGIN = 0.02


@dataclass
class PlanSettings:
    """What the planner reads of a run's settings: the token budget (``tokens``; 0: none, with ``max_minutes``),
    the time budget (``max_minutes``), rows per step (``batch_size``) of ``seq_len`` tokens each, the peak
    learning rate (``lr``, :meth:`base_lr`), the warm-up's share of the run, the steps between checkpoints and
    between validations (0: none; validations: about 12 per run)."""

    tokens: int
    batch_size: int
    lr: float
    warmup_fraction: float
    max_minutes: float | None = None
    seq_len: int = 1
    checkpoint_every: int = 0
    validate_every: int = 0

    def base_lr(self) -> float:
        return self.lr


@dataclass
class TrainState:
    """A run's progress: what a checkpoint restores."""

    step: int = 0
    seconds: float = 0.0
    history: list = field(default_factory=list)  # [step, mean loss, seconds]
    n_steps: int = 0  # planned steps (fixed by the token budget, fitted to the time budget)
    warm: int = 0  # warm-up steps (0: warmup_fraction of n_steps)
    every: int = 0  # steps between validations
    precision: dict = field(default_factory=dict)  # the bfloat16 decision, kept on resume
    timing: dict = field(default_factory=dict)  # time budget: measured seconds per step, validation, checkpoint
    fits: list = field(default_factory=list)  # time budget: [step, planned steps, seconds per step] per (re)fit
    init: dict = field(default_factory=dict)  # the parameters' start (a tuned lens's least-squares: tokens, seconds)


def fit_steps(done: int, seconds_left: float, step_s: float, *, val_s: float = 0.0, every: int = 0,
              ckpt_s: float = 0.0, ckpt_every: int = 0, n_checks: int = 12, cap: int | None = None) -> int:
    """How many steps in all fit the time left, at ``step_s`` seconds per step.

    The time left also pays for the validations still to come (``val_s`` each, every ``every`` steps, or
    ``n_checks`` in the whole run while ``every`` is not fixed yet, plus the final one) and the checkpoints
    (``ckpt_s`` each, every ``ckpt_every`` steps, plus the final save). At least ``done`` steps, at least one;
    at most ``cap``.
    """
    step_s = max(step_s, 1e-9)
    left = max(0.0, seconds_left - ckpt_s)  # the final save
    n_left = left / step_s
    for _ in range(4):  # the overheads depend on the number of steps: a few fixed-point iterations
        n_total = done + n_left
        ev = every or max(1, round(n_total / n_checks))
        vals = n_left / ev + 1
        ckpts = n_left / ckpt_every if ckpt_every else 0.0
        n_left = max(0.0, (left - vals * val_s - ckpts * ckpt_s) / step_s)
    n = max(done, 1, done + math.floor(n_left))
    return n if cap is None else max(done, 1, min(n, cap))


def warmup_steps(n_steps: int, s: PlanSettings) -> int:
    """Steps of the linear warm-up of a run of ``n_steps`` steps."""
    return max(1, round(s.warmup_fraction * n_steps))


def linear_lr(step: int, n_steps: int, warm: int, base: float) -> float:
    """The learning rate of step ``step`` (from 0) of ``n_steps``: linear warm-up to ``base`` over ``warm`` steps,
    then linear decay to zero at ``n_steps``."""
    if step < warm:
        return base * (step + 1) / warm
    return base * max(0.0, (n_steps - step) / max(1, n_steps - warm))


def lr_at(step: int, n_steps: int, s: PlanSettings, warm: int = 0) -> float:
    """:func:`linear_lr` at the settings' learning rate, the warm-up ``warm`` steps (0: the settings' fraction of
    the run)."""
    return linear_lr(step, n_steps, warm or warmup_steps(n_steps, s), s.base_lr())


class Planner:
    """Plans one run's steps from the settings and, under a time budget, from the measured seconds per step.

    ``seq_len``: tokens per sequence (default: the settings'; a step has ``batch_size x seq_len`` tokens,
    :attr:`per_step`);
    ``started``: the ``clock()`` reading the time budget runs from; ``validates``: validations run (their
    measured time counts against the budget); ``checkpoints``: checkpoints are written every
    ``settings.checkpoint_every`` steps; ``refit``: the plan may change after calibration (a resumed run keeps
    the plan it was interrupted with, so that it ends where the straight run would). The plan lives in a
    :class:`TrainState` (``n_steps``, ``every``, ``warm``, ``fits``; measured seconds in ``timing``), which every
    method reads and updates. ``s``: a :class:`PlanSettings` or any settings with its fields.
    """

    def __init__(self, s: PlanSettings, seq_len: int | None = None, *, started: float, clock: Callable[[], float],
                 validates: bool, checkpoints: bool, refit: bool = True):
        self.s, self.clock, self.started = s, clock, started
        self.validates, self.refit = validates, refit
        self.ckpt_every = s.checkpoint_every if checkpoints else 0
        self.per_step = s.batch_size * (s.seq_len if seq_len is None else seq_len)
        self.budgeted = s.max_minutes is not None
        self.cap = max(1, math.ceil(s.tokens / self.per_step)) if s.tokens else None  # the token budget's steps
        self.deadline = started + 60.0 * s.max_minutes if self.budgeted else None

    def start(self, state: TrainState) -> None:
        """The plan before the first step of a new or resumed run: a token budget's, or (time budget, none in the
        state yet) a provisional one, replaced after the first step."""
        s = self.s
        if not self.budgeted:  # (a checkpoint from before issue 11 has no plan in its state)
            state.n_steps = self.cap
            state.every = state.every or s.validate_every or max(1, round(self.cap / 12))
        if not state.n_steps:
            state.n_steps = self.cap or 10**9

    def calibrated(self, state: TrainState) -> bool:
        """Whether the number of steps is fixed (always, with a token budget)."""
        return not self.budgeted or state.step >= CALIBRATION_STEPS or state.n_steps <= state.step

    def fit(self, state: TrainState, step_s: float, done: int, now: float) -> int:
        """:func:`fit_steps` for the time left at clock reading ``now``, with the state's measured overheads."""
        t, s = state.timing, self.s
        return fit_steps(done, self.deadline - now - BUDGET_MARGIN * 60.0 * s.max_minutes, step_s,
                         val_s=t.get("validation_s", 0.0) if self.validates else 0.0, every=state.every,
                         ckpt_s=t.get("checkpoint_s", 0.0), ckpt_every=self.ckpt_every, cap=self.cap)

    def first_step(self, state: TrainState, k: int, t0: float) -> None:
        """After step ``k``'s gradients (begun at clock reading ``t0``), before its optimizer step: under a time
        budget, a provisional plan from the first step (it also pays one-off costs, so it errs on the short
        side)."""
        if self.budgeted and k == 0 and not self.calibrated(state):
            clock = self.clock
            state.n_steps = self.fit(state, clock() - t0, 0, clock())
            state.fits.append([0, state.n_steps, round(clock() - t0, 4)])

    def after_step(self, state: TrainState, step_times: list[float], t1: float) -> str | None:
        """After a step that ended at clock reading ``t1`` (``step_times``: seconds of every step so far): under a
        time budget, fix the plan once calibrated, or refit it when the time left at the recent speed (the median of
        the last :data:`RECENT_STEPS` steps) says it is more than 3% off. Returns a line for the log when the plan
        was fixed."""
        s = self.s
        if not self.budgeted:
            return None
        if state.step == CALIBRATION_STEPS or (state.step < CALIBRATION_STEPS and state.step >= state.n_steps):
            step_s = sum(step_times[1:]) / max(1, len(step_times) - 1) if len(step_times) > 1 else step_times[0]
            state.every = s.validate_every or 0
            n = self.fit(state, step_s, state.step, t1)
            state.every = s.validate_every or max(1, round(n / 12))
            state.n_steps = self.fit(state, step_s, state.step, t1)
            state.warm = warmup_steps(state.n_steps, s)
            state.fits.append([state.step, state.n_steps, round(step_s, 4)])
            return (f"time budget {s.max_minutes:g} min: {step_s:.1f} s per step of {self.per_step} tokens -> "
                    f"{state.n_steps} steps ({state.n_steps * self.per_step} tokens), warm-up {state.warm}, "
                    f"validation every {state.every}")
        if state.step > CALIBRATION_STEPS and state.step < state.n_steps and self.refit:
            # the median of the recent steps: a burst of slow steps (another job for a moment) moves it only once it
            # lasts half the window, so the plan (and the learning-rate schedule it stretches) does not swing; the
            # time such a burst cost is still paid, as the time left is measured
            step_s = statistics.median(step_times[1:][-RECENT_STEPS:])
            n = self.fit(state, step_s, state.step, t1)
            if abs(n - state.n_steps) > 0.03 * state.n_steps:
                state.n_steps = max(n, state.step)
                state.fits.append([state.step, state.n_steps, round(step_s, 4)])
        return None

    def record(self, state: TrainState, step_times: list[float]) -> dict:
        """The ``time_budget`` record of the training info (``{}`` with a token budget)."""
        if not self.budgeted:
            return {}
        s = self.s
        return {"max_minutes": s.max_minutes, "token_cap": s.tokens or None,
                "wall_s": round(self.clock() - self.started, 2), "fits": state.fits,
                "seconds_per_step": (round(sum(step_times[1:]) / max(1, len(step_times) - 1), 4)
                                     if len(step_times) > 1 else None),
                "warmup_steps": state.warm}


__all__ = ["BUDGET_MARGIN", "CALIBRATION_STEPS", "RECENT_STEPS", "PlanSettings", "Planner", "TrainState", "fit_steps",
           "linear_lr", "lr_at", "warmup_steps"]
