"""The app of ``lenscope serve`` in a real browser: Debian's chromium driven by Playwright (never a downloaded browser
build) against a real server (uvicorn in a background thread on a free 127.0.0.1 port).

Every request outside the server is blocked and recorded; console errors (a CSP violation is one) fail the tests.
Skipped, with the command that installs it, when chromium or Playwright is missing; ``./dev test`` installs both.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from ..browser import (
    READY_TIMEOUT_MS,
    chromium_browser,  # noqa: F401 - the browser fixture
    isolated_page,
    needs_chromium,
    needs_playwright,
    wait_drawn,
)

TEXT = "When Mary and John went to the store, John gave a drink to"
SCRIPTS = ("core.js", "prediction.js", "trajectory.js", "components.js", "attribution.js", "mixing.js", "flow.js",
           "app.js")


def test_page_is_a_shell_without_inline_script_or_style():
    """What the CSP needs: every script and style is a file under static/, no inline script, style or handler."""
    from lenscope.viz.app import app_html, asset_names

    page = app_html(models=["tiny:llama", "tiny:gpt2", "<b>x</b>"], default="tiny:gpt2", token_required=True,
                    max_tokens=77)
    scripts = re.findall(r"<script\b[^>]*>", page)
    assert scripts and all(re.fullmatch(r'<script src="static/[a-z_-]+\.js">', s) for s in scripts)
    assert page.count("</script>") == len(scripts) and "<script></script>" not in page.replace("\n", "")
    assert [s.split('"')[1].removeprefix("static/") for s in scripts][0] == "core.js"
    assert set(SCRIPTS) <= {s.split('"')[1].removeprefix("static/") for s in scripts}
    assert "<style" not in page and " style=" not in page and not re.search(r"\son[a-z]+=", page)
    names = asset_names()
    linked = re.findall(r'(?:src|href)="static/([^"]+)"', page)
    assert set(linked) <= set(names["report"]) | set(names["app"]) and "app.css" in linked and "report.css" in linked
    assert '<option value="tiny:gpt2" selected>' in page and "&lt;b&gt;x&lt;/b&gt;" in page and "<b>x" not in page
    assert 'data-token-required="1"' in page and "at most 77 tokens" in page
    assert 'data-groups="prediction,trajectory,components;attribution;mixing;flow;circuit"' in page
    # the server's own titles replace the defaults; views the page does not request get no card
    page = app_html(models=["m"], default="m", token_required=False, max_tokens=1,
                    views=[{"key": "flow", "title": "Flow <t>", "blurb": "b & c"}, {"key": "other", "title": "X"}])
    assert "<h2>Flow &lt;t&gt;</h2><p class=\"blurb\">b &amp; c</p>" in page and 'id="sec-other"' not in page
    assert page.index('id="sec-flow"') < page.index('id="sec-prediction"')


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    import uvicorn

    from lenscope.serve import create_app

    app = create_app(["tiny:llama", "tiny:gpt2"])
    port = _free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    t0 = time.monotonic()
    while not srv.started:
        assert th.is_alive() and time.monotonic() - t0 < READY_TIMEOUT_MS / 1000, "the server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    srv.should_exit = True
    th.join(10)


def _post(base: str, path: str, payload: dict) -> dict:
    req = urllib.request.Request(base + path, data=json.dumps(payload).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=READY_TIMEOUT_MS / 1000) as r:
        return json.loads(r.read())


def _open(browser, base: str, query: str = ""):
    """The app with every request outside the server blocked; console errors and page errors collected."""
    ctx, page, errors, blocked = isolated_page(browser, (base + "/",), viewport={"width": 1500, "height": 1000},
                                               accept_downloads=True)
    page.goto(base + "/" + query)
    page.wait_for_selector("body[data-app='1']")
    return ctx, page, errors, blocked


def _fills(page, selector: str) -> list[str]:
    return page.eval_on_selector_all(selector, "els => els.map(e => e.getAttribute('fill') || e.style.background)")


def _ready(page, run_before: str | None = None):
    """Wait until every view of a run newer than ``run_before`` has answered (the app's own signal)."""
    page.wait_for_function(
        "prev => document.body.getAttribute('data-ready') === '1' && document.body.getAttribute('data-run') !== prev",
        arg=run_before, timeout=READY_TIMEOUT_MS)


def _dla(page) -> str:
    return page.text_content("#sec-components .body p.meta b")


@needs_playwright
@needs_chromium
def test_app_explores_a_prediction(browser, server, tmp_path, capsys):
    ctx, page, errors, blocked = _open(browser, server)
    try:
        assert page.input_value("#model") == "tiny:llama"
        _post(server, "/api/analyze", {"model": "tiny:llama", "text": "warm up", "sections": ["prediction"]})
        page.fill("#text", TEXT)
        t0 = time.perf_counter()
        page.press("#text", "Enter")
        page.wait_for_selector("#sec-prediction[data-state=done] svg.topk rect")
        page.wait_for_selector("#sec-trajectory[data-state=done] svg.heat rect")
        page.wait_for_selector("#sec-components[data-state=done] svg.dla-heads rect")
        first = time.perf_counter() - t0
        _ready(page)
        total = time.perf_counter() - t0
        with capsys.disabled():
            ms = page.get_attribute("body", "data-first-ms")
            print(f"\napp, tiny:llama resident, {len(TEXT.split())} words: enter -> first views (prediction, "
                  f"trajectory, components) drawn {first:.2f} s (the page's own clock: {ms} ms to the first answer); "
                  f"every view {total:.2f} s")
        for key in ("prediction", "trajectory", "components", "attribution", "mixing", "flow"):
            assert page.get_attribute(f"#sec-{key}", "data-state") == "done", key
            n = page.eval_on_selector_all(f"#sec-{key} svg rect, #sec-{key} svg line, #sec-{key} svg circle",
                                          "els => els.length")
            assert n > 0, f"view {key} drew nothing"
        assert page.is_hidden("#sec-circuit")

        # target and foil filled in from the first answer: the model's top prediction and runner-up
        direct = _post(server, "/api/analyze", {"model": "tiny:llama", "text": TEXT, "sections": ["prediction"]})
        top = direct["sections"]["prediction"]["top"]
        assert direct["target"]["token"] == top[0]["token"] and direct["foil"]["token"] == top[1]["token"]
        assert page.input_value("#target") == top[0]["token"] and page.input_value("#foil") == top[1]["token"]
        assert "auto" in page.get_attribute("#target", "class")
        n_tok = len(direct["tokens"])
        assert page.locator("#sec-run [data-role=run-tokens] .tok").count() == n_tok
        assert page.url.startswith(server + "/?") and "text=When+Mary" in page.url and "target=" not in page.url
        page.wait_for_function("document.getElementById('model-info').textContent.indexOf('layers') >= 0")
        assert page.text_content("#model-info").startswith("llama \u00b7 2 layers")

        # a head of the DLA heat map: its attention pattern, its writes, its DLA (the heat map's own number)
        page.click("#sec-components svg.dla-heads rect[data-r='1'][data-c='2']")
        page.wait_for_selector("#panel[data-kind=head][data-state=done]")
        assert page.text_content("#panel-title") == "Head L1.H2"
        assert page.eval_on_selector_all(".ls-sel", "els => els.map(e => e.dataset.r + '.' + e.dataset.c)") == ["1.2"]
        cells = _fills(page, "#panel svg.head-pattern rect")
        assert len(cells) == n_tok * n_tok
        upper = [cells[r * n_tok + c] for r in range(n_tok) for c in range(r + 1, n_tok)]
        assert set(upper) == {"rgb(247,251,255)"}  # causal: no query attends to a later key (blues at 0)
        assert cells[0] == "rgb(8,48,107)"  # the first query attends to itself only (blues at 1)
        assert len(set(cells)) > 3
        assert page.locator("#panel svg.head-promoted rect").count() == 10
        assert page.locator("#panel svg.head-suppressed rect").count() == 10
        comp = _post(server, "/api/analyze", {"model": "tiny:llama", "text": TEXT, "sections": ["components"]})
        heads = comp["sections"]["components"]["views"]["difference"]["heads"]
        assert float(page.text_content("#panel [data-role=head-dla]")) == pytest.approx(heads[1][2], abs=2e-4)
        assert "corrupted prompt" in page.text_content("#panel-body p.note")
        page.screenshot(path=str(tmp_path / "head.png"))

        # a token of the attribution strip: every method's row for the prediction at that position
        page.click("#sec-attribution [data-role=strip] .tok >> nth=4")
        page.wait_for_selector("#panel[data-kind=token][data-position='4'][data-state=done]")
        assert page.locator(".tok.ls-sel").count() == 2  # position 4 in the attribution strip and the run card
        tok = _post(server, "/api/token", {"model": "tiny:llama", "text": TEXT, "position": 4})
        rows = page.locator("#panel svg.token-methods rect").count()
        assert len(tok["methods"]) >= 2 and rows == len(tok["methods"]) * max(len(m["scores"])
                                                                              for m in tok["methods"].values())
        page.click("#panel-close")
        assert page.is_hidden("#panel")

        # another target: the DLA is explained for it, and the URL keeps it
        dla_before, heads_before = _dla(page), _fills(page, "#sec-components svg.dla-heads rect")
        run = page.get_attribute("body", "data-run")
        page.fill("#target", " John")
        page.press("#target", "Enter")
        _ready(page, run)
        dla_after = _dla(page)
        assert dla_after != dla_before and dla_after.startswith('logit(" John")')
        assert _fills(page, "#sec-components svg.dla-heads rect") != heads_before
        assert "target=+John" in page.url and page.input_value("#foil") == ""

        # reload: the same state, the same views
        heads_after = _fills(page, "#sec-components svg.dla-heads rect")
        run = page.get_attribute("body", "data-run")
        page.reload()
        page.wait_for_selector("body[data-app='1']")
        _ready(page)
        assert page.input_value("#text") == TEXT and page.input_value("#target") == " John"
        assert _dla(page) == dla_after and _fills(page, "#sec-components svg.dla-heads rect") == heads_after

        # back: the previous state (the model's own target) again
        run = page.get_attribute("body", "data-run")
        page.go_back()
        _ready(page, run)
        assert "target=" not in page.url and page.input_value("#target") == top[0]["token"]
        assert _dla(page) == dla_before
        run = page.get_attribute("body", "data-run")
        page.go_forward()
        _ready(page, run)
        assert page.input_value("#target") == " John" and _dla(page) == dla_after

        # save as report: the static page of the same state
        with page.expect_download() as dl:
            page.click("#save")
        assert dl.value.suggested_filename == "lenscope-report.html"
        saved = tmp_path / "saved.html"
        dl.value.save_as(saved)
        html = saved.read_text(encoding="utf-8")
        assert html.startswith("<!doctype html>") and 'id="lenscope-data"' in html and "John" in html

        page.screenshot(path=str(tmp_path / "app.png"), full_page=True)
        print(f"screenshot: {tmp_path / 'app.png'}")
        assert errors == [], errors
        assert blocked == [], f"the page tried to fetch {blocked}"
    finally:
        ctx.close()


@needs_playwright
@needs_chromium
def test_app_moves_on_patches_and_says_what_is_wrong(browser, server):
    ctx, page, errors, blocked = _open(browser, server)
    try:
        # a second prompt before the first one's views are in: only the second one's views stay
        page.fill("#text", "The capital of Italy is Rome and the capital of France is")
        page.press("#text", "Enter")
        page.fill("#text", "The capital of France is")
        page.press("#text", "Enter")
        _ready(page)
        tokens = page.eval_on_selector_all("#sec-run [data-role=run-tokens] .tok", "els => els.length")
        assert tokens == len(_post(server, "/api/analyze", {"model": "tiny:llama", "text": "The capital of France is",
                                                            "sections": ["prediction"]})["tokens"])
        assert "France" in page.url and "Italy" not in page.url

        # another model from the picker, a target and foil, and a corrupted prompt: the circuit view and patching
        page.select_option("#model", "tiny:gpt2")
        page.fill("#target", " capital")
        page.fill("#foil", " of")
        page.fill("#corrupted", "The capital of Spain is")
        run = page.get_attribute("body", "data-run")
        page.press("#corrupted", "Enter")
        _ready(page, run)
        assert "model=tiny%3Agpt2" in page.url and "corrupted=The+capital+of+Spain+is" in page.url
        assert page.get_attribute("#sec-circuit", "data-state") == "done"
        assert page.locator("#sec-circuit svg.circuit-graph").count() == 1
        page.click("#sec-components svg.dla-heads rect[data-r='0'][data-c='1']")
        page.wait_for_selector("#panel[data-kind=head][data-state=done]")
        head = _post(server, "/api/head", {"model": "tiny:gpt2", "text": "The capital of France is", "layer": 0,
                                           "head": 1, "target": " capital", "foil": " of",
                                           "corrupted": "The capital of Spain is"})
        assert head["patch"] is not None
        shown = page.eval_on_selector_all("#panel [data-role=head-patch] td", "els => els.map(e => e.textContent)")
        assert [float(x) for x in shown] == pytest.approx(
            [head["patch"][k] for k in ("clean", "corrupted", "patched", "effect")], abs=1e-3)

        # a target that is not one token: the server's one-line error, shown in the page
        page.fill("#target", " Mary John")
        page.press("#target", "Enter")
        page.wait_for_selector("#msg:not([hidden])")
        msg = page.text_content("#msg")
        assert msg and "\n" not in msg and "token" in msg
        assert page.get_attribute("#sec-prediction", "data-state") == "error"
        # the browser logs each 4xx answer; nothing else may be logged
        assert [e for e in errors if "status of 400" not in e] == [], errors
        assert blocked == [], f"the page tried to fetch {blocked}"
    finally:
        ctx.close()


@needs_playwright
@needs_chromium
def test_app_sends_the_token_of_its_url(browser):
    """With ``token=``: the page's own address carries the token, every API call sends it as a Bearer header."""
    import uvicorn

    from lenscope.serve import create_app

    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    srv = uvicorn.Server(uvicorn.Config(create_app(["tiny:llama"], token="s3cret"), host="127.0.0.1", port=port,
                                        log_level="warning"))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    t0 = time.monotonic()
    while not srv.started:
        assert th.is_alive() and time.monotonic() - t0 < READY_TIMEOUT_MS / 1000, "the server did not start"
        time.sleep(0.05)
    try:
        ctx, page, errors, blocked = _open(browser, base, "?token=s3cret&text=The+capital+of+France+is")
        sent: list[str | None] = []
        page.on("request", lambda r: sent.append(r.headers.get("authorization")) if "/api/" in r.url else None)
        try:
            _ready(page)  # the text in the URL runs at once
            assert page.get_attribute("#sec-components", "data-state") == "done"
            page.click("#sec-components svg.dla-heads rect[data-r='0'][data-c='0']")
            page.wait_for_selector("#panel[data-kind=head][data-state=done]")
            with page.expect_download() as dl:
                page.click("#save")
            assert dl.value.suggested_filename == "lenscope-report.html"
            assert sent and set(sent) == {"Bearer s3cret"}
            assert "token=s3cret" in page.url and "text=The+capital" in page.url
            assert errors == [], errors
            assert blocked == [], f"the page tried to fetch {blocked}"
        finally:
            ctx.close()
        with pytest.raises(urllib.error.HTTPError) as e:  # and without it, the API refuses
            _post(base, "/api/analyze", {"model": "tiny:llama", "text": "The capital of France is"})
        assert e.value.code == 401 and "error" in json.loads(e.value.read())
    finally:
        srv.should_exit = True
        th.join(10)


@needs_playwright
@needs_chromium
def test_static_report_ignores_the_clicks_the_app_listens_to(browser, tmp_path):
    """The report's views emit head / token / target clicks; in the static report nothing listens: no change."""
    from lenscope.report import build_report

    from ..conftest import get_model

    rep = build_report(get_model("tiny:llama"), TEXT, " Mary", " John", sections=["prediction", "components",
                                                                                   "attribution"])
    path = rep.write(tmp_path / "report.html")
    ctx, page, errors, blocked = isolated_page(browser, ("file:",))
    try:
        page.goto(path.resolve().as_uri())
        wait_drawn(page)
        before = page.inner_html("main")
        clicks = ["#sec-components svg.dla-heads rect >> nth=3", "#sec-attribution [data-role=strip] .tok >> nth=2",
                  "#sec-attribution svg.attr-all rect >> nth=5", "#sec-prediction svg.topk rect >> nth=1"]
        for sel in clicks:
            assert page.get_attribute(sel, "data-emit") in ("head", "token", "target")
            page.click(sel)
        assert page.inner_html("main") == before and page.url == path.resolve().as_uri()
        assert errors == [], errors
        assert blocked == [], blocked
    finally:
        ctx.close()
