"""What a tuned-lens training run is told (:class:`TrainSettings`; what it has done so far is the
:class:`~lenscope.training.plan.TrainState` every training run keeps).

Both go into the checkpoint (:mod:`lenscope.lenses.training.checkpoint`) and the settings into the lens file's
``training`` record; the planner (:mod:`lenscope.training.plan`, which reads these settings as its ``PlanSettings``)
fills in the state's plan.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import InputError


@dataclass
class TrainSettings:
    """Settings of :func:`~lenscope.lenses.training.train.train_tuned_lens` (all visible in the lens file's ``training``
    record)."""

    tokens: int = 32_768  # token budget (sequences x seq_len, rounded up to whole batches); with max_minutes
    # the most tokens to use (0: no limit)
    max_minutes: float | None = None  # time budget: the token budget follows from the measured speed
    seq_len: int = 256
    batch_size: int = 4  # sequences per optimizer step
    optimizer: str = "adam"  # "adam" or "sgd" (Nesterov momentum, as in the paper)
    lr: float | None = None  # default: 2e-3 for adam, 1.0 for sgd
    momentum: float = 0.9
    weight_decay: float = 1e-3
    warmup_fraction: float = 0.1
    seed: int = 0
    bf16: bool | None = None  # None: bfloat16 where the CPU runs it natively or a measurement says it is faster
    checkpoint_every: int = 0  # steps; 0 = no checkpoints
    keep_best: bool = True  # per state, keep the translator with the lowest validation KL (identity included)
    backoff: float = 0.3  # keep_best: a state worse than its best goes back to it, its step size times this
    patience: int = 1  # keep_best: failed checks in a row before the step size shrinks (it always goes back);
    # 2 is better on average but worse at some late layers (docs/lenses.md, issue 11), so not the default
    validation_tokens: int = 512  # held out of the training sequences for keep_best
    validate_every: int = 0  # steps between validations; 0 = about 12 per run
    mid: bool = False  # also train translators for the mid-layer (after-attention) states
    init: str = "least-squares"  # the translators' start: "least-squares" (training.warmstart) or "identity"
    init_tokens: int = 32_768  # least-squares start: tokens it reads (whole training sequences)
    init_ridge: float = 1e-3  # least-squares start: ridge towards the identity, relative to the mean diagonal
    init_max_fraction: float = 0.15  # time budget: the start stops reading text after this share of the budget

    def base_lr(self) -> float:
        if self.lr is not None:
            return self.lr
        return {"adam": 2e-3, "sgd": 1.0}[self.optimizer]

    def check(self) -> None:
        if self.optimizer not in ("adam", "sgd"):
            raise InputError(f"optimizer must be 'adam' or 'sgd', not {self.optimizer!r}")
        if self.init not in ("least-squares", "identity"):
            raise InputError(f"init must be 'least-squares' or 'identity', not {self.init!r}")
        if self.init_tokens < 1 or self.init_ridge < 0 or not 0.0 < self.init_max_fraction < 1.0:
            raise InputError("init_tokens must be >= 1, init_ridge >= 0 and init_max_fraction in (0, 1)")
        if self.patience < 1:
            raise InputError(f"patience must be >= 1, not {self.patience}")
        if not 0.0 < self.backoff <= 1.0:
            raise InputError(f"backoff must be in (0, 1], not {self.backoff}")
        if self.validation_tokens < 0 or self.validate_every < 0:
            raise InputError("validation_tokens and validate_every must be >= 0")
        if self.max_minutes is not None and not self.max_minutes > 0:
            raise InputError(f"max_minutes must be positive, not {self.max_minutes}")
        if self.tokens < (0 if self.max_minutes else 1) or self.seq_len < 2 or self.batch_size < 1:
            raise InputError("tokens, seq_len (>= 2) and batch_size must be positive (tokens may be 0, no limit, "
                             "with max_minutes)")


__all__ = ["TrainSettings"]
