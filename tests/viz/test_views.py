"""One view per result (issue 30): each result class declares its view once (``VIEW``); every view is one folder
(issue 43: ``viz/views/<key>/``, its ``VIEW`` with the payload function, and its script ``<key>.js``); ``to_html``,
``_repr_html_`` and ``lenscope.show`` write one page, the report page with that one section, and those pages draw
in Debian's chromium."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import pytest

import lenscope
from lenscope.attribution import ComponentAttribution, Explanation
from lenscope.features.dictionaries.cards import FeatureCard
from lenscope.features.dictionaries.result import FeatureActivations
from lenscope.features.graphs.graph import AttributionGraph
from lenscope.generation import Generation
from lenscope.lenses.trajectory import PredictionTrajectory, prediction_trajectory
from lenscope.mixing.alti import MixingMatrices
from lenscope.mixing.maps import MixingMaps
from lenscope.report import Report
from lenscope.results import Result
from lenscope.steering.evaluate import SteeringEvaluation
from lenscope.viz import notebook, views
from lenscope.viz.report import asset

from ..browser import CHROMIUM, isolated_page, sync_playwright, wait_drawn
from ..conftest import get_model
from ..tolerances import assert_same_computation

TEXT = "The capital of France is"
TARGET, FOIL = " capital", " of"
RESULTS = {ComponentAttribution: "components", Explanation: "attribution", PredictionTrajectory: "trajectory",
           MixingMaps: "mixing", MixingMatrices: "flow", Generation: "generation", SteeringEvaluation: "steering",
           FeatureActivations: "features", FeatureCard: "feature", AttributionGraph: "graph"}


@pytest.fixture(scope="module")
def lm():
    return get_model("tiny:llama")


def _section(page: str) -> dict:
    m = re.search(r'<script type="application/json" id="lenscope-data">(.*?)</script>', page, re.S)
    data = json.loads(m.group(1))
    (sec,) = data["sections"]
    return {"meta": data["meta"], **sec}


def test_every_result_declares_one_view_with_one_payload_function_and_one_script():
    for cls, key in RESULTS.items():
        assert cls.VIEW == key, cls
        view = views.get(key)
        assert view.folder.name == key and (view.folder / f"{key}.js").is_file()  # one folder: its view, its script
        assert type(view).show is not views.View.show  # its payload function
        assert asset(f"{key}.js") == view.script() and view.script().startswith("/*")
        assert f"LS.sections.{key} = " in asset(f"{key}.js")
    # every other view is one of the report's own (drawn from a report's context, by no single result)
    report_only = set(views.registry()) - set(RESULTS.values())
    assert report_only == {"prediction", "circuit", "alignment"}
    assert all(type(views.get(k)).show is views.View.show for k in report_only)
    assert Report.VIEW == "report" and Result.__dict__.get("VIEW") is None


@dataclass
class _Plain(Result):
    x: int = 1


def test_the_view_follows_the_class_not_its_name(lm):
    dla = lenscope.direct_logit_attribution(lm, TEXT, TARGET, FOIL, by_head=True)
    renamed = type("SomethingElse", (ComponentAttribution,), {})(**{f: getattr(dla, f) for f in
                                                                  dla.__dataclass_fields__})
    # a rename keeps its view
    assert_same_computation(_section(notebook.view(renamed).page), _section(notebook.view(dla).page),
                            why="one view of the same numbers")

    named = type("Explanation", (_Plain,), {})  # named like a result with a view, declaring none: no view
    out = notebook.view(named())
    assert out.page is None and "<iframe" not in out and out.startswith('<div class="lenscope-result"><b>Explanation')


def test_to_html_show_and_the_notebook_write_one_page(lm, tmp_path):
    traj = prediction_trajectory(lm, TEXT, k=3)
    page = traj.to_html(tmp_path / "t.html").read_text(encoding="utf-8")
    shown = notebook.show(traj, tmp_path / "s.html", open_browser=False).read_text(encoding="utf-8")
    assert page == shown == notebook.view(traj).page  # one page: the report page with one section
    assert 'data-section="trajectory"' in page and asset("trajectory.js") in page

    exs = lenscope.explain_all(lm, TEXT, TARGET, FOIL, methods=["logit", "alti-logit"])
    page = exs["logit"].to_html()
    assert page == notebook.view(exs["logit"]).page
    both = lenscope.attribution.explain_html(list(exs.values()))
    assert_same_computation(_section(both)["data"], _section(notebook.view(exs).page)["data"],
                            why="one view of the same explanations")
    with pytest.raises(lenscope.InputError, match="share a method"):
        lenscope.attribution.explain_html([exs["logit"], exs["logit"]])

    gen = lenscope.generate(lm, TEXT, max_new_tokens=2, explain=("logit",))
    standalone, framed = _section(gen.to_html()), _section(notebook.view(gen).page)
    assert standalone["key"] == framed["key"] == "generation"
    assert_same_computation(standalone["data"], framed["data"], why="one view of the same generation")
    assert 'id="sec-run"' in gen.to_html() and views.HIDE_RUN_CARD not in gen.to_html()  # its run card, shown
    assert views.HIDE_RUN_CARD in notebook.view(gen).page  # in a notebook: hidden


def test_collections_show_one_kind(lm):
    dla = lenscope.direct_logit_attribution(lm, TEXT, TARGET)
    ex = lenscope.explain(lm, TEXT, TARGET, method="logit")
    with pytest.raises(lenscope.InputError, match="one kind of result"):
        notebook.view([dla, ex])
    with pytest.raises(lenscope.InputError, match="empty"):
        notebook.view([])
    with pytest.raises(lenscope.InputError, match="no view shows a list of direct logit"):
        notebook.view([dla, dla])


pytestmark_browser = pytest.mark.skipif(sync_playwright is None or CHROMIUM is None,
                                        reason="chromium and Playwright: see tests/report/test_report_browser.py")


@pytestmark_browser
def test_to_html_pages_draw_in_chromium(lm, tmp_path):
    """The trajectory and explanation pages of ``to_html``: drawn by the report's scripts, with their controls
    and tooltips, no console error and no request."""
    a = prediction_trajectory(lm, TEXT, k=3)
    b = prediction_trajectory(lm, TEXT, k=3, mid=True)
    tpath = a.to_html(tmp_path / "t.html", [b])
    exs = lenscope.explain_all(lm, TEXT, TARGET, FOIL, methods=["logit", "alti-logit", "erasure"])
    epath = tmp_path / "e.html"
    lenscope.attribution.explain_html(list(exs.values()), epath)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        try:
            ctx, page, errors, blocked = isolated_page(browser, ("file:",), viewport={"width": 1400, "height": 1000})
            page.goto(tpath.resolve().as_uri())
            wait_drawn(page)
            # one heat map per lens, a cell per (state, position), each showing the lens's top-1 token
            sizes = page.eval_on_selector_all("#sec-trajectory svg.heat",
                                              "els => els.map(e => e.querySelectorAll('rect[data-r]').length)")
            assert sizes == [a.n_states * a.n_pos, b.n_states * b.n_pos]
            fills = "els => els.map(e => e.getAttribute('fill'))"
            before = page.eval_on_selector_all("#sec-trajectory svg.heat rect", fills)
            page.click("#sec-trajectory .seg button[data-value=kl]")
            assert page.eval_on_selector_all("#sec-trajectory svg.heat rect", fills) != before
            page.hover("#sec-trajectory svg.heat rect >> nth=3")
            assert page.locator("#ls-tip").is_visible() and "entropy" in page.inner_text("#ls-tip")

            page.goto(epath.resolve().as_uri())
            wait_drawn(page)
            strip = "#sec-attribution [data-role=strip] .tok"
            assert page.eval_on_selector_all(strip, "els => els.map(e => e.textContent)") == [
                t.replace(" ", "\u2423") for t in exs["logit"].tokens]
            before = page.eval_on_selector_all(strip, "els => els.map(e => e.style.background)")
            page.click("#sec-attribution .seg button[data-value=erasure]")
            assert page.eval_on_selector_all(strip, "els => els.map(e => e.style.background)") != before
            assert page.locator("#sec-attribution svg.attr-all rect[data-r]").count() == 3 * len(exs["logit"].tokens)
            assert page.locator("#sec-attribution svg.attr-layers rect[data-r]").count() > 0  # per-layer scores
            assert errors == [] and blocked == [], (errors, blocked)
            ctx.close()
        finally:
            browser.close()
