"""``lenscope serve`` under concurrency: the model pool never holds more than ``--max-resident`` models, resident or
loading, however many first requests arrive at once (a fake loader, many threads), and concurrent requests for one
model share its one load; a running job whose client has gone stops at its next chunk
(:func:`lenscope.models.runtime.stop.checkpoint`), so a new prompt's first views wait for at most the chunk in progress,
through the worker alone and through a real uvicorn server with a client that closes its connection (what the page
does to the requests of the input it leaves)."""

from __future__ import annotations

import http.client
import json
import random
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from lenscope.errors import Stopped
from lenscope.models.runtime.stop import checkpoint, stoppable
from lenscope.serve import create_app
from lenscope.serve.jobs import Jobs, ModelPool

from ..conftest import get_model
from .helpers import free_port, start_server, stop_server


class FakeLoader:
    """Counts the models alive (a load has started and ``on_unload`` has not come yet) and the loads per name."""

    def __init__(self, seconds: float = 0.02, fail: tuple[str, ...] = ()):
        self.seconds = seconds
        self.fail = fail
        self.lock = threading.Lock()
        self.alive: set[str] = set()
        self.peak = 0
        self.loads: dict[str, int] = {}

    def __call__(self, name: str):
        with self.lock:
            assert name not in self.alive, f"{name} loaded twice at once"
            self.alive.add(name)
            self.peak = max(self.peak, len(self.alive))
            self.loads[name] = self.loads.get(name, 0) + 1
        time.sleep(self.seconds * random.random())  # the load's work; other threads run meanwhile
        if name in self.fail:
            with self.lock:
                self.alive.discard(name)
            raise OSError(f"cannot load {name}")
        return f"model:{name}"

    def unload(self, name: str) -> None:
        with self.lock:
            self.alive.remove(name)


@pytest.mark.parametrize("max_resident", [1, 2, 3])
def test_simultaneous_first_requests_never_hold_more_than_max_resident(max_resident):
    fake = FakeLoader()
    pool = ModelPool(max_resident, loader=fake, on_unload=fake.unload)
    names = [f"m{i}" for i in range(6)]
    rng = random.Random(0)
    asks = [rng.choice(names) for _ in range(300)]
    start = threading.Barrier(24)

    def ask(i):
        if i < 24:
            start.wait()  # the first 24 arrive together
        lm, lens = pool.get(asks[i])
        return lm, lens

    with ThreadPoolExecutor(24) as ex:
        got = list(ex.map(ask, range(len(asks))))
    assert got == [(f"model:{n}", None) for n in asks]  # every request got the model it asked for
    assert fake.peak == max_resident  # reached, never passed
    assert len(fake.alive) == len(pool._models) == max_resident and not pool._loading
    assert sum(fake.loads.values()) > len(names)  # models were let go and loaded again


def test_concurrent_requests_for_one_model_wait_for_its_one_load():
    fake = FakeLoader(seconds=0.2)
    pool = ModelPool(2, loader=fake, on_unload=fake.unload)
    start = threading.Barrier(16)

    def ask(_):
        start.wait()
        return pool.get("m")

    with ThreadPoolExecutor(16) as ex:
        got = list(ex.map(ask, range(16)))
    assert fake.loads == {"m": 1} and all(g == ("model:m", None) for g in got)


def test_a_failed_load_frees_its_slot():
    fake = FakeLoader(fail=("bad",))
    pool = ModelPool(1, loader=fake, on_unload=fake.unload)
    with pytest.raises(OSError, match="cannot load bad"):
        pool.get("bad")
    assert not pool._loading and pool.loaded("bad") is None
    assert pool.get("good") == ("model:good", None) and fake.alive == {"good"}


# ------------------------------------------------------------------------------------------ stopping a job


def chunks(n: int, seconds: float, ran: list):
    """A job of ``n`` chunks, a checkpoint before each (as the methods have one before each forward pass)."""

    def job():
        for i in range(n):
            checkpoint()
            ran.append(i)
            time.sleep(seconds)
        return "finished"

    return job


def wait_for(cond, timeout: float = 120) -> None:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "timed out"
        time.sleep(0.005)


