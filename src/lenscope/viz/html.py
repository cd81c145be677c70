"""Writing self-contained HTML pages (nothing fetched from anywhere), and the ``to_html`` pages of lens
trajectories and explanations: each is the report page holding just that result's view (:mod:`lenscope.viz.views`),
drawn by that view's own script (``viz/views/<key>/<key>.js``).

The data travel as JSON in a ``<script type="application/json">`` block in which ``<``, ``>``, ``&`` and ``/``
are written as JSON escapes (:func:`script_json`), so no token string (``"</script>"``, ``"<b>"``, a URL) can end
the block or appear as markup; the scripts place token strings with ``textContent`` only.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import InputError


def script_json(obj) -> str:
    """``obj`` as JSON that is safe inside a ``<script>`` block (no ``<``, ``>``, ``&`` or ``/`` characters)."""
    text = json.dumps(obj, ensure_ascii=False, allow_nan=False)
    for ch, esc in (("&", "\\u0026"), ("<", "\\u003c"), (">", "\\u003e"), ("/", "\\/"),
                    ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):
        text = text.replace(ch, esc)
    return text


def write_page(page: str, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page, encoding="utf-8")
    return path


def trajectory_html(trajs, path: str | Path, title: str | None = None) -> Path:
    """Write the page of prediction trajectories side by side (``PredictionTrajectory.to_html``); returns its path.

    ``trajs`` is a :class:`~lenscope.lenses.trajectory.PredictionTrajectory` or a list of them (e.g. the tuned
    and the logit lens on the same text). The page is the report page holding just the trajectory view
    (:func:`lenscope.viz.views.page`, drawn by ``trajectory.js``): one heat map per lens whose cells show its
    top-1 token; hovering a cell shows the state, position, top-k tokens with their probabilities, entropy and
    KL; buttons switch the colour between entropy, KL and top-1 probability (one scale for all grids).
    """
    from .views import page

    trajs = [trajs] if not isinstance(trajs, (list, tuple)) else list(trajs)
    if not trajs:
        raise InputError("no trajectories given; pass at least one PredictionTrajectory")
    return write_page(page(trajs, title=title), path)


def explanation_html(results, path: str | Path | None = None, title: str | None = None) -> str:
    """The page of one or several :class:`~lenscope.attribution.explanation.Explanation` of the same text, one
    per method (``Explanation.to_html``, ``lenscope.attribution.explain_html``): the report page holding just the
    context-attribution view (:func:`lenscope.viz.views.page`, drawn by ``attribution.js``); written to
    ``path`` when given. Returns the HTML."""
    from .views import page

    results = list(results) if isinstance(results, (list, tuple)) else [results]
    if not results:
        raise InputError("no explanations given")
    out = page(results, title=title)
    if path is not None:
        write_page(out, path)
    return out
