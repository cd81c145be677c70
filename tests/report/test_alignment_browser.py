"""The alignment report of a translation model in a real browser (Debian's chromium driven by Playwright): it opens
without a console error, its matrices draw, the method selector switches methods, the gold links and AER show.

Skipped, with the command that installs it, when chromium or Playwright is missing; ``./dev test`` installs both.
"""

from __future__ import annotations

import pytest

from lenscope.data.alignments import AlignedPair
from lenscope.report import build_report

from ..browser import chromium_browser  # noqa: F401,E402 - the browser fixture
from ..conftest import get_model
from .test_alignment_view import METHODS, SOURCE, TARGET, _alignment
from .test_report_browser import _fills, _open, pytestmark  # noqa: F401 - the shared harness


def test_alignment_page_draws_and_switches_methods(browser, tmp_path):  # noqa: F811 - the fixture
    lm = get_model("tiny:marian")
    gold = AlignedPair("g", tuple(SOURCE.split()), tuple(TARGET.split()), frozenset({(0, 0), (1, 1), (2, 2)}),
                       frozenset({(0, 0), (1, 1), (2, 2), (3, 3)}))
    rep = build_report(lm, TARGET, source=SOURCE, gold=gold, methods=METHODS)
    d = _alignment(rep.html())
    path = rep.write(tmp_path / "alignment.html")
    ctx, page, errors, blocked = _open(browser, path)
    try:
        n_rows, n_src, n_pre = len(d["target_tokens"]), d["n_source"], len(d["prefix_tokens"])
        src = _fills(page, "#sec-alignment svg.align-source rect[data-r]")
        pre = _fills(page, "#sec-alignment svg.align-prefix rect[data-r]")
        assert len(src) == n_rows * n_src and len(pre) == n_rows * n_pre
        assert len(set(src)) > 3
        # a prefix token the prediction did not read (its own and later ones) is grey
        assert {pre[r * n_pre + c] for r in range(n_rows) for c in range(r + 1, n_pre)} == {"#f3f4f6"}
        words = _fills(page, "#sec-alignment svg.align-words rect[data-r]")
        assert len(words) == len(d["words"]["target"]) * (len(d["words"]["source"]) + (d["words"]["null"] is not None))

        # the method selector: the other method recolours both matrices and moves the links
        assert page.get_attribute("#sec-alignment [data-role=align-methods] button.on", "data-value") == METHODS[0]
        links = page.eval_on_selector_all("#sec-alignment svg.align-words circle.link", "els => els.map(e => "
                                          "e.getAttribute('data-link')).sort()")
        assert links == sorted(f"{i}-{j}" for i, j in d["links"][METHODS[0]])
        page.click(f"#sec-alignment [data-role=align-methods] button[data-value={METHODS[1]}]")
        assert _fills(page, "#sec-alignment svg.align-source rect[data-r]") != src
        assert _fills(page, "#sec-alignment svg.align-prefix rect[data-r]") != pre
        links = page.eval_on_selector_all("#sec-alignment svg.align-words circle.link", "els => els.map(e => "
                                          "e.getAttribute('data-link')).sort()")
        assert links == sorted(f"{i}-{j}" for i, j in d["links"][METHODS[1]])
        assert page.get_attribute("#sec-alignment table.align-aer tr.on", "data-method") == METHODS[1]

        # the gold links: outlined on the word matrix (sure solid, possible dashed) and on the token matrix
        assert page.locator("#sec-alignment svg.align-words rect.gold-sure").count() == 3
        assert page.locator("#sec-alignment svg.align-words rect.gold-possible").count() == 1
        assert page.locator("#sec-alignment svg.align-source rect.gold-sure").count() > 0
        # the AER of each method, as on the page's data
        for m in METHODS:
            got = float(page.get_attribute(f"#sec-alignment tr[data-method='{m}'] td[data-role=aer]", "data-value"))
            assert got == pytest.approx(d["aer"][m]["aer"])
        assert "Left out" in page.text_content("#sec-omitted p.note")
        page.screenshot(path=str(tmp_path / "alignment.png"), full_page=True)
        assert errors == [] and blocked == []
    finally:
        ctx.close()


def test_alignment_page_without_gold(browser, tmp_path):  # noqa: F811 - the fixture
    lm = get_model("tiny:m2m100")
    rep = build_report(lm, TARGET, source=SOURCE, methods=METHODS)
    ctx, page, errors, blocked = _open(browser, rep.write(tmp_path / "a.html"))
    try:
        assert page.locator("#sec-alignment svg.align-source rect[data-r]").count() > 0
        assert page.locator("#sec-alignment table.align-aer").count() == 0
        assert page.locator("#sec-alignment .gold-sure").count() == 0
        assert "--gold FILE" in page.text_content("#sec-alignment")
        assert errors == [] and blocked == []
    finally:
        ctx.close()
