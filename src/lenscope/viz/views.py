"""Which view draws a result, and the one page every view is drawn on.

A result class with a view says so once, as a class attribute naming the view's key (``VIEW = "components"`` on
``ComponentAttribution``); viz never compares class names and never imports a method. Each key has

- one payload function here, registered with :func:`register`: a result of that class, or a collection of them
  (a dict or list, e.g. ``explain_all``'s methods), -> :class:`Shown` (the view's data, the run card's fields and
  the title), its data computed by the conversion the report shares (:mod:`lenscope.viz.report.payloads`);
- one script, ``viz/report/assets/<key>.js``, that draws the data (:func:`lenscope.viz.report.render`).

Every way of showing a result goes through :func:`page` (the report page holding just that section): ``to_html``,
``_repr_html_`` and ``lenscope.show`` (:mod:`lenscope.viz.notebook`); the report and ``lenscope serve`` draw the
same sections with the same scripts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from ..errors import InputError
from ..version import __version__
from .report import payloads
from .report.page import render
from .report.words import WORDS

# shown when a page hides its run card (notebooks, show, to_html of a view without checks): the section's card only
HIDE_RUN_CARD = ("<style>header.top, nav.toc, #sec-run, footer { display: none !important; }\n"
                 "main { padding: 8px 8px 10px !important; }</style>\n")


@dataclasses.dataclass
class Shown:
    """What a page shows of a result: the view ``key`` (drawn by ``assets/<key>.js``) with its ``data``, the run
    card's ``meta``, the section's ``title`` and ``blurb``, and the exactness ``checks`` and ``timings`` of the run
    card."""

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


# view key -> payload function: (a result, or a dict / list of results of one class) -> Shown, or None where
# the view does not apply to this result (then it shows its plot)
VIEWS: dict[str, Callable[[Any], Shown | None]] = {}
# plot() arguments for a result of a view that does not apply to it (MixingMatrices without their rollout)
FALLBACK_PLOT: dict[str, dict] = {"flow": {"which": "contributions"}}


def register(key: str):
    """Register the decorated function as the payload function of view ``key`` (its script:
    ``assets/<key>.js``)."""

    def deco(fn):
        VIEWS[key] = fn
        return fn

    return deco


def view_key(obj) -> str | None:
    """The view a result's class declares (its ``VIEW`` attribute), else None."""
    return getattr(type(obj), "VIEW", None)


def shown(obj) -> Shown | None:
    """What the page of ``obj`` shows: a result with a view, or a dict / list of results of one class shown
    together; None for a result whose view does not apply (or that has none)."""
    if isinstance(obj, (dict, list, tuple)):
        items = list(obj.values()) if isinstance(obj, dict) else list(obj)
        if not items:
            raise InputError("nothing to show: the collection is empty")
        kinds = {type(x) for x in items}
        if len(kinds) != 1:
            raise InputError(f"a collection to show holds one kind of result, not {sorted(k.__name__ for k in kinds)}")
        key = view_key(items[0])
        if key not in VIEWS:
            raise InputError(f"no view shows a collection of {type(items[0]).__name__}; show them one at a time")
        return VIEWS[key](obj if isinstance(obj, dict) else items)
    key = view_key(obj)
    return VIEWS[key](obj) if key in VIEWS else None


def page(obj, *, title: str | None = None, run_card: bool = False) -> str:
    """The self-contained page of ``obj`` (anything :func:`shown` takes, or a :class:`Shown`): the report page
    (:func:`~lenscope.viz.report.render`) with just its section, under ``title`` (default: the view's); the run
    card (and the page's header) hidden unless ``run_card``."""
    s = obj if isinstance(obj, Shown) else shown(obj)
    if s is None:
        raise InputError(f"a {type(obj).__name__} has no page; show its plot() instead")
    if title is not None:
        s = dataclasses.replace(s, title=title)
    out = render(s.report(), title=s.title)
    return out if run_card else out.replace("</head>", HIDE_RUN_CARD + "</head>", 1)


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


def _meta_of(res, **extra) -> dict:
    fields = {k: getattr(res, k) for k in ("target", "target_id", "foil", "foil_id", "causal") if hasattr(res, k)}
    return view_meta(getattr(res, "model", ""), getattr(res, "tokens", ()), **{**fields, **extra})


def _keyed(obj, attr: str) -> dict:
    """A dict of results as given, or a list / one result keyed by each one's ``attr`` (which must differ)."""
    if isinstance(obj, dict):
        return obj
    items = list(obj) if isinstance(obj, (list, tuple)) else [obj]
    out = {getattr(x, attr): x for x in items}
    if len(out) != len(items):
        raise InputError(f"these results share a {attr}: show those of one {attr} one at a time")
    return out


# ---------------------------------------------------------------------------------------------- the views


@register("components")
def components_view(obj) -> Shown:
    if isinstance(obj, list):
        raise InputError("no view shows a list of direct logit attributions; give a dict {name: result} "
                         "(the report's difference, target and foil) or one result")
    first = next(iter(obj.values())) if isinstance(obj, dict) else obj
    what = repr(first.target) + (f" - {first.foil!r}" if first.foil is not None else "")
    return Shown("components", payloads.components_payload(obj), _meta_of(first),
                 f"{WORDS['components'].title} · {what}")


