"""The attribution-graph view in a real browser (Debian's chromium driven by Playwright): the page of a graph
(``viz.views.page``: every node drawn, the slider hiding the nodes above its influence threshold and their edges, a
click showing a node's details, shift-click selecting, a supernode grouped, shown and downloaded as JSON), and the app
of ``lenscope serve --dict`` (the graph card, a supernode kept by ``/api/supernode``, a feature node opening its card
from ``/api/feature``); no console errors, nothing fetched from elsewhere."""

from __future__ import annotations

import json
import math

from lenscope.features.graphs.graph import attribution_graph
from lenscope.models.dictionaries.dictionary import save_dictionaries
from lenscope.viz import views

from ..browser import (
    NEEDS_BROWSER,
    chromium_browser,  # noqa: F401 - the browser fixture
    isolated_page,
    wait_drawn,
)
from ..conftest import get_model
from ..features.test_cards import corpus
from ..serve.helpers import start_server, stop_server
from ..viz.test_graph_view import TEXT, transcoders

pytestmark = NEEDS_BROWSER
NODES = "svg.attr-graph [data-node]"
IDS = "els => els.map(e => e.getAttribute('data-node'))"
EDGES = "svg => svg.lsEdges"  # the edges drawn, "source>target" (one SVG path per sign and strength band)


def _move(page, value: float, role: str = "graph-threshold") -> None:
    page.eval_on_selector(f"[data-role={role}]",
                          f"el => {{ el.value = {value}; el.dispatchEvent(new Event('input')); }}")


def show_everything(page) -> None:
    """Every edge (the edge slider at 0) and the first position's nodes (the first-token switch on)."""
    _move(page, 0, "graph-edge-threshold")
    if not page.is_checked("[data-role=graph-first-token]") and page.is_enabled("[data-role=graph-first-token]"):
        page.check("[data-role=graph-first-token]")


