"""The attribution graph's view (``graph``): its payload (the graph pruned as ``to_dict`` prunes it, each node's
influence in the order the page's slider relies on, the logit nodes' tokens), its checks, its page (``viz.views.page``,
a notebook's frame, a reloaded graph, supernodes) and ``lenscope graph --html``."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from lenscope.cli import app
from lenscope.errors import InputError
from lenscope.features.dictionaries.labels import FORMAT as LABELS_FORMAT
from lenscope.features.graphs.graph import AttributionGraph, attribution_graph, node_id
from lenscope.features.graphs.prune import node_influence
from lenscope.models.dictionaries.dictionary import save_dictionaries
from lenscope.models.loading.load import token_ids
from lenscope.models.loading.summary import fingerprint
from lenscope.viz import views
from lenscope.viz.notebook import view
from lenscope.viz.views.graph import EDGE_SHARE, SINK_SHARE

from ..conftest import get_model
from ..features.test_cards import random_dict
from ..tolerances import assert_same_computation

TEXT = "The cat sat on the mat because it was warm"


def transcoders(lm, width: int = 40, k: int = 6) -> list:
    """A random TopK transcoder at every block's MLP, saved-ready (model name and fingerprint set)."""
    d, L = lm.anatomy.d_model, lm.anatomy.n_layers
    out = [random_dict(d, width, kind="topk", role="transcoder", site=f"mlp_out.{layer}", seed=1 + layer, k=k)
           for layer in range(L)]
    for D in out:
        D.model, D.fingerprint = lm.name, fingerprint(lm.anatomy)
    return out


def page_data(page: str) -> dict:
    start = page.index('id="lenscope-data">') + len('id="lenscope-data">')
    return json.loads(page[start:page.index("</script>", start)])


@pytest.fixture(scope="module")
def setup():
    lm = get_model("tiny:llama")
    ts = transcoders(lm)
    return lm, ts, attribution_graph(lm, TEXT, ts)


def test_graph_payload_is_the_pruned_graph(setup):
    lm, ts, g = setup
    d = g.to_dict()
    p = views.shown(g).data
    assert [n["id"] for n in p["nodes"]] == [n["id"] for n in d["nodes"]]
    for a, b in zip(p["nodes"], d["nodes"]):
        assert (a["kind"], a["layer"], a["position"], a["feature"]) == (b["kind"], b["layer"], b["position"],
                                                                        b["feature"])
        assert a["influence"] == pytest.approx(b["influence"], rel=1e-5, abs=1e-300)  # 6 significant digits
        assert (a["activation"] is None) == (b["activation"] is None)
        if b["activation"] is not None:
            assert a["activation"] == pytest.approx(b["activation"], rel=1e-4)
    kinds = [n["kind"] for n in p["nodes"]]
    assert kinds.count("token") == g.n_pos and kinds.count("logit") == g.n_logits > 1  # always there
    assert kinds.count("feature") + kinds.count("error") >= 5
    logits = {n["feature"]: n for n in p["nodes"] if n["kind"] == "logit"}
    for i, t, pr in zip(g.logit_ids.tolist(), g.logit_tokens, g.logit_probs.tolist()):
        assert logits[i]["logit_token"] == t and logits[i]["activation"] == pytest.approx(pr, rel=1e-4)
    # the links: the pruned edges, each weight the adjacency's entry [target, source]
    index = {node_id(g, i): i for i in range(g.n_nodes)}
    assert len(p["links"]) == len(d["links"]) > 0
    shown = {n["id"] for n in p["nodes"]}
    for e, f in zip(p["links"], d["links"]):
        assert (e["source"], e["target"]) == (f["source"], f["target"]) and {e["source"], e["target"]} <= shown
        assert e["weight"] == pytest.approx(float(g.adjacency[index[e["target"]], index[e["source"]]]), rel=1e-4)
    # the slider's order: a node of lower influence share is at least as influential on the logits as one of higher
    inf = node_influence(g)
    pr = [(n["influence"], float(inf[index[n["id"]]])) for n in p["nodes"] if n["kind"] in ("feature", "error")]
    for sa, ra in pr:
        for sb, rb in pr:
            if sa < sb:
                assert ra >= rb, (sa, ra, sb, rb)
    assert p["layer_sites"] == {str(layer): f"mlp_out.{layer}" for layer in range(lm.anatomy.n_layers)}
    assert p["n_layers"] == lm.anatomy.n_layers and p["tokens"] == g.tokens and p["supernodes"] == []
    assert p["n_feature_nodes"] == g.n_features
    assert_same_computation(p["node_threshold"], 0.8, why="the option, copied")
    json.dumps(p, allow_nan=False)  # plain JSON
    # a lower pruning threshold: fewer feature and error nodes, the same tokens and logits
    q = views.shown(g, node_threshold=0.4).data
    assert sum(n["kind"] in ("feature", "error") for n in q["nodes"]) < kinds.count("feature") + kinds.count("error")
    assert [n["kind"] for n in q["nodes"]].count("token") == g.n_pos


