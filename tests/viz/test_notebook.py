"""Results that draw themselves (``_repr_html_``, ``lenscope.show``): each view's frame holds the report page with
the section's own script and exactly the data the report embeds for the same input; results without a report view
show their plot as inline SVG; ``show`` writes the page and opens it; in chromium the frame draws with no error and
no request."""

from __future__ import annotations

import html
import json
import re
from dataclasses import dataclass
from html.parser import HTMLParser

import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch

import lenscope
from lenscope.interventions import activation_patching
from lenscope.lenses import LogitLens
from lenscope.lenses.trajectory import prediction_trajectory
from lenscope.mixing.alti import mixing_matrices
from lenscope.mixing.maps import context_mixing
from lenscope.report import build_report, unpack
from lenscope.results import Result
from lenscope.viz import notebook
from lenscope.viz.report import asset

from ..browser import CHROMIUM, isolated_page, sync_playwright, wait_drawn
from ..conftest import get_model
from ..tolerances import assert_same_computation

TEXT = "The capital of France is"
TARGET, FOIL = " capital", " of"


@pytest.fixture(scope="module")
def lm():
    return get_model("tiny:llama")


@pytest.fixture(scope="module")
def report(lm):
    return build_report(lm, TEXT, TARGET, FOIL)


class _Frames(HTMLParser):
    """Every iframe's attributes (``srcdoc`` unescaped, as the browser reads it)."""

    def __init__(self):
        super().__init__()
        self.frames: list[dict] = []

    def handle_starttag(self, tag, attrs):
        if tag == "iframe":
            self.frames.append(dict(attrs))


def _frame(markup: str) -> dict:
    p = _Frames()
    p.feed(markup)
    assert len(p.frames) == 1, markup[:300]
    return p.frames[0]


def _page_data(page: str) -> dict:
    m = re.search(r'<script type="application/json" id="lenscope-data">(.*?)</script>', page, re.S)
    assert m, "the page has no data block"
    return json.loads(m.group(1))


