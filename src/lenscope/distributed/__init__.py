"""Past one machine: dataset sweeps on Ray (:func:`run_sweep`). Nothing here imports Ray until it is asked for."""

from .sweep import run_sweep

__all__ = ["run_sweep"]
