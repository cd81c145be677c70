"""Training a tuned lens: the settings and state, the planner, the objective, precision, warm start, checkpoints and
the choice of the best translators; :func:`train_tuned_lens` runs them (also exported as ``lenscope.lenses``)."""

from .settings import TrainSettings
from .train import train_tuned_lens

__all__ = ["TrainSettings", "train_tuned_lens"]
