"""Training a tuned lens: minimise KL(final || lens) over the tokens of a text corpus, model frozen.

:func:`train_tuned_lens` composes parts that each live, and are tested, on their own:

- :mod:`lenscope.lenses.training.settings`: :class:`TrainSettings` (what a run is told); what it has done is the
  ``TrainState`` of :mod:`lenscope.training.plan` (a checkpoint restores it);
- :mod:`lenscope.lenses.training.precision`: bfloat16 or float32 for the unembedding matmuls (:func:`choose_precision`:
  the CPU's features, ``$LENSCOPE_NATIVE_BF16``, a one-off timing);
- :mod:`lenscope.training.plan` (shared with dictionary training): the number of steps, the warm-up, the validation
  interval and the learning rate, under a time budget fitted to the measured speed
  (:class:`~lenscope.training.plan.Planner`);
- :mod:`lenscope.lenses.training.objective`: the KL objective and its gradient (:func:`kl_backward`), the one readout of
  training;
- :mod:`lenscope.lenses.training.selection`: per-state model selection on held-out sequences (``keep_best``);
- :mod:`lenscope.lenses.training.checkpoint`: save and resume (in :mod:`lenscope.training.checkpoint`'s files);
- here: one training step (:func:`train_step`) and the loop, in one process or over several
  (:mod:`lenscope.distributed.ddp`).

``TrainSettings(max_minutes=M)`` sets a time budget instead of a token budget: the first steps are timed
and the number of steps (and with it the warm-up and decay of the learning rate) is fitted to what the
budget allows on this machine, refitted while the run goes on (see :func:`lenscope.training.plan.fit_steps`).

Before the first KL step every translator starts from its closed-form least-squares fit to the last state
(:mod:`lenscope.lenses.training.warmstart`, ``init="least-squares"``, the default since issue 22; ``keep_best`` keeps it
per state only where it beats the identity on the held-out text); ``init="identity"`` is the paper's start.
The recipe otherwise follows Belrose et al. (2023): KL objective averaged over layers and tokens, linear
warm-up then linear decay. The default optimizer is Adam (our measurements in
``docs/lenses.md`` show it converges faster than SGD-Nesterov on the small budgets a CPU affords);
``optimizer="sgd"`` gives the paper's Nesterov SGD. Beyond the paper, ``keep_best`` judges every state's
translator on a few held-out sequences about twelve times per run: a state that got worse goes back to
its best translator (the identity included) with a smaller step size (see
:class:`~lenscope.lenses.training.selection.BestPerState`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
from torch import Tensor

from ...errors import InputError, UnsupportedModelError
from ...models.loading.load import LoadedModel, require_decoder
from ...models.runtime.trace import residual_states
from ...training.plan import Planner, TrainState, lr_at
from ...training.precision import NATIVE_BF16_ENV, cpu_features, forced_native_bf16
from ..lenses import TunedLens, fingerprint
from .checkpoint import load_checkpoint, read_checkpoint_info, save_checkpoint
from .objective import _groups, _training_states, kl_backward
from .precision import choose_precision, describe, resumed_precision
from .selection import BestPerState, split_validation
from .settings import TrainSettings
from .warmstart import regression_start


def _optimizer(lens: TunedLens, s: TrainSettings):
    params = [p for pair in _groups(lens) for p in pair]
    if s.optimizer == "sgd":
        return torch.optim.SGD(params, lr=s.base_lr(), momentum=s.momentum, nesterov=True, weight_decay=s.weight_decay)
    return torch.optim.AdamW(params, lr=s.base_lr(), weight_decay=s.weight_decay)


class BatchOrder:
    """The sequences of step ``k`` (``order(k)``: ``batch_size`` row indices into ``n_seq`` sequences): one random
    permutation per epoch, drawn as needed from ``seed``, so a resumed run draws the same batches."""

    def __init__(self, n_seq: int, batch_size: int, seed: int):
        self.n_seq, self.batch_size = n_seq, batch_size
        self.g = torch.Generator().manual_seed(seed)
        self.order = torch.zeros(0, dtype=torch.long)

    def __call__(self, k: int) -> Tensor:
        bs = self.batch_size
        while self.order.numel() < (k + 1) * bs:
            self.order = torch.cat([self.order, torch.randperm(self.n_seq, generator=self.g)])
        return self.order[k * bs : (k + 1) * bs]


def train_step(lm: LoadedModel, lens: TunedLens, sequences: Tensor, ids: Tensor, *, batch_size: int, mid: bool,
               bf16: bool, dist) -> float:
    """Accumulate one step's gradient of the mean KL in ``lens`` (zeroed by the caller); returns the mean KL.

    ``ids``: this rank's share of the step's global batch of ``batch_size`` rows of ``sequences (n_seq,
    seq_len)`` (all of it in one process, possibly none on a rank); one frozen forward pass captures every
    layer's state. Under DDP (``dist.active``) the gradient and the loss are averaged over every rank's tokens.
    """
    from ...distributed import ddp

    S = sequences.shape[1]
    if len(ids):
        cap = residual_states(lm, sequences[ids], mid=mid)
        states = _training_states(cap, lm.anatomy.n_layers, mid)  # (state, tokens, d): the output state needs no lens
        loss = kl_backward(lm, lens, states, cap["logits"].flatten(0, 1), bf16=bf16)
    else:
        loss = 0.0
    if dist.active:  # the mean over every rank's tokens, of the loss and of its gradient
        ddp.average_gradients(lens.parameters(), len(ids) * S, dist)
        loss = float(ddp.all_sum(loss * len(ids), dist)) / max(1, batch_size)
    return loss


def train_tuned_lens(
    lm: LoadedModel,
    sequences: Tensor,
    settings: TrainSettings | None = None,
    *,
    out: str | Path | None = None,
    resume: bool = False,
    progress: bool = True,
    max_steps: int | None = None,
    clock: Callable[[], float] | None = None,
    started: float | None = None,
    log: Callable[[str], None] | None = None,
    dist=None,
) -> TunedLens:
    """Train a :class:`TunedLens` on token ``sequences (n_seq, seq_len)`` within ``settings.tokens`` or, with
    ``settings.max_minutes``, within a time budget.

    With ``out``, checkpoints go to ``out/checkpoint*`` every ``settings.checkpoint_every`` steps and the
    finished lens to ``out``; ``resume=True`` continues from the checkpoint to the same result as an
    uninterrupted run (a time-budgeted run keeps the number of steps it had planned when it was interrupted and
    refits no more). ``max_steps`` stops early (after a checkpoint), to simulate an interruption.

    Time budget: the budget runs from ``started`` (a ``clock()`` reading; default: now), so a caller can count
    its own model loading. The first :data:`lenscope.training.plan.CALIBRATION_STEPS` steps are timed; the number
    of steps that fits what is left (validations and checkpoints included, :func:`lenscope.training.plan.fit_steps`)
    fixes the warm-up and the linear decay of the learning rate, and is refitted after every step when the
    measured speed says the plan is more than 3% off. ``clock`` (default ``time.perf_counter``) is what the budget
    is measured with (tests inject a fake one). ``log`` receives one-line messages (the precision decision, the
    plan).

    ``dist``: a :class:`lenscope.distributed.ddp.Dist` (``ddp.from_env()`` under ``torchrun``): each rank runs the
    model and the loss on its share of every step's global batch, the gradients are averaged over all the
    tokens, every rank takes the same step; rank 0 alone writes checkpoints and the lens. The global batch
    (``batch_size`` sequences) does not depend on the number of ranks, so the lens is the single process's
    (up to float rounding) and a checkpoint resumes with any number of ranks.
    """
    from ...distributed import ddp

    d = dist or ddp.SINGLE
    from tqdm.auto import tqdm

    progress = progress and d.main
    clock = clock or time.perf_counter
    t_begin = clock()
    started = t_begin if started is None else started
    say = log or (lambda msg: None)
    s = settings or TrainSettings()
    s.check()
    A = lm.anatomy
    require_decoder(lm, "tuned-lens training", instead="use a model with a language-model head")
    if A.unembed.softcap is not None:
        raise UnsupportedModelError("tuned-lens training does not support final-logit soft-capping yet")
    sequences = torch.as_tensor(sequences, dtype=torch.long)
    if sequences.dim() != 2 or sequences.shape[0] == 0:
        raise InputError("sequences must be a non-empty (n_seq, seq_len) tensor of token ids")
    best_val = None
    if s.keep_best:
        sequences, best_val = split_validation(sequences, s.validation_tokens)
    n_seq, S = sequences.shape
    out = Path(out) if out is not None else None
    plan = Planner(s, S, started=started, clock=clock, validates=best_val is not None, checkpoints=out is not None,
                   refit=not resume)
    per_step = plan.per_step
    batch_ids = BatchOrder(n_seq, s.batch_size, s.seed)

    fp = fingerprint(A)
    lens = TunedLens(A, model_name=lm.name, mid_translators=s.mid)
    opt = _optimizer(lens, s)
    prec = _precision(lm, s, out, resume, d)
    bf16 = bool(prec["bf16"])
    say(describe(prec))
    best = BestPerState(lm, lens, best_val, bf16, s.backoff, s.patience) if best_val is not None else None
    if resume:
        state = load_checkpoint(out, lens, opt, s, fp, best)
    else:
        state = _first_state(lm, lens, opt, s, sequences, best, prec, budgeted=plan.budgeted, clock=clock, say=say,
                             dist=d, progress=progress)
    plan.start(state)

    step_times: list[float] = list(state.timing.get("step_s", []))
    bar = tqdm(total=state.n_steps if state.n_steps < 10**9 else None, initial=state.step,
               desc=f"tuned lens {lm.name}", unit="step", disable=not progress)
    stop_at = None if max_steps is None else state.step + max_steps
    while state.step < state.n_steps and (stop_at is None or state.step < stop_at):
        t0 = clock()
        k = state.step
        ids = batch_ids(k)
        ids = ids[ddp.shard(len(ids), d)]  # this rank's share of the global batch (all of it in one process)
        opt.zero_grad(set_to_none=True)
        loss = train_step(lm, lens, sequences, ids, batch_size=s.batch_size, mid=s.mid, bf16=bf16, dist=d)
        plan.first_step(state, k, t0)
        for group in opt.param_groups:
            group["lr"] = lr_at(k, state.n_steps, s, state.warm)
        if best is not None:
            best.step_scaled(opt, lens)
        else:
            opt.step()
        state.step += 1
        t1 = clock()
        step_times.append(t1 - t0)
        if plan.budgeted:
            msg = plan.after_step(state, step_times, t1)
            if msg is not None:
                say(msg)
            # rank 0's clock decides the plan, so that every rank takes the same number of steps
            state.n_steps, state.every, state.warm = ddp.broadcast((state.n_steps, state.every, state.warm), d)
            bar.total = state.n_steps
            bar.refresh()
        if best is not None and plan.calibrated(state) and (
                state.step % state.every == 0 or state.step == state.n_steps):
            tv = clock()
            best.update(lens, opt, state.step)
            state.timing["validation_s"] = round(clock() - tv, 4)
        state.seconds += clock() - t0
        state.timing["step_s"] = [round(x, 4) for x in step_times]
        state.history.append([state.step, loss, round(state.seconds, 3)])
        bar.update(1)
        bar.set_postfix(kl=f"{loss:.3f}", tok_s=f"{state.step * per_step / max(state.seconds, 1e-9):.0f}")
        if out is not None and d.main and s.checkpoint_every and (
                state.step % s.checkpoint_every == 0 or state.step == stop_at) and state.step < state.n_steps:
            tc = clock()
            save_checkpoint(out, lens, opt, state, s, fp, best)
            dt = clock() - tc
            state.timing["checkpoint_s"] = round(dt, 4)
            state.seconds += dt
    bar.close()
    n_steps = state.n_steps
    selection = best.finish(lens, state.every) if best is not None and state.step >= n_steps else {}
    lens.training_info = _training_info(s, state, prec, per_step, selection, plan.record(state, step_times), d)
    if out is not None and state.step >= n_steps and d.main:
        lens.save(out)
    ddp.barrier(d)  # the lens is on disk before any rank returns
    return lens


def _precision(lm: LoadedModel, s: TrainSettings, out: Path | None, resume: bool, dist) -> dict:
    """The precision decision of the run (:mod:`.precision`): on resume the interrupted run's, read from its
    checkpoint before anything else; rank 0's on every rank."""
    from ...distributed import ddp

    if resume:
        if out is None:
            raise InputError("resume needs the output directory of the interrupted run")
        # read the state first: the precision decision must be the interrupted run's
        prec = resumed_precision(lm, read_checkpoint_info(out), s.bf16)
    else:
        prec = choose_precision(lm, s.bf16)
    return ddp.broadcast(prec, dist)  # every rank computes in rank 0's precision


