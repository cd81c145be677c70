"""The feature views in a real browser (Debian's chromium driven by Playwright): the report's features section
(click a token: its active features; click a feature: its card drawn), and the app of ``lenscope serve --dict
--dict-data`` (the features card, a feature opening its card in the side panel from ``/api/feature``); no console
errors, nothing fetched from elsewhere. Skipped, with the command that installs it, when chromium or Playwright is
missing; ``./dev test`` installs both."""

from __future__ import annotations

from lenscope.features.dictionaries.cards import feature_cards
from lenscope.features.dictionaries.result import active_features
from lenscope.models.dictionaries.dictionary import save_dictionaries
from lenscope.viz import views

from ..browser import (
    NEEDS_BROWSER,
    chromium_browser,  # noqa: F401 - the browser fixture
    isolated_page,
    wait_drawn,
)
from ..conftest import get_model
from ..features.test_cards import corpus, random_dict
from ..serve.helpers import start_server, stop_server

pytestmark = NEEDS_BROWSER
TEXT = "When Mary and John went to the store, John gave a drink to"


def test_features_page_in_a_browser(browser, tmp_path):
    lm = get_model("tiny:llama")
    d = lm.anatomy.d_model
    dicts = [random_dict(d, 40, site="resid_post.1", seed=1), random_dict(d, 40, kind="jumprelu", role="transcoder",
                                                                          site="mlp_out.0", seed=2)]
    data = corpus(tmp_path)
    fa = active_features(lm, TEXT, dicts)
    first = int(fa.ids[0, 3, 0])
    cards = feature_cards(lm, dicts[0], [first], data, tokens=800, seq_len=32, top=5)
    path = tmp_path / "features.html"
    labels = {"resid_post.1": [f"r{i}" for i in range(40)]}  # cached labels for one of the two dictionaries
    path.write_text(views.page(fa, cards=cards, labels=labels))
    ctx, page, errors, blocked = isolated_page(browser, ("file:",), viewport={"width": 1400, "height": 1000})
    try:
        page.goto(path.resolve().as_uri())
        wait_drawn(page)
        toks = page.locator("[data-role=feature-tokens] .tok")
        assert toks.count() == len(fa.tokens)
        toks.nth(3).click()
        assert "position 3" in page.text_content("[data-role=feature-list]")
        listed = page.eval_on_selector_all("[data-role=feature-list] .feature-link", "els => els.map(e => "
                                           "e.getAttribute('data-feature'))")
        want = [f"{s}#{int(i)}" for j, s in enumerate(fa.sites) for i in fa.ids[j, 3].tolist() if i >= 0]
        assert listed == want
        shown = page.eval_on_selector_all("[data-role=feature-list] [data-role=feature-label]",
                                          "els => els.map(e => e.textContent.trim())")
        assert shown == [f"r{int(i)}" for i in fa.ids[0, 3].tolist() if i >= 0] and fa.sites[0] == "resid_post.1"
        page.click(f"[data-role=feature-list] b.feature-link[data-feature='resid_post.1#{first}']")
        card = page.locator(f".feature-card-holder .feature-card[data-feature='resid_post.1#{first}']")
        assert card.count() == 1
        assert card.locator("[data-role=feature-label]").text_content().strip() == f"r{first}"
        assert page.locator(".feature-card-holder .feature-context").count() == cards[0].context_max.shape[0]
        assert page.locator(".feature-card-holder svg.feature-hist rect").count() > 0
        assert page.locator(".feature-card-holder svg.feature-promoted rect").count() == 10
        assert not errors, errors
        assert not blocked, blocked
    finally:
        ctx.close()


def test_app_features_in_a_browser(browser, tmp_path):
    from lenscope.serve import create_app

    lm = get_model("tiny:llama")
    D = random_dict(lm.anatomy.d_model, 40, site="resid_post.1", seed=1)
    save_dictionaries([D], tmp_path / "dict")
    data = corpus(tmp_path)
    srv, th = start_server(create_app(["tiny:llama"], loader=get_model, dicts=str(tmp_path / "dict"),
                                      dict_data=str(data)))
    base = f"http://127.0.0.1:{srv.config.port}"
    ctx, page, errors, blocked = isolated_page(browser, (base + "/",), viewport={"width": 1500, "height": 1000})
    try:
        page.goto(base + "/?model=tiny:llama&text=" + TEXT.replace(" ", "+"))
        page.wait_for_selector("#sec-features[data-state=done] [data-role=feature-tokens] .tok")
        page.locator("#sec-features [data-role=feature-tokens] .tok").nth(2).click()
        link = page.locator("#sec-features [data-role=feature-list] .feature-link").first
        key = link.get_attribute("data-feature")
        link.click()  # no card in the view's data: the app asks /api/feature and draws it in the side panel
        page.wait_for_selector("#panel[data-state=done], #panel[data-state=error]")
        assert page.get_attribute("#panel", "data-state") == "done", (page.text_content("#panel"), errors)
        assert page.get_attribute("#panel", "data-feature") == key
        assert page.locator(f"#panel-body .feature-card[data-feature='{key}']").count() == 1
        assert page.locator("#panel-body svg.feature-hist rect").count() > 0
        assert not errors, errors
        assert not blocked, blocked
    finally:
        ctx.close()
        stop_server(srv, th)
