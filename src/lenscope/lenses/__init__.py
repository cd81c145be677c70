"""Logit lens, tuned lens and Patchscope lens: training, evaluation, trajectories, lens files."""

from ..data.text import read_text, split_text, token_sequences
from .cbe import CausalBasis, causal_bases, causal_basis
from .depth import DepthStats, TokenDepths, corpus_depths, text_depths
from .evaluate import LensEvaluation, evaluate_lens, evaluate_lenses
from .lenses import Lens, LogitLens, TunedLens, decode, fingerprint
from .patchscope import PatchscopeLens
from .training import TrainSettings, train_tuned_lens
from .trajectory import PredictionTrajectory, prediction_trajectory

__all__ = ["Lens", "LensEvaluation", "LogitLens", "TrainSettings", "TunedLens", "decode", "evaluate_lens",
           "evaluate_lenses", "fingerprint", "PredictionTrajectory", "prediction_trajectory", "read_text", "split_text",
           "token_sequences", "train_tuned_lens"]
__all__ += ["PatchscopeLens"]
__all__ += ["CausalBasis", "causal_basis", "causal_bases", "DepthStats", "TokenDepths", "corpus_depths", "text_depths"]
