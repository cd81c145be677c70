"""The Patchscope lens (Ghandeharioun et al. 2024): the model reads its own hidden state.

A residual state ``h`` of layer ``l`` is patched into another prompt, the token-identity prompt
``"cat -> cat; 1135 -> 1135; hello -> hello; ?"``, as the residual stream entering block ``l*`` at that prompt's
LAST position; the model runs on from there (blocks ``l*..n_layers-1``, the final norm, the unembedding), and the
next-token distribution at the last position is the lens's reading. ``l* = l`` by default (``target_layer``: a
fixed block, or a function of ``l``). States are numbered as for the other lenses (:mod:`lenscope.lenses.lenses`):
state ``l < n_layers`` enters block ``l``, state ``n_layers`` is the last residual, which is only read out.

How it fits the :class:`~lenscope.lenses.lenses.Lens` interface: :meth:`PatchscopeLens.transform` returns the
residual state leaving the last block at the patched position (the state the model's own readout decodes), so
``logits(h, l) = decode(transform(h, l))`` like every lens, and prediction depth, trajectories and evaluation use
it unchanged. It runs the model's blocks, through lenscope's own math (the Anatomy's norms, attention, MLP), not
a learned map.

Exact and cheap: the model is causal, so the prompt's prefix (every position but the last) does not depend on
what is patched at the last position. Its residual states are captured ONCE with the engine; per block the
prefix's queries, keys and values (after q/k-norms and rotary) are computed once from them and reused by every
patched row. A patched row then costs one position through blocks ``l*..n_layers-1`` (its attention reads the
prefix's keys and values and its own); all (position, state) pairs are rows of one batch, sorted by ``l*`` so
block ``j`` runs on the rows that have started, in chunks bounded by ``memory_mb``. The test compares it with
the brute force (the real model on the whole prompt with an engine edit of ``resid_pre`` at block ``l*``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import Tensor

from ..errors import InputError, NotApplicableError
from ..models.loading.load import LoadedModel, encode, require_decoder
from ..models.runtime.engine import capture
from .lenses import Lens

IDENTITY_PROMPT = "cat -> cat; 1135 -> 1135; hello -> hello; ?"


class PatchscopeLens(Lens):
    """The token-identity Patchscope: state ``l`` patched at block ``l*`` of ``prompt``'s last position.

    - ``prompt``: the target prompt (its last token's residual is replaced; its earlier tokens are the context);
    - ``target_layer``: ``None`` (``l* = l``), an int (every state patched at that block) or a function
      ``l -> l*``; ``l*`` lies in ``0..n_layers`` (``n_layers``: no block runs, only the readout);
    - ``memory_mb``: the working memory of one chunk of patched rows (64 MB: about 300 rows on smollm2, faster
      there than 16 or 256 MB).

    Raises :class:`NotApplicableError` for models that do not predict a next token (encoders, no language-model
    head) and :class:`InputError` for a bad ``target_layer`` or prompt.
    """

    kind = "patchscope"

    def __init__(self, lm: LoadedModel, *, prompt: str = IDENTITY_PROMPT,
                 target_layer: int | Callable[[int], int] | None = None, memory_mb: float = 64.0):
        require_decoder(lm, "the Patchscope lens", causal=True,
                        instead="use the logit lens (--lens logit), which reads a state without running the model")
        super().__init__(lm.anatomy, model_name=lm.name)
        self._lm = lm
        self.prompt = prompt
        self.target_layer = target_layer
        self.memory_mb = float(memory_mb)
        L = self.n_layers
        self._targets = [self._resolve(layer) for layer in range(L + 1)]
        self.ids = encode(lm, prompt)  # (pos,): the prompt's tokens, special tokens as the tokenizer adds them
        self._prefix: list[tuple[Tensor, Tensor, Tensor]] | None = None
        self._unmasked: list | None = None

    # ------------------------------------------------------------------ settings

    def _resolve(self, layer: int) -> int:
        t = self.target_layer
        if t is None:
            target = layer
        elif callable(t):
            target = t(layer)
        else:
            target = t
        if isinstance(target, bool) or not isinstance(target, int) or not 0 <= target <= self.n_layers:
            raise InputError(f"target_layer gives {target!r} for state {layer}; it must be a block in "
                             f"0..{self.n_layers} (None: the state's own layer; {self.n_layers}: the readout only)")
        return target

    def target(self, layer: int) -> int:
        """The block ``l*`` where state ``layer`` is patched."""
        self._check_layer(layer)
        return self._targets[layer]

    @property
    def n_prompt(self) -> int:
        """Tokens of the target prompt (the patched position is the last one)."""
        return int(self.ids.numel())

    # ------------------------------------------------------------------ the prompt's prefix, computed once

    @torch.no_grad()
    def prefix(self) -> list[tuple[Tensor, Tensor, Tensor]]:
        """Per block: the prefix's queries, keys and values ``(head, prefix_pos, d_head)`` (keys and values
        repeated per query head; after q/k-norms and rotary), from one engine capture of the prefix's residual
        stream. Computed on first use and kept."""
        if self._prefix is None:
            A, P = self.anatomy, self.n_prompt
            pos = torch.arange(P - 1)
            states = None
            if P > 1:
                cap = capture(self._lm, self.ids[None, :-1], [("resid_pre", i) for i in range(A.n_layers)],
                              upcast=True)
                states = cap.stacked("resid_pre")[:, 0]  # (layer, prefix_pos, d_model)
            out = []
            for j, layer in enumerate(A.layers):
                at = layer.attn
                if states is None:
                    e = torch.zeros(at.n_heads, 0, at.d_head, dtype=at.W_Q.dtype, device=layer.device)
                    out.append((e, e, e))
                    continue
                h = states[j].to(layer.device, at.W_Q.dtype)
                x = h if layer.placement == "post" else layer.ln_attn(h)
                q, k = at.queries_keys(x, pos)
                out.append((q, k, at.values(x)))
            self._prefix = out
        return self._prefix

    # ------------------------------------------------------------------ one block on patched rows

    def _block(self, j: int, x: Tensor) -> Tensor:
        """Block ``j`` at the prompt's last position for rows ``x (row, d_model)`` (each row its own residual
        there, the prefix shared): the block's output ``(row, d_model)``."""
        layer = self.anatomy.layers[j]
        at = layer.attn
        pq, pk, pv = self.prefix()[j]
        x = x.to(layer.device, at.W_Q.dtype)
        R, P = x.shape[0], self.n_prompt
        positions = torch.arange(P, device=layer.device)
        attn_in = (x if layer.placement == "post" else layer.ln_attn(x))[:, None, :]  # (row, 1, d_model)
        q, k = at.queries_keys(attn_in, positions[-1:])  # (row, head, 1, d_head)
        v = at.values(attn_in)
        K = torch.cat([pk.expand(R, *pk.shape), k], -2)  # (row, head, pos, d_head)
        V = torch.cat([pv.expand(R, *pv.shape), v], -2)
        last_only = self._last_row_attention(j)
        if last_only is not None:  # the last query sees every key: its row alone, nothing to mask
            probs = last_only.probs(q, K, positions)[:, :, -1, :]
        else:  # ALiBi or a window shorter than the prompt: every query row, the last one kept
            Q = torch.cat([pq.expand(R, *pq.shape), q], -2)
            probs = at.probs(Q, K, positions)[:, :, -1, :]  # (row, head, pos)
        probs = probs.to(V.dtype)
        z = torch.einsum("rhk,rhke->rhe", probs, V)
        attn_out = torch.einsum("rhe,hed->rd", z, at.W_O)  # the output projection, as Attention.__call__
        if at.b_O is not None:
            attn_out = attn_out + at.b_O
        return layer.after_attention(x, attn_out)["resid_post"]

    def _last_row_attention(self, j: int):
        """Block ``j``'s attention without its mask (the same weights, no copies) when the prompt's last query may
        attend to every key of the prompt (no ALiBi, no window shorter than the prompt): then its probabilities
        are :meth:`~lenscope.models.weights.anatomy.Attention.probs` of that query alone. None otherwise."""
        if self._unmasked is None:
            P = self.n_prompt
            self._unmasked = [
                dataclasses.replace(layer.attn, causal=False, window=None)
                if layer.attn.alibi is None and (layer.attn.window is None or layer.attn.window >= P) else None
                for layer in self.anatomy.layers]
        return self._unmasked[j]

    def _rows_per_chunk(self) -> int:
        A = self.anatomy
        at, d_mlp = A.layers[0].attn, A.layers[0].mlp.d_mlp
        P = self.n_prompt
        per_row = 4 * (3 * d_mlp + 8 * A.d_model + at.n_heads * P * (2 * P + 3 * at.d_head))
        return max(1, int(self.memory_mb * 2**20 // per_row))

    def run(self, h: Tensor, targets: Tensor) -> Tensor:
        """Rows ``h (row, d_model)`` patched at blocks ``targets (row,)`` (``0..n_layers``) -> the residual
        leaving the last block at the patched position ``(row, d_model)``, in ``h``'s dtype and device."""
        L = self.n_layers
        targets = torch.as_tensor(targets, dtype=torch.long).reshape(-1).cpu()
        if h.dim() != 2 or h.shape[0] != targets.shape[0] or h.shape[1] != self.d_model:
            raise InputError(f"run() takes states (row, {self.d_model}) and one target block per row; got "
                             f"{tuple(h.shape)} and {tuple(targets.shape)}")
        out = h.clone()
        order = torch.argsort(targets, stable=True)
        t_sorted = targets[order]
        step = self._rows_per_chunk()
        for a in range(0, order.numel(), step):
            idx, ts = order[a : a + step], t_sorted[a : a + step]
            if int(ts[0]) >= L:
                break  # the rest only go through the readout
            x = h[idx.to(h.device)].to(self.anatomy.dtype)
            started = torch.bincount(ts.clamp_max(L), minlength=L + 1).cumsum(0)  # rows with l* <= j: x[:started[j]]
            for j in range(int(ts[0]), L):
                n = int(started[j])
                x = x.to(self.anatomy.layers[j].device)
                y = self._block(j, x[:n])  # a new tensor (no in-place write: gradients may flow through a lens)
                x = y if n == x.shape[0] else torch.cat([y, x[n:]])
            out[idx.to(h.device)] = x.to(out.device, out.dtype)
        return out

    # ------------------------------------------------------------------ the Lens interface

    def transform(self, h: Tensor, layer: int) -> Tensor:
        """States ``h (..., d_model)`` of state ``layer`` -> the residual leaving the last block after patching
        them at block ``target(layer)`` of the prompt (decode it with the model's readout)."""
        target = self.target(layer)
        flat = h.reshape(-1, h.shape[-1])
        return self.run(flat, torch.full((flat.shape[0],), target)).reshape(h.shape)

    def transform_all(self, h: Tensor) -> Tensor:
        """``h (state, ..., d_model)`` for states ``0..state-1``: every (state, position) pair a row of one batch."""
        S = h.shape[0]
        flat = h.reshape(S, -1, h.shape[-1])
        targets = torch.tensor([self.target(i) for i in range(S)]).repeat_interleave(flat.shape[1])
        return self.run(flat.reshape(-1, h.shape[-1]), targets).reshape(h.shape)

    def transform_mid(self, h: Tensor, layer: int) -> Tensor:
        raise NotApplicableError("the Patchscope lens patches a state as the residual entering a block; the "
                                 "mid-layer (after-attention) states have no such place; leave out --mid / mid=True")

    def extra_repr(self) -> str:
        t = self.target_layer
        t = "l" if t is None else (t if isinstance(t, int) else getattr(t, "__name__", "fn"))
        return f"model={self.model_name!r}, n_layers={self.n_layers}, prompt={self.prompt!r}, target_layer={t}"


__all__ = ["IDENTITY_PROMPT", "PatchscopeLens"]
