"""``lenscope serve``'s ``/api/alignment`` on tiny translation models (Starlette's TestClient, no network): the answer
equals pair_scores for the pair (the report's alignment view's data), its links model_alignments's, with gold its AER
alignment_error_rate's; every bad request a JSON error with its status; the token when one is set."""

from __future__ import annotations

import pytest
import torch
from starlette.testclient import TestClient

from lenscope.data.alignments import AlignedPair
from lenscope.evaluate.aer import alignment_error_rate, model_alignments, pair_scores
from lenscope.report import build_report, unpack
from lenscope.serve import create_app

from ..conftest import get_model

SOURCE, TARGET = "das Haus ist klein", "the house is small"
METHODS = ["logit", "alti-logit"]
GOLD = {"sure": [[0, 0], [1, 1], [2, 2]], "possible": [[3, 3]]}


@pytest.fixture(scope="module")
def client():
    app = create_app(["tiny:marian", "tiny:m2m100", "tiny:llama"], loader=get_model)
    with TestClient(app) as c:
        yield c


def ask(c, **body):
    return c.post("/api/alignment", json={"model": "tiny:marian", "source": SOURCE, "target": TARGET,
                                          "methods": METHODS, **body})


@pytest.mark.parametrize("name", ["tiny:marian", "tiny:m2m100"])
def test_alignment_equals_pair_scores(client, name):
    r = ask(client, model=name)
    assert r.status_code == 200, r.text
    d = r.json()
    lm = get_model(name)
    ps = pair_scores(lm, [(SOURCE, TARGET)], METHODS)[0]
    assert d["methods"] == METHODS and d["n_source"] == ps.n_source
    assert len(d["source_tokens"]) == ps.n_source and len(d["prefix_tokens"]) == len(ps.decoder_ids)
    for m in METHODS:
        got = torch.from_numpy(unpack(d["alignment"]["methods"][m]["scores"]).copy()).double()
        torch.testing.assert_close(got, ps.scores[m].double(), rtol=1e-6, atol=1e-9)
    g = AlignedPair("0", tuple(SOURCE.split()), tuple(TARGET.split()), frozenset(), frozenset())
    links = model_alignments(lm, [g], METHODS)
    assert d["links"] == {m: sorted(list(x) for x in links[m]["0"]) for m in METHODS}
    assert d["gold"] is None and d["aer"] is None
    assert all(c["ok"] is not False for c in d["checks"]) and d["checks"][0]["section"] == "alignment"
    # the same data as the report's alignment view
    rep = build_report(lm, TARGET, source=SOURCE, methods=METHODS)
    assert rep.sections[0]["data"] == d["alignment"]


def test_alignment_with_gold_has_each_methods_aer(client):
    r = ask(client, gold=GOLD)
    assert r.status_code == 200, r.text
    d = r.json()
    lm = get_model("tiny:marian")
    pair = AlignedPair("0", tuple(SOURCE.split()), tuple(TARGET.split()), frozenset({(0, 0), (1, 1), (2, 2)}),
                       frozenset({(0, 0), (1, 1), (2, 2), (3, 3)}))
    links = model_alignments(lm, [pair], METHODS)
    assert d["gold"] == {"sure": GOLD["sure"], "possible": GOLD["possible"]}
    for m in METHODS:
        want = alignment_error_rate([pair], links[m], method=m)
        assert d["aer"][m]["aer"] == pytest.approx(want.aer, abs=1e-15)
        assert d["aer"][m]["precision"] == pytest.approx(want.precision, abs=1e-15)
        assert d["aer"][m]["recall"] == pytest.approx(want.recall, abs=1e-15)
    # Pharaoh strings are links too, and the default methods are every method that reads a source
    from lenscope.attribution.methods import source_readers
    from lenscope.report.alignment import view_methods

    assert view_methods() == source_readers()
    assert ask(client, gold={"sure": "0-0 1-1 2-2", "possible": ["3-3"]}).json()["aer"] == d["aer"]


@pytest.mark.parametrize("body, status, message", [
    ({"source": None}, 400, "the source is missing or empty"),
    ({"target": "  "}, 400, "the target is missing or empty"),
    ({"methods": "logit"}, 400, "\"methods\" must be a non-empty list"),
    ({"methods": ["nope"]}, 400, "unknown or not source-reading method(s) ['nope']"),
    ({"gold": [[0, 0]]}, 400, "\"gold\" must be an object"),
    ({"gold": {"sure": [[9, 0]]}}, 400, "links source word 9, but the source has 4 words"),
    ({"gold": {"sure": [[0, "x"]]}}, 400, "not a link"),
    ({"model": "tiny:llama"}, 400, "--source is for encoder-decoder (translation) models"),
    ({"model": "nope"}, 404, "unknown model 'nope'"),
])
def test_bad_requests_are_json_errors(client, body, status, message):
    r = ask(client, **body)
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json") and message in r.json()["error"]
    assert "\n" not in r.json()["error"]


