"""The tuned lens's training objective: KL(final || lens) per state and token, and its gradient.

Training goes from a residual state to logits through the model's readout
(:class:`lenscope.models.weights.readout.Readout`: the final norm, the unembedding and its bias), and from logits to the
KL here, with the fused log-partition (:class:`LogPartition`) and the KL terms;
:mod:`lenscope.lenses.training.precision` times the log-partition and :mod:`lenscope.lenses.training.selection`
evaluates the objective.

Where the time goes: the model's forward pass is cheap next to decoding every layer's state through the
unembedding (``state x tokens x d_model x vocab`` multiply-adds, forwards and backwards). So:

- one frozen forward pass per batch yields every layer's state (hooks, no gradients);
- all translators run as one batched matmul;
- ``-sum_v p log q = lse(z) - p . z`` and ``p . z = x . (p W_U^T)``: the final distribution is folded into
  one ``(tokens, d_model)`` matrix per batch, so only the log-partition function needs the full vocabulary;
- the unembedding matmuls of training run in bfloat16 where the CPU runs it natively (AVX512-BF16 / AMX)
  or a one-off measurement says it is faster, in float32 otherwise
  (:func:`lenscope.lenses.training.precision.choose_precision`); the loss and everything else in float32; evaluation
  is float32 throughout;
- the log-partition's forward pass reads ``lse = z_k - log q_k`` at the final distribution's top token
  ``k`` (no pass over the vocabulary for a maximum).
"""

from __future__ import annotations

import itertools

import torch
from torch import Tensor

from ...models.loading.load import LoadedModel
from ...models.weights.readout import Readout
from ..lenses import TunedLens


