"""The attribution-graph page as a diagram, in a real browser (Debian's chromium driven by Playwright), on synthetic
payloads of the graph view's shape (built here, so any size draws without computing a graph): the features' labels
drawn beside them, the first-token switch hiding the first position's feature and error nodes and their edges with
their share of the influence stated, the supernodes drawn as boxes around their members, no two nodes in one place,
and graphs of 100, 1,000 and 5,000 nodes drawn with no console error. (How fast: benchmarks/bench_graph_page.py;
no test here times anything.)"""

from __future__ import annotations

import random

import pytest

from lenscope.viz import views
from lenscope.viz.views import Shown, view_meta
from lenscope.viz.views.graph import EDGE_SHARE, VIEW

from ..browser import (
    NEEDS_BROWSER,
    chromium_browser,  # noqa: F401 - the browser fixture
    isolated_page,
    wait_drawn,
)

pytestmark = NEEDS_BROWSER

NODES = "svg.attr-graph [data-node]"
IDS = "els => els.map(e => e.getAttribute('data-node'))"

# every shown feature and error node's centre; the pairs closer than a node's size (a circle of radius 4, a square
# of side 7.6), found through a grid of cells of that size (each node against the nodes of its 9 neighbouring cells)
OVERLAPS = """svg => {
  const pts = [];
  svg.querySelectorAll("[data-kind=feature][data-shown='1'], [data-kind=error][data-shown='1']").forEach(e => {
    const c = e.tagName === "circle" ? [+e.getAttribute("cx"), +e.getAttribute("cy")]
      : [+e.getAttribute("x") + 3.8, +e.getAttribute("y") + 3.8];
    pts.push([e.getAttribute("data-node"), c[0], c[1]]);
  });
  const S = 8, grid = new Map(), bad = [];
  pts.forEach(p => {
    const k = Math.floor(p[1] / S) + "," + Math.floor(p[2] / S);
    (grid.get(k) || grid.set(k, []).get(k)).push(p);
  });
  pts.forEach(p => {
    const gx = Math.floor(p[1] / S), gy = Math.floor(p[2] / S);
    for (let dx = -1; dx <= 1; dx++) for (let dy = -1; dy <= 1; dy++) {
      (grid.get((gx + dx) + "," + (gy + dy)) || []).forEach(q => {
        if (q[0] < p[0] && Math.hypot(p[1] - q[1], p[2] - q[2]) < S) bad.push([p[0], q[0]]);
      });
    }
  });
  return {n: pts.length, bad: bad.slice(0, 10), nbad: bad.length};
}"""


