"""A closed-form start for tuned-lens training: every translator fitted by weighted least squares to the last state.

The KL objective pays for the whole vocabulary: ``d_model x vocab`` multiply-adds per state and token, forwards
and backwards (smollm2: 576 x 49,152). Before any of that, each translator ``h -> h + h A_l + b_l`` is fitted
so that the translated state matches the model's last residual state (the input of the final norm),

    minimise  sum_t w_t || h_l,t + h_l,t A_l + b_l - h_L,t ||^2  +  ridge x mean(diag) x (||A_l||^2 + ||b_l||^2),

a linear regression (Din et al. 2023's "linear shortcut", here as the start of the tuned lens's KL training).
Its normal equations cost ``(d_model + 1)^2`` multiply-adds per state and token, about 85 times fewer than the
KL's forward pass alone on smollm2, so the start sees more text in a minute than the KL stage sees in fifteen.
``w_t = 1 / mean(h_L,t^2)``: the final norm divides every target by its own root mean square, so each token
counts by its error relative to its own scale (without it a few tokens with huge activations, such as the
first position, would dominate the fit). The ridge term pulls towards the identity (``A = 0, b = 0``).

The least-squares fit is the same for any fixed metric on the residual space (the regression is unconstrained),
so the unembedding's Gram matrix would change nothing; what it does not see is the softmax, which the KL stage
then fine-tunes. Measured in ``docs/lenses.md``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ...models.loading.load import LoadedModel
from ...models.runtime.trace import residual_states
from ..lenses import TunedLens
from .objective import _training_states, write_translators


class NormalEquations:
    """Weighted least-squares sums for ``n`` states of width ``d``: ``X^T W X`` and ``X^T W R`` with
    ``X = [h, 1]`` and ``R = h_last - h`` (float64 accumulators, float32 products per batch)."""

    def __init__(self, n: int, d: int):
        self.XtX = torch.zeros(n, d + 1, d + 1, dtype=torch.float64)
        self.XtR = torch.zeros(n, d + 1, d, dtype=torch.float64)
        self.tokens = 0

    def add(self, states: Tensor, last: Tensor) -> None:
        """``states (n, tokens, d)``, ``last (tokens, d)``: the target of every state."""
        w = 1.0 / last.pow(2).mean(-1).clamp_min(1e-12)
        X = torch.cat([states, states.new_ones(*states.shape[:2], 1)], -1)
        Xw = (X * w[None, :, None]).transpose(1, 2)
        self.XtX += torch.bmm(Xw, X).double()
        self.XtR += torch.bmm(Xw, last[None] - states).double()
        self.tokens += states.shape[1]

    def solve(self, ridge: float) -> tuple[Tensor, Tensor]:
        """``A (n, d, d), b (n, d)`` in float32."""
        d = self.XtR.shape[-1]
        scale = self.XtX.diagonal(dim1=1, dim2=2).mean(-1).clamp_min(1e-30)
        eye = torch.eye(d + 1, dtype=torch.float64)
        B = torch.linalg.solve(self.XtX + ridge * scale[:, None, None] * eye, self.XtR)
        return B[:, :d].float(), B[:, d].float()


def regression_start(lm: LoadedModel, lens: TunedLens, sequences: Tensor, *, tokens: int, ridge: float,
                     batch_size: int = 4, seed: int = 0, dist=None, clock: Callable[[], float] | None = None,
                     deadline: float | None = None, progress: bool = False) -> dict:
    """Set every translator of ``lens`` (the mid-layer ones too) to its least-squares fit on about ``tokens``
    tokens of ``sequences (n_seq, seq_len)`` (whole sequences, a seeded random choice); stops early, after at
    least one batch, once ``clock()`` passes ``deadline``. Under DDP (``dist``) each rank reads its share of every
    batch and the sums are added over ranks, so every rank solves the same equations. Returns the record of the
    start (tokens, seconds, ridge)."""
    import time

    from tqdm.auto import tqdm

    from ...distributed import ddp

    d = dist or ddp.SINGLE
    clock = clock or time.perf_counter
    t0 = clock()
    A = lm.anatomy
    L, mid = A.n_layers, lens.has_mid_translators
    n_seq, S = sequences.shape
    n_use = max(1, min(n_seq, -(-tokens // S)))
    order = torch.randperm(n_seq, generator=torch.Generator().manual_seed(seed + 7919))[:n_use]
    eq = NormalEquations(L * (2 if mid else 1), A.d_model)
    batches = [order[i : i + batch_size] for i in range(0, n_use, batch_size)]
    bar = tqdm(batches, desc=f"tuned lens {lm.name}: least-squares start", unit="batch",
               disable=not (progress and d.main))
    done = 0
    with torch.no_grad():
        for ids in bar:
            mine = ids[ddp.shard(len(ids), d)]
            if len(mine):
                cap = residual_states(lm, sequences[mine], mid=mid)
                eq.add(_training_states(cap, L, mid), cap["states"][L].flatten(0, 1))
            done += len(ids)
            late = deadline is not None and clock() > deadline
            if ddp.broadcast(late, d):  # rank 0's clock decides, so every rank reads the same batches
                break
    bar.close()
    if d.active:
        eq.XtX, eq.XtR = ddp.all_sum(eq.XtX, d), ddp.all_sum(eq.XtR, d)
    write_translators(lens, *eq.solve(ridge))
    return {"method": "least-squares", "tokens": done * S, "ridge": ridge, "seconds": round(clock() - t0, 3)}


__all__ = ["NormalEquations", "regression_start"]