def kl_to_final_terms(lm: LoadedModel, final_logits: Tensor, W: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Per-batch constants of the KL for final logits ``(tokens, vocab)`` (:func:`kl_terms` of the model's
    readout)."""
    return kl_terms(Readout.from_anatomy(lm.anatomy), final_logits, W)


def kl_terms(readout: Readout, final_logits: Tensor, W: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Per-batch constants of the KL for final logits ``(tokens, vocab)``.

    With lens logits ``z = x W_U + b_U``: ``KL(p || softmax z) = c - x . pbar + lse(z)`` where
    ``c = sum p log p - p . b_U`` (tokens,) and ``pbar = p W_U^T`` (tokens, d_model). ``W``: the unembedding
    in the dtype to multiply in (default: float32).
    """
    logp = torch.log_softmax(final_logits.float(), dim=-1)
    p = logp.exp()
    c = (p * logp).sum(-1)
    if readout.b_U is not None:
        c = c - p @ readout.b_U.float()
    if W is None or W.dtype == torch.float32:
        return c, p @ readout.W_U.T.float()
    return c, (p.to(W.dtype) @ W.T).float()


def log_partition(readout: Readout, x: Tensor, W: Tensor, ref: Tensor | None = None) -> Tensor:
    """``logsumexp(x @ W + b_U)`` ``(...)`` of features ``x (..., d_model)`` (:meth:`Readout.features`),
    differentiable in ``x``, with ``W`` the unembedding in the dtype to multiply in (:meth:`Readout.unembedding`).
    float32 without ``ref``: ``torch.logsumexp``; otherwise one fused softmax pass (:class:`LogPartition`), read at
    the token ``ref (...)`` where given."""
    if W.dtype == torch.float32 and ref is None:
        z = x @ W
        if readout.b_U is not None:
            z = z + readout.b_U
        return torch.logsumexp(z, dim=-1)
    r = None if ref is None else ref.reshape(-1)
    return LogPartition.apply(x.reshape(-1, x.shape[-1]), W, readout.b_U, r).reshape(x.shape[:-1])


class LogPartition(torch.autograd.Function):
    """``lse(x @ W + b)`` per row, with ``W`` in the dtype to multiply in (bfloat16 is fast on CPUs with
    native support).

    One fused softmax pass gives the probabilities ``q`` (kept in ``W``'s dtype for the backward, where the
    gradient is ``q W^T``); the log-partition is read at one token, ``lse = z_k - log q_k``, which needs no
    second exponential pass. ``ref (rows,)`` names that token (training passes the final distribution's top
    token, which the lens's distribution rarely puts below float underflow); without it, or where ``q_k``
    underflowed, the most probable token is used (one more pass over the vocabulary). Gradients flow to ``x``
    only (the unembedding is frozen).
    """

    @staticmethod
    def forward(ctx, x: Tensor, W: Tensor, b: Tensor | None, ref: Tensor | None = None) -> Tensor:
        z = x.to(W.dtype) @ W
        if b is not None:
            z += b.to(z.dtype)
        q = torch.softmax(z, dim=-1)
        if ref is None:
            q_k, j = q.max(dim=-1)
            lse = z.gather(-1, j[:, None]).squeeze(-1).float() - q_k.float().log()
        else:
            k = ref[:, None]
            lse = z.gather(-1, k).squeeze(-1).float() - q.gather(-1, k).squeeze(-1).float().log()
            bad = ~torch.isfinite(lse)
            if bool(bad.any()):
                q_k, j = q[bad].max(dim=-1)
                lse[bad] = z[bad].gather(-1, j[:, None]).squeeze(-1).float() - q_k.float().log()
        ctx.save_for_backward(q, W)
        return lse

    @staticmethod
    def backward(ctx, g: Tensor):
        q, W = ctx.saved_tensors
        return (q @ W.T).float() * g[:, None], None, None, None


def lens_kl_loss(lm: LoadedModel, lens: TunedLens, states: Tensor, c: Tensor, pbar: Tensor, W: Tensor,
                 first_state: int = 0, ref: Tensor | None = None) -> Tensor:
    """Sum over states and tokens of :func:`lens_kl`."""
    return lens_kl(lm, lens, states, c, pbar, W, first_state, ref).sum()


def _groups(lens: TunedLens) -> list[tuple[Tensor, Tensor]]:
    """The translator parameters in training order: the regular states, then (if any) the mid-layer ones."""
    return [(lens.A, lens.b)] + ([(lens.A_mid, lens.b_mid)] if lens.A_mid is not None else [])


def stacked_translators(lens: TunedLens) -> tuple[Tensor, Tensor]:
    """Copies of every state's ``A, b`` stacked in training order (regular states, then mid-layer ones)."""
    g = _groups(lens)
    return torch.cat([a.detach() for a, _ in g]).clone(), torch.cat([b.detach() for _, b in g]).clone()


def write_translators(lens: TunedLens, A: Tensor, b: Tensor, mask: Tensor | None = None) -> None:
    """Set the translators of the states in ``mask`` (default: all) to ``A[mask], b[mask]``, both stacked in
    training order like :func:`stacked_translators`."""
    L = lens.n_layers
    with torch.no_grad():
        for gi, (pA, pb) in enumerate(_groups(lens)):
            m = slice(None) if mask is None else mask[gi * L : (gi + 1) * L]
            pA[m] = A[gi * L : (gi + 1) * L][m]
            pb[m] = b[gi * L : (gi + 1) * L][m]


def _translators(lens: TunedLens, first: int, n: int) -> tuple[Tensor, Tensor]:
    """``A, b`` of training states ``first .. first + n - 1`` (``n_layers + l`` is layer ``l``'s mid state)."""
    L = lens.n_layers
    if first >= L:
        return lens.A_mid[first - L : first - L + n], lens.b_mid[first - L : first - L + n]
    if first + n > L:
        raise ValueError("a block of states may not span the regular and the mid-layer states")
    return lens.A[first : first + n], lens.b[first : first + n]


def lens_kl(lm: LoadedModel, lens: TunedLens, states: Tensor, c: Tensor, pbar: Tensor, W: Tensor,
            first_state: int = 0, ref: Tensor | None = None) -> Tensor:
    """KL(final || lens) per state and token, ``(state, tokens)``, for ``states (state, tokens, d_model)`` that
    start at state ``first_state`` (``n_layers + l``: layer ``l``'s mid-layer state); ``c, pbar`` from
    :func:`kl_to_final_terms` for the same tokens; ``W`` the unembedding in the dtype to multiply in (bfloat16
    for speed, float32 for exactness). ``ref (tokens,)``: the final distribution's top token, which makes the
    log-partition cheaper (training); without it the float32 path is ``torch.logsumexp``."""
    readout = Readout.from_anatomy(lm.anatomy)
    n = states.shape[0]
    tA, tb = _translators(lens, first_state, n)
    x = readout.features(states + torch.bmm(states, tA) + tb[:, None])
    lse = log_partition(readout, x, W, None if ref is None else ref.expand(n, -1))
    return c - (x * pbar).sum(-1) + lse


def chunks(n_states: int, n_tokens: int, vocab: int, budget_bytes: float = 1.5e9, split_at: int | None = None):
    """(state slice, token slice) pairs whose ``(states, tokens, vocab)`` logits fit the memory budget; no
    state slice crosses ``split_at`` (the boundary between regular and mid-layer states)."""
    per_row = vocab * 16  # bytes per (state, token) row: bf16 + fp32 logits, softmax and gradient buffers
    rows = max(1, int(budget_bytes // per_row))
    tok = min(n_tokens, rows)
    st = max(1, min(n_states, rows // tok))
    bounds = [0, n_states] if split_at is None or not 0 < split_at < n_states else [0, split_at, n_states]
    for g0, g1 in itertools.pairwise(bounds):
        for s0 in range(g0, g1, st):
            for t0 in range(0, n_tokens, tok):
                yield slice(s0, min(g1, s0 + st)), slice(t0, min(n_tokens, t0 + tok))


# Training works through blocks of about this many bytes of logits. Smaller, cache-sized blocks (200 MB) were
# tried in issue 11: faster for an isolated matmul + softmax, but slower for the whole step (more blocks, each
# with its own translator, norm and autograd graph), so the budget stays at 1.5 GB.
TRAIN_BLOCK_BYTES = 1.5e9


def _unembed_weight(lm: LoadedModel, bf16: bool) -> Tensor:
    """The unembedding as a contiguous matrix in the training dtype, converted once per model."""
    ro = Readout.from_anatomy(lm.anatomy)
    return ro.unembedding(torch.bfloat16) if bf16 else ro.W_U


def kl_backward(lm: LoadedModel, lens: TunedLens, states: Tensor, final_logits: Tensor, bf16: bool = True,
                budget_bytes: float = TRAIN_BLOCK_BYTES) -> float:
    """Accumulate the gradient of the mean KL over ``states (state, tokens, d)``; returns the mean KL.

    ``states`` are the regular states ``0..`` and, for a lens with mid-layer translators, the ``n_layers``
    mid-layer states after them. Works block by block (states and tokens are independent), so memory stays
    bounded for any vocabulary.
    """
    W = _unembed_weight(lm, bf16)
    c, pbar = kl_to_final_terms(lm, final_logits)  # float32: a bfloat16 p W^T measured no faster (issue 11)
    ref = final_logits.argmax(-1)
    n_states, n_tokens = states.shape[:2]
    scale = 1.0 / (n_states * n_tokens)
    total = 0.0
    for ss, ts in chunks(n_states, n_tokens, lm.anatomy.vocab_size, budget_bytes, split_at=lens.n_layers):
        loss = lens_kl_loss(lm, lens, states[ss, ts], c[ts], pbar[ts], W, first_state=ss.start, ref=ref[ts]) * scale
        loss.backward()
        total += loss.item()
    return total


def _training_states(cap: dict, L: int, mid: bool) -> Tensor:
    """``(state, tokens, d)``: the regular states ``0..L-1``, then (``mid``) the ``L`` mid-layer states."""
    states = cap["states"][:L]
    if mid:
        states = torch.cat([states, cap["mid"]])
    return states.flatten(1, 2)


__all__ = ["TRAIN_BLOCK_BYTES", "chunks", "kl_backward", "kl_to_final_terms", "lens_kl", "lens_kl_loss",
           "stacked_translators", "write_translators"]
