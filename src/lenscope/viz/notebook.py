"""Results that draw themselves: in Jupyter (``_repr_html_``) and from a script (:func:`show`, a browser tab).

A result with a report view (its class's ``VIEW``: direct logit attribution, explanations, mixing maps and
matrices, lens trajectories, a generation, a steering evaluation; the report itself) is drawn by the report's
own script for that view (``viz/views/<key>/<key>.js``) from the same data the report embeds, on the page
of :func:`lenscope.viz.views.page` (the report page holding just that section, with the run card, header and
table of contents hidden; the result's ``to_html`` writes the same page); :func:`view` puts that page in an
``<iframe sandbox="allow-scripts" srcdoc="...">``, so its scripts and styles cannot touch the notebook's and
nothing is fetched. The frame tells
its parent its height (``postMessage``) so the output grows to fit where the notebook runs the output's script;
elsewhere it keeps its first height and scrolls.

Results without a report view (patching, tracing, neurons, circuits, lens evaluations...) show their
``plot()`` as an inline SVG (:meth:`lenscope.results.Result._repr_html_`).

>>> dla = lenscope.direct_logit_attribution(lm, "The capital of France is", " Paris", by_head=True)  # doctest: +SKIP
>>> dla                      # in Jupyter: the report's DLA view                                  # doctest: +SKIP
>>> lenscope.show(dla)       # from a script: the same view in a browser tab                      # doctest: +SKIP
>>> view(lenscope.explain_all(lm, text, target))  # several explanations side by side            # doctest: +SKIP
"""

from __future__ import annotations

import html
import tempfile
import uuid
import webbrowser
from pathlib import Path

from ..errors import InputError
from ..results import Result, figure_svg
from . import views
from .html import write_page
from .report.page import render
from .views import Shown, view_meta

__all__ = ["View", "view", "show", "view_html", "view_page", "view_meta", "report_html", "frame_html"]

# the first height of a whole report's frame, in pixels (a view's: its View.height; the frame then fits its page
# where scripts run)
REPORT_HEIGHT = 900
MAX_HEIGHT = 4000

# inside the frame: report the height of the page's content (the body's, which does not depend on the frame's own
# height, so resizing the frame never feeds back) to the parent; the frame's id is written into the script
_SIZER = ('<script>(function () {{ var last = 0; function post() {{ var h = Math.ceil('
          "document.body.getBoundingClientRect().height); if (h === last) return; last = h;\n"
          'try {{ parent.postMessage({{ lenscopeFrame: "{id}", height: h }}, "*"); }} catch (e) {{}} }}\n'
          'window.addEventListener("load", post); if (window.ResizeObserver) new ResizeObserver(post).observe('
          "document.body); setTimeout(post, 50); }})();</script>\n")
# outside: resize the frame whose page said so
_LISTENER = ('<script>(function () {{ var f = document.getElementById("lenscope-{id}"); if (!f) return;\n'
             'window.addEventListener("message", function (e) {{ var d = e.data;\n'
             'if (!d || d.lenscopeFrame !== "{id}" || e.source !== f.contentWindow) return;\n'
             "var h = Math.min({max}, Math.max(60, Math.ceil(+d.height) + 4));\n"
             'if (isFinite(h)) f.style.height = h + "px"; }}); }})();</script>')


class View(str):
    """The HTML shown in a notebook (an iframe, or an inline SVG), with ``page``: the self-contained page that
    :func:`show` writes (None for HTML that is its own page's body)."""

    page: str | None = None

    def _repr_html_(self) -> str:
        return str(self)


def _frame_id() -> str:
    return uuid.uuid4().hex[:12]


def _inject(page: str, head: str = "", body: str = "") -> str:
    """``page`` with ``head`` added at the end of its head and ``body`` at the end of its body."""
    if head:
        page = page.replace("</head>", head + "</head>", 1)
    if body:
        i = page.rfind("</body>")
        page = page[:i] + body + page[i:]
    return page


def view_page(key: str, payload: dict, meta: dict | None = None, *, title: str | None = None,
              blurb: str = "") -> str:
    """The self-contained page of one report view: the report page with just the section ``key`` holding
    ``payload`` (drawn by its view's script) under ``title`` (default: the key), its run card hidden
    (:func:`lenscope.viz.views.page`)."""
    return views.page(Shown(key, payload, view_meta() if meta is None else meta, title or key, blurb))