def synthetic_graph(n_nodes: int, *, n_layers: int = 24, n_pos: int = 16, n_logits: int = 5, hide_first: bool = False,
                    first_share: float = 0.7, seed: int = 0) -> dict:
    """A ``graph`` view payload (:func:`lenscope.viz.views.graph.graph_payload`'s keys) of about ``n_nodes`` nodes:
    ``n_pos`` tokens, ``n_logits`` logits, error nodes at a third of the (block, position) cells or fewer (a third of
    the nodes at most) and feature nodes for the rest, a third of them at the first position (a sink), four fifths of
    them labelled; each feature, error and logit node with up to three incoming edges from nodes of lower blocks at
    the same or earlier positions; two supernodes of four features each."""
    rng = random.Random(seed)
    tokens = [f" w{i}" for i in range(n_pos)]
    nodes = [{"id": f"E_{100 + p}_{p}", "kind": "token", "layer": None, "position": p, "feature": None,
              "activation": None, "influence": 0.0} for p in range(n_pos)]
    inner = []
    for layer in range(n_layers):
        for p in range(n_pos):
            if rng.random() < 0.33 and len(inner) < (n_nodes - n_pos - n_logits) // 3:
                inner.append({"id": f"{layer}_-1_{p}", "kind": "error", "layer": layer, "position": p,
                              "feature": None, "activation": round(rng.uniform(0.1, 2), 4)})
    k = 0
    while len(inner) < n_nodes - n_pos - n_logits:
        layer, p = rng.randrange(n_layers), 0 if rng.random() < 0.33 else rng.randrange(n_pos)
        label = f"'w{rng.randrange(50)}' \u2192 ' x{rng.randrange(50)}'" if rng.random() < 0.8 else None
        inner.append({"id": f"{layer}_{k}_{p}", "kind": "feature", "layer": layer, "position": p, "feature": k,
                      "activation": round(rng.uniform(0.1, 5), 4), "label": label})
        k += 1
    order = list(range(len(inner)))
    rng.shuffle(order)
    for rank, i in enumerate(order):  # the cumulative share of the influence: 1/n for the most influential, ... 1
        inner[i]["influence"] = round((rank + 1) / len(inner), 6)
    logits = [{"id": f"{n_layers + 1}_{200 + j}_{n_pos - 1}", "kind": "logit", "layer": n_layers,
               "position": n_pos - 1, "feature": 200 + j, "activation": round(0.5 / (j + 1), 4),
               "influence": 0.0, "logit_token": f" y{j}"} for j in range(n_logits)]
    nodes += inner + logits
    below = {}  # block -> the nodes an edge into it may come from: tokens and the nodes of lower blocks
    for layer in range(n_layers + 1):
        below[layer] = nodes[:n_pos] + [n for n in inner if n["layer"] < layer]
    links = []
    for t in inner + logits:
        cands = [s for s in rng.sample(below[t["layer"]], min(12, len(below[t["layer"]])))
                 if s["position"] <= t["position"]]
        for s in cands[:3]:
            links.append({"source": s["id"], "target": t["id"], "weight": round(rng.gauss(0, 1), 4)})
    feats = [n for n in inner if n["kind"] == "feature" and n["position"] > 0]
    feats.sort(key=lambda n: (n["layer"], n["position"]))
    supernodes = [["early", *[n["id"] for n in feats[:4]]], ["late", *[n["id"] for n in feats[-4:]]]]
    return {"model": "synthetic", "tokens": tokens, "node_threshold": 0.8, "edge_threshold": 0.98,
            "n_active_features": k * 3, "n_feature_nodes": k, "replacement_score": 0.6, "completeness_score": 0.8,
            "max_exactness_error": 1e-7, "real_error": 1e-6, "tolerance": 1e-4, "seconds": 1.0, "n_layers": n_layers,
            "layer_sites": {str(layer): f"mlp_out.{layer}" for layer in range(n_layers)}, "nodes": nodes,
            "links": links, "supernodes": supernodes, "skip_first": False, "first_position_share": first_share,
            "hide_first": hide_first, "edge_share": EDGE_SHARE}


def graph_page(data: dict) -> str:
    """The view's page of a payload (as ``lenscope graph --html`` writes it)."""
    return views.page(Shown("graph", data, view_meta(data["model"], data["tokens"]), VIEW.title, VIEW.blurb))


def _open(browser, tmp_path, data: dict):
    path = tmp_path / "graph.html"
    path.write_text(graph_page(data), encoding="utf-8")
    ctx, page, errors, blocked = isolated_page(browser, ("file:", "blob:"), viewport={"width": 1500, "height": 1000})
    page.goto(path.resolve().as_uri())
    wait_drawn(page)
    return ctx, page, errors, blocked