def test_graph_page_in_a_browser(browser, tmp_path):
    lm = get_model("tiny:llama")
    g = attribution_graph(lm, TEXT, transcoders(lm))
    d = views.shown(g).data
    path = tmp_path / "graph.html"
    path.write_text(views.page(g), encoding="utf-8")
    ctx, page, errors, blocked = isolated_page(browser, ("file:", "blob:"), viewport={"width": 1500, "height": 1000})
    try:
        page.goto(path.resolve().as_uri())
        wait_drawn(page)
        show_everything(page)
        kinds = [n["kind"] for n in d["nodes"]]
        assert page.locator(NODES).count() == len(d["nodes"])
        assert page.locator("svg.attr-graph circle[data-kind=feature]").count() == kinds.count("feature")
        assert page.locator("svg.attr-graph rect[data-kind=error]").count() == kinds.count("error")
        assert page.locator("svg.attr-graph [data-kind=logit]").count() == g.n_logits
        svg = page.locator("svg.attr-graph")
        assert int(svg.get_attribute("data-nodes")) == len(d["nodes"])
        edges = page.eval_on_selector("svg.attr-graph", EDGES)
        assert int(svg.get_attribute("data-edges")) == len(edges) == len(d["links"])
        assert sorted(edges) == sorted(f"{e['source']}>{e['target']}" for e in d["links"])

        # the slider at the median influence: the nodes above it go, with their edges; tokens and logits stay
        inf = sorted(n["influence"] for n in d["nodes"] if n["kind"] in ("feature", "error"))
        thr = math.floor(inf[len(inf) // 2] * 100) / 100
        _move(page, thr)
        keep = {n["id"] for n in d["nodes"] if n["kind"] in ("token", "logit") or n["influence"] <= thr + 1e-9}
        assert g.n_pos + g.n_logits < len(keep) < len(d["nodes"])
        assert int(svg.get_attribute("data-nodes")) == len(keep)
        shown = page.eval_on_selector_all(NODES + "[data-shown='1']", IDS)
        assert set(shown) == keep and page.locator(NODES + "[data-shown='0']").first.is_hidden()
        kept = [f"{e['source']}>{e['target']}" for e in d["links"] if e["source"] in keep and e["target"] in keep]
        assert int(svg.get_attribute("data-edges")) == len(kept) < len(d["links"])
        assert sorted(page.eval_on_selector("svg.attr-graph", EDGES)) == sorted(kept)
        assert f"{len(keep)} of {len(d['nodes'])} nodes" in page.text_content("[data-role=graph-count]")

        # a click shows a node's details; shift-click selects more; a label groups them into a supernode
        feats = [n for n in d["nodes"] if n["kind"] == "feature" and n["id"] in keep]
        a, b = feats[0], feats[1]
        page.click(f"{NODES}[data-node='{a['id']}']")
        assert page.get_attribute("[data-role=graph-detail]", "data-node") == a["id"]
        detail = page.text_content("[data-role=graph-detail]")
        assert f"L{a['layer']} #{a['feature']}" in detail and f"mlp_out.{a['layer']}" in detail
        page.click(f"{NODES}[data-node='{b['id']}']", modifiers=["Shift"])
        assert "2 selected" in page.text_content("[data-role=graph-selected]")
        page.fill("[data-role=supernode-label]", "subject")
        page.click("[data-role=supernode-group]")
        assert page.locator("[data-role=graph-supernodes] [data-supernode=subject]").count() == 1
        assert "0 selected" in page.text_content("[data-role=graph-selected]")
        with page.expect_download() as dl:
            page.click("[data-role=supernode-download]")
        saved = json.loads(open(dl.value.path(), encoding="utf-8").read())
        assert saved["supernodes"] == [["subject", a["id"], b["id"]]] and saved["tokens"] == g.tokens
        assert not errors, errors
        assert not blocked, blocked
    finally:
        ctx.close()


def test_app_graph_in_a_browser(browser, tmp_path):
    from lenscope.serve import create_app

    lm = get_model("tiny:llama")
    save_dictionaries(transcoders(lm), tmp_path / "tc")
    app = create_app(["tiny:llama"], loader=get_model, dicts=str(tmp_path / "tc"), dict_data=str(corpus(tmp_path)))
    srv, th = start_server(app)
    base = f"http://127.0.0.1:{srv.config.port}"
    ctx, page, errors, blocked = isolated_page(browser, (base + "/",), viewport={"width": 1500, "height": 1000})
    try:
        page.goto(base + "/?model=tiny:llama&text=" + TEXT.replace(" ", "+"))
        page.wait_for_selector("#sec-graph[data-state=done] svg.attr-graph [data-node]")
        ids = page.eval_on_selector_all("#sec-graph circle[data-kind=feature]", IDS)[:2]
        for i in ids:
            page.click(f"#sec-graph [data-node='{i}']", modifiers=["Shift"])
        page.fill("#sec-graph [data-role=supernode-label]", "pair")
        page.click("#sec-graph [data-role=supernode-group]")
        page.wait_for_selector("#sec-graph [data-role=graph-supernodes] [data-supernode=pair]")
        g = app.state.service.graphs.get(("tiny:llama", TEXT, None))
        assert g.supernodes == [["pair", *ids]]  # kept by the server (/api/supernode)
        # a feature node's click opens its card in the side panel (/api/feature)
        page.click(f"#sec-graph [data-node='{ids[0]}']")
        page.wait_for_selector("#panel[data-state=done], #panel[data-state=error]")
        assert page.get_attribute("#panel", "data-state") == "done", (page.text_content("#panel"), errors)
        layer, feature = ids[0].split("_")[:2]
        assert page.get_attribute("#panel", "data-feature") == f"mlp_out.{layer}#{feature}"
        assert page.locator("#panel-body .feature-card").count() == 1
        assert not errors, errors
        assert not blocked, blocked
    finally:
        ctx.close()
        stop_server(srv, th)
