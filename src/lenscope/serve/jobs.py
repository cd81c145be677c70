"""The server's machinery: one worker thread per model (one computation per model at a time), a bound on the jobs
waiting in all, jobs whose client has gone dropped before they run or stopped at their next chunk, least-recently-used
caches, and the pool of loaded models (loaded lazily on first use, at most ``max_resident`` resident or loading)."""

from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future

from ..errors import Stopped
from ..models.runtime.stop import stoppable

log = logging.getLogger("lenscope.serve")


class ApiError(Exception):
    """A request the server refuses: ``status`` (4xx / 503) and a one-line message saying what to do."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


class LRU:
    """A thread-safe least-recently-used mapping with at most ``size`` entries and, with ``sizeof(value) -> bytes``,
    at most ``max_bytes`` in all (the newest entry is always kept); ``on_evict(key, value)`` is called for each
    entry pushed out."""

    def __init__(self, size: int, on_evict: Callable | None = None, *, max_bytes: int | None = None,
                 sizeof: Callable | None = None):
        self.size = max(1, int(size))
        self.max_bytes = max_bytes
        self.sizeof = sizeof
        self.bytes = 0
        self._d: OrderedDict = OrderedDict()
        self._n: dict = {}
        self._lock = threading.Lock()
        self.on_evict = on_evict

    def get(self, key, default=None):
        with self._lock:
            if key not in self._d:
                return default
            self._d.move_to_end(key)
            return self._d[key]

    def put(self, key, value) -> None:
        n = self.sizeof(value) if self.sizeof is not None else 0
        evicted = []
        with self._lock:
            if key in self._d:
                self.bytes -= self._n.pop(key)
            self._d[key] = value
            self._n[key] = n
            self.bytes += n
            self._d.move_to_end(key)
            while len(self._d) > self.size or (self.max_bytes is not None and self.bytes > self.max_bytes
                                               and len(self._d) > 1):
                k, v = self._d.popitem(last=False)
                self.bytes -= self._n.pop(k)
                evicted.append((k, v))
        if self.on_evict is not None:
            for k, v in evicted:
                self.on_evict(k, v)

    def drop(self, pred: Callable) -> None:
        """Remove every entry whose key satisfies ``pred(key)``."""
        with self._lock:
            for k in [k for k in self._d if pred(k)]:
                del self._d[k]
                self.bytes -= self._n.pop(k)

    def __contains__(self, key) -> bool:
        with self._lock:
            return key in self._d

    def __len__(self) -> int:
        with self._lock:
            return len(self._d)


class Job(Future):
    """A job's future with a way to stop it: :meth:`stop` drops it if it has not started, else asks it to stop at its
    next chunk (:func:`lenscope.models.runtime.stop.checkpoint`: before a forward pass, a layer of a mixing loop, an
    attribution method, a view); it then ends with :class:`~lenscope.errors.Stopped` and nothing of it is cached."""

    def __init__(self):
        super().__init__()
        self.stopping = threading.Event()

    def stop(self) -> str:
        """``"dropped"`` (it had not started), ``"stopping"`` (it stops at its next chunk) or ``"done"``."""
        if self.cancel():
            return "dropped"
        if self.done():
            return "done"
        self.stopping.set()
        return "stopping"


class Jobs:
    """Per-model worker threads fed by FIFO queues. :meth:`submit` refuses (503) when ``max_queue`` jobs already wait
    (in all models together); a job stopped before its worker reaches it is skipped, a running one stops at its next
    chunk (:meth:`Job.stop`)."""

    def __init__(self, max_queue: int = 16):
        self.max_queue = max(0, int(max_queue))
        self._queues: dict[str, queue.Queue] = {}
        self._threads: dict[str, threading.Thread] = {}
        self._lock = threading.Lock()
        self.waiting = 0  # submitted, not yet started (or skipped)
        self.running = 0
        self.skipped = 0  # dropped before they ran because their client went away
        self.stopped = 0  # stopped while running, at a chunk's end, because their client went away
        self._closed = False

    def submit(self, model: str, fn: Callable[[], object]) -> Job:
        fut = Job()
        with self._lock:
            if self._closed:
                raise ApiError(503, "the server is shutting down; try again later")
            if self.waiting >= self.max_queue:
                raise ApiError(503, f"the server is busy ({self.waiting} jobs waiting, the limit is --max-queue "
                                    f"{self.max_queue}); try again in a moment")
            q = self._queues.get(model)
            if q is None:
                q = self._queues[model] = queue.Queue()
                t = threading.Thread(target=self._work, args=(q,), name=f"lenscope-serve:{model}", daemon=True)
                self._threads[model] = t
                t.start()
            self.waiting += 1
        q.put((fut, fn))
        return fut

    def _work(self, q: queue.Queue) -> None:
        while True:
            item = q.get()
            if item is None:
                return
            fut, fn = item
            with self._lock:
                self.waiting -= 1
            if not fut.set_running_or_notify_cancel():  # cancelled while queued: the client went away
                with self._lock:
                    self.skipped += 1
                continue
            with self._lock:
                self.running += 1
            try:
                with stoppable(fut.stopping):
                    fut.set_result(fn())
            except Stopped as e:
                log.info("job stopped at a chunk's end: its client went away")
                with self._lock:
                    self.stopped += 1
                fut.set_exception(e)
            except BaseException as e:  # noqa: BLE001 - handed to the request, the worker keeps serving
                fut.set_exception(e)
            finally:
                with self._lock:
                    self.running -= 1

    def close(self) -> None:
        with self._lock:
            self._closed = True
            queues = list(self._queues.values())
        for q in queues:
            q.put(None)


class ModelPool:
    """Loads models by registered name on first use, keeps at most ``max_resident`` resident or loading (the least
    recently used resident one is let go to make room; a computation still holding it finishes), and a tuned lens
    per model when a lens directory is given and fits it. ``on_unload(name)`` drops what the server cached for a
    model.

    A load reserves its slot under the lock before it starts (letting the least recently used resident model go
    first), so simultaneous first requests for different models never hold more than ``max_resident`` between
    them: when every slot is taken by a load in progress, the next waits for one to finish. Requests for a model
    that is being loaded wait for that one load."""

    def __init__(self, max_resident: int = 2, lens: str | None = None, loader: Callable | None = None,
                 on_unload: Callable[[str], None] | None = None):
        self.max_resident = max(1, int(max_resident))
        self.lens_dir = lens
        self._loader = loader
        self._on_unload = on_unload
        self._models: OrderedDict = OrderedDict()  # name -> (lm, lens)
        self._loading: set[str] = set()  # names with a reserved slot, loading now
        self._cond = threading.Condition()

    def loaded(self, name: str):
        """``(lm, lens)`` when resident, else None (never loads)."""
        with self._cond:
            return self._models.get(name)

    def get(self, name: str):
        """``(lm, lens)``, loading the model on first use (in the calling thread, after reserving its slot)."""
        gone = None
        with self._cond:
            while True:
                if name in self._models:
                    self._models.move_to_end(name)
                    return self._models[name]
                if name in self._loading:  # another thread loads it: wait for that one load
                    self._cond.wait()
                    continue
                if len(self._models) + len(self._loading) < self.max_resident:
                    break
                if self._models:  # make room: the least recently used resident model goes
                    gone = self._models.popitem(last=False)[0]
                    break
                self._cond.wait()  # every slot is a load in progress: wait for one to finish
            self._loading.add(name)
        try:
            if gone is not None:
                log.info("unloading model %s (--max-resident %d)", gone, self.max_resident)
                if self._on_unload is not None:
                    self._on_unload(gone)
            log.info("loading model %s (first use)", name)
            with stoppable(threading.Event()):  # a load is never stopped half-way: the next request needs it
                if self._loader is not None:
                    lm = self._loader(name)
                else:
                    from ..models.loading.load import load

                    lm = load(name)
                lens = self._load_lens(lm)
        except BaseException:
            with self._cond:
                self._loading.discard(name)
                self._cond.notify_all()
            raise
        with self._cond:
            self._loading.discard(name)
            self._models[name] = (lm, lens)
            self._cond.notify_all()
        log.info("model %s ready", name)
        return lm, lens

    def _load_lens(self, lm):
        if self.lens_dir is None:
            return None
        from ..errors import LenscopeError
        from ..lenses import TunedLens

        try:
            return TunedLens.load(self.lens_dir, lm)
        except (LenscopeError, OSError, ValueError) as e:
            log.warning("tuned lens %s not used for %s: %s", self.lens_dir, lm.name, str(e).splitlines()[0])
            return None
