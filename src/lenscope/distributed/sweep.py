"""Dataset sweeps, here or on Ray workers, with the same results in the same order.

A sweep is a module-level function ``job(lm, item) -> result`` applied to a list of items. :func:`sweep_map`
yields ``(index, result)`` as results complete; :func:`run_sweep` yields them in input order, whichever way it
runs:

- sequentially in this process (the default), or
- on Ray (``ray=True`` for a local Ray on this machine, or a cluster address such as ``"auto"`` or
  ``"ray://head:10001"``): each worker is an actor that loads the model once (``lenscope.load(model)``) and
  takes items as they come. Results stream back as workers finish them and are released in input order
  (the few that finish early wait in a small buffer: :func:`lenscope.distributed.records.in_order`). A
  resumable sweep hands :func:`sweep_map` to :class:`lenscope.distributed.records.Records`, which decides what
  is left, orders and appends, so the file is the sequential run's and an interrupted run resumes from the
  same place.

Ray is imported only when ``ray`` is given. ``job`` and its items must be picklable (a function defined at
module level; plain data).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ..errors import InputError, MissingDependencyError
from .records import in_order


def _ray():
    try:
        import ray
    except ImportError:
        raise MissingDependencyError("--ray needs Ray: pip install 'ray>=2.9' (or pip install lenscope[ray])") from None
    return ray


class _Worker:
    """A Ray actor: one model per worker process, loaded once."""

    def __init__(self, model: str, threads: int, load_kwargs: dict):
        import torch

        from ..models.loading.load import load

        torch.set_num_threads(threads)
        self.lm = load(model, **load_kwargs)

    def run(self, job, index: int, item):
        return index, job(self.lm, item)


def _init_ray(ray, address, workers: int):
    if ray.is_initialized():
        return
    kw: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False, "ignore_reinit_error": True}
    if address in (None, True, "", "local"):
        kw["num_cpus"] = workers
    else:
        kw["address"] = address
    # the workers must import this very lenscope (a source checkout, an editable install): put it on their path
    src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    kw["runtime_env"] = {"env_vars": {"PYTHONPATH": os.pathsep.join(
        p for p in (src, os.environ.get("PYTHONPATH", "")) if p)}}
    ray.init(**kw)


def run_sweep(job: Callable, items: Sequence, *, lm=None, model: str | None = None, ray=None, workers: int = 2,
              threads_per_worker: int = 1, start: int = 0, progress: Callable[[int], None] | None = None
              ) -> Iterator[tuple[int, Any]]:
    """Yield ``(index, job(lm, items[index]))`` for ``index = start, start + 1, ...`` in order.

    Sequential: ``lm`` is used directly. With ``ray``: ``workers`` actors (one CPU each, ``threads_per_worker``
    torch threads) each load ``model`` (default ``lm.name``) once; items are handed out as workers free up
    (:func:`sweep_map`) and released in input order (:func:`lenscope.distributed.records.in_order`).
    ``progress(index)`` is called as each result is released.
    """
    n = len(items)
    if not 0 <= start <= n:
        raise InputError(f"start {start} is outside 0..{n}")
    todo = list(range(start, n))
    for i, r in in_order(sweep_map(job, items, todo, lm=lm, model=model, ray=ray, workers=workers,
                                   threads_per_worker=threads_per_worker), todo):
        if progress:
            progress(i)
        yield i, r


def sweep_map(job: Callable, items: Sequence, todo: Sequence[int], *, lm=None, model: str | None = None, ray=None,
              workers: int = 2, threads_per_worker: int = 1) -> Iterator[tuple[int, Any]]:
    """Yield ``(index, job(lm, items[index]))`` for every ``index`` in ``todo`` as it completes: in order when
    sequential, in completion order on Ray (what :meth:`lenscope.distributed.records.Records.run` takes as its
    ``compute``). Closing the iterator cancels the Ray tasks still running and stops the workers."""
    todo = list(todo)
    if not ray:
        if lm is None:
            from ..models.loading.load import load

            lm = load(model)
        for i in todo:
            yield i, job(lm, items[i])
        return
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise InputError(f"workers must be a positive integer, not {workers!r}")
    name = model or (lm.name if lm is not None else None)
    if not name:
        raise InputError("a Ray sweep needs the model's name (or path) so that each worker can load it")
    rr = _ray()
    _init_ray(rr, ray, workers)
    actor = rr.remote(num_cpus=1)(_Worker)
    # the workers load the model in the driver's dtype (each on its own machine's devices: no device map)
    dtype = getattr(lm, "dtype", None)
    load_kwargs = {"dtype": str(dtype).replace("torch.", "")} if dtype not in (None, torch.float32) else {}
    pool = [actor.remote(name, threads_per_worker, load_kwargs) for _ in range(min(workers, max(1, len(todo))))]
    job_ref = rr.put(job)
    left = iter(todo)
    running: dict = {}  # object ref -> the actor running it

    def submit(a) -> bool:
        i = next(left, None)
        if i is None:
            return False
        running[a.run.remote(job_ref, i, items[i])] = a
        return True

    for a in pool:  # two items in flight per worker, so a worker never waits for the driver
        submit(a)
        submit(a)
    try:
        while running:
            ready, _ = rr.wait(list(running), num_returns=1)
            for ref in ready:
                a = running.pop(ref)
                i, r = rr.get(ref)
                submit(a)
                yield i, r
    finally:
        for ref in running:
            rr.cancel(ref, force=True)
        for a in pool:
            rr.kill(a)