def _close(a, b, path="") -> None:
    """Equal JSON data, floats to 1e-5 relative, packed arrays compared unpacked."""
    if isinstance(a, dict) and set(a) == {"shape", "f32"}:
        assert a["shape"] == b["shape"], path
        assert np.allclose(unpack(a), unpack(b), rtol=1e-5, atol=1e-7), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), (path, list(a), list(b))
        for k in a:
            _close(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _close(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and isinstance(b, float):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-7), path
    else:
        assert a == b, (path, a, b)


def _section(report, key) -> dict:
    (s,) = [s for s in report.sections if s["key"] == key]
    return s["data"]


def _shown(obj, key: str) -> dict:
    """The data of the one section in ``obj``'s notebook frame, after checking the frame and its page."""
    markup = obj._repr_html_() if hasattr(obj, "_repr_html_") else str(notebook.view(obj))
    fr = _frame(markup)
    assert fr["sandbox"] == "allow-scripts"  # scripts run, in their own origin: no access to the notebook
    page = fr["srcdoc"]
    assert asset(f"{key}.js") in page and asset("core.js") in page  # the report's own scripts, inline
    assert not re.search(r"<script[^>]+src=|<link[^>]+href=", page)  # nothing fetched
    data = _page_data(page)
    assert [s["key"] for s in data["sections"]] == [key]
    return data["sections"][0]["data"]


def test_dla_view_is_the_reports(lm, report):
    rep = _section(report, "components")
    dla = lenscope.direct_logit_attribution(lm, TEXT, TARGET, FOIL, by_head=True)
    shown = _shown(dla, "components")
    assert list(shown["views"]) == ["difference"] and shown["target"] == TARGET and shown["foil"] == FOIL
    _close(shown["views"]["difference"], rep["views"]["difference"])
    # the report's three logits side by side: its whole payload
    both = {"difference": dla, "target": lenscope.direct_logit_attribution(lm, TEXT, TARGET, by_head=True),
            "foil": lenscope.direct_logit_attribution(lm, TEXT, FOIL, by_head=True)}
    _close(_shown(both, "components"), rep)
    # without a foil the one view is the target's
    alone = _shown(both["target"], "components")
    assert list(alone["views"]) == ["target"] and alone["foil"] is None
    _close(alone["views"]["target"], rep["views"]["target"])


def test_explanations_view_is_the_reports(lm, report):
    rep = _section(report, "attribution")
    exs = {}
    for m in rep["methods"]:
        rollout = m in ("alti", "value-zeroing")
        exs[m] = lenscope.explain(lm, TEXT, None if rollout else TARGET, None if rollout else FOIL, method=m,
                                  **({"steps": 32} if m == "ig" else {}))
    _close(_shown(exs, "attribution"), rep)
    one = _shown(exs["alti-logit"], "attribution")
    assert list(one["methods"]) == ["alti-logit"] and one["target"] == TARGET and one["foil"] == FOIL
    _close(one["methods"]["alti-logit"], rep["methods"]["alti-logit"])
    _close(one["layers"]["alti-logit"], rep["layers"]["alti-logit"])


def test_mixing_flow_and_trajectory_views_are_the_reports(lm, report):
    maps = context_mixing(lm, TEXT)
    _close(_shown(maps, "mixing"), _section(report, "mixing"))
    one = _shown(maps["atb"], "mixing")
    assert one["scopes"] == ["atb"]
    _close(one["maps"]["atb"], _section(report, "mixing")["maps"]["atb"])

    mm = mixing_matrices(lm.anatomy, lenscope.trace(lm, TEXT), "alti", model_name=lm.name)
    _close(_shown(mm, "flow"), _section(report, "flow"))
    meta = _page_data(_frame(mm._repr_html_())["srcdoc"])["meta"]
    assert meta["causal"] is True and meta["tokens"] == report.meta["tokens"]  # flow.js reads meta.causal

    bare = mixing_matrices(lm.anatomy, lenscope.trace(lm, TEXT), "alti", model_name=lm.name, rollout=False)
    assert bare._repr_html_().startswith('<div class="lenscope-plot"><svg')  # no rollout: the contributions' plot

    traj = prediction_trajectory(lm, TEXT, LogitLens(lm.anatomy, model_name=lm.name), k=5)
    _close(_shown(traj, "trajectory"), _section(report, "trajectory"))


def test_generation_view_is_the_reports(lm):
    methods = ("alti-logit", "logit")
    gen = lenscope.generate(lm, TEXT, max_new_tokens=3, explain=methods)
    rep = _section(build_report(lm, TEXT, generate=3, explain=methods, sections=["generation"]), "generation")
    shown = _shown(gen, "generation")
    drop = ("seconds", "timings")  # the wall-clock times of two runs differ
    _close({k: v for k, v in shown.items() if k not in drop}, {k: v for k, v in rep.items() if k not in drop})
    assert len(shown["generated"]) == 3 and shown["methods"] == list(methods)


def test_report_shows_its_whole_page(report):
    fr = _frame(report._repr_html_())
    assert fr["sandbox"] == "allow-scripts"
    page = fr["srcdoc"]
    assert page.startswith(report.html().split("</body>")[0])  # the page itself, plus the frame's size message
    assert 'id="sec-run"' in page
    assert_same_computation(_page_data(page)["meta"], report.meta, why="the report's meta, written into the page")


def test_srcdoc_is_escaped_for_any_token():
    """A token that could end the attribute, the data block or the frame reaches the page unchanged."""
    nasty = ['"><script>alert(1)</script>', "</iframe>", "&amp;", "'", "</script>"]
    payload = {"tokens": nasty, "scopes": ["attention"], "maps": {"attention": {"shape": [1, 5, 5],
               "f32": __import__("base64").b64encode(np.eye(5, dtype="<f4").tobytes()).decode()}},
               "completeness_error": {"attention": 0.0}}
    v = notebook.view_html("mixing", payload, notebook.view_meta("m", nasty))
    fr = _frame(str(v))
    assert fr["srcdoc"].startswith(v.page.split("</body>")[0])
    assert _page_data(fr["srcdoc"])["sections"][0]["data"]["tokens"] == nasty
    outside = re.sub(r'srcdoc="[^"]*"', "", str(v))  # nothing of the page leaks out of the attribute
    assert "<script>alert" not in outside and "lenscope-data" not in outside


def test_results_without_a_view_show_their_plot_as_svg(lm):
    res = activation_patching(lm, TEXT, "The capital of Spain is", TARGET, FOIL)
    before = plt.get_fignums()
    out = res._repr_html_()
    assert out.startswith('<div class="lenscope-plot"><svg') and out.count("<svg") >= 1
    assert "<iframe" not in out and plt.get_fignums() == before  # the figure is closed: shown once
    assert "Patching the residual stream (denoising)" in out  # the result's own plot: its title, kept as text


def test_circuit_neuron_and_lens_results_show_a_plot_or_a_table(lm):
    from lenscope import circuits
    from lenscope.data.contrast import ContrastPair
    from lenscope.interventions import knowledge_neurons
    from lenscope.lenses import evaluate_lens, text_depths
    from lenscope.models.loading.load import encode

    pairs = [ContrastPair(TEXT, "The capital of Spain is", TARGET, FOIL)]
    edges = circuits.edge_attribution(lm, pairs, method="eap")
    ids = encode(lm, TEXT + " the city of Paris")[None].repeat(2, 1)
    plots = [circuits.faithfulness(lm, pairs, edges, ks=[1, 5]), circuits.information_flow_routes(lm, TEXT),
             knowledge_neurons(lm, TEXT, TARGET), text_depths(lm, TEXT + " the city of Paris")["logit"],
             evaluate_lens(lm, LogitLens(lm.anatomy), ids, progress=False)]
    before = plt.get_fignums()
    for res in plots:
        assert res._repr_html_().startswith('<div class="lenscope-plot"><svg'), type(res).__name__
    for res in (edges, circuits.attribution_patching(lm, TEXT, "The capital of Spain is", TARGET, FOIL)):
        out = res._repr_html_()  # no plot: the fields
        assert out.startswith(f'<div class="lenscope-result"><b>{type(res).__name__}</b><table>') and "tensor (" in out
    assert plt.get_fignums() == before  # every figure closed once drawn


@dataclass
class _Plain(Result):
    model: str
    values: torch.Tensor
    tokens: list


def test_a_result_without_a_plot_shows_a_table():
    out = _Plain("m<b>", torch.zeros(3, 4), [f"t{i}" for i in range(20)])._repr_html_()
    assert "<table>" in out and "tensor (3, 4) float32" in out and "list of 20" in out
    assert "m&lt;b&gt;" in out and "<b>m" not in out  # escaped


def test_show_writes_the_page_and_opens_it(lm, tmp_path, monkeypatch):
    opened = []
    monkeypatch.setattr(notebook.webbrowser, "open", lambda url: opened.append(url))
    dla = lenscope.direct_logit_attribution(lm, TEXT, TARGET, FOIL, by_head=True)
    path = lenscope.show(dla, tmp_path / "dla.html")
    assert path == tmp_path / "dla.html" and opened == [path.resolve().as_uri()]
    page = path.read_text()
    assert "<iframe" not in page and asset("components.js") in page  # the view's page itself, not a frame
    _close(_page_data(page)["sections"][0]["data"], _shown(dla, "components"))

    res = activation_patching(lm, TEXT, "The capital of Spain is", TARGET, FOIL)
    p2 = lenscope.show(res, open_browser=False)
    assert p2.exists() and "<svg" in p2.read_text() and len(opened) == 1

    with pytest.raises(lenscope.InputError, match="cannot show"):
        lenscope.show(object(), tmp_path / "x.html", open_browser=False)
    with pytest.raises(lenscope.InputError, match="one kind"):
        lenscope.show([dla, res], tmp_path / "x.html", open_browser=False)


@pytest.mark.skipif(sync_playwright is None or CHROMIUM is None, reason="chromium and Playwright: see "
                    "tests/report/test_report_browser.py")
def test_frames_draw_in_chromium_without_errors_or_requests(lm, report, tmp_path):
    """Notebook outputs (the _repr_html_ of every kind of view, and of a report) in one page, opened in Debian's
    chromium: each sandboxed frame draws, grows to its page's height, logs no error and fetches nothing."""
    outputs = [
        ("components", lenscope.direct_logit_attribution(lm, TEXT, TARGET, FOIL, by_head=True)._repr_html_()),
        ("attribution", str(notebook.view(lenscope.explain_all(lm, TEXT, TARGET, FOIL,
                                                               methods=["alti-logit", "logit", "erasure"])))),
        ("trajectory", prediction_trajectory(lm, TEXT)._repr_html_()),
        ("mixing", str(notebook.view(context_mixing(lm, TEXT, scopes=["attention", "atb"])))),
        ("flow", mixing_matrices(lm.anatomy, lenscope.trace(lm, TEXT), "alti", model_name=lm.name)._repr_html_()),
        ("generation", lenscope.generate(lm, TEXT, max_new_tokens=3, explain=("logit",))._repr_html_()),
        ("report", report._repr_html_()),
    ]
    path = tmp_path / "notebook-output.html"
    path.write_text("<!doctype html><html><head><meta charset='utf-8'></head><body>"
                    + "".join(html for _, html in outputs) + "</body></html>")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        ctx, page, errors, blocked = isolated_page(browser, ("file:", "about:"),
                                                   viewport={"width": 1300, "height": 900})
        page.goto(path.resolve().as_uri())
        frames = [f for f in page.frames if f != page.main_frame]
        assert len(frames) == len(outputs)
        for f, (key, _) in zip(frames, outputs):
            wait_drawn(f)
            keys = ["components", "trajectory", "flow"] if key == "report" else [key]
            for k in keys:
                n = f.eval_on_selector_all(f"#sec-{k} svg rect, #sec-{k} svg line, #sec-{k} svg circle, "
                                           f"#sec-{k} .body span", "els => els.length")
                assert n > 5, f"{key}: {k} drew {n} elements"
            shown = f.eval_on_selector("#sec-run", "e => getComputedStyle(e).display")
            assert shown == ("block" if key == "report" else "none"), key  # a view shows its card only
        # each frame told the page its height: none keeps its first height
        firsts = [f"{notebook.height(k)}px" for k, _ in outputs]
        page.wait_for_function("firsts => [...document.querySelectorAll('iframe')].every((f, i) => "
                               "f.style.height !== firsts[i])", arg=firsts)  # the ceiling: tests/browser.py
        page.wait_for_timeout(500)  # and then keeps it: the frame's height is its content's, with no feedback
        heights = page.evaluate("() => [...document.querySelectorAll('iframe')].map(f => parseFloat(f.style.height))")
        for f, h in zip(frames, heights):
            content = f.evaluate("() => Math.ceil(document.body.getBoundingClientRect().height)")
            assert abs(h - min(notebook.MAX_HEIGHT, content + 4)) <= 2, (h, content)
        # the frame's script cannot reach the notebook (sandbox without allow-same-origin)
        assert frames[0].evaluate("() => { try { return !!parent.document; } catch (e) { return 'blocked'; } }") \
            == "blocked"
        browser.close()
    assert errors == [] and blocked == []


def test_view_page_is_the_report_page_with_one_section(lm):
    dla = lenscope.direct_logit_attribution(lm, TEXT, TARGET, FOIL, by_head=True)
    v = notebook.view(dla)
    assert v.page.startswith("<!doctype html>") and _frame(str(v))["srcdoc"].startswith(v.page.split("</body>")[0])
    assert 'data-section="components"' in v.page and v.page.count('class="card"') == 2  # + the run card, hidden
    assert html.escape(v.page.split("<main>")[1][:200], quote=True) in str(v)  # srcdoc: the page, escaped
