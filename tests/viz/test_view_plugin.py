"""A view is one folder (issue 43): a dummy view registered from one plug-in folder (its ``__init__.py``, declaring the
view, a result class whose ``VIEW`` names it and the report's section that computes it, and its script ``dummy.js``)
is found everywhere a view of lenscope's own is: the report page (``build_report``, ``lenscope report``), the
notebook display (``_repr_html_``, ``lenscope.show``, ``to_html``) and ``lenscope serve`` (its generic route
``/api/view/<key>``, ``/api/analyze``, ``/static/`` and a card of its page), without a line changed elsewhere."""

from __future__ import annotations

import json
import re
import sys
import textwrap

import pytest
from starlette.testclient import TestClient
from typer.testing import CliRunner

from lenscope.report import SECTIONS, build_report, section_keys
from lenscope.serve import create_app
from lenscope.viz import notebook, views

from ..browser import CHROMIUM, isolated_page, sync_playwright, wait_drawn
from ..conftest import get_model

TEXT = "the cat sat on the mat"

PLUGIN = '''
"""A dummy view: the number of tokens of the text."""
from dataclasses import dataclass, field

from lenscope.report.sections import Section
from lenscope.results import Result
from lenscope.viz.notebook import ReportView
from lenscope.viz.views import Shown, View, meta_of


@dataclass
class DummyResult(ReportView, Result):
    VIEW = "dummy"

    model: str = "m"
    tokens: list = field(default_factory=lambda: ["a", "b"])


class Dummy(View):
    key = "dummy"
    title = "Dummy view"
    blurb = "How many tokens the text has."
    height = 321

    def show(self, obj):
        return Shown(self.key, {"n": len(obj.tokens)}, meta_of(obj), f"{self.title} · {obj.model}")


class DummySection(Section):
    key = "dummy"

    def compute(self, ctx):
        return VIEW.show(DummyResult(ctx.lm.name, list(ctx.tokens))).data


VIEW = Dummy()
'''
SCRIPT = ('/* the dummy view */\n(function () { LS.sections.dummy = function (body, d) { '
          'LS.el("p", "dummy", "tokens: " + d.n, body); }; })();\n')


@pytest.fixture
def plugin(tmp_path):
    folder = tmp_path / "dummy"
    folder.mkdir()
    (folder / "__init__.py").write_text(textwrap.dedent(PLUGIN))
    (folder / "dummy.js").write_text(SCRIPT)
    saved = list(SECTIONS)
    view = views.add_folder(folder)
    yield view
    views.remove("dummy")
    SECTIONS[:] = saved


def _sections(page: str) -> list[dict]:
    m = re.search(r'<script type="application/json" id="lenscope-data">(.*?)</script>', page, re.S)
    return json.loads(m.group(1))["sections"]


def test_found_by_the_registry_and_the_report(plugin, tmp_path):
    assert views.get("dummy") is plugin and list(views.registry())[-1] == "dummy" and "dummy" in section_keys()
    lm = get_model("tiny:llama")
    rep = build_report(lm, TEXT)  # a default view of the report: its section applies to every model
    sec = rep.sections[-1]
    assert sec["key"] == "dummy" and sec["title"] == "Dummy view" and sec["data"] == {"n": len(rep.meta["tokens"])}
    page = rep.html()
    assert SCRIPT in page and 'data-section="dummy"' in page  # its script, found in its folder
    assert SCRIPT not in build_report(lm, TEXT, sections=["prediction"]).html()  # only where it is shown

    from lenscope.cli import app  # lenscope report: the same section by its key

    out = tmp_path / "r.html"
    r = CliRunner().invoke(app, ["report", TEXT, "--model", "tiny:llama", "--sections", "prediction,dummy",
                                 "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert [s["key"] for s in _sections(out.read_text())] == ["prediction", "dummy"] and SCRIPT in out.read_text()


def test_found_by_the_notebook_show_and_to_html(plugin, tmp_path):
    result = sys.modules[type(plugin).__module__].DummyResult("m", ["x", "y", "z"])  # the plug-in's result class
    markup = result._repr_html_()
    assert "<iframe" in markup and "height: 321px" in markup  # its frame, at its height
    page = notebook.view(result).page
    assert SCRIPT in page and _sections(page) == [{"key": "dummy", "data": {"n": 3}}]
    path = notebook.show(result, tmp_path / "s.html", open_browser=False)
    assert path.read_text() == page == result.to_html()
    assert views.standalone(result) == page  # the CLI's --html writes this page


def test_found_by_serve(plugin):
    app = create_app(["tiny:llama"], loader=get_model)
    with TestClient(app) as c:
        r = c.post("/api/view/dummy", json={"model": "tiny:llama", "text": TEXT})
        assert r.status_code == 200, r.text
        d = r.json()
        assert d["key"] == "dummy" and d["title"] == "Dummy view" and d["data"] == {"n": len(d["tokens"])}
        a = c.post("/api/analyze", json={"text": TEXT, "sections": ["dummy"]}).json()
        assert a["sections"] == {"dummy": d["data"]}
        page = c.get("/api/view/dummy", params={"text": TEXT})
        assert page.status_code == 200 and SCRIPT in page.text
        assert _sections(page.text) == [{"key": "dummy", "data": d["data"]}]
        js = c.get("/static/dummy.js")
        assert js.status_code == 200 and js.text == SCRIPT and js.headers["content-type"].startswith("text/javascript")
        # the same route answers lenscope's own views
        p = c.post("/api/view/prediction", json={"text": TEXT}).json()
        assert p["key"] == "prediction" and "verify" in p["data"]
        home = c.get("/").text  # the app's page: a card for it, asked for on its own, drawn by its script
        assert 'data-section="dummy"' in home and '<script src="static/dummy.js">' in home
        assert "dummy" in re.search(r'data-groups="([^"]*)"', home).group(1).split(";")
        bad = c.post("/api/view/nope", json={"text": TEXT})
        assert bad.status_code == 404 and "no view 'nope'" in bad.json()["error"]
    views.remove("dummy")
    with TestClient(create_app(["tiny:llama"], loader=get_model)) as c:
        assert c.get("/static/dummy.js").status_code == 404  # gone with its folder


@pytest.mark.skipif(sync_playwright is None or CHROMIUM is None,
                    reason="chromium and Playwright: see tests/report/test_report_browser.py")
def test_its_script_draws_it_in_chromium(plugin, tmp_path):
    """The report page with the plug-in's section, in Debian's chromium: drawn by its own script, beside lenscope's
    views, no console error and no request."""
    rep = build_report(get_model("tiny:llama"), TEXT, sections=["prediction", "dummy"])
    path = rep.write(tmp_path / "r.html")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        try:
            ctx, page, errors, blocked = isolated_page(browser, ("file:",))
            page.goto(path.resolve().as_uri())
            wait_drawn(page)
            assert page.text_content("#sec-dummy p.dummy") == f"tokens: {len(rep.meta['tokens'])}"
            assert page.locator("#sec-prediction svg.topk").count() == 1
            assert errors == [] and blocked == []
            ctx.close()
        finally:
            browser.close()
