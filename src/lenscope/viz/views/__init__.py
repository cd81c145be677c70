"""The views: one folder each, found by discovery, and the one page every view is drawn on.

A view is the folder ``viz/views/<key>/``: its ``__init__.py`` declares ``VIEW``, an instance of a :class:`View`
subclass (its key, words, notebook height, the scripts it draws with, and :meth:`View.show`: a result, or a
collection of them, -> :class:`Shown`, with the payload conversion the report and ``lenscope serve`` share), and its
script ``<key>.js`` draws the data (``LS.sections["<key>"]``). A result class with a view says so once, as a class
attribute naming the view's key (``VIEW = "components"`` on ``ComponentAttribution``); viz never compares class
names and never imports a method.

Everything that shows views finds them here (:func:`registry`, :func:`get`): the report page loads a section's script
(:func:`lenscope.viz.report.render`), the section titles and blurbs of the report and of ``lenscope serve`` are the
views' words, ``lenscope serve`` serves the scripts and answers ``/api/view/<key>``, notebooks frame a view's page at
its height, ``to_html``, ``lenscope.show`` and the CLI's ``--html`` write :func:`page` (:func:`standalone`). A view
outside lenscope (a plug-in) is a folder of the same shape: :func:`add_folder`.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import pkgutil
import sys
from pathlib import Path
from typing import NamedTuple

from ...errors import InputError
from ...version import __version__

# shown when a page hides its run card (notebooks, show, to_html of a view without checks): the section's card only
HIDE_RUN_CARD = ("<style>header.top, nav.toc, #sec-run, footer { display: none !important; }\n"
                 "main { padding: 8px 8px 10px !important; }</style>\n")


class Words(NamedTuple):
    title: str
    blurb: str


@dataclasses.dataclass
class Shown:
    """What a page shows of a result: the view ``key`` (drawn by ``<key>.js``) with its ``data``, the run card's
    ``meta``, the section's ``title`` and ``blurb``, and the exactness ``checks`` and ``timings`` of the run card."""

    key: str
    data: dict
    meta: dict
    title: str
    blurb: str = ""
    checks: list = dataclasses.field(default_factory=list)
    timings: dict = dataclasses.field(default_factory=dict)

    def report(self) -> dict:
        """The report's plain data (:meth:`lenscope.report.Report.to_dict`) with this one section."""
        return {"meta": self.meta, "sections": [{"key": self.key, "title": self.title, "blurb": self.blurb,
                                                 "data": self.data}],
                "checks": list(self.checks), "timings": dict(self.timings),
                "ok": all(c["ok"] is not False for c in self.checks)}


class View:
    """One view, declared by its folder (``VIEW = MyView()`` in ``viz/views/<key>/__init__.py``).

    ``key``: the section key (the folder's name; its script ``<key>.js``); ``title``/``blurb``: the words of its card
    (the report's section, the app's card); ``order``: its place among the report's views; ``height``: its
    notebook frame's first height in pixels; ``uses``: the views whose scripts its script draws with (the features
    view opens feature cards); ``run_card``: whether its page shows the run card by default (views with their own
    checks); ``fallback_plot``: the ``plot()`` arguments of a result that this view does not apply to
    (:meth:`show` returned None). ``folder`` is set when the view is found."""

    key = ""
    title = ""
    blurb = ""
    order = 1000.0
    height = 500
    uses: tuple[str, ...] = ()
    run_card = False
    fallback_plot: dict | None = None
    folder: Path | None = None

    @property
    def words(self) -> Words:
        return Words(self.title, self.blurb)

    def show(self, obj, **options) -> Shown | None:
        """``obj`` (a result with this view, or a dict / list of them) -> what its page shows; None where the view
        does not apply to it. A view that no single result draws (the report's own views) refuses."""
        raise InputError(f"the {self.key} view is drawn by the report only; no result shows it alone")

    def script(self) -> str:
        """The view's script, ``<key>.js`` in its folder ("" when it has none)."""
        p = self.folder / f"{self.key}.js" if self.folder is not None else None
        return p.read_text(encoding="utf-8") if p is not None and p.is_file() else ""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(key={self.key!r})"


_REGISTRY: dict[str, View] = {}
_FOUND = False


def _register_module(mod) -> View:
    view = getattr(mod, "VIEW", None)
    if not isinstance(view, View) or not view.key:
        raise InputError(f"{mod.__name__} declares no VIEW (an instance of lenscope.viz.views.View with a key)")
    view.folder = Path(mod.__file__).resolve().parent
    _REGISTRY[view.key] = view
    return view


def _discover() -> None:
    global _FOUND
    if _FOUND:
        return
    _FOUND = True
    for info in pkgutil.iter_modules(__path__):
        if info.ispkg:
            _register_module(importlib.import_module(f"{__name__}.{info.name}"))


def registry() -> dict[str, View]:
    """Every view by key, in the report's order (:attr:`View.order`, then key)."""
    _discover()
    return dict(sorted(_REGISTRY.items(), key=lambda kv: (kv[1].order, kv[0])))


