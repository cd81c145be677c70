"""``lenscope serve`` under load: a real uvicorn server (background thread, a free port on 127.0.0.1), 20 concurrent
requests from threads (identical and different texts on tiny:llama): every one answered 200, none lost, identical
inputs give identical results, and the process's memory after the burst (after gc) stays within a stated margin of
its level after a first warm-up burst. A queued request whose client disconnects is dropped before it runs."""

from __future__ import annotations

import gc
import http.client
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import uvicorn

from lenscope.serve import create_app

from ..conftest import get_model
from .helpers import free_port, start_server, stop_server

RSS_MARGIN_MB = 16  # measured +3.7 to +4.0 MB: the new cache entries of a tiny model are kilobytes, the rest is the
# allocator's growth under 20 request threads; 16 MB leaves 4x that for other allocators and machines
WORDS = "the cat sat on a mat and then the dog ran off to see what".split()


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


@pytest.fixture(scope="module")
def server():
    app = create_app(["tiny:llama"], max_queue=32, loader=get_model)
    port = free_port()
    srv, th = start_server(app, port=port)
    yield app, port
    stop_server(srv, th)


def post(port: int, path: str, body: dict, timeout: float = 60) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def burst(port: int, texts: list[str]) -> list[tuple[int, dict]]:
    with ThreadPoolExecutor(len(texts)) as ex:
        return list(ex.map(lambda t: post(port, "/api/analyze", {"model": "tiny:llama", "text": t}), texts))


def texts_for(round_: int) -> list[str]:
    """20 requests: 5 different texts, each sent 4 times, interleaved."""
    distinct = [" ".join(WORDS[i + round_ * 5: i + round_ * 5 + 6]) + f" {round_}" for i in range(5)]
    return [distinct[i % 5] for i in range(20)]


def check(results, texts) -> None:
    assert len(results) == len(texts) == 20
    assert [s for s, _ in results] == [200] * 20, [d.get("error") for _, d in results]
    assert [d["text"] for _, d in results] == texts  # every request got its own answer: none lost or swapped
    by_text: dict = {}
    for (_, d), t in zip(results, texts):
        by_text.setdefault(t, []).append(json.dumps(d, sort_keys=True))
    for t, answers in by_text.items():
        assert len(set(answers)) == 1, f"different answers for {t!r}"
    first = {t: json.loads(a[0]) for t, a in by_text.items()}
    assert len({json.dumps(d["sections"], sort_keys=True) for d in first.values()}) == 5  # different texts differ
    for d in first.values():
        assert set(d["sections"]) == {"prediction", "trajectory", "components", "attribution", "mixing", "flow"}
        assert all(c["ok"] is not False for c in d["checks"])


def test_twenty_concurrent_requests(server):
    app, port = server
    svc = app.state.service
    warm = texts_for(0)
    check(burst(port, warm), warm)
    gc.collect()
    before = rss_mb()
    texts = texts_for(1)
    results = burst(port, texts)
    check(results, texts)
    assert svc.jobs.waiting == 0 and svc.jobs.running == 0
    again = burst(port, texts)  # now from the cache, byte for byte
    assert [json.dumps(d, sort_keys=True) for _, d in again] == [json.dumps(d, sort_keys=True) for _, d in results]
    gc.collect()
    after = rss_mb()
    print(f"\nRSS after the warm-up burst {before:.1f} MB, after two more bursts {after:.1f} MB "
          f"(+{after - before:.1f} MB; margin {RSS_MARGIN_MB} MB)")
    assert after - before < RSS_MARGIN_MB


def test_a_queued_request_whose_client_left_is_dropped(server):
    app, port = server
    svc = app.state.service
    gate = threading.Event()
    busy = svc.jobs.submit("tiny:llama", gate.wait)  # the model's worker is busy
    skipped = svc.jobs.skipped
    text = "a request nobody waits for"
    sock = socket.create_connection(("127.0.0.1", port))
    try:
        body = json.dumps({"model": "tiny:llama", "text": text}).encode()
        sock.sendall(b"POST /api/analyze HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        t0 = time.monotonic()
        while svc.jobs.waiting < 1:
            assert time.monotonic() - t0 < 10
            time.sleep(0.02)
    finally:
        sock.close()
    time.sleep(1.0)  # the handler polls the connection every 0.2 s and cancels the queued job
    gate.set()
    busy.result(10)
    t0 = time.monotonic()
    while svc.jobs.skipped == skipped and time.monotonic() - t0 < 10:
        time.sleep(0.02)
    assert svc.jobs.skipped == skipped + 1 and svc.jobs.waiting == 0
    assert svc.contexts.get(("tiny:llama", text, None, None, None)) is None  # it never ran
    status, d = post(port, "/api/analyze", {"model": "tiny:llama", "text": "still serving", "sections": ["prediction"]})
    assert status == 200 and "prediction" in d["sections"]


def test_serve_binds_to_127_0_0_1_by_default(monkeypatch):
    """``lenscope serve`` without ``--host``: the real uvicorn server it starts listens on 127.0.0.1 only (its
    sockets, read once it has started; then it is stopped), and the address it prints is that one."""
    from typer.testing import CliRunner

    from lenscope.cli import app as cli_app

    seen = {}

    def run_briefly(app, host, port, **kw):  # uvicorn.run, but stopped as soon as it listens
        srv, th = start_server(app, host, port)
        seen["host"] = host
        seen["bound"] = [sock.getsockname()[:2] for server in srv.servers for sock in server.sockets]
        status, d = get(port, "/api/models")
        seen["models"] = status, d
        stop_server(srv, th)

    monkeypatch.setattr(uvicorn, "run", run_briefly)
    port = free_port()
    r = CliRunner().invoke(cli_app, ["serve", "--model", "tiny:llama", "--port", str(port)])
    assert r.exit_code == 0, r.output
    assert seen["host"] == "127.0.0.1" and seen["bound"] == [("127.0.0.1", port)]
    assert seen["models"][0] == 200 and seen["models"][1]["default"] == "tiny:llama"
    assert f"open http://127.0.0.1:{port}/" in r.output


def get(port: int, path: str) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()
