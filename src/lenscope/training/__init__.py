"""What every training run in lenscope shares, whatever it trains (a tuned lens's translators, sparse
dictionaries): the plan (:mod:`.plan`: the number of steps under a token or time budget, the warm-up and linear
decay of the learning rate, the run's :class:`~.plan.TrainState`), the checkpoint's files and an optimizer's state
in them (:mod:`.checkpoint`), and whether the machine runs bfloat16 natively (:mod:`.precision`). Data-parallel
runs use :mod:`lenscope.distributed.ddp`. What a run computes (its objective, its parameters, its data) stays with
the method: ``lenses/training/``, ``features/dictionaries/train.py``.
"""

from .checkpoint import flatten_optimizer, read_state, unflatten_optimizer, write_state
from .plan import Planner, PlanSettings, TrainState, fit_steps, linear_lr, lr_at, warmup_steps
from .precision import NATIVE_BF16_ENV, cpu_features, forced_native_bf16

__all__ = ["NATIVE_BF16_ENV", "PlanSettings", "Planner", "TrainState", "cpu_features", "fit_steps",
           "flatten_optimizer", "forced_native_bf16", "linear_lr", "lr_at", "read_state", "unflatten_optimizer",
           "warmup_steps", "write_state"]
