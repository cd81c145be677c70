"""The generation view in a real browser (Debian's chromium through Playwright, as tests/report/test_report_browser.py):
the strip and the matrix draw, clicking a token shows its explanation, the switches recolour, no console error and
no network request."""

from __future__ import annotations

from lenscope.viz.views.generation import generation_html

from ..browser import (
    NEEDS_BROWSER,
    chromium_browser,  # noqa: F401 - the browser fixture
)
from ..conftest import get_model
from ..report.test_report_browser import _fills, _open
from .test_generation_view import PROMPT, fake_generation

pytestmark = NEEDS_BROWSER

SEC = "#sec-generation"


def _styles(page, selector: str, prop: str = "background") -> list[str]:
    return page.eval_on_selector_all(selector, f"els => els.map(e => e.style.{prop})")


def _detail_scores(page, method: str) -> list[str]:
    return _styles(page, f"{SEC} [data-role=detail] [data-method='{method}'] .tok")


def test_generation_page_draws_and_reacts(browser, tmp_path):
    d = fake_generation(n_prompt=6, n_new=5, tuned=True)
    path = tmp_path / "gen.html"
    generation_html(d, path)
    ctx, page, errors, blocked = _open(browser, path)
    try:
        strip = f"{SEC} [data-role=strip] .tok"
        # the strip: every token, in order, read through textContent (markup in a token stays text)
        texts = page.eval_on_selector_all(strip, "els => els.map(e => e.textContent)")
        assert len(texts) == len(d["tokens"]) and texts[3] == "\u2423<b>&" and texts[4] == "</script>"
        assert page.locator(f"{SEC} [data-role=strip] b").count() == 0
        steps = page.eval_on_selector_all(f"{strip}[data-step]", "els => els.map(e => +e.dataset.pos)")
        assert steps == [g["position"] for g in d["generated"]]
        prompt_bg = set(_styles(page, f"{strip}:not([data-step])"))
        assert len(prompt_bg) == 1  # prompt tokens: one grey
        by_prob = _styles(page, f"{strip}[data-step]")
        assert len(set(by_prob)) == 5 and not prompt_bg & set(by_prob)

        # the matrix: one row per step, one column per token before the last generated one; blank after each position
        cells = f"{SEC} svg.gen-matrix rect[data-r]"
        fills = _fills(page, cells)
        n_cols = d["generated"][-1]["position"]
        assert len(fills) == 5 * n_cols
        blank = [f == "#e2e5e9" for f in fills]
        assert blank == [c >= g["position"] for g in d["generated"] for c in range(n_cols)]
        assert page.get_attribute(f"{SEC} svg.gen-matrix", "data-method") == "alti-logit"

        # step 1 is shown first: its explanation has one coloured token per earlier token, for every method
        detail = f"{SEC} [data-role=detail]"
        assert page.get_attribute(detail, "data-step") == "0"
        for m in d["methods"]:
            assert len(_detail_scores(page, m)) == d["generated"][0]["position"]
        first = _detail_scores(page, "logit")
        facts0 = page.text_content(f"{detail} [data-role=facts]")

        # clicking the 4th generated token shows its explanation instead
        page.click(f"{strip}[data-step='3']")
        g3 = d["generated"][3]
        assert page.get_attribute(detail, "data-step") == "3"
        assert len(_detail_scores(page, "logit")) == g3["position"] != len(first)
        facts = page.text_content(f"{detail} [data-role=facts]")
        assert facts != facts0 and f"id #{g3['id']}" in facts and f"{g3['prob']:.4f}" in facts
        assert f"#{g3['runner_up']['id']}" in facts
        head = page.text_content(f"{detail} [data-method='logit'] .meta")
        assert "invariant error" in head
        # the strongest source named in the explanation is the largest |score|
        sc = g3["explanations"]["logit"]["scores"]
        j = max(range(len(sc)), key=lambda i: abs(sc[i]))
        assert f"{sc[j]:.3f}" in head

        # the arrow keys step through the generated tokens
        page.focus(f"{SEC} [data-role=strip]")
        page.keyboard.press("ArrowRight")
        assert page.get_attribute(detail, "data-step") == "4"
        page.keyboard.press("ArrowRight")  # the last step stays selected
        page.keyboard.press("ArrowLeft")
        assert page.get_attribute(detail, "data-step") == "3"

        # the colour switch: depth instead of probability
        page.click(f"{SEC} [data-role=colour] button[data-value=depth]")
        by_depth = _styles(page, f"{strip}[data-step]")
        assert by_depth != by_prob and by_depth[2] == "rgb(209, 213, 219)"  # step 3 never settles: grey
        page.click(f"{SEC} [data-role=colour] button[data-value=tuned_depth]")  # the tuned lens's depth
        by_tuned = _styles(page, f"{strip}[data-step]")
        depths = [g["depth"] for g in d["generated"]], [g["tuned_depth"] for g in d["generated"]]
        assert [a == b for a, b in zip(*depths)] == [a == b for a, b in zip(by_depth, by_tuned)]
        assert "tuned lens: " in page.text_content(f"{detail} [data-role=facts]")

        # the method switch changes the matrix
        page.click(f"{SEC} [data-role=method] button[data-value=alti]")
        assert page.get_attribute(f"{SEC} svg.gen-matrix", "data-method") == "alti"
        fills2 = _fills(page, cells)
        assert fills2 != fills and [f == "#e2e5e9" for f in fills2] == blank

        # clicking a matrix row selects that step; hovering a cell shows its number
        page.click(f"{cells}[data-r='1'][data-c='0']")
        assert page.get_attribute(detail, "data-step") == "1"
        y = float(page.get_attribute(f"{SEC} svg.gen-matrix rect.selected", "y"))
        assert y == float(page.get_attribute(f"{cells}[data-r='1'][data-c='0']", "y")) - 1
        page.hover(f"{cells}[data-r='4'][data-c='2']")
        tip = page.text_content("#ls-tip")
        score = d["generated"][4]["explanations"]["alti"]["scores"][2]
        assert page.locator("#ls-tip").is_visible() and f"{score:.5f}" in tip

        page.screenshot(path=str(tmp_path / "gen.png"), full_page=True)
        print(f"screenshot: {tmp_path / 'gen.png'}")
        assert errors == [], errors
        assert blocked == [], f"the page tried to fetch {blocked}"
    finally:
        ctx.close()