def test_graph_checks_and_page(setup, tmp_path):
    lm, ts, g = setup
    s = views.shown(g)
    assert s.key == "graph" and s.title == "Attribution graph · tiny:llama"
    exact, real, rep, comp = s.checks
    assert_same_computation((exact["value"], real["value"], exact["tolerance"], real["tolerance"], rep["value"],
                             comp["value"]),
                            (g.exactness_error, g.real_error, g.tolerance, g.tolerance, s.data["replacement_score"],
                             s.data["completeness_score"]), why="the graph's numbers, copied into its checks")
    assert exact["ok"] and real["ok"] and rep["ok"] is None and comp["ok"] is None
    page = views.page(g)
    assert "LS.sections.graph = " in page and page == views.page(s)
    data = page_data(page)
    assert_same_computation(data["sections"], [{"key": "graph", "data": s.data}], why="the view's data, written into "
                            "the page and read back")
    assert data["meta"]["tokens"] == g.tokens
    assert "<iframe" in str(view(g)) and 'data-section="graph"' in page
    with pytest.raises(InputError, match="one at a time"):
        views.shown([g, g])
    # a reloaded graph shows the same; its supernodes travel in the view's data
    g2 = AttributionGraph.load(g.save(tmp_path / "g.safetensors"))
    assert_same_computation(views.shown(g2).data, s.data, why="saved and read back")
    ids = [n["id"] for n in s.data["nodes"] if n["kind"] == "feature"][:2]
    g2.group("subject", ids)
    assert views.shown(g2).data["supernodes"] == [["subject", *ids]]


def test_graph_cli_writes_the_page(setup, tmp_path):
    lm, ts, g = setup
    folder = save_dictionaries(ts, tmp_path / "d")
    path = tmp_path / "graph.html"
    r = CliRunner().invoke(app, ["graph", TEXT, "--model", "tiny:llama", "--dict", str(folder), "--html", str(path),
                                 "--node-threshold", "0.6", "--json"])
    assert r.exit_code == 0, r.output
    data = page_data(path.read_text(encoding="utf-8"))
    (sec,) = data["sections"]
    assert sec["key"] == "graph"
    assert_same_computation(sec["data"]["node_threshold"], 0.6, why="the option, copied")
    assert [n["id"] for n in sec["data"]["nodes"]] == [n["id"] for n in json.loads(r.stdout)["nodes"]]


def brute_first_parts(g) -> tuple[float, float]:
    """The feature and error nodes' influence at the first position and in all, node by node from their records."""
    inf = node_influence(g).tolist()
    recs = [g.node(i) for i in range(g.n_nodes)]
    fe = [(r["position"], x) for r, x in zip(recs, inf) if r["kind"] in ("feature", "error")]
    return sum(x for p, x in fe if p == 0), sum(x for _, x in fe)


def brute_first_share(g) -> float:
    first, total = brute_first_parts(g)
    return first / total


def test_graph_payload_labels_and_first_token_share(setup):
    lm, ts, g = setup
    p = views.shown(g).data
    feats = [n for n in p["nodes"] if n["kind"] == "feature"]
    assert feats and all(n["label"] is None for n in feats)  # no labels cached: None
    assert all("label" not in n for n in p["nodes"] if n["kind"] != "feature")
    # labels for block 0 only (and too few for block 1): each feature of block 0 labelled, the others None
    labels = {"mlp_out.0": [f"f{i}" for i in range(40)], "mlp_out.1": ["x"]}
    q = views.shown(g, labels=labels).data
    for n in (n for n in q["nodes"] if n["kind"] == "feature"):
        assert n["label"] == (f"f{n['feature']}" if n["layer"] == 0 else "x" if n["feature"] == 0 else None)
    assert any(n["label"] for n in q["nodes"] if n["kind"] == "feature" and n["layer"] == 0)
    assert [{k: v for k, v in n.items() if k != "label"} for n in q["nodes"]] == \
        [{k: v for k, v in n.items() if k != "label"} for n in p["nodes"]]
    # the first position's share of the influence, against the nodes' influence summed by position
    first, total = brute_first_parts(g)
    share = first / total
    assert first > 0 and total > first  # nodes with influence at the first position and after it
    assert g.skip_first is False and p["skip_first"] is False
    assert p["first_position_share"] == pytest.approx(share, rel=1e-4)  # rounded to 5 significant digits
    assert p["hide_first"] == (share >= SINK_SHARE) and p["edge_share"] == EDGE_SHARE
    assert views.shown(g, first_token="hide").data["hide_first"] is True
    assert views.shown(g, first_token="show").data["hide_first"] is False
    with pytest.raises(InputError, match="first_token must be one of auto, show, hide"):
        views.shown(g, first_token="maybe")
    assert g.to_dict()["first_position_share"] == pytest.approx(share, rel=1e-9)


