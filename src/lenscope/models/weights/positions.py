"""The input side of the Anatomy: the token embedding and the position schemes (learned positions, rotary,
ALiBi slopes, T5's relative position bias). :mod:`lenscope.models.weights.anatomy` re-exports every name; a module of
its
own to keep each file short."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ...results import axis_size
from .tensors import _on, _up

if TYPE_CHECKING:
    from .anatomy import Norm

@dataclass(repr=False)
class Rotary:
    """Rotary position embedding on the first ``dim`` features of a head (the rest pass through: partial rotary).
    Frequency ``i`` rotates the features ``(i, i + dim/2)`` (rotate-half: Llama, GPT-NeoX, Falcon) or, ``interleaved``,
    the adjacent pair ``(2i, 2i + 1)`` (rotate-every-two: GPT-J, Cohere)."""

    inv_freq: Tensor  # (dim/2,)
    dim: int
    attention_scaling: float = 1.0
    interleaved: bool = False

    def cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """``cos, sin (pos, dim)``, laid out as the features they multiply."""
        freqs = positions.double()[:, None] * self.inv_freq.double()[None, :]
        emb = freqs.repeat_interleave(2, dim=-1) if self.interleaved else torch.cat([freqs, freqs], dim=-1)
        return (emb.cos() * self.attention_scaling).float(), (emb.sin() * self.attention_scaling).float()

    def apply(self, x: Tensor, positions: Tensor) -> Tensor:
        """x: (head, pos, d_head) -> same, rotated."""
        cos, sin = self.cos_sin(_on(positions, self.inv_freq))
        cos, sin = _on(cos, x), _on(sin, x)
        xr, xp = x[..., : self.dim], x[..., self.dim :]
        half = self.dim // 2
        rot = (torch.stack([-xr[..., 1::2], xr[..., 0::2]], dim=-1).flatten(-2) if self.interleaved
               else torch.cat([-xr[..., half:], xr[..., :half]], dim=-1))
        return torch.cat([xr * cos + rot * sin, xp], dim=-1)

    def __repr__(self) -> str:
        return f"Rotary(dim={self.dim}, scaling={self.attention_scaling:g}{', interleaved' * self.interleaved})"


def alibi_slopes(n_heads: int) -> Tensor:
    """ALiBi head slopes (Press et al. 2022), for any number of heads."""
    closest = 2 ** math.floor(math.log2(n_heads))
    base = 2.0 ** (-(2.0 ** -(math.log2(closest) - 3)))
    slopes = [base ** (i + 1) for i in range(closest)]
    if closest != n_heads:
        extra = 2.0 ** (-(2.0 ** -(math.log2(2 * closest) - 3)))
        slopes += [extra ** (2 * i + 1) for i in range(n_heads - closest)]
    return torch.tensor(slopes, dtype=torch.float32)


@dataclass(repr=False)
class RelativeBias:
    """T5's relative position bias (Raffel et al. 2020): a learned logit per head and bucket of the distance
    ``key - query``, added to the attention scores. ``weight (bucket, head)``; half the buckets (of each direction,
    when ``bidirectional``) count distances exactly, the rest grow logarithmically up to ``max_distance``.
    Every layer of a stack shares it (transformers keeps it in layer 0 and passes the bias down)."""

    weight: Tensor  # (bucket, head)
    bidirectional: bool
    max_distance: int

    n_buckets = axis_size("weight", 0)

    def buckets(self, rel: Tensor) -> Tensor:
        """The bucket of each distance ``rel = key - query`` (integers), as T5 forms it (the logarithmic part in
        float32, so the boundaries are T5's own)."""
        n, out = self.n_buckets, torch.zeros_like(rel)
        if self.bidirectional:
            n //= 2
            out = out + (rel > 0).long() * n
            dist = rel.abs()
        else:
            dist = (-rel).clamp_min(0)  # a causal query sees keys at or before it
        exact = n // 2
        far = exact + (torch.log(dist.clamp_min(1).float() / exact) / math.log(self.max_distance / exact)
                       * (n - exact)).long()
        return out + torch.where(dist < exact, dist, far.clamp_max(n - 1))

    def __call__(self, positions: Tensor) -> Tensor:
        """The bias ``(head, pos, pos)`` between the query and key ``positions``."""
        positions = _on(positions, self.weight).long()
        rel = positions[None, :] - positions[:, None]  # key - query
        return self.weight[self.buckets(rel)].permute(2, 0, 1)

    def __repr__(self) -> str:
        return f"RelativeBias(buckets={self.n_buckets}, max_distance={self.max_distance}, " + (
            "bidirectional)" if self.bidirectional else "causal)")


@dataclass(repr=False)
class Embedding:
    """Token embedding (times ``scale``), learned positions at ``position + pos_offset``, a constant
    token-type row, then an optional norm. Shapes: ``W_E (vocab, d_model)``, ``W_pos (n_pos, d_model)``."""

    W_E: Tensor
    scale: float = 1.0
    W_pos: Tensor | None = None
    pos_offset: int = 0
    type_row: Tensor | None = None  # (d_model,)
    norm: Norm | None = None

    def parts(self, ids: Tensor, positions: Tensor) -> dict[str, Tensor]:
        """The additive parts before the norm: ``tok``, ``pos``, ``type`` (each (pos, d_model))."""
        out = {"tok": _up(self.W_E[_on(ids, self.W_E)]) * self.scale}
        if self.W_pos is not None:
            out["pos"] = _up(self.W_pos[_on(positions, self.W_pos) + self.pos_offset])
        if self.type_row is not None:
            out["type"] = _up(self.type_row).expand_as(out["tok"])
        return out

    def __call__(self, ids: Tensor, positions: Tensor) -> Tensor:
        x = sum(self.parts(ids, positions).values())
        return self.norm(x) if self.norm is not None else x