def test_generation_without_methods_draws_the_strip(browser, tmp_path):
    d = fake_generation(n_prompt=6, n_new=3, methods=())
    path = tmp_path / "plain.html"
    generation_html(d, path)
    ctx, page, errors, blocked = _open(browser, path)
    try:
        assert page.locator(f"{SEC} [data-role=strip] .tok[data-step]").count() == 3
        assert page.locator(f"{SEC} svg.gen-matrix").count() == 0
        page.click(f"{SEC} [data-role=strip] .tok[data-step='2']")
        assert page.get_attribute(f"{SEC} [data-role=detail]", "data-step") == "2"
        assert errors == [] and blocked == [], (errors, blocked)
    finally:
        ctx.close()


def test_report_with_a_real_generation(browser, tmp_path):
    from lenscope.report import build_report

    rep = build_report(get_model("tiny:llama"), PROMPT, sections=["prediction", "generation"], generate=4,
                       explain=("alti-logit", "logit"))
    (sec,) = [s for s in rep.sections if s["key"] == "generation"]
    d = sec["data"]
    ctx, page, errors, blocked = _open(browser, rep.write(tmp_path / "report.html"))
    try:
        assert page.locator(f"{SEC} [data-role=strip] .tok[data-step]").count() == 4
        assert page.locator(f"{SEC} svg.gen-matrix rect[data-r]").count() == 4 * d["generated"][-1]["position"]
        page.click(f"{SEC} [data-role=strip] .tok[data-step='2']")
        assert len(_detail_scores(page, "alti-logit")) == d["generated"][2]["position"]
        before = _fills(page, f"{SEC} svg.gen-matrix rect[data-r]")
        page.click(f"{SEC} [data-role=method] button[data-value=logit]")
        assert _fills(page, f"{SEC} svg.gen-matrix rect[data-r]") != before
        assert errors == [], errors
        assert blocked == [], f"the page tried to fetch {blocked}"
    finally:
        ctx.close()