def test_graph_payload_first_token_with_a_bos():
    """A prompt that opens with a special token (a BOS): its first position's MLP outputs are constants of the
    replacement model, so no feature node sits there, its share is that of its error nodes, and it is not hidden."""
    lm = get_model("tiny:llama")
    bos = lm.tokenizer.bos_token_id
    if bos is None:
        pytest.skip("tiny:llama's tokenizer has no BOS")
    ids = token_ids(lm, TEXT)[:7]
    if int(ids[0]) != bos:
        ids = torch.cat([torch.tensor([bos]), ids])
    g = attribution_graph(lm, ids, transcoders(lm))
    assert g.skip_first
    p = views.shown(g).data
    assert p["skip_first"] is True and not any(n["kind"] == "feature" and n["position"] == 0 for n in p["nodes"])
    assert p["first_position_share"] == pytest.approx(brute_first_share(g), rel=1e-4, abs=1e-12)
    assert p["hide_first"] is (p["first_position_share"] >= SINK_SHARE)


def test_features_views_show_cached_labels(setup, tmp_path):
    from lenscope.features.dictionaries.cards import feature_cards
    from lenscope.features.dictionaries.result import active_features
    from lenscope.viz.views.feature import feature_label

    from ..features.test_cards import corpus

    lm, ts, g = setup
    fa = active_features(lm, token_ids(lm, TEXT), ts[:2])
    labels = {"mlp_out.0": [f"a{i}" for i in range(40)], "mlp_out.1": ["short"]}  # block 1's of another width
    d = views.shown(fa, labels=labels).data
    active0 = {i for row in d["active"][0] for i, _ in row}
    assert active0 and d["labels"]["mlp_out.0"] == {str(i): f"a{i}" for i in sorted(active0)}
    assert "mlp_out.1" not in d["labels"]
    assert views.shown(fa).data["labels"] == {}
    assert feature_label(labels, "mlp_out.1", 0) == "short" and feature_label(labels, "mlp_out.1", 0, 40) is None
    assert feature_label(labels, "mlp_out.7", 0) is None and feature_label(None, "mlp_out.0", 3) is None
    assert feature_label(labels, "mlp_out.0", 40) is None and feature_label(labels, "mlp_out.0", 3, 40) == "a3"
    card = feature_cards(lm, ts[0], [3], corpus(tmp_path), tokens=400)[0]
    assert views.shown(card, labels=labels).data["label"] == "a3"
    assert views.shown(card).data["label"] is None


def test_graph_cli_first_token_and_labels(setup, tmp_path):
    lm, ts, g = setup
    folder = save_dictionaries(ts, tmp_path / "d")
    (folder / "labels.json").write_text(json.dumps({"format": LABELS_FORMAT, "dictionaries": {
        "mlp_out.0": {"width": 40, "label": [f"L0 feature {i}" for i in range(40)]}}}))
    path = tmp_path / "graph.html"
    r = CliRunner().invoke(app, ["graph", TEXT, "--model", "tiny:llama", "--dict", str(folder), "--html", str(path),
                                 "--first-token", "hide", "--no-heads", "--json"])
    assert r.exit_code == 0, r.output
    (sec,) = page_data(path.read_text(encoding="utf-8"))["sections"]
    assert sec["data"]["hide_first"] is True
    feats = [n for n in sec["data"]["nodes"] if n["kind"] == "feature"]
    assert all(n["label"] == (f"L0 feature {n['feature']}" if n["layer"] == 0 else None) for n in feats)
    assert [n.get("label") for n in json.loads(r.stdout)["nodes"] if n["kind"] == "feature"] == \
        [n["label"] for n in feats]
    bad = CliRunner().invoke(app, ["graph", TEXT, "--model", "tiny:llama", "--dict", str(folder), "--first-token",
                                   "never"])
    assert bad.exit_code == 2 and "--first-token" in bad.stderr
