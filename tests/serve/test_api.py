"""``lenscope serve``'s HTTP API on tiny models (Starlette's TestClient, no network): every route's shape, the data
equal to what the static report embeds, every bad input's status and JSON error, the token, the queue limit, a
crashed view that leaves the server serving, the security headers and the static assets."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from starlette.testclient import TestClient

from lenscope.report import build_report
from lenscope.serve import create_app
from lenscope.serve.app import CSP

from ..conftest import get_model
from ..tolerances import assert_same_computation

TEXT = "the cat sat on the mat"
CORRUPTED = "the dog sat on the mat"


@pytest.fixture(scope="module")
def client():
    app = create_app(["tiny:llama", "tiny:bert"], loader=get_model)
    with TestClient(app) as c:
        yield c


def analyze(c, **body):
    return c.post("/api/analyze", json={"model": "tiny:llama", "text": TEXT, **body})


def test_models_before_and_after_loading(client):
    d = client.get("/api/models").json()
    assert d["default"] == "tiny:llama" and d["max_tokens"] == 512 and d["max_resident"] == 2
    assert [m["name"] for m in d["models"]] == ["tiny:llama", "tiny:bert"]
    assert analyze(client).status_code == 200
    m = {m["name"]: m for m in client.get("/api/models").json()["models"]}
    A = get_model("tiny:llama").anatomy
    assert m["tiny:llama"] == {"name": "tiny:llama", "loaded": True, "family": A.family, "n_layers": A.n_layers,
                               "n_heads": A.layers[0].attn.n_heads, "causal": True, "has_logits": True}


def test_analyze_equals_the_static_report(client):
    """Default target/foil are the model's top two; the data are exactly build_report's for those tokens."""
    r = analyze(client)
    assert r.status_code == 200
    d = r.json()
    lm = get_model("tiny:llama")
    rep = build_report(lm, TEXT)
    logits = lm.model(torch.tensor([lm.tokenizer(TEXT)["input_ids"]])).logits[0, -1]
    top = torch.topk(logits, 2).indices.tolist()
    assert d["target"]["id"] == top[0] == rep.meta["target_id"] and d["foil"]["id"] == top[1]
    assert d["tokens"] == rep.meta["tokens"] and d["meta"]["target_is_top_prediction"] is True
    rep2 = build_report(lm, TEXT, f"#{top[0]}", f"#{top[1]}")
    want = {s["key"]: s["data"] for s in rep2.sections if "data" in s}
    assert list(d["sections"]) == ["prediction", "trajectory", "components", "attribution", "mixing", "flow"]
    assert_same_computation(d["sections"], want, why="build_report of the same text and tokens, in the server and here")
    assert [(c["section"], c["name"], c["ok"]) for c in d["checks"]] == \
        [(c["section"], c["name"], c["ok"]) for c in rep2.checks]
    assert all(c["ok"] is not False for c in d["checks"])
    assert set(d["timings"]) == {"trace", *want} and d["notes"] == {}


def test_identical_requests_identical_json_and_sections_share_a_trace(client):
    body = {"text": "a b c d", "target": "#5", "sections": ["prediction", "trajectory", "components"]}
    a, b = analyze(client, **body), analyze(client, **body)
    assert a.status_code == b.status_code == 200 and a.content == b.content
    svc = client.app.state.service
    ctx = svc.contexts.get(("tiny:llama", "a b c d", "#5", None, None)).ctx
    c = analyze(client, **dict(body, sections=["mixing"])).json()
    assert set(c["sections"]) == {"mixing"} and svc.contexts.get(("tiny:llama", "a b c d", "#5", None, None)).ctx is ctx
    assert c["target"] == a.json()["target"] == {"token": get_model("tiny:llama").tokenizer.decode([5]), "id": 5}
    assert a.json()["foil"] is None


def test_encoder_gets_notes_where_a_view_does_not_apply(client):
    d = client.post("/api/analyze", json={"model": "tiny:bert", "text": TEXT}).json()
    assert "components" in d["notes"] and "components" not in d["sections"]
    assert {"prediction", "attribution", "mixing", "flow"} <= set(d["sections"])


def test_head(client):
    lm = get_model("tiny:llama")
    body = {"model": "tiny:llama", "text": TEXT, "layer": 1, "head": 2, "target": "#7", "foil": "#9",
            "corrupted": CORRUPTED}
    d = client.post("/api/head", json=body).json()
    P = len(d["tokens"])
    assert d["layer"] == 1 and d["head"] == 2 and d["position"] == P - 1
    pattern = torch.tensor(d["pattern"])
    assert pattern.shape == (P, P)
    assert torch.allclose(pattern.sum(-1), torch.ones(P), atol=1e-4)
    assert torch.all(pattern.triu(1) == 0)  # causal
    # promoted / suppressed: the head's write at the last position, z_h W_O^h, through the final RMSNorm with the
    # run's own scale and the unembedding, recomputed from the model's modules (hooks, float64)
    m = lm.model
    seen = {}
    hs = [m.model.layers[1].self_attn.o_proj.register_forward_pre_hook(lambda mod, a: seen.__setitem__("z", a[0])),
          m.model.norm.register_forward_pre_hook(lambda mod, a: seen.__setitem__("x", a[0]))]
    try:
        with torch.no_grad():
            m(torch.tensor([lm.tokenizer(TEXT)["input_ids"]]))
    finally:
        for h in hs:
            h.remove()
    dh = m.config.hidden_size // m.config.num_attention_heads
    z = seen["z"][0, -1, 2 * dh : 3 * dh].double()
    write = m.model.layers[1].self_attn.o_proj.weight[:, 2 * dh : 3 * dh].double() @ z
    x = seen["x"][0, -1].double()
    normed = write * m.model.norm.weight.double() / (x.pow(2).mean() + m.config.rms_norm_eps).sqrt()
    logits = m.lm_head.weight.double() @ normed
    up, down = logits.topk(10), (-logits).topk(10)
    assert [t["id"] for t in d["promoted"]] == up.indices.tolist()
    assert [t["id"] for t in d["suppressed"]] == down.indices.tolist()
    assert [t["token"] for t in d["promoted"]] == [lm.tokenizer.decode([i]) for i in up.indices.tolist()]
    # the JSON keeps 5 significant digits; float32 against float64 is 1e-6 of the largest logit
    scale = float(logits.abs().max())
    for got, want in ((d["promoted"], up.values), (d["suppressed"], -down.values)):
        for t, w in zip(got, want.tolist()):
            assert t["value"] == pytest.approx(w, rel=5e-5, abs=1e-6 * scale), (t, w)
    # its DLA is the head's entry in the report's components view (target minus foil)
    comp = analyze(client, target="#7", foil="#9", corrupted=CORRUPTED, sections=["components"]).json()
    assert d["dla"] == pytest.approx(comp["sections"]["components"]["views"]["difference"]["heads"][1][2], abs=1e-4)
    # promoted/suppressed values are the head's write read through the unembedding: the foil/target contrast agrees
    from lenscope.interventions.patching import activation_patching

    ref = activation_patching(lm, TEXT, CORRUPTED, "#7", "#9", what="heads", noising=True)
    p = d["patch"]
    assert p["clean"] == pytest.approx(ref.clean_metric, abs=1e-4)
    assert p["corrupted"] == pytest.approx(ref.corrupted_metric, abs=1e-4)
    assert p["patched"] == pytest.approx(float(ref.raw[1, 2]), abs=1e-4)
    assert p["effect"] == pytest.approx(p["patched"] - p["clean"], abs=1e-4)
    no_patch = client.post("/api/head", json={k: v for k, v in body.items() if k != "corrupted"}).json()
    assert no_patch["patch"] is None and no_patch["dla"] == pytest.approx(d["dla"], abs=1e-4)


def test_token(client):
    from lenscope.attribution import explain

    lm = get_model("tiny:llama")
    d = client.post("/api/token", json={"model": "tiny:llama", "text": TEXT, "position": 3}).json()
    tr_logits = lm.model(torch.tensor([lm.tokenizer(TEXT)["input_ids"]])).logits[0, 3]
    assert d["position"] == 3 and d["token"] == " s" and d["foil"] is None
    assert d["target"]["id"] == int(tr_logits.argmax())
    assert set(d["methods"]) == {"logit", "alti-logit", "alti", "grad-norm", "grad-x-input", "ig", "erasure",
                                 "value-zeroing"}
    # every method equals explain on its own: the JSON keeps 5 significant digits (5e-5 relative), and the two
    # float32 computations (the route reuses its cached trace, ig runs its 32 steps) agree to 1e-5 of the scale
    for m, got in d["methods"].items():
        needs_target = m not in ("alti", "value-zeroing")
        e = explain(lm, TEXT, d["target"]["id"] if needs_target else None, method=m, position=3,
                    **({"steps": 32} if m == "ig" else {}))
        want = e.scores.double()
        err = (torch.tensor(got["scores"], dtype=torch.float64) - want).abs()
        assert bool((err <= 5e-5 * want.abs() + 1e-5 * float(want.abs().max())).all()), (m, got["scores"], want)
        assert float(want.abs().max()) > 0, m
        if e.invariant_error is None or e.invariant_error != e.invariant_error:  # NaN: no such check
            assert got["invariant_error"] is None or got["invariant_error"] != got["invariant_error"], m
        else:
            assert got["invariant_error"] == pytest.approx(e.invariant_error, abs=1e-6), m
    neg = client.post("/api/token", json={"model": "tiny:llama", "text": TEXT, "position": -1, "foil": "#3"}).json()
    assert neg["position"] == len(d["methods"]["alti"]["scores"]) - 1 and neg["foil"]["id"] == 3


def test_report_download(client):
    r = client.get("/api/report", params={"model": "tiny:llama", "text": TEXT, "target": "#7"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert r.headers["content-disposition"] == 'attachment; filename="lenscope-report.html"'
    assert "<script" in r.text and '"prediction"' in r.text


@pytest.mark.parametrize("body,status,words", [
    ({"model": "nope"}, 404, "unknown model"),
    ({"model": "/etc/passwd"}, 404, "unknown model"),
    ({"text": ""}, 400, "empty"),
    ({"text": None}, 400, "missing"),
    ({"text": "x" * 400}, 400, "context"),
    ({"sections": ["bogus"]}, 400, "unknown section"),
    ({"sections": "prediction,nope"}, 400, "unknown section"),
    ({"target": "the cat"}, 400, "not exactly one token"),
    ({"target": "#7", "foil": "cat cat"}, 400, "not exactly one token"),
    ({"target": "#999999"}, 400, "outside the vocabulary"),
    ({"target": ["x"]}, 400, "target"),
    ({"corrupted": "the dog"}, 400, "same number of tokens"),
])
def test_bad_analyze(client, body, status, words):
    r = client.post("/api/analyze", json={"model": "tiny:llama", "text": TEXT, **body})
    assert r.status_code == status
    assert words in r.json()["error"] and "\n" not in r.json()["error"]


@pytest.mark.parametrize("route,body,words", [
    ("/api/head", {"layer": 2, "head": 0}, "layer 2"),
    ("/api/head", {"layer": 0, "head": 4}, "head 4"),
    ("/api/head", {"layer": "x", "head": 0}, "integer"),
    ("/api/head", {"head": 0}, "layer"),
    ("/api/token", {"position": 99}, "position 99"),
    ("/api/token", {"position": -99}, "position -99"),
    ("/api/token", {"position": 1.5}, "integer"),
])
def test_bad_head_and_token(client, route, body, words):
    r = client.post(route, json={"model": "tiny:llama", "text": TEXT, **body})
    assert r.status_code == 400 and words in r.json()["error"]


def test_bad_json_routes_and_methods(client):
    r = client.post("/api/analyze", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]
    assert client.post("/api/analyze", json=["a"]).status_code == 400
    r = client.get("/api/nothing")
    assert r.status_code == 404 and "no such route" in r.json()["error"]
    assert client.get("/api/analyze").status_code == 405
    assert client.post("/api/analyze", content=b"x" * (1 << 21)).status_code == 413


def test_over_the_servers_token_limit_is_413():
    app = create_app(["tiny:llama"], max_tokens=5, loader=get_model)
    with TestClient(app) as c:
        r = c.post("/api/analyze", json={"model": "tiny:llama", "text": TEXT})
        assert r.status_code == 413 and "--max-tokens" in r.json()["error"]
        assert c.post("/api/analyze", json={"model": "tiny:llama", "text": "the cat"}).status_code == 200


def test_token_required():
    app = create_app(["tiny:llama"], token="s3cret", loader=get_model)
    with TestClient(app) as c:
        for r in (c.get("/api/models"), c.post("/api/analyze", json={"text": TEXT}),
                  c.get("/api/models", headers={"Authorization": "Bearer wrong"}),
                  c.get("/api/models", headers={"Authorization": "s3cret"}), c.get("/"),
                  c.post("/api/head", json={"text": TEXT, "layer": 0, "head": 0}),
                  c.post("/api/token", json={"text": TEXT, "position": 0}), c.get("/api/report?text=a")):
            assert r.status_code == 401 and "token" in r.json()["error"]
            assert r.headers["www-authenticate"] == "Bearer"
        ok = {"Authorization": "Bearer s3cret"}
        assert c.get("/api/models", headers=ok).status_code == 200
        assert c.post("/api/analyze", json={"text": "a b", "sections": ["prediction"]}, headers=ok).status_code == 200
        assert c.get("/?token=s3cret").status_code == 200
        r = c.get("/api/report", params={"text": "a b", "token": "s3cret"})  # a download link sends no header
        assert r.status_code == 200 and "attachment" in r.headers["content-disposition"]
        assert c.post("/api/analyze?token=s3cret", json={"text": "a b"}).status_code == 401  # JSON calls: the header
        assert c.get("/static/core.js").status_code == 200  # the page's own scripts need no token


def test_queue_full_is_503_and_a_crash_leaves_the_server_serving(client):
    svc = client.app.state.service
    gate = threading.Event()
    svc.jobs.max_queue = 1
    try:
        busy = svc.jobs.submit("tiny:llama", gate.wait)  # the model's worker is busy
        time.sleep(0.05)
        queued = svc.jobs.submit("tiny:llama", lambda: 1)  # one waits: the queue is full
        r = analyze(client, text="something new", sections=["prediction"])
        assert r.status_code == 503 and "busy" in r.json()["error"]
    finally:
        gate.set()
        svc.jobs.max_queue = 16
    assert busy.result(5) and queued.result(5) == 1

    from lenscope.report.sections import Mixing

    orig = Mixing.compute
    Mixing.compute = lambda self, ctx: 1 / 0
    try:
        r = analyze(client, text="a crash", sections=["mixing"])
        assert r.status_code == 500 and "ZeroDivisionError" in r.json()["error"]
    finally:
        Mixing.compute = orig
    assert analyze(client, text="a crash", sections=["mixing"]).status_code == 200


def test_cancelled_job_is_dropped_before_it_runs():
    from lenscope.serve.jobs import Jobs

    jobs = Jobs(max_queue=4)
    gate, ran = threading.Event(), []
    first = jobs.submit("m", gate.wait)
    second = jobs.submit("m", lambda: ran.append(1))
    assert second.cancel()
    gate.set()
    first.result(5)
    third = jobs.submit("m", lambda: 3)
    assert third.result(5) == 3 and ran == [] and jobs.skipped == 1 and jobs.waiting == 0
    jobs.close()


def test_security_headers_on_every_response(client):
    for r in (client.get("/api/models"), client.get("/nope"), client.get("/static/nope.js"),
              client.post("/api/analyze", json={"text": ""}), client.get("/")):
        assert r.headers["content-security-policy"] == CSP
        assert r.headers["x-content-type-options"] == "nosniff"
    assert "'unsafe-inline'" not in CSP and "http" not in CSP


@pytest.mark.parametrize("name", ["../__init__.py", "..%2F__init__.py", "%2Fetc%2Fpasswd", "/etc/passwd",
                                  "..%2F..%2Freport%2F__init__.py", "page.py", ".hidden.js", "core.js%00.css",
                                  "nope.js"])
def test_static_refuses_names_outside_the_asset_folders(client, name):
    r = client.get(f"/static/{name}")
    assert r.status_code == 404 and "error" in r.json()


def test_static_serves_the_report_assets(client):
    r = client.get("/static/core.js")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/javascript")
    from lenscope.viz.report import asset

    assert r.text == asset("core.js")
    assert client.get("/static/report.css").headers["content-type"].startswith("text/css")


def test_circuit_view_with_a_corrupted_prompt(client):
    d = analyze(client, target="#7", foil="#9", corrupted=CORRUPTED, sections=["circuit"]).json()
    circ = d["sections"]["circuit"]
    assert circ["edges"] and circ["faithfulness"]
    assert any(c["section"] == "circuit" for c in d["checks"])
    plain = analyze(client, target="#7", foil="#9", sections=["circuit"]).json()
    assert "corrupted" in plain["notes"]["circuit"] and plain["sections"] == {}  # no corrupted prompt: a note
    assert "circuit" not in analyze(client, target="#7", foil="#9", sections=None).json()["notes"]  # not by default


def test_models_load_lazily_and_at_most_max_resident_stay():
    app = create_app(["tiny:llama", "tiny:gpt2"], max_resident=1, loader=get_model)
    svc = app.state.service
    with TestClient(app) as c:
        loaded = lambda: {m["name"]: m["loaded"] for m in c.get("/api/models").json()["models"]}  # noqa: E731
        assert loaded() == {"tiny:llama": False, "tiny:gpt2": False}
        assert analyze(c, sections=["prediction"]).status_code == 200
        assert loaded() == {"tiny:llama": True, "tiny:gpt2": False} and len(svc.results) == 1
        assert c.post("/api/analyze", json={"model": "tiny:gpt2", "text": TEXT, "sections": ["prediction"]}
                      ).status_code == 200
        assert loaded() == {"tiny:llama": False, "tiny:gpt2": True}
        assert len(svc.results) == 1 and len(svc.contexts) == 1  # what was cached for tiny:llama went with it


def test_create_app_and_serve_refuse_bad_settings():
    from lenscope.errors import InputError, UnknownModelError
    from lenscope.serve import serve

    with pytest.raises(UnknownModelError, match="unknown model 'nope'"):
        create_app(["nope"])
    with pytest.raises(InputError, match="--max-tokens"):
        create_app(["tiny:llama"], max_tokens=0)
    with pytest.raises(InputError, match="--token"):
        serve("0.0.0.0", 8000, models=["tiny:llama"])
    served = [m["name"] for m in TestClient(create_app()).get("/api/models").json()["models"]]
    assert served[:1] == ["smollm2"] and "tiny:llama" in served
    assert {"tiny:t5", "tiny:bart", "tiny:marian"} <= set(served)  # encoder-decoder models: the alignment view
    create_app(["tiny:t5"])  # tests/serve/test_alignment_api.py


def test_cli_refuses_a_public_host_without_a_token():
    from typer.testing import CliRunner

    from lenscope.cli import app

    r = CliRunner().invoke(app, ["serve", "--host", "0.0.0.0", "--model", "tiny:llama"])
    assert r.exit_code == 2 and "--token" in r.output and len(r.output.strip().splitlines()) == 1
    r = CliRunner().invoke(app, ["serve", "--model", "nope"])
    assert r.exit_code == 2 and "unknown model 'nope'" in r.output
    from lenscope.serve.app import url

    assert url("127.0.0.1", 8000) == "http://127.0.0.1:8000/"
    assert url("0.0.0.0", 9000, "abc") == "http://0.0.0.0:9000/?token=abc"


def test_head_and_token_on_an_encoder(client):
    body = {"model": "tiny:bert", "text": TEXT}
    h = client.post("/api/head", json=dict(body, layer=0, head=1)).json()
    P = len(h["tokens"])
    pattern = torch.tensor(h["pattern"])
    assert pattern.shape == (P, P) and torch.allclose(pattern.sum(-1), torch.ones(P), atol=1e-4)
    assert (pattern.triu(1) > 0).any()  # bidirectional
    assert h["promoted"] is None and h["dla"] is None and "Post-LN" in h["notes"]["write"]
    t = client.post("/api/token", json=dict(body, position=2)).json()
    assert set(t["methods"]) == {"alti", "grad-norm", "grad-x-input", "ig", "erasure", "value-zeroing"}
    assert all(len(m["scores"]) == P for m in t["methods"].values())