def test_labels_switch_boxes_and_layout(browser, tmp_path):
    d = synthetic_graph(300, n_layers=8, n_pos=10, seed=1)
    ctx, page, errors, blocked = _open(browser, tmp_path, d)
    try:
        by = {n["id"]: n for n in d["nodes"]}
        svg = page.locator("svg.attr-graph")
        assert page.locator(NODES).count() == int(svg.get_attribute("data-nodes")) == len(d["nodes"])
        # labels: drawn beside the features of the cells with room, each its node's label (cut with an ellipsis)
        drawn = page.eval_on_selector_all("svg.attr-graph [data-role=node-label]",
                                          "els => els.filter(e => e.style.display !== 'none')"
                                          ".map(e => [e.getAttribute('data-label-of'), e.textContent])")
        assert len(drawn) >= 20, drawn
        for i, text in drawn:
            full = by[i]["label"]
            assert text == full or (text.endswith("\u2026") and full.startswith(text[:-1])), (text, full)
        # hover and click: the label in the tooltip and in the details
        node = next(n for n in d["nodes"] if n["kind"] == "feature" and n["label"] and n["position"] > 0)
        page.hover(f"{NODES}[data-node='{node['id']}']")
        assert node["label"] in page.text_content("#ls-tip")
        page.click(f"{NODES}[data-node='{node['id']}']")
        assert node["label"] in page.text_content("[data-role=graph-detail]")
        # no two nodes in one place
        res = page.eval_on_selector("svg.attr-graph", OVERLAPS)
        assert res["n"] == sum(n["kind"] in ("feature", "error") for n in d["nodes"]) and res["nbad"] == 0, res
        # the edges: those at least EDGE_SHARE of the strongest at first, every one with the slider at 0
        m = max(abs(e["weight"]) for e in d["links"])
        strong = sorted(f"{e['source']}>{e['target']}" for e in d["links"] if abs(e["weight"]) >= EDGE_SHARE * m)
        assert sorted(page.eval_on_selector("svg.attr-graph", "s => s.lsEdges")) == strong
        page.eval_on_selector("[data-role=graph-edge-threshold]",
                              "el => { el.value = 0; el.dispatchEvent(new Event('input')); }")
        assert int(svg.get_attribute("data-edges")) == len(d["links"])
        # supernodes: a box around each one's members, with its label
        for s in d["supernodes"]:
            box = page.locator(f"svg.attr-graph [data-role=supernode-box][data-supernode='{s[0]}']")
            assert box.count() == 1 and s[0] in box.text_content()
            b = box.locator("rect").bounding_box()
            for i in s[1:]:
                c = page.locator(f"{NODES}[data-node='{i}']").bounding_box()
                assert b["x"] <= c["x"] and c["x"] + c["width"] <= b["x"] + b["width"]
                assert b["y"] <= c["y"] and c["y"] + c["height"] <= b["y"] + b["height"]
        # the first-token switch: the first position's feature and error nodes and their edges go, the share stated
        first = {n["id"] for n in d["nodes"] if n["kind"] in ("feature", "error") and n["position"] == 0}
        assert len(first) > 30 and page.is_checked("[data-role=graph-first-token]")
        assert "share of the influence 0.7" in page.text_content("[data-role=graph-first-share]")
        page.uncheck("[data-role=graph-first-token]")
        hidden = set(page.eval_on_selector_all(NODES + "[data-shown='0']", IDS))
        assert hidden == first and int(svg.get_attribute("data-nodes")) == len(d["nodes"]) - len(first)
        kept = sorted(f"{e['source']}>{e['target']}" for e in d["links"]
                      if e["source"] not in first and e["target"] not in first)
        assert sorted(page.eval_on_selector("svg.attr-graph", "s => s.lsEdges")) == kept
        res = page.eval_on_selector("svg.attr-graph", OVERLAPS)
        assert res["n"] == len(by) - len(first) - 15 and res["nbad"] == 0, res  # 15: the tokens and logits
        page.check("[data-role=graph-first-token]")
        assert int(svg.get_attribute("data-nodes")) == len(d["nodes"])
        assert not errors, errors
        assert not blocked, blocked
    finally:
        ctx.close()


@pytest.mark.parametrize("n_nodes", [100, 1000, 5000])
def test_large_graphs_draw_without_errors(browser, tmp_path, n_nodes):
    d = synthetic_graph(n_nodes, hide_first=True, seed=n_nodes)
    assert len(d["nodes"]) == n_nodes
    ctx, page, errors, blocked = _open(browser, tmp_path, d)
    try:
        first = sum(n["kind"] in ("feature", "error") and n["position"] == 0 for n in d["nodes"])
        svg = page.locator("svg.attr-graph")
        assert page.locator(NODES).count() == n_nodes and not page.is_checked("[data-role=graph-first-token]")
        assert int(svg.get_attribute("data-nodes")) == n_nodes - first  # the first position hidden at first
        assert page.locator("svg.attr-graph [data-role=supernode-box]").count() == 2
        res = page.eval_on_selector("svg.attr-graph", OVERLAPS)
        assert res["n"] == n_nodes - first - 21 and res["nbad"] == 0, res  # 21: the tokens and logits
        assert not errors, errors
        assert not blocked, blocked
    finally:
        ctx.close()
