"""The report in a real browser: Debian's chromium driven by Playwright (never a downloaded browser build).

Skipped, with the command that installs it, when chromium or Playwright is missing; ``./dev test`` installs both.
"""

from __future__ import annotations

from pathlib import Path

from lenscope.report import build_report

from ..browser import (
    NEEDS_BROWSER,
    chromium_browser,  # noqa: F401 - the browser fixture
    isolated_page,
    wait_drawn,
)
from ..conftest import get_model

pytestmark = NEEDS_BROWSER


def _open(browser, path: Path):
    """Load the page from a file URL with every other request blocked; collect console errors."""
    ctx, page, errors, blocked = isolated_page(browser, ("file:",), viewport={"width": 1400, "height": 1000})
    page.goto(path.resolve().as_uri())
    wait_drawn(page)
    return ctx, page, errors, blocked


def _fills(page, selector: str) -> list[str]:
    return page.eval_on_selector_all(selector, "els => els.map(e => e.getAttribute('fill') || e.style.background)")


def test_report_renders_and_reacts(browser, tmp_path):
    lm = get_model("tiny:llama")
    rep = build_report(lm, "When Mary and John went to the store, John gave a drink to", " Mary", " John")
    path = rep.write(tmp_path / "report.html")
    ctx, page, errors, blocked = _open(browser, path)
    try:
        # every section drew something: non-empty SVG in each card
        for key in ("prediction", "trajectory", "components", "attribution", "mixing", "flow"):
            n = page.eval_on_selector_all(f"#sec-{key} svg rect, #sec-{key} svg line, #sec-{key} svg circle",
                                          "els => els.length")
            assert n > 0, f"section {key} drew nothing"
        assert page.locator("#sec-run table.checks tr").count() == len(rep.checks) + 1

        # the layer slider changes the mixing map
        before = _fills(page, "#sec-mixing svg.mixing-map rect")
        page.eval_on_selector("#sec-mixing input[data-role=layer]",
                              "el => { el.value = el.max; el.dispatchEvent(new Event('input')); }")
        after = _fills(page, "#sec-mixing svg.mixing-map rect")
        assert len(before) == len(after) > 0 and before != after

        # the scope switch changes it too
        page.click("#sec-mixing .seg button[data-value=attention]")
        assert _fills(page, "#sec-mixing svg.mixing-map rect") != after

        # switching the attribution method recolours the tokens
        strip = "#sec-attribution [data-role=strip] .tok"
        before = _fills(page, strip)
        page.click("#sec-attribution .seg button[data-value=erasure]")
        after = _fills(page, strip)
        assert before != after and all(c for c in after)

        # the flow graph's threshold slider changes the number of edges drawn
        edges = int(page.get_attribute("#sec-flow svg.flow", "data-edges"))
        page.eval_on_selector("#sec-flow input[data-role=threshold]",
                              "el => { el.value = 0.5; el.dispatchEvent(new Event('input')); }")
        assert int(page.get_attribute("#sec-flow svg.flow", "data-edges")) < edges

        # the logit switch of direct logit attribution redraws the bars
        bars = _fills(page, "#sec-components svg.dla-layers rect")
        heights = page.eval_on_selector_all("#sec-components svg.dla-layers rect",
                                            "els => els.map(e => e.getAttribute('height'))")
        page.click("#sec-components .seg button[data-value=foil]")
        assert page.eval_on_selector_all("#sec-components svg.dla-layers rect",
                                         "els => els.map(e => e.getAttribute('height'))") != heights and bars

        # the trajectory's colour switch works and hovering shows a tooltip
        page.click("#sec-trajectory .seg button[data-value=kl]")
        page.hover("#sec-trajectory svg.heat rect >> nth=3")
        assert page.locator("#ls-tip").is_visible()

        shot = tmp_path / "report.png"
        page.screenshot(path=str(shot), full_page=True)
        assert shot.stat().st_size > 10_000
        print(f"screenshot: {shot}")
        assert errors == [], errors
        assert blocked == [], f"the page tried to fetch {blocked}"
    finally:
        ctx.close()


def test_encoder_report_shows_notes(browser, tmp_path):
    lm = get_model("tiny:bert")
    path = build_report(lm, "The capital of France is Paris").write(tmp_path / "enc.html")
    ctx, page, errors, _ = _open(browser, path)
    try:
        assert page.locator("#sec-components p.note").count() == 1
        assert page.eval_on_selector_all("#sec-mixing svg rect", "els => els.length") > 0
        assert errors == [], errors
    finally:
        ctx.close()


def _circuit_page(browser, tmp_path, payload):
    from lenscope.viz.report import render

    from .test_report import circuit_page

    path = tmp_path / "circuit.html"
    path.write_text(render(circuit_page(get_model("tiny:llama"), payload)), encoding="utf-8")
    return _open(browser, path)


def _set_k(page, index):
    page.eval_on_selector("#sec-circuit input[data-role=k]",
                          f"el => {{ el.value = {index}; el.dispatchEvent(new Event('input')); }}")


