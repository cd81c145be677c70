"""Data-parallel training with torch.distributed, as launched by ``torchrun --nproc-per-node N``.

Every rank holds the whole (small) lens and the frozen model. A step's global batch is the same list of
sequences a single process would take; each rank runs the model and the loss on its contiguous share
(:func:`shard`), the gradients are averaged with weights equal to each share's size (:func:`average_gradients`),
and every rank then takes the same optimizer step, so all ranks keep identical parameters. Rank 0 alone writes
checkpoints and the lens; a checkpoint records the global step and batch, not the number of ranks, so a run
resumes with any number of processes. Backend: gloo on CPU, NCCL when each rank has a CUDA device.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Dist:
    """The process group this rank belongs to (``world == 1``: a single process, nothing distributed)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    backend: str = ""

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1


SINGLE = Dist()


def from_env(backend: str | None = None) -> Dist:
    """Join the process group torchrun describes (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``...);
    a single process when ``WORLD_SIZE`` is unset or 1. Idempotent."""
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return SINGLE
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    if not dist.is_initialized():
        if backend == "nccl":
            torch.cuda.set_device(local)
        dist.init_process_group(backend=backend)
    return Dist(rank=rank, world=world, local_rank=local, backend=backend)


def shard(n: int, d: Dist) -> slice:
    """This rank's contiguous share of ``n`` items (shares differ in size by at most one; may be empty)."""
    base, extra = divmod(n, d.world)
    start = d.rank * base + min(d.rank, extra)
    return slice(start, start + base + (1 if d.rank < extra else 0))


def average_gradients(params, n_local: int, d: Dist) -> None:
    """Replace each parameter's gradient (a mean over this rank's ``n_local`` items) by the mean over all ranks'
    items: ``sum_r n_r * grad_r / sum_r n_r``. One flat all-reduce."""
    if not d.active:
        return
    import torch.distributed as dist

    params = [p for p in params if p.requires_grad]
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1).float() for g in grads] + [torch.tensor([1.0])]) * float(n_local)
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    total = flat[-1]
    flat = flat[:-1] / total.clamp_min(1.0)
    k = 0
    for p, g in zip(params, grads):
        m = g.numel()
        p.grad = flat[k : k + m].view_as(p).to(p.dtype)
        k += m


def all_sum(x: Tensor | float, d: Dist) -> Tensor:
    """The sum over ranks of a number or tensor (returned on every rank)."""
    t = torch.as_tensor(x, dtype=torch.float64).clone()
    if d.active:
        import torch.distributed as dist

        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def broadcast(obj, d: Dist):
    """Rank 0's ``obj`` on every rank (any picklable object)."""
    if not d.active:
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier(d: Dist) -> None:
    if d.active:
        import torch.distributed as dist

        dist.barrier()
