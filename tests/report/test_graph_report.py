"""The report's attribution-graph section (``lenscope report TEXT --dict DIR`` with transcoders): its data is the
graph view's payload of ``attribution_graph`` through the report's transcoders (SAEs left out) with at most
``Graph.max_feature_nodes`` features, its checks, the target as the only logit node, its note without transcoders,
and the CLI adding it."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from lenscope.cli import app
from lenscope.features.dictionaries.labels import FORMAT as LABELS_FORMAT
from lenscope.features.dictionaries.labels import LABELS_FILE
from lenscope.features.graphs.graph import attribution_graph
from lenscope.models.dictionaries.dictionary import save_dictionaries
from lenscope.report import ReportContext, build_report
from lenscope.report.sections import Graph
from lenscope.viz.views.graph import graph_payload

from ..conftest import get_model
from ..features.test_cards import random_dict
from ..viz.test_graph_view import TEXT, transcoders


def _section(rep, key):
    (s,) = [s for s in rep.sections if s["key"] == key]
    return s


@pytest.fixture(scope="module")
def setup():
    lm = get_model("tiny:llama")
    ts = transcoders(lm)
    sae = random_dict(lm.anatomy.d_model, 30, site="resid_post.1", seed=9)
    return lm, ts, sae


def _same(a: dict, b: dict) -> None:
    assert [n["id"] for n in a["nodes"]] == [n["id"] for n in b["nodes"]]
    assert [(e["source"], e["target"], e["weight"]) for e in a["links"]] == \
        [(e["source"], e["target"], e["weight"]) for e in b["links"]]


def test_report_graph_section(setup, monkeypatch):
    lm, ts, sae = setup
    rep = build_report(lm, TEXT, sections=["prediction", "graph"], dictionaries=[sae, *ts])
    p = _section(rep, "graph")["data"]
    g = attribution_graph(lm, TEXT, ts, max_feature_nodes=Graph.max_feature_nodes)
    _same(p, graph_payload(g))
    checks = [c for c in rep.checks if c["section"] == "graph"]
    assert len(checks) == 4 and [c["ok"] for c in checks] == [True, True, None, None]
    assert checks[0]["value"] == pytest.approx(g.exactness_error, rel=1e-6, abs=1e-9)
    assert "LS.sections.graph = " in rep.html()
    # the feature nodes are bounded (the most influential first): the report stays fast on a real model
    monkeypatch.setattr(Graph, "max_feature_nodes", 5)
    few = _section(build_report(lm, TEXT, sections=["graph"], dictionaries=ts), "graph")["data"]
    assert few["n_feature_nodes"] == 5 < few["n_active_features"]
    _same(few, graph_payload(attribution_graph(lm, TEXT, ts, max_feature_nodes=5)))


def test_report_graph_target_and_note(setup):
    lm, ts, sae = setup
    p = _section(build_report(lm, TEXT, " the", sections=["graph"], dictionaries=ts), "graph")["data"]
    (logit,) = [n for n in p["nodes"] if n["kind"] == "logit"]
    assert logit["logit_token"] == " the"
    rep = build_report(lm, TEXT, sections=["graph"], dictionaries=[sae])
    assert "needs transcoders" in _section(rep, "graph")["note"]
    assert not Graph().wanted(ReportContext(lm, TEXT, dictionaries=[sae]))  # not a default view without transcoders
    assert Graph().wanted(ReportContext(lm, TEXT, dictionaries=[sae, *ts]))


def test_report_cli_adds_the_graph_with_transcoders(setup, tmp_path):
    lm, ts, sae = setup
    folder = save_dictionaries(ts, tmp_path / "d")
    out = tmp_path / "r.html"
    r = CliRunner().invoke(app, ["report", TEXT, "--model", "tiny:llama", "--sections", "prediction", "--dict",
                                 str(folder), "--out", str(out), "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert [s["key"] for s in d["sections"]] == ["prediction", "features", "graph"] and d["ok"]
    assert 'data-section="graph"' in out.read_text(encoding="utf-8")
    # the labels `lenscope dict label` cached in the folder: on the graph's feature nodes and the features view's
    (folder / LABELS_FILE).write_text(json.dumps({"format": LABELS_FORMAT, "dictionaries": {
        "mlp_out.1": {"width": 40, "label": [f"one {i}" for i in range(40)]}}}))
    r = CliRunner().invoke(app, ["report", TEXT, "--model", "tiny:llama", "--sections", "features,graph", "--dict",
                                 str(folder), "--out", str(out)])
    assert r.exit_code == 0, r.output
    page = out.read_text(encoding="utf-8")
    start = page.index('id="lenscope-data">') + len('id="lenscope-data">')
    secs = {s["key"]: s["data"] for s in json.loads(page[start:page.index("</script>", start)])["sections"]}
    feats = [n for n in secs["graph"]["nodes"] if n["kind"] == "feature"]
    assert any(n["layer"] == 1 for n in feats)
    assert all(n["label"] == (f"one {n['feature']}" if n["layer"] == 1 else None) for n in feats)
    j = secs["features"]["sites"].index("mlp_out.1")
    active = {i for row in secs["features"]["active"][j] for i, _ in row}
    assert secs["features"]["labels"] == {"mlp_out.1": {str(i): f"one {i}" for i in sorted(active)}}
