"""``lenscope serve --dict DIR`` with transcoders: ``/api/graph`` (the graph view's data of attribution_graph through
the server's transcoders, at most the report's ``max_feature_nodes`` features), the graph view among the analyzed
views drawn from the same kept graph, ``/api/supernode`` (``AttributionGraph.group`` on that graph: later answers
carry it), their errors, the token rule, and the page asking for the view."""

from __future__ import annotations

import json

import pytest
from starlette.testclient import TestClient

from lenscope.features.dictionaries.labels import FORMAT as LABELS_FORMAT
from lenscope.features.dictionaries.labels import LABELS_FILE
from lenscope.features.graphs.graph import attribution_graph
from lenscope.models.dictionaries.dictionary import save_dictionaries
from lenscope.report.sections import Graph
from lenscope.serve import create_app
from lenscope.viz.views.graph import graph_payload

from ..conftest import get_model
from ..features.test_cards import random_dict
from ..tolerances import assert_same_computation
from ..viz.test_graph_view import transcoders

TEXT = "the cat sat on the mat"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve-graph")
    lm = get_model("tiny:llama")
    ts = transcoders(lm)
    save_dictionaries(ts, tmp / "tc")
    save_dictionaries([random_dict(lm.anatomy.d_model, 40, site="resid_post.1", seed=1)], tmp / "sae")
    with TestClient(create_app(["tiny:llama"], loader=get_model, dicts=str(tmp / "tc"))) as c:
        yield c, lm, ts, tmp


def _ids(p: dict) -> list[str]:
    return [n["id"] for n in p["nodes"]]


def test_graph_route_analyze_and_supernodes(setup):
    c, lm, ts, tmp = setup
    want = graph_payload(attribution_graph(lm, TEXT, ts, max_feature_nodes=Graph.max_feature_nodes))
    r = c.post("/api/graph", json={"model": "tiny:llama", "text": TEXT})
    assert r.status_code == 200, r.text
    d = r.json()
    assert d["tokens"] == want["tokens"] and _ids(d["graph"]) == _ids(want)
    assert_same_computation(d["graph"]["links"], want["links"], why="the same graph of the same text, in the server "
                            "and here")
    assert d["graph"]["supernodes"] == []
    assert [ch["ok"] for ch in d["checks"]] == [True, True, None, None]
    a = c.post("/api/analyze", json={"model": "tiny:llama", "text": TEXT, "sections": ["graph"]}).json()
    assert_same_computation(a["sections"]["graph"], d["graph"], why="the server's one graph, by two routes")
    assert len(a["checks"]) == 4
    # a supernode is kept with the server's graph: its answer lists every supernode, later views carry them
    feats = [n["id"] for n in d["graph"]["nodes"] if n["kind"] == "feature"][:3]
    r = c.post("/api/supernode", json={"model": "tiny:llama", "text": TEXT, "label": " subject ", "ids": feats[:2]})
    assert r.status_code == 200, r.text
    assert r.json() == {"supernode": ["subject", *feats[:2]], "supernodes": [["subject", *feats[:2]]]}
    r = c.post("/api/supernode", json={"model": "tiny:llama", "text": TEXT, "label": "x", "ids": feats[2:]}).json()
    assert r["supernodes"] == [["subject", *feats[:2]], ["x", *feats[2:]]]
    assert c.post("/api/graph", json={"text": TEXT}).json()["graph"]["supernodes"] == r["supernodes"]
    a = c.post("/api/analyze", json={"model": "tiny:llama", "text": TEXT, "sections": ["graph"]}).json()
    assert a["sections"]["graph"]["supernodes"] == r["supernodes"]
    # another target is another graph, without them; its one logit node is the target
    t = c.post("/api/graph", json={"text": TEXT, "target": " the"}).json()["graph"]
    assert t["supernodes"] == [] and [n["logit_token"] for n in t["nodes"] if n["kind"] == "logit"] == [" the"]
    page = c.get("/").text
    assert 'id="sec-graph"' in page and "graph" in page.split('data-groups="')[1].split('"')[0].split(";")


@pytest.mark.parametrize("route,body,words", [
    ("/api/supernode", {"label": "a", "ids": ["9_9_9"]}, "unknown: ['9_9_9']"),
    ("/api/supernode", {"ids": ["0_1_2"]}, "\"label\" must be"),
    ("/api/supernode", {"label": "a", "ids": "0_1_2"}, "\"ids\" must be"),
    ("/api/supernode", {"label": "a", "ids": []}, "\"ids\" must be"),
    ("/api/graph", {"target": " the cat"}, "one token"),
    ("/api/graph", {"text": ""}, "text is missing"),
])
def test_bad_graph_requests(setup, route, body, words):
    c = setup[0]
    r = c.post(route, json={"model": "tiny:llama", "text": TEXT, **body})
    assert r.status_code == 400 and words in r.json()["error"], r.text


def test_without_transcoders_or_token(setup):
    tmp = setup[3]
    with TestClient(create_app(["tiny:llama"], loader=get_model)) as c:
        r = c.post("/api/graph", json={"text": TEXT})
        assert r.status_code == 400 and "--dict DIR" in r.json()["error"]
        assert 'id="sec-graph"' not in c.get("/").text
    with TestClient(create_app(["tiny:llama"], loader=get_model, dicts=str(tmp / "sae"))) as c:
        for route, body in (("/api/graph", {}), ("/api/supernode", {"label": "a", "ids": ["0_1_2"]})):
            r = c.post(route, json={"text": TEXT, **body})
            assert r.status_code == 400 and "transcoder" in r.json()["error"], r.text
        a = c.post("/api/analyze", json={"text": TEXT, "sections": ["graph"]}).json()
        assert "needs transcoders" in a["notes"]["graph"]
    with TestClient(create_app(["tiny:llama"], loader=get_model, dicts=str(tmp / "tc"), token="s3cret")) as c:
        for route, body in (("/api/graph", {}), ("/api/supernode", {"label": "a", "ids": ["0_1_2"]})):
            r = c.post(route, json={"text": TEXT, **body})
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        ok = c.post("/api/graph", json={"text": TEXT}, headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200


def test_cached_labels_on_the_graph_and_the_features(setup):
    """Labels that ``lenscope dict label`` cached in ``--dict``: on the graph's feature nodes and on
    ``/api/features``'s features (None where a site has none)."""
    c, lm, ts, tmp = setup
    folder = save_dictionaries(ts, tmp / "labelled")
    (folder / LABELS_FILE).write_text(json.dumps({"format": LABELS_FORMAT, "dictionaries": {
        "mlp_out.0": {"width": 40, "label": [f"zero {i}" for i in range(40)]}}}))
    with TestClient(create_app(["tiny:llama"], loader=get_model, dicts=str(folder))) as lc:
        g = lc.post("/api/graph", json={"model": "tiny:llama", "text": TEXT}).json()["graph"]
        feats = [n for n in g["nodes"] if n["kind"] == "feature"]
        assert any(n["layer"] == 0 for n in feats)
        assert all(n["label"] == (f"zero {n['feature']}" if n["layer"] == 0 else None) for n in feats)
        r = lc.post("/api/features", json={"model": "tiny:llama", "text": TEXT, "position": 2})
        assert r.status_code == 200, r.text
        fs = r.json()["features"]
        assert fs["mlp_out.0"] and all(x["label"] == f"zero {x['feature']}" for x in fs["mlp_out.0"])
        assert fs["mlp_out.1"] and all(x["label"] is None for x in fs["mlp_out.1"])
