"""A real uvicorn server in a thread, for the tests that go through HTTP."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

START_TIMEOUT_S = 120  # a ceiling a loaded 2-core machine does not reach in normal operation


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(app, host: str = "127.0.0.1", port: int | None = None) -> tuple[uvicorn.Server, threading.Thread]:
    """``app`` served by uvicorn on ``host:port`` in a daemon thread, returned once it listens."""
    srv = uvicorn.Server(uvicorn.Config(app, host=host, port=free_port() if port is None else port,
                                        log_level="warning", lifespan="on"))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    t0 = time.monotonic()
    while not srv.started:
        assert time.monotonic() - t0 < START_TIMEOUT_S, "uvicorn did not start"
        time.sleep(0.02)
    return srv, th


def stop_server(srv: uvicorn.Server, th: threading.Thread) -> None:
    srv.should_exit = True
    th.join(10)
