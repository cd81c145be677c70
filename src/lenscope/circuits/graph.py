"""The component graph of a decoder, and the per-prompt material every edge method reads.

Senders (what writes to the residual stream): ``embed`` (the residual stream entering block 0: token embeddings and
whatever the model adds before the first block), each head ``L{l}H{h}`` and each MLP ``L{l}.mlp`` (a mixture of
experts: each expert ``L{l}.E{e}.mlp``, its weighted output, 0 where a token does not use it). Receivers (what
reads it): each head's query, key and value input separately (``L{l}H{h}.q``, ``.k``, ``.v``), each MLP's input
(``L{l}.mlp``) and the unembedding (``logits``). An edge ``(sender, receiver)`` exists when the sender writes before
the receiver reads: heads of block ``l`` read what blocks ``< l`` wrote; an MLP of a sequential block also reads its
own block's heads, a parallel block's (GPT-NeoX) does not.

The residual stream is exactly the sum of the senders' writes. A head's write is its share of what the attention
part adds: ``z_h W_O^h + b_O / H``; under a post-attention norm (Gemma 3's sandwich) that share goes through the
norm with the per-token scale of its own run (the norm is affine given the scale), plus ``1/H`` of the norm's bias,
so the heads' writes still sum to what the block adds. Post-LN blocks (the residual stream renormalised after every
sub-layer) have no such sum and are refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..data.contrast import ContrastPair
from ..errors import InputError, NotApplicableError
from ..models.loading.load import LoadedModel, require_decoder
from ..models.runtime.engine import run
from ..models.runtime.request import Group, by_length, contrasts, metric_of
from ..models.runtime.sites import display_name
from ..models.weights.algebra import head_writes
from ..models.weights.anatomy import Layer
from ..models.weights.moe import is_moe

__all__ = ["ComponentGraph", "Group", "end_metrics", "groups", "mlp_write", "sender_writes",
           "writer_sites"]


@dataclass(frozen=True)
class ComponentGraph:
    """Names, order and the edges of one model's component graph.

    - ``senders`` (S,): ``embed``, then per block its heads ``L{l}H{h}`` and ``L{l}.mlp`` (a mixture of experts:
      its ``n_mlp`` experts ``L{l}.E{e}.mlp``)
    - ``receivers`` (R,): per block ``L{l}H{h}.q`` for every head, then ``.k``, then ``.v``, then ``L{l}.mlp``;
      last ``logits``
    - ``valid (S, R)``: whether the edge exists
    """

    n_layers: int
    n_heads: int
    placement: str
    senders: tuple = field(repr=False)
    receivers: tuple = field(repr=False)
    valid: Tensor = field(repr=False)
    n_mlp: int = 1  # senders per MLP: 1, or a mixture of experts' number of experts

    @classmethod
    def of(cls, lm: LoadedModel) -> ComponentGraph:
        A = lm.anatomy
        require_decoder(lm, "edge attribution", instead="use a causal decoder (GPT-2, Llama, ...)", causal=True)
        placement = A.placement
        if placement == "post":
            raise NotApplicableError("edges need a residual stream that is the sum of what each part writes; this "
                                     "model renormalises it after every sub-layer (Post-LN). Use node-level "
                                     "attribution patching (level='nodes') instead")
        L, H = A.n_layers, A.layers[0].attn.n_heads
        moe = is_moe(A)
        if moe and A.layers[0].ln_mlp_out is not None:
            raise NotApplicableError("edges of a mixture of experts followed by a sandwich norm are not supported")
        M = A.layers[0].mlp.n_experts if moe else 1

        def mlps(layer):
            return [display_name("mlp", layer, expert=e) for e in range(M)] if moe else [display_name("mlp", layer)]

        senders = [display_name("embed")] + [n for layer in range(L)
                                             for n in [display_name("head", layer, h) for h in range(H)] + mlps(layer)]
        receivers = [n for layer in range(L) for n in [display_name(w, layer, h) for w in "qkv" for h in range(H)]
                     + [display_name("mlp", layer)]] + [display_name("logits")]
        # a stage per sender (the order of writing) and per receiver (it reads stages below its own)
        s_stage = [-1] + [2 * layer + (h >= H) for layer in range(L) for h in range(H + M)]
        # heads of block l read stages < 2l; a sequential MLP reads < 2l + 1, a parallel one < 2l
        r_read = [2 * layer + (1 if (i == 3 * H and placement != "parallel") else 0)
                  for layer in range(L) for i in range(3 * H + 1)] + [2 * L]
        valid = torch.tensor(s_stage)[:, None] < torch.tensor(r_read)[None, :]
        return cls(L, H, placement, tuple(senders), tuple(receivers), valid, M)

    @property
    def n_edges(self) -> int:
        return int(self.valid.sum())

    def sender_index(self, name: str) -> int:
        try:
            return self.senders.index(name)
        except ValueError:
            mlp = "L{l}.E{e}.mlp" if self.n_mlp > 1 else "L{l}.mlp"
            raise InputError(f"no sender named {name!r}; senders are embed, L{{l}}H{{h}}, {mlp}") from None

    def receiver_index(self, name: str) -> int:
        try:
            return self.receivers.index(name)
        except ValueError:
            raise InputError(f"no receiver named {name!r}; receivers are L{{l}}H{{h}}.q|.k|.v, L{{l}}.mlp, "
                             "logits") from None

    def heads_of(self, layer: int) -> slice:
        """The senders of block ``layer``'s heads (its MLP's follow)."""
        start = 1 + layer * (self.n_heads + self.n_mlp)
        return slice(start, start + self.n_heads)

    def mlp_of(self, layer: int) -> int:
        """The (first) sender of block ``layer``'s MLP (a mixture of experts: its first expert's)."""
        return 1 + layer * (self.n_heads + self.n_mlp) + self.n_heads

    def mlps_of(self, layer: int) -> slice:
        """The senders of block ``layer``'s MLP: one, or one per expert of a mixture of experts."""
        start = self.mlp_of(layer)
        return slice(start, start + self.n_mlp)

    def inputs_of(self, layer: int) -> slice:
        """The receivers of block ``layer``: q, k, v of every head, then the MLP."""
        start = layer * (3 * self.n_heads + 1)
        return slice(start, start + 3 * self.n_heads + 1)

    def edge_list(self) -> tuple[Tensor, Tensor]:
        """``(sender_index, receiver_index)`` of every edge, in (sender, receiver) order."""
        s, r = self.valid.nonzero(as_tuple=True)
        return s, r

    def node_edges(self, nodes: set[str]) -> Tensor:
        """``(S, R)``: the edges whose sender is one of ``nodes``."""
        keep = torch.tensor([n in nodes for n in self.senders])
        return self.valid & keep[:, None]


