"""The report page (``lenscope report``): one self-contained HTML page drawn from a report's plain data.

The data (``meta``, ``sections``, ``checks``, ``timings``, ``ok``: :meth:`lenscope.report.Report.to_dict`) are
computed by :mod:`lenscope.report`; this package only writes the page (:func:`render`) with the shared
``assets/`` and each section's script (its view's folder, :mod:`lenscope.viz.views`). Nothing here calls a method.
"""

from .page import asset, render

__all__ = ["asset", "render"]