@register("trajectory")
def trajectory_view(obj) -> Shown:
    trajs = list(obj.values()) if isinstance(obj, dict) else list(obj) if isinstance(obj, (list, tuple)) else [obj]
    lenses = " vs ".join(dict.fromkeys(t.lens for t in trajs))
    return Shown("trajectory", payloads.trajectory_payload(trajs), _meta_of(trajs[0]),
                 f"{WORDS['trajectory'].title} · {lenses} lens · {trajs[0].model}")


@register("attribution")
def attribution_view(obj) -> Shown:
    exs = _keyed(obj, "method")
    first = next(iter(exs.values()))
    named = [e for e in exs.values() if e.target is not None]
    title = f"{WORDS['attribution'].title} · " + ", ".join(exs) + (f" · {named[0].what()}" if named else "")
    return Shown("attribution", payloads.attribution_payload(exs), _meta_of(named[0] if named else first), title)


@register("mixing")
def mixing_view(obj) -> Shown:
    maps = _keyed(obj, "scope")
    first = next(iter(maps.values()))
    return Shown("mixing", payloads.mixing_payload(maps), _meta_of(first),
                 f"{WORDS['mixing'].title} · " + ", ".join(maps))


@register("flow")
def flow_view(mm) -> Shown | None:
    if isinstance(mm, (dict, list)):
        raise InputError("no view shows a collection of mixing matrices; show them one at a time")
    if mm.rollout is None:  # without its rollout (rollout=False) the view does not apply
        return None
    causal = bool((mm.contributions.triu(1) == 0).all())  # whether a position ever draws on a later one
    return Shown("flow", payloads.flow_payload(mm), _meta_of(mm, causal=causal), f"{WORDS['flow'].title} · {mm.method}")


@register("generation")
def generation_view(obj, *, lm=None, meta: dict | None = None, tolerance: float | None = None) -> Shown:
    """A generation (or its ``to_dict()``): its data, and each method's largest invariant error as a check
    (against ``tolerance``, by default the model's completeness tolerance when ``lm`` is given; else reported)."""
    from . import generation_html as g

    if isinstance(obj, list):
        raise InputError("no view shows a collection of generations; show them one at a time")
    d = g.as_dict(obj)
    if tolerance is None and lm is not None:
        from ..models.verify import completeness_tolerance

        tolerance = completeness_tolerance(lm)
    checks = []
    for m, v in g.invariant_errors(d).items():
        if v is None:
            continue
        ok = None if tolerance is None else bool(v <= tolerance)
        checks.append({"section": g.KEY, "name": g.check_name(m), "value": float(v), "tolerance": tolerance, "ok": ok,
                       "note": ""})
    seconds = d.get("seconds")
    return Shown(g.KEY, g.generation_payload(d), g.run_meta(d, lm, meta), g.TITLE, g.BLURB, checks,
                 {"generate": float(seconds)} if seconds is not None else {})


@register("steering")
def steering_view(obj) -> Shown:
    """A steering evaluation (or its ``to_dict()``): its data, and the effect at multiplier 0 as a check."""
    from . import steering_html as s

    if isinstance(obj, list):
        raise InputError("no view shows a collection of steering evaluations; show them one at a time")
    d = s.as_dict(obj)
    zero = [abs(e) for r in d["layers"].values() for a, e in zip(r["multipliers"], r["mean_effect"])
            if a == 0 and e is not None]
    checks = [{"section": s.KEY, "name": "effect at multiplier 0 (no edit applied)", "value": max(zero),
               "tolerance": 0.0, "ok": max(zero) == 0.0, "note": ""}] if zero else []
    seconds = d.get("seconds") or {}
    return Shown(s.KEY, s.steering_payload(d), s.run_meta(d), s.TITLE, s.BLURB, checks,
                 {k: float(v) for k, v in seconds.items() if k != "total"})


@register("features")
def features_view(obj, cards=()) -> Shown:
    """The features of a prompt (``FeatureActivations``), with the ``cards`` of some of its features."""
    if isinstance(obj, list):
        raise InputError("no view shows a list of feature activations; show them one at a time")
    return Shown("features", payloads.features_payload(obj, cards), _meta_of(obj),
                 "Features · " + ", ".join(obj.sites))


@register("feature")
def feature_view(obj) -> Shown:
    """One feature's card (``FeatureCard``); a list of cards is refused (show them through the features view)."""
    if isinstance(obj, list):
        raise InputError("no view shows a list of feature cards; show them one at a time")
    d = payloads.feature_payload(obj)
    return Shown("feature", d, view_meta(d["model"], ()), f"Feature {d['site']} #{d['feature']}")


@register("graph")
def graph_view(obj, *, node_threshold: float = 0.8, edge_threshold: float = 0.98) -> Shown:
    """An attribution graph (``AttributionGraph``), pruned at ``node_threshold`` / ``edge_threshold`` (the page's
    slider prunes further), with its exactness checks."""
    if isinstance(obj, list):
        raise InputError("no view shows a list of attribution graphs; show them one at a time")
    d = payloads.graph_payload(obj, node_threshold, edge_threshold)
    checks = [{"section": "graph", "name": name, "value": v, "tolerance": tol,
               "ok": None if tol is None or v is None else bool(v <= tol), "note": ""}
              for name, v, tol in payloads.graph_checks(obj, d)]
    w = WORDS["graph"]
    return Shown("graph", d, _meta_of(obj), f"{w.title} · {obj.model}", w.blurb, checks,
                 {"graph": float(obj.seconds)})