def get(key: str) -> View | None:
    """The view ``key``, or None."""
    _discover()
    return _REGISTRY.get(key)


def words() -> dict[str, Words]:
    """Each view's title and blurb, in the report's order."""
    return {k: v.words for k, v in registry().items()}


def add_folder(path: str | Path) -> View:
    """Register the view in folder ``path`` (a plug-in: ``__init__.py`` declaring ``VIEW``, and its script
    ``<key>.js``), found everywhere a view in lenscope is. Returns it; a view of the same key is replaced."""
    path = Path(path).resolve()
    if not (path / "__init__.py").is_file():
        raise InputError(f"{path} is not a view's folder: it has no __init__.py declaring VIEW")
    _discover()
    name = f"lenscope_view_plugin_{path.name}"
    spec = importlib.util.spec_from_file_location(name, path / "__init__.py", submodule_search_locations=[str(path)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return _register_module(mod)


def remove(key: str) -> None:
    """Forget the view ``key`` (a plug-in's, e.g. at the end of a test)."""
    _REGISTRY.pop(key, None)


# ---------------------------------------------------------------------------------------------- showing


def view_key(obj) -> str | None:
    """The view a result's class declares (its ``VIEW`` attribute), else None."""
    return getattr(type(obj), "VIEW", None)


def shown(obj, **options) -> Shown | None:
    """What the page of ``obj`` shows: a result with a view, or a dict / list of results of one class shown
    together; None for a result whose view does not apply (or that has none). ``options`` go to its view's
    :meth:`View.show` (the graph's thresholds)."""
    if isinstance(obj, (dict, list, tuple)):
        items = list(obj.values()) if isinstance(obj, dict) else list(obj)
        if not items:
            raise InputError("nothing to show: the collection is empty")
        kinds = {type(x) for x in items}
        if len(kinds) != 1:
            raise InputError(f"a collection to show holds one kind of result, not {sorted(k.__name__ for k in kinds)}")
        view = get(view_key(items[0]) or "")
        if view is None:
            raise InputError(f"no view shows a collection of {type(items[0]).__name__}; show them one at a time")
        return view.show(obj if isinstance(obj, dict) else items, **options)
    view = get(view_key(obj) or "")
    return view.show(obj, **options) if view is not None else None


def page(obj, *, title: str | None = None, run_card: bool = False, **options) -> str:
    """The self-contained page of ``obj`` (anything :func:`shown` takes, or a :class:`Shown`): the report page
    (:func:`~lenscope.viz.report.render`) with just its section, under ``title`` (default: the view's); the run
    card (and the page's header) hidden unless ``run_card``."""
    from ..report.page import render

    s = _shown(obj, **options)
    if title is not None:
        s = dataclasses.replace(s, title=title)
    out = render(s.report(), title=s.title)
    return out if run_card else out.replace("</head>", HIDE_RUN_CARD + "</head>", 1)


def _shown(obj, **options) -> Shown:
    s = obj if isinstance(obj, Shown) else shown(obj, **options)
    if s is None:
        raise InputError(f"a {type(obj).__name__} has no page; show its plot() instead")
    return s


def standalone(obj, path: str | Path | None = None, *, title: str | None = None, **options) -> str:
    """The page of ``obj`` on its own (``to_html``, the CLI's ``--html``): :func:`page` with the run card where its
    view shows one (:attr:`View.run_card`); written to ``path`` when given. Returns the HTML."""
    from ..html import write_page

    s = _shown(obj, **options)
    view = get(s.key)
    out = page(s, title=title, run_card=bool(view is not None and view.run_card))
    if path is not None:
        write_page(out, path)
    return out


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


def meta_of(res, **extra) -> dict:
    """:func:`view_meta` of a result: its model, tokens, target and foil where it has them."""
    fields = {k: getattr(res, k) for k in ("target", "target_id", "foil", "foil_id", "causal") if hasattr(res, k)}
    return view_meta(getattr(res, "model", ""), getattr(res, "tokens", ()), **{**fields, **extra})


def keyed(obj, attr: str) -> dict:
    """A dict of results as given, or a list / one result keyed by each one's ``attr`` (which must differ)."""
    if isinstance(obj, dict):
        return obj
    items = list(obj) if isinstance(obj, (list, tuple)) else [obj]
    out = {getattr(x, attr): x for x in items}
    if len(out) != len(items):
        raise InputError(f"these results share a {attr}: show those of one {attr} one at a time")
    return out


def one(obj, what: str, kinds: tuple = (list,)):
    """``obj`` itself, refusing a collection (``kinds``) for a view that shows one result at a time; ``what``: the
    collection in words (``"a list of feature cards"``)."""
    if isinstance(obj, kinds):
        raise InputError(f"no view shows {what}; show them one at a time")
    return obj


__all__ = ["View", "Shown", "Words", "registry", "get", "words", "add_folder", "remove", "view_key", "shown", "page",
           "standalone", "view_meta", "meta_of", "keyed", "one", "HIDE_RUN_CARD"]
