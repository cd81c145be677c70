"""Steering: directions in the residual stream built from contrast pairs (:mod:`.directions`), added through the
engine's edits in a forward pass or while generating (:func:`lenscope.generate`'s ``edits``), and measured input by
input (:mod:`.evaluate`: per-input steerability, damage to held-out text; :mod:`.locus`: where the effect acts)."""

from .directions import (
    METHODS,
    SITE,
    Direction,
    add_edits,
    build_direction,
    generation_edits,
    steered_logits,
    steering_edits,
)
from .evaluate import DEFAULT_MULTIPLIERS, SteeringEvaluation, evaluate_steering
from .locus import SteeringLocus, steering_locus

__all__ = ["DEFAULT_MULTIPLIERS", "METHODS", "SITE", "Direction", "SteeringEvaluation", "SteeringLocus", "add_edits",
           "build_direction", "evaluate_steering", "generation_edits", "steered_logits", "steering_edits",
           "steering_locus"]