def test_circuit_view_renders_and_the_slider_moves_it(browser, tmp_path):
    from .test_report import fake_circuit

    d = fake_circuit(L=4, H=8)
    ks = [f["k"] for f in d["faithfulness"]]
    assert len(d["edges"]) > 300 and ks[0] == 10
    ctx, page, errors, blocked = _circuit_page(browser, tmp_path, d)
    try:
        graph, marker = "#sec-circuit svg.circuit-graph", "#sec-circuit svg.circuit-faith circle.marker"
        # every component of the 4-layer, 8-head model is a node; the faithfulness curve has one point per k
        assert page.locator(f"{graph} [data-node]").count() == 2 + 4 * 9
        assert page.locator("#sec-circuit svg.circuit-faith circle").count() == len(ks) + 1
        start = 1 + max(i for i, f in enumerate(d["faithfulness"]) if f["value"] < 0.8)  # the smallest k >= 0.8
        assert page.get_attribute(marker, "data-k") == str(ks[start])
        assert f"k = {ks[start]} edges" in page.text_content("#sec-circuit [data-role=reach]")
        assert "Spearman 0.900" in page.text_content("#sec-circuit [data-role=check]")

        _set_k(page, 0)  # the 10 strongest edges
        assert page.get_attribute(graph, "data-edges") == "10" == str(page.locator(f"{graph} path").count())
        x0 = page.get_attribute(marker, "cx")
        assert page.get_attribute(marker, "data-k") == "10"
        v = d["faithfulness"][0]["value"]
        assert "faithfulness at k = 10 " in page.text_content("#sec-circuit [data-role=value]")
        assert f"{v:.3f}" in page.text_content("#sec-circuit [data-role=value]")
        # the drawn edges are the top 10 by |score|, and only the nodes they touch are lit
        top = sorted(d["edges"], key=lambda e: -abs(e["score"]))[:10]
        drawn = page.eval_on_selector_all(f"{graph} path", "els => els.map(e => e.getAttribute('data-edge'))")
        assert sorted(drawn) == sorted(f"{e['src']}->{e['dst']}" for e in top)
        touched = {e["src"] for e in top} | {e["dst"].rsplit(".", 1)[0] if e["dst"][-2:] in (".q", ".k", ".v")
                                             else e["dst"] for e in top}
        assert int(page.get_attribute(graph, "data-nodes")) == len(touched - {"embed", "logits"})

        _set_k(page, len(ks) - 1)  # every edge: drawing capped at 300
        assert page.get_attribute(graph, "data-edges") == "300" == str(page.locator(f"{graph} path").count())
        assert page.get_attribute(marker, "data-k") == str(ks[-1]) and page.get_attribute(marker, "cx") != x0
        assert "drawing the top 300 edges" in page.text_content("#sec-circuit [data-role=value]")

        page.hover(f"{graph} path >> nth=-1")  # the strongest edge, drawn last
        assert page.locator("#ls-tip").is_visible() and "score" in page.text_content("#ls-tip")
        page.screenshot(path=str(tmp_path / "circuit.png"), full_page=True)
        print(f"screenshot: {tmp_path / 'circuit.png'}")
        assert errors == [], errors
        assert blocked == [], f"the page tried to fetch {blocked}"
    finally:
        ctx.close()


def test_circuit_view_of_nodes(browser, tmp_path):
    from .test_report import fake_circuit

    d = fake_circuit(L=2, H=4)
    d.update(level="nodes", edges=[])
    n = len(d["nodes"]) - 1  # logits is not a node to keep
    d["faithfulness"] = [{"k": k, "fraction": k / n, "value": k / n} for k in (1, 2, 4, 8, n)]
    ctx, page, errors, _ = _circuit_page(browser, tmp_path, d)
    try:
        graph = "#sec-circuit svg.circuit-graph"
        _set_k(page, 2)
        assert page.get_attribute(graph, "data-nodes") == "4" and page.get_attribute(graph, "data-edges") == "0"
        _set_k(page, 0)
        best = max(d["nodes"][1:-1], key=lambda x: abs(x["score"]))  # the strongest head or MLP
        assert abs(best["score"]) > abs(d["nodes"][0]["score"])  # (stronger than the embedding, with this seed)
        lit = page.eval_on_selector_all(f"{graph} circle[data-node]",
                                        "els => els.filter(e => e.getAttribute('r') === '5').map(e => e.dataset.node)")
        assert lit == [best["name"]]
        assert "no circuit on the grid reaches" not in page.text_content("#sec-circuit [data-role=reach]")
        assert errors == [], errors
    finally:
        ctx.close()


def test_circuit_view_of_a_real_report(browser, tmp_path):
    from .test_report import CORRUPTED, TEXT

    lm = get_model("tiny:gpt2")
    rep = build_report(lm, TEXT, " capital", " of", corrupted=CORRUPTED, sections=["prediction", "circuit"])
    (sec,) = [s for s in rep.sections if s["key"] == "circuit"]
    d = sec["data"]
    ks = [f["k"] for f in d["faithfulness"]]
    ctx, page, errors, blocked = _open(browser, rep.write(tmp_path / "real.html"))
    try:
        graph, marker = "#sec-circuit svg.circuit-graph", "#sec-circuit svg.circuit-faith circle.marker"
        assert f"k = {d['smallest']} edges" in page.text_content("#sec-circuit [data-role=reach]")
        counts, marks = [], []
        for i in range(len(ks)):
            _set_k(page, i)
            counts.append(int(page.get_attribute(graph, "data-edges")))
            marks.append(page.get_attribute(marker, "data-k"))
        assert counts == [min(k, 300) for k in ks] and marks == [str(k) for k in ks]
        assert page.locator(f"{graph} path").count() == counts[-1]
        assert errors == [], errors
        assert blocked == [], f"the page tried to fetch {blocked}"
    finally:
        ctx.close()