def mlp_write(layer: Layer, mlp_out: Tensor) -> Tensor:
    """What the MLP adds to the residual stream (its output, through a post-MLP norm when there is one, times a
    residual multiplier): :meth:`~lenscope.models.weights.anatomy.Layer.write`."""
    return layer.write("mlp", mlp_out)


def sender_writes(lm: LoadedModel, graph: ComponentGraph, cap) -> Tensor:
    """``(batch, pos, S, d_model)``: every sender's write in a run whose engine captures ``cap`` hold
    ``resid_pre.0``, ``head.l`` and ``mlp_out.l`` (a mixture of experts: ``expert_out.l``); sums to the residual
    stream."""
    A = lm.anatomy
    first = cap["resid_pre", 0]
    out = first.new_empty(first.shape[:2] + (len(graph.senders), first.shape[-1]))
    out[:, :, 0] = first
    for layer in range(graph.n_layers):
        out[:, :, graph.heads_of(layer)] = head_writes(A.layers[layer], cap["head", layer], "shared")[0]
        if graph.n_mlp > 1:
            out[:, :, graph.mlps_of(layer)] = mlp_write(A.layers[layer], cap["expert_out", layer])  # no sandwich
        else:
            out[:, :, graph.mlp_of(layer)] = mlp_write(A.layers[layer], cap["mlp_out", layer])
    return out


def writer_sites(L: int, moe: bool = False) -> list[tuple[str, int]]:
    """The engine sites :func:`sender_writes` reads (``moe``: a mixture of experts' per-expert outputs)."""
    return [("resid_pre", 0)] + [(s, layer) for layer in range(L) for s in ("head", "expert_out" if moe else "mlp_out")]


def groups(lm: LoadedModel, pairs, metric: str, position: int = -1) -> list[Group]:
    """Validated prompt pairs (``ContrastPair``-like objects or ``(clean, corrupted, target, foil)`` tuples) as
    :class:`Group`s of one token length (the node methods' grouping, :func:`lenscope.circuits.atp.groups`)."""
    pairs = [p if hasattr(p, "clean") else ContrastPair(*p) for p in pairs]
    if not pairs:
        raise InputError("no prompt pairs given")
    ps = []
    for i, p in enumerate(pairs):
        try:
            ps += contrasts(lm, None, None, None, None, metric, position, pairs=[p], what="edge attribution")
        except InputError as e:
            raise InputError(f"pair {i + 1}: {e}") from None
    return by_length(ps)


def end_metrics(lm: LoadedModel, g: Group, metric: str) -> tuple[Tensor, Tensor]:
    """The real model's metric per prompt on the clean and on the corrupted prompts, ``(b,)`` each."""
    with torch.no_grad():
        lg, _ = run(lm, torch.cat([g.clean, g.corrupted]), last_only=False)
    m = metric_of(lg[:, g.position], metric, torch.cat([g.target, g.target]),
                    None if g.foil is None else torch.cat([g.foil, g.foil]))
    return m[: g.size], m[g.size:]
