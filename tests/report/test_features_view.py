"""The feature views (``features``: a prompt's active features; ``feature``: one feature's card): their payloads,
their pages (the report page holding just that section, for to_html, notebooks and lenscope.show), and the report's
features section given dictionaries."""

from __future__ import annotations

import json

import pytest

from lenscope.errors import InputError
from lenscope.features.dictionaries.cards import feature_cards
from lenscope.features.dictionaries.result import active_features
from lenscope.report import build_report
from lenscope.viz import views
from lenscope.viz.notebook import view
from tests.conftest import get_model
from tests.features.test_cards import corpus, random_dict
from tests.tolerances import assert_same_ints

TEXT = "The cat sat on the mat because it was warm"


def _data(page: str) -> dict:
    start = page.index('id="lenscope-data">') + len('id="lenscope-data">')
    return json.loads(page[start:page.index("</script>", start)])


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    lm = get_model("tiny:llama")
    d = lm.anatomy.d_model
    D1 = random_dict(d, 40, site="resid_post.1", seed=1)
    D2 = random_dict(d, 30, kind="jumprelu", role="transcoder", site="mlp_out.0", seed=2)
    data = corpus(tmp_path_factory.mktemp("corpus"))
    fa = active_features(lm, TEXT, [D1, D2], top=6)
    top = [int(i) for i in fa.ids[0, -1, :2].tolist()]
    cards = feature_cards(lm, D1, top, data, tokens=600, top=4, seq_len=32)
    return lm, [D1, D2], data, fa, cards


def test_features_payload(setup):
    lm, dicts, data, fa, cards = setup
    p = views.shown(fa, cards=cards).data
    assert p["tokens"] == fa.tokens and p["sites"] == ["resid_post.1", "mlp_out.0"] and p["widths"] == [40, 30]
    for j in range(2):
        assert p["l0"][j] == fa.l0[j].tolist()
        for pos in range(len(fa.tokens)):
            want = [(i, v) for i, v in zip(fa.ids[j, pos].tolist(), fa.values[j, pos].tolist()) if i >= 0]
            got = p["active"][j][pos]
            assert [i for i, _ in got] == [i for i, _ in want]
            assert all(abs(a[1] - v) <= 1e-4 * abs(v) for a, (_, v) in zip(got, want))
    assert set(p["cards"]) == {f"resid_post.1#{c.feature}" for c in cards}
    json.dumps(p)  # plain JSON


def test_feature_payload_and_pages(setup):
    lm, dicts, data, fa, cards = setup
    c = cards[0]
    s = views.shown(c)
    assert s.key == "feature" and s.title == f"Feature resid_post.1 #{c.feature}"
    d = s.data
    assert d["feature"] == c.feature and d["tokens"] == c.tokens_seen and len(d["contexts"]) == c.context_max.shape[0]
    assert d["histogram"]["counts"] == c.hist_counts.tolist()
    assert [x["id"] for x in d["promoted"]] == c.promoted_ids.tolist()
    assert d["density"] == pytest.approx(c.density, rel=1e-4)
    page = c.to_html()
    assert "LS.sections.feature" in page and _data(page)["sections"][0]["key"] == "feature"
    # the features page carries the card script too (its feature links open cards)
    fpage = views.page(views.shown(fa, cards=cards))
    assert "LS.sections.features" in fpage and "LS.sections.feature =" in fpage
    assert "<iframe" in str(view(c)) and "<iframe" in str(view(fa))
    with pytest.raises(InputError, match="one at a time"):
        views.shown(cards)


def test_report_features_section(setup, tmp_path):
    lm, dicts, data, fa, cards = setup
    rep = build_report(lm, TEXT, sections=["prediction", "features"], dictionaries=dicts, dict_data=str(data),
                       dict_tokens=400)
    sec = {s["key"]: s for s in rep.sections}["features"]
    p = sec["data"]
    assert p["tokens"] == fa.tokens and p["sites"] == fa.sites
    # the cards of the strongest features at the last position, per dictionary
    want = {f"{s}#{int(i)}" for j, s in enumerate(fa.sites) for i in fa.ids[j, -1, :3].tolist() if i >= 0}
    assert set(p["cards"]) == want
    assert any(c["section"] == "features" for c in rep.checks)
    html = rep.html()
    assert "LS.sections.features" in html and "LS.sections.feature =" in html
    default = build_report(lm, TEXT, sections=None, dictionaries=dicts)
    assert "features" in [s["key"] for s in default.sections]
    assert not {s["key"]: s for s in default.sections}["features"]["data"]["cards"]  # no data: no cards
    assert "graph" in [s["key"] for s in default.sections]  # one of the dictionaries is a transcoder
    plain = build_report(lm, TEXT, sections=["prediction"])
    assert "features" not in [s["key"] for s in plain.sections]
    with pytest.raises(InputError, match="data file not found"):
        build_report(lm, TEXT, sections=["features"], dictionaries=dicts, dict_data=str(tmp_path / "nope.txt"))
    other = random_dict(lm.anatomy.d_model + 2, 10, site="resid_post.0")
    with pytest.raises(InputError, match="d_model"):
        build_report(lm, TEXT, sections=["features"], dictionaries=[other])
    assert_same_ints(fa.ids, active_features(lm, TEXT, dicts, top=6).ids)