def test_not_json_too_long_and_a_decoder_analysis(client):
    r = client.post("/api/alignment", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]
    assert client.get("/api/alignment").status_code == 405
    # the decoder's views of a translation model: one line saying what it needs
    r = client.post("/api/analyze", json={"model": "tiny:marian", "text": TARGET, "sections": ["prediction"]})
    assert r.status_code == 400 and "--source" in r.json()["error"]
    app = create_app(["tiny:marian"], loader=get_model, max_tokens=5)
    with TestClient(app) as c:
        r = ask(c)
        assert r.status_code == 413 and "more than this server's limit of 5" in r.json()["error"]


def test_the_token_is_required_when_set():
    app = create_app(["tiny:marian"], loader=get_model, token="s3cret")
    with TestClient(app) as c:
        r = ask(c)
        assert r.status_code == 401 and "token" in r.json()["error"]
        r = c.post("/api/alignment", json={"source": SOURCE, "target": TARGET, "methods": ["logit"]},
                   headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 200 and r.json()["model"] == "tiny:marian"


# ------------------------------------------------------------------------- the app's view, in a real browser

from ..browser import chromium_browser  # noqa: F401,E402 - the browser fixture
from .helpers import start_server, stop_server  # noqa: E402
from .test_app_browser import _fills, _open, _ready, needs_chromium, needs_playwright  # noqa: E402,F401


@pytest.fixture(scope="module")
def server():
    srv, th = start_server(create_app(["tiny:llama", "tiny:marian"], loader=get_model))
    yield f"http://127.0.0.1:{srv.config.port}"
    stop_server(srv, th)


@needs_playwright
@needs_chromium
def test_app_shows_the_alignment_of_a_translation(browser, server):  # noqa: F811 - the fixture
    ctx, page, errors, blocked = _open(browser, server)
    try:
        assert page.is_hidden("#pair-row") and page.is_hidden("#sec-alignment")
        page.select_option("#model", "tiny:marian")  # a translation model: its source field and its one view
        assert page.is_visible("#pair-row") and page.is_visible("#sec-alignment") and page.is_hidden("#target")
        assert page.is_hidden("#sec-prediction") and page.is_hidden("#sec-attribution")
        page.fill("#text", TARGET)
        page.press("#text", "Enter")
        page.wait_for_selector("#msg:not([hidden])")
        assert "give the source" in page.text_content("#msg")
        page.fill("#source", SOURCE)
        page.fill("#gold", "0-0 1-1 2-2 p3-3")
        page.click("#run")
        _ready(page)
        assert page.get_attribute("#sec-alignment", "data-state") == "done", page.text_content("#msg")
        d = ask_direct(server)
        n_rows, n_src = len(d["prefix_tokens"]) - 1, d["n_source"]
        cells = _fills(page, "#sec-alignment svg.align-source rect[data-r]")
        assert len(cells) == n_rows * n_src and len(set(cells)) > 3
        methods = page.eval_on_selector_all("#sec-alignment [data-role=align-methods] button",
                                            "els => els.map(e => e.getAttribute('data-value'))")
        assert methods == list(d["methods"])  # the server's default: every method that reads a source
        page.click(f"#sec-alignment [data-role=align-methods] button[data-value='{methods[1]}']")
        assert _fills(page, "#sec-alignment svg.align-source rect[data-r]") != cells
        for m in methods:
            got = float(page.get_attribute(f"#sec-alignment tr[data-method='{m}'] td[data-role=aer]", "data-value"))
            assert got == pytest.approx(d["aer"][m]["aer"])
        assert page.locator("#sec-alignment svg.align-words rect.gold-sure").count() == 3
        assert "source=das+Haus" in page.url and "gold=" in page.url
        assert page.locator("#sec-run table.checks tr").count() == len(d["checks"]) + 1
        # back to a decoder: its views, no source field
        before = page.get_attribute("body", "data-run")
        page.select_option("#model", "tiny:llama")  # with a text: its views run at once
        _ready(page, before)
        assert page.is_hidden("#pair-row") and page.is_hidden("#sec-alignment") and page.is_visible("#sec-prediction")
        assert errors == [] and blocked == []
    finally:
        ctx.close()


def ask_direct(base: str) -> dict:
    """What the page asked for, from the server itself (its defaults: every method that reads a source)."""
    from .test_app_browser import _post

    return _post(base, "/api/alignment", {"model": "tiny:marian", "source": SOURCE, "target": TARGET,
                                          "gold": {"sure": [[0, 0], [1, 1], [2, 2]], "possible": [[3, 3]]}})
