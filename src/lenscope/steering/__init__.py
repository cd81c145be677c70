"""Steering: directions in the residual stream built from contrast pairs (:mod:`.directions`, by the builders of
:mod:`.builders`), added through the engine's edits in a forward pass or while generating
(:func:`lenscope.generate`'s ``edits``), and measured input by input (:mod:`.evaluate`: per-input steerability,
damage to held-out text; :mod:`.locus`: where the effect acts).

The package's face imports no torch (the command line's ``--help`` reads :mod:`.builders`); its names are
imported on first use."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .builders import Builder

if TYPE_CHECKING:
    from .directions import (
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

# name -> the module that defines it, imported when first asked for
_LAZY = {
    **dict.fromkeys(("SITE", "Direction", "add_edits", "build_direction", "generation_edits", "steered_logits",
                     "steering_edits"), ".directions"),
    **dict.fromkeys(("DEFAULT_MULTIPLIERS", "SteeringEvaluation", "evaluate_steering"), ".evaluate"),
    **dict.fromkeys(("SteeringLocus", "steering_locus"), ".locus"),
}


def __getattr__(name: str):
    if name == "METHODS":  # the builders' names, read when asked for (a registered builder is in it)
        from .builders import names

        return names()
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | {"METHODS"})


__all__ = ["DEFAULT_MULTIPLIERS", "METHODS", "SITE", "Builder", "Direction", "SteeringEvaluation", "SteeringLocus",
           "add_edits", "build_direction", "evaluate_steering", "generation_edits", "steered_logits",
           "steering_edits", "steering_locus"]
