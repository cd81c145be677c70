"""Results that draw themselves: in Jupyter (``_repr_html_``) and from a script (:func:`show`, a browser tab).

A result with a report view (direct logit attribution, explanations, mixing maps and matrices, lens
trajectories, a generation, the report itself) is drawn by the report's own script for that view
(``viz/report/assets/<key>.js``) from the same data the report embeds (:mod:`lenscope.viz.report.payloads`):
:func:`view_page` is the report page (:func:`lenscope.viz.report.render`) holding just that section, with the
run card, header and table of contents hidden; :func:`view_html` puts that page in an ``<iframe sandbox="allow-scripts"
srcdoc="...">``, so its scripts and styles cannot touch the notebook's and nothing is fetched. The frame tells
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
from ..version import __version__
from .html import write_page
from .report import payloads
from .report.page import render

# the default first height of each view's frame, in pixels (the frame then fits its page where scripts run)
HEIGHTS = {"prediction": 360, "trajectory": 560, "components": 470, "attribution": 520, "mixing": 720,
           "flow": 620, "circuit": 700, "generation": 620, "report": 900}
MAX_HEIGHT = 4000

# shown in the frame: the section's card only
_CSS = ("<style>header.top, nav.toc, #sec-run, footer { display: none !important; }\n"
        "main { padding: 8px 8px 10px !important; }</style>\n")
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


def view_meta(model: str = "", tokens=(), **extra) -> dict:
    """A report ``meta`` record for a view drawn outside a report: the fields the page and the scripts read,
    with neutral values where a result does not know them (``extra`` overrides any)."""
    tokens = list(tokens)
    meta = {"model": model or "?", "family": "?", "model_type": "?", "n_layers": 0, "d_model": 0, "causal": True,
            "placement": "?", "text": "".join(tokens), "tokens": tokens, "target": None, "target_id": None,
            "foil": None, "foil_id": None, "target_is_top_prediction": False, "lens": None,
            "versions": {"lenscope": __version__}, "created": ""}
    meta.update(extra)
    return meta


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
    """The self-contained page of one report view: the report page (:func:`~lenscope.viz.report.render`) with
    just the section ``key`` holding ``payload`` (drawn by ``assets/<key>.js``) under ``title`` (default: the
    key), its run card hidden."""
    meta = view_meta() if meta is None else meta
    report = {"meta": meta, "sections": [{"key": key, "title": title or key, "blurb": blurb,
                                          "data": payload}], "checks": [], "timings": {}, "ok": True}
    return _inject(render(report), head=_CSS)


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
    page = view_page(key, payload, meta, title=title, blurb=blurb)
    out = View(frame_html(page, height=height or HEIGHTS.get(key, 500), title=title or key))
    out.page = page
    return out


def report_html(report: dict, height: int | None = None) -> View:
    """A whole report (:meth:`lenscope.report.Report.to_dict`) in a sandboxed iframe."""
    page = render(report)
    title = f"lenscope report · {report['meta']['model']}"
    out = View(frame_html(page, height=height or HEIGHTS["report"], title=title))
    out.page = page
    return out


# ------------------------------------------------------------------------------------ results -> views


def _meta_of(res, **extra) -> dict:
    fields = {k: getattr(res, k) for k in ("target", "target_id", "foil", "foil_id", "causal") if hasattr(res, k)}
    return view_meta(getattr(res, "model", ""), getattr(res, "tokens", ()), **{**fields, **extra})


def _dla(res):
    what = repr(res.target) + (f" - {res.foil!r}" if res.foil is not None else "")
    return "components", payloads.components_payload(res), _meta_of(res), f"Direct logit attribution · {what}"


def _trajectories(trajs):
    t = trajs[0]
    lenses = " vs ".join(dict.fromkeys(x.lens for x in trajs))
    return "trajectory", payloads.trajectory_payload(list(trajs)), _meta_of(t), f"Prediction trajectory · {lenses}"


def _explanations(exs: dict):
    first = next(iter(exs.values()))
    named = [e for e in exs.values() if e.target is not None]
    meta = _meta_of(named[0] if named else first)
    title = "Context attribution · " + ", ".join(exs) + (f" · {named[0].what()}" if named else "")
    return "attribution", payloads.attribution_payload(exs), meta, title


def _mixing(maps: dict):
    first = next(iter(maps.values()))
    return "mixing", payloads.mixing_payload(maps), _meta_of(first), "Context-mixing maps · " + ", ".join(maps)


def _flow(mm):
    c = mm.contributions
    causal = bool((c.triu(1) == 0).all())  # whether a position ever draws on a later one
    return "flow", payloads.flow_payload(mm), _meta_of(mm, causal=causal), f"Information flow · {mm.method}"


def _generation(g):
    from .generation_html import TITLE, generation_payload

    d = g.to_dict()
    settings = d.get("settings") or {}
    run = {k: settings[k] for k in ("family", "model_type", "n_layers", "d_model", "placement") if k in settings}
    meta = view_meta(d.get("model", ""), d.get("tokens", ()), text=d.get("prompt", ""), **run)
    return "generation", generation_payload(d), meta, TITLE


def _single(obj):
    """``(key, payload, meta, title)`` of a result with a report view, else None (duck-typed on the class
    name: viz never imports a method)."""
    name = type(obj).__name__
    if name == "ComponentAttribution":
        return _dla(obj)
    if name == "Explanation":
        return _explanations({obj.method: obj})
    if name == "MixingMaps":
        return _mixing({obj.scope: obj})
    if name == "MixingMatrices" and obj.rollout is not None:
        return _flow(obj)
    if name == "PredictionTrajectory":
        return _trajectories([obj])
    if name == "Generation" and hasattr(obj, "to_dict"):
        return _generation(obj)
    return None


def _collection(obj):
    """A dict or list of results of one kind shown together (``explain_all``'s methods, ``context_mixing``'s
    scopes, trajectories of several lenses, the report's DLA views)."""
    items = list(obj.values()) if isinstance(obj, dict) else list(obj)
    if not items:
        raise InputError("nothing to show: the collection is empty")
    kinds = {type(x).__name__ for x in items}
    if len(kinds) != 1:
        raise InputError(f"a collection to show holds one kind of result, not {sorted(kinds)}")
    kind = kinds.pop()
    if kind == "Explanation":
        return _explanations(obj if isinstance(obj, dict) else {e.method: e for e in items})
    if kind == "MixingMaps":
        return _mixing(obj if isinstance(obj, dict) else {m.scope: m for m in items})
    if kind == "PredictionTrajectory":
        return _trajectories(items)
    if kind == "ComponentAttribution" and isinstance(obj, dict):
        key, payload, meta, title = _dla(items[0])
        return key, payloads.components_payload(obj), meta, title
    raise InputError(f"no view shows a collection of {kind}; show them one at a time")


def view(obj) -> View:
    """The notebook HTML of a result (what its ``_repr_html_`` returns), of a report, or of a dict / list of
    results of one kind drawn together: :func:`~lenscope.explain_all`'s explanations (the attribution view,
    every method side by side), :func:`~lenscope.mixing.maps.context_mixing`'s scopes, several lenses'
    trajectories. Other results: their ``plot()`` as an inline SVG."""
    if type(obj).__name__ == "Report" and hasattr(obj, "to_dict"):
        return report_html(obj.to_dict())
    spec = _collection(obj) if isinstance(obj, (dict, list, tuple)) else _single(obj)
    if spec is not None:
        key, payload, meta, title = spec
        return view_html(key, payload, meta, title=title)
    if type(obj).__name__ == "MixingMatrices":  # without its rollout (rollout=False): the last contributions
        return View(f'<div class="lenscope-plot">{figure_svg(obj.plot(which="contributions"))}</div>')
    if isinstance(obj, Result):
        return View(Result._repr_html_(obj))  # the plot as SVG (never the subclass's: it may call view)
    raise InputError(f"lenscope cannot show a {type(obj).__name__}; give a lenscope result or report")


class ReportView:
    """Mixin for the results that have a view of the report (before :class:`~lenscope.results.Result` in the bases):
    in a notebook such a result draws itself with that view, by the report's own script (:func:`view`;
    ``lenscope.show(result)`` opens it in a browser)."""

    def _repr_html_(self) -> str:
        return str(view(self))


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
