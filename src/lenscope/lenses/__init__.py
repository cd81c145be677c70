"""Logit lens and tuned lens: training, evaluation, trajectories, lens files."""

from .data import read_text, split_text, token_sequences
from .evaluate import LensEvaluation, evaluate_lens
from .lenses import Lens, LogitLens, TunedLens, decode, fingerprint
from .train import TrainSettings, train_tuned_lens

__all__ = ["Lens", "LensEvaluation", "LogitLens", "TrainSettings", "TunedLens", "decode", "evaluate_lens",
           "fingerprint", "read_text", "split_text", "token_sequences", "train_tuned_lens"]