def test_checkpoint_outside_a_stoppable_block_does_nothing_and_inside_raises_once_set():
    checkpoint()
    ev = threading.Event()
    with stoppable(ev):
        checkpoint()
        ev.set()
        with pytest.raises(Stopped):
            checkpoint()
        with stoppable(threading.Event()):  # an inner block (a model load) is not stopped by the outer event
            checkpoint()
    checkpoint()  # the block is left: nothing to stop


def test_a_running_job_stops_at_its_next_chunk_and_the_next_job_runs_at_once():
    jobs = Jobs(max_queue=4)
    ran: list = []
    old = jobs.submit("m", chunks(200, 0.01, ran))
    new = jobs.submit("m", lambda: len(ran))  # queued behind the running job: the next prompt's first views
    wait_for(lambda: len(ran) >= 3)
    assert old.stop() == "stopping"
    with pytest.raises(Stopped):
        old.result(10)
    at_stop = new.result(10)  # chunks run by the old job when the new one started
    assert at_stop < 200 and at_stop == len(ran)  # no chunk of the old job ran after it stopped
    assert jobs.stopped == 1 and jobs.running == 0 and jobs.waiting == 0
    assert old.stop() == "done"
    gate, never = threading.Event(), []
    busy = jobs.submit("m", gate.wait)
    queued = jobs.submit("m", lambda: never.append(1))
    assert queued.stop() == "dropped" and queued.cancelled()
    gate.set()
    assert busy.result(10) and jobs.submit("m", lambda: 3).result(10) == 3
    assert never == [] and jobs.skipped == 1 and jobs.stopped == 1
    jobs.close()


# --------------------------------------------------------------------------------- through a real server

N_CHUNKS, CHUNK_S = 400, 0.025  # a slow attribution view of 10 s, in chunks as the real one has


@pytest.fixture
def server():
    app = create_app(["tiny:llama"], loader=get_model)
    port = free_port()
    srv, th = start_server(app, port=port)
    yield app, port
    stop_server(srv, th)


def post(port: int, body: dict, timeout: float = 600) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/api/analyze", json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def test_a_new_prompts_first_views_do_not_wait_for_the_old_prompts_attribution(server, monkeypatch):
    app, port = server
    svc = app.state.service
    from lenscope.report.sections import Attribution

    ran: list = []

    def slow(self, ctx):  # chunks with a check each, as the real view records one per method
        for i in range(N_CHUNKS):
            checkpoint()
            ran.append(i)
            ctx.check(self.key, f"chunk {i}", 0.0)
            time.sleep(CHUNK_S)
        return {"chunks": N_CHUNKS}

    monkeypatch.setattr(Attribution, "compute", slow)
    assert post(port, {"model": "tiny:llama", "text": "warm up", "sections": ["prediction"]})[0] == 200

    old_text, new_text = "the old prompt", "the new prompt"
    sock = socket.create_connection(("127.0.0.1", port))  # the page's request for the old prompt's attribution
    try:
        body = json.dumps({"model": "tiny:llama", "text": old_text, "sections": ["attribution"]}).encode()
        sock.sendall(b"POST /api/analyze HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        wait_for(lambda: len(ran) >= 3)  # the attribution is running
    finally:
        sock.close()  # a new input: the page aborts the requests of the old one
    status, d = post(port, {"model": "tiny:llama", "text": new_text, "sections": ["prediction", "trajectory"]})
    assert status == 200 and set(d["sections"]) == {"prediction", "trajectory"}
    at_answer = len(ran)
    assert at_answer < N_CHUNKS  # the first views did not wait for the old job's remaining chunks
    wait_for(lambda: svc.jobs.stopped == 1 and svc.jobs.running == 0)
    time.sleep(5 * CHUNK_S)
    assert len(ran) == at_answer  # the old job ran no chunk after it stopped
    assert svc.results.get(("tiny:llama", old_text, None, None, None, "attribution")) is None  # nothing cached
    ctx = svc.contexts.get(("tiny:llama", old_text, None, None, None)).ctx
    assert not any(c.section == "attribution" for c in ctx.checks)  # no half-done checks left behind

    monkeypatch.undo()  # the old prompt's attribution, asked again, is computed whole
    status, d = post(port, {"model": "tiny:llama", "text": old_text, "sections": ["attribution"]})
    assert status == 200 and d["sections"]["attribution"]["methods"]
    assert svc.jobs.stopped == 1
