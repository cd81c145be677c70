"""Stopping a running computation at its next chunk: :func:`stoppable` marks a block of work (in this thread) as
stoppable by an event, and :func:`checkpoint`, called before every forward pass of the engine and between the chunks
of long loops, raises :class:`~lenscope.errors.Stopped` once the event is set."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from ...errors import Stopped

_STOP: ContextVar[threading.Event | None] = ContextVar("lenscope_stop", default=None)


@contextmanager
def stoppable(event: threading.Event) -> Iterator[None]:
    """Within this block (in this thread), :func:`checkpoint` raises :class:`~lenscope.errors.Stopped` once
    ``event`` is set: another thread asks the computation to stop, and it stops at its next chunk (``lenscope
    serve`` sets it when the client of a running job goes away)."""
    token = _STOP.set(event)
    try:
        yield
    finally:
        _STOP.reset(token)


def checkpoint() -> None:
    """Raise :class:`~lenscope.errors.Stopped` when the computation running in this thread was asked to stop (see
    :func:`stoppable`); otherwise nothing. :func:`run` calls it before every forward pass, and long loops of the
    methods between their chunks, so nothing is left half-done: a chunk either ran or did not start."""
    event = _STOP.get()
    if event is not None and event.is_set():
        raise Stopped("the computation was stopped: nobody waits for its result any more")
