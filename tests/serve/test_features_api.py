"""``lenscope serve --dict DIR [--dict-data FILE]``: the features view among the analyzed views, ``/api/features``
(a token's active features, equal to active_features) and ``/api/feature`` (a feature's card, equal to
feature_card's), their errors, the token rule, and the page asking for the view."""

from __future__ import annotations

import pytest
import torch
from starlette.testclient import TestClient

from lenscope.errors import InputError
from lenscope.features.dictionaries.cards import feature_card
from lenscope.features.dictionaries.result import active_features
from lenscope.models.dictionaries.dictionary import save_dictionaries
from lenscope.serve import create_app
from lenscope.viz.views.feature import feature_payload

from ..conftest import get_model
from ..features.test_cards import corpus, random_dict
from ..tolerances import assert_same_computation

TEXT = "the cat sat on the mat"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve-features")
    lm = get_model("tiny:llama")
    d = lm.anatomy.d_model
    dicts = [random_dict(d, 40, site="resid_post.1", seed=1), random_dict(d, 40, site="resid_post.0", seed=4)]
    save_dictionaries(dicts, tmp / "dicts")
    data = corpus(tmp)
    app = create_app(["tiny:llama"], loader=get_model, dicts=str(tmp / "dicts"), dict_data=str(data))
    with TestClient(app) as c:
        yield c, lm, dicts, data, tmp


def test_features_route_and_view(setup):
    c, lm, dicts, data, tmp = setup
    fa = active_features(lm, TEXT, sorted(dicts, key=lambda D: D.layer))
    r = c.post("/api/features", json={"model": "tiny:llama", "text": TEXT, "position": 2})
    assert r.status_code == 200, r.text
    d = r.json()
    assert d["position"] == 2 and d["token"] == fa.tokens[2] and d["sites"] == fa.sites
    for j, s in enumerate(fa.sites):
        want = [(i, v) for i, v in zip(fa.ids[j, 2].tolist(), fa.values[j, 2].tolist()) if i >= 0]
        assert [x["feature"] for x in d["features"][s]] == [i for i, _ in want]
        assert all(abs(x["activation"] - v) <= 1e-4 * abs(v) for x, (_, v) in zip(d["features"][s], want))
        assert d["l0"][s] == int(fa.l0[j, 2])
    a = c.post("/api/analyze", json={"model": "tiny:llama", "text": TEXT, "sections": ["features"]}).json()
    assert a["sections"]["features"]["tokens"] == fa.tokens and a["sections"]["features"]["cards"] == {}
    page = c.get("/").text
    assert 'id="sec-features"' in page and "features" in page.split('data-groups="')[1].split('"')[0]


def test_feature_route_is_the_card(setup):
    c, lm, dicts, data, tmp = setup
    r = c.post("/api/feature", json={"model": "tiny:llama", "site": "resid_post.1", "feature": 3})
    assert r.status_code == 200, r.text
    want = feature_payload(feature_card(lm, dicts[0], 3, str(data), tokens=16_384))
    assert_same_computation(r.json(), want, why="the same card of the same data, in the server and here")


@pytest.mark.parametrize("route,body,words", [
    ("/api/feature", {"site": "resid_post.7", "feature": 1}, "no dictionary for site"),
    ("/api/feature", {"site": "resid_post.1", "feature": 40}, "outside the dictionary's 40 latents"),
    ("/api/feature", {"feature": 1}, "\"site\" must name"),
    ("/api/feature", {"site": "resid_post.1", "feature": "x"}, "\"feature\" must be an integer"),
    ("/api/features", {"text": TEXT, "position": 99}, "outside the text"),
    ("/api/features", {"position": 0}, "text is missing"),
])
def test_bad_feature_requests(setup, route, body, words):
    c = setup[0]
    r = c.post(route, json={"model": "tiny:llama", **body})
    assert r.status_code == 400 and words in r.json()["error"], r.text


def test_without_dictionaries_or_data(setup):
    tmp = setup[4]
    with TestClient(create_app(["tiny:llama"], loader=get_model)) as c:
        r = c.post("/api/features", json={"text": TEXT, "position": 0})
        assert r.status_code == 400 and "--dict DIR" in r.json()["error"]
        assert 'id="sec-features"' not in c.get("/").text
    with TestClient(create_app(["tiny:llama"], loader=get_model, dicts=str(tmp / "dicts"))) as c:
        r = c.post("/api/feature", json={"site": "resid_post.1", "feature": 0})
        assert r.status_code == 400 and "--dict-data" in r.json()["error"]
    with TestClient(create_app(["tiny:llama"], loader=get_model, dicts=str(tmp / "dicts"), token="s3cret")) as c:
        for route, body in (("/api/features", {"text": TEXT, "position": 0}),
                            ("/api/feature", {"site": "resid_post.1", "feature": 0})):
            r = c.post(route, json=body)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        ok = c.post("/api/features", json={"text": TEXT, "position": 0}, headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200
    with pytest.raises(InputError, match="does not exist"):
        create_app(["tiny:llama"], loader=get_model, dicts=str(tmp / "nope"))
    with pytest.raises(InputError, match="give --dict DIR as well"):
        create_app(["tiny:llama"], loader=get_model, dict_data=str(tmp / "corpus.txt"))
    assert torch.__version__  # torch is loaded (the routes ran)
