"""Moved: the heat maps of intervention results are drawn by :mod:`lenscope.viz.intervention_plots` (a methods
package computes, viz draws); ``heatmap`` and ``heatmaps`` stay importable from here."""

from ..viz.intervention_plots import heatmap, heatmaps

__all__ = ["heatmap", "heatmaps"]