def frame_html(page: str, *, height: int = 500, title: str = "lenscope view") -> str:
    """``page`` in a sandboxed iframe (scripts run, but in their own origin: they cannot reach the notebook),
    as ``srcdoc`` escaped for a double-quoted attribute; the frame grows to its page's height."""
    fid = _frame_id()
    page = _inject(page, body=_SIZER.format(id=fid))
    return (f'<div class="lenscope-view"><iframe id="lenscope-{fid}" sandbox="allow-scripts" '
            f'title="{html.escape(title)}" style="width: 100%; height: {int(height)}px; border: 0; '
            f'resize: vertical; overflow: auto" srcdoc="{html.escape(page, quote=True)}"></iframe>'
            + _LISTENER.format(id=fid, max=MAX_HEIGHT) + "</div>")


def view_html(key: str, payload: dict, meta: dict | None = None, *, title: str | None = None, blurb: str = "",
              height: int | None = None) -> View:
    """One report view for a notebook: :func:`view_page` in a sandboxed iframe (a :class:`View`, whose
    ``page`` is the page itself)."""
    return _framed(view_page(key, payload, meta, title=title, blurb=blurb), key, title or key, height)


def height(key: str) -> int:
    """The first height of view ``key``'s frame (its :attr:`~lenscope.viz.views.View.height`; a whole report's:
    :data:`REPORT_HEIGHT`)."""
    if key == "report":
        return REPORT_HEIGHT
    v = views.get(key)
    return v.height if v is not None else views.View.height


def _framed(page: str, key: str, title: str, height_px: int | None = None) -> View:
    out = View(frame_html(page, height=height_px or height(key), title=title))
    out.page = page
    return out


def report_html(report: dict, height: int | None = None) -> View:
    """A whole report (:meth:`lenscope.report.Report.to_dict`) in a sandboxed iframe."""
    return _framed(render(report), "report", f"lenscope report · {report['meta']['model']}", height)


def view(obj) -> View:
    """The notebook HTML of a result (what its ``_repr_html_`` returns), of a report, or of a dict / list of
    results of one kind drawn together: :func:`~lenscope.explain_all`'s explanations (the attribution view,
    every method side by side), :func:`~lenscope.mixing.maps.context_mixing`'s scopes, several lenses'
    trajectories. The view is the one the result's class declares (``VIEW``, :mod:`lenscope.viz.views`); other
    results show their ``plot()`` as an inline SVG."""
    key = views.view_key(obj)
    if key == "report" and hasattr(obj, "to_dict"):
        return report_html(obj.to_dict())
    s = views.shown(obj)
    if s is not None:
        return _framed(views.page(s), s.key, s.title)
    fallback = getattr(views.get(key or ""), "fallback_plot", None)
    if fallback is not None:  # a view that does not apply to this result (MixingMatrices without rollout)
        return View(f'<div class="lenscope-plot">{figure_svg(obj.plot(**fallback))}</div>')
    if isinstance(obj, Result):
        return View(Result._repr_html_(obj))  # the plot as SVG (never the subclass's: it may call view)
    raise InputError(f"lenscope cannot show a {type(obj).__name__}; give a lenscope result or report")


class ReportView:
    """Mixin for the results that have a view of the report (before :class:`~lenscope.results.Result` in the bases):
    in a notebook such a result draws itself with that view, by the view's own script (:func:`view`;
    ``lenscope.show(result)`` opens it in a browser), and ``to_html`` writes that view's page."""

    def _repr_html_(self) -> str:
        return str(view(self))

    def to_html(self, path: str | Path | None = None) -> str:
        """The self-contained page of this result (:func:`lenscope.viz.views.standalone`); written to ``path``
        when given. Returns the HTML."""
        return views.standalone(self, path)


def _standalone(body: str, title: str) -> str:
    return ('<!doctype html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
            f'<meta name="generator" content="lenscope">\n<title>{html.escape(title)}</title>\n'
            '<style>body { margin: 16px; font: 13px system-ui, sans-serif; }</style>\n</head>\n<body>\n'
            f"{body}\n</body>\n</html>\n")


def show(result, path: str | Path | None = None, open_browser: bool = True) -> Path:
    """Write what ``result`` shows in a notebook as a self-contained page (``path``, default a new file in a
    temporary folder) and open it in the browser; returns the path. ``result``: anything :func:`view` takes."""
    v = view(result)
    page = v.page if v.page is not None else _standalone(str(v), f"lenscope · {type(result).__name__}")
    if path is None:
        path = Path(tempfile.mkdtemp(prefix="lenscope-show-")) / f"{type(result).__name__.lower()}.html"
    path = write_page(page, path)
    if open_browser:
        webbrowser.open(path.resolve().as_uri())
    return path