def _first_state(lm: LoadedModel, lens: TunedLens, opt, s: TrainSettings, sequences: Tensor,
                 best: BestPerState | None, prec: dict, *, budgeted: bool, clock: Callable[[], float],
                 say: Callable[[str], None], dist, progress: bool) -> TrainState:
    """A new run's state before its first step: the identity judged on the held-out text (``best``), then the
    least-squares start (``s.init``), their seconds counted."""
    state = TrainState()
    state.precision = prec
    if best is not None:
        t0 = clock()
        best.update(lens, opt, 0)
        dt = clock() - t0
        state.seconds += dt
        state.timing["validation_s"] = round(dt, 4)
    if s.init == "least-squares":
        t0 = clock()
        deadline = t0 + s.init_max_fraction * 60.0 * s.max_minutes if budgeted else None
        state.init = regression_start(lm, lens, sequences, tokens=s.init_tokens, ridge=s.init_ridge,
                                      batch_size=s.batch_size, seed=s.seed, dist=dist, clock=clock,
                                      deadline=deadline, progress=progress)
        if best is not None:
            best.adopt(lens)  # per state: the start where it beats the identity on held-out text
        state.seconds += clock() - t0
        say(f"least-squares start on {state.init['tokens']} tokens in {state.init['seconds']:.1f} s")
    return state


def _training_info(s: TrainSettings, state: TrainState, prec: dict, per_step: int, selection: dict, budget: dict,
                   dist) -> dict:
    """The lens file's ``training`` record of a run that has taken ``state.step`` steps."""
    n_steps = state.n_steps
    info = {
        "settings": asdict(s), "steps": state.step, "n_steps": n_steps, "tokens_seen": state.step * per_step,
        "seconds": round(state.seconds, 2), "tokens_per_s": round(state.step * per_step / max(state.seconds, 1e-9), 2),
        "precision": state.precision or prec, "history": state.history, "complete": state.step >= n_steps,
        **({"selection": selection} if selection else {}), **({"time_budget": budget} if budget else {}),
        **({"init": state.init} if state.init else {}),
    }
    if dist.active:
        info["ranks"] = dist.world
    return info


# the precision decision's public names, importable from here as before they moved to lenscope.lenses.training.precision
# (and the hardware's part of it on to lenscope.training.precision)
__all__ = ["NATIVE_BF16_ENV", "BatchOrder", "TrainSettings", "choose_precision", "cpu_features", "forced_native_bf16",
           "kl_backward", "train_step", "train_tuned_lens"]
