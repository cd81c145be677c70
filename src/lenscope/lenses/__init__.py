"""Logit lens and tuned lens: training, evaluation, trajectories, lens files."""

from ..data.text import read_text, split_text, token_sequences
from .cbe import CausalBasis, causal_bases, causal_basis
from .depth import DepthStats, TokenDepths, corpus_depths, text_depths
from .evaluate import LensEvaluation, evaluate_lens, evaluate_lenses
from .lenses import Lens, LogitLens, TunedLens, decode, fingerprint
from .train import TrainSettings, train_tuned_lens
from .trajectory import PredictionTrajectory, prediction_trajectory

__all__ = ["Lens", "LensEvaluation", "LogitLens", "TrainSettings", "TunedLens", "decode", "evaluate_lens",
           "evaluate_lenses", "fingerprint", "PredictionTrajectory", "prediction_trajectory", "read_text", "split_text",
           "token_sequences", "train_tuned_lens"]
__all__ += ["CausalBasis", "causal_basis", "causal_bases", "DepthStats", "TokenDepths", "corpus_depths", "text_depths"]

# prompt-injection detection (lenscope.lenses.detect) imports scikit-learn: loaded on first use
_DETECT = ("DetectionFeatures", "DetectionResult", "build_labelled_set", "detection_features", "evaluate_detectors")


def __getattr__(name):
    if name in _DETECT:
        from . import detect as _detect

        return getattr(_detect, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
