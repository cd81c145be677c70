"""The Anatomy: a model's weights in one canonical, family-independent form, plus lenscope's own math.

Every method in lenscope reads an :class:`Anatomy` (what the weights are) and a
:class:`~lenscope.models.runtime.trace.Trace` (what one forward pass computed). Family modules under
``models/families`` are the only code that knows how a transformers model stores its weights; they
fill these dataclasses and nothing downstream asks which family it is looking at.

Conventions: weights act on row vectors (``x @ W``); shapes are written with named axes.
Tensors are views of the real model's parameters where possible (detached, no copies).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch
from torch import Tensor

from ...errors import UnsupportedModelError
from ...results import axis_size
from ..runtime.activations import ACTIVATION_ALIASES, ACTIVATIONS, activation_name  # noqa: F401 (re-exported)
from .positions import Embedding, RelativeBias, Rotary, alibi_slopes  # noqa: F401 (re-exported)
from .tensors import _map_tensors, _mix, _on, _up, astype, to_device  # noqa: F401 (re-exported)

if TYPE_CHECKING:
    from .moe import MoE  # a mixture of experts: a block's other kind of MLP (models/weights/moe.py)


@dataclass(repr=False)
class Norm:
    """LayerNorm or RMSNorm over the last axis, or the identity.

    ``weight`` is the effective multiplier (Gemma's ``1 + w`` is folded in). ``scale(x)`` is the
    per-token factor ``1/sqrt(var + eps)`` (LayerNorm, variance of the centred vector) or
    ``1/sqrt(mean(x^2) + eps)`` (RMSNorm). Given that scale, the norm is affine in ``x``:
    ``linear(x, s) + bias``; decompositions use this with the scale taken from the trace.

    ``"identity"`` (scale 1, a weight of ones placing it on the block's device) is a norm slot a block lacks (OLMo
    2's pre-norms): every method reads the slot as a norm.
    """

    kind: Literal["layernorm", "rmsnorm", "identity"]
    weight: Tensor | None  # (d,)
    bias: Tensor | None  # (d,)
    eps: float

    def center(self, x: Tensor) -> Tensor:
        return x - x.mean(-1, keepdim=True) if self.kind == "layernorm" else x

    def scale(self, x: Tensor) -> Tensor:
        """Per-token scale, shape ``x.shape[:-1]`` (float32, or float64 for a float64 input)."""
        x = x if x.dtype == torch.float64 else x.float()
        if self.kind == "identity":
            return x.new_ones(x.shape[:-1])
        if self.kind == "layernorm":
            var = x.var(-1, unbiased=False)
        else:
            var = x.pow(2).mean(-1)
        return torch.rsqrt(var + self.eps)

    def linear(self, x: Tensor, scale: Tensor) -> Tensor:
        """The norm without its bias, with a given per-token ``scale`` (linear in ``x``)."""
        y = self.center(x) * scale.unsqueeze(-1)
        return y * self.weight if self.weight is not None else y

    def pullback(self, u: Tensor, scale: Tensor) -> Tensor:
        """The transpose of :meth:`linear`: ``linear(x, scale) . u == x . pullback(u, scale)`` for every ``x``.

        ``u (..., d)``, ``scale (...)``. Centring and the element-wise weight are symmetric maps, so this is
        ``scale * center(weight * u)``. Decompositions use it to carry a read-out direction (e.g. an
        unembedding row) back through a norm before expanding over source tokens.
        """
        w = u * self.weight if self.weight is not None else u
        return self.center(w) * scale.unsqueeze(-1)

    def __call__(self, x: Tensor) -> Tensor:
        x = _on(x, self.weight if self.weight is not None else self.bias)
        y = self.linear(x, self.scale(x))
        return y + self.bias if self.bias is not None else y

    def to(self, dtype: torch.dtype) -> Norm:
        """The same norm with its parameters in ``dtype``."""
        return astype(self, dtype)

    def __repr__(self) -> str:
        d = None if self.weight is None else self.weight.shape[-1]
        return f"Norm({self.kind}, d={d}, bias={self.bias is not None}, eps={self.eps:g})"


@dataclass(repr=False)
class Attention:
    """Multi-head attention with per-head weights.

    Shapes: ``W_Q (head, d_model, d_head)``, ``W_K, W_V (kv_head, d_model, d_head)``,
    ``W_O (head, d_head, d_model)``; biases ``b_Q (head, d_head)``, ``b_K, b_V (kv_head, d_head)``,
    ``b_O (d_model,)``. Query head ``h`` reads key/value head ``h // (head / kv_head)``.
    """

    W_Q: Tensor
    W_K: Tensor
    W_V: Tensor
    W_O: Tensor
    b_Q: Tensor | None
    b_K: Tensor | None
    b_V: Tensor | None
    b_O: Tensor | None
    scale: float
    causal: bool = True
    rotary: Rotary | None = None
    q_norm: Norm | None = None  # over each head's d_head features; weight (d_head,) or per head (head, 1, d_head)
    k_norm: Norm | None = None  # weight (d_head,) or per key/value head (kv_head, 1, d_head)
    alibi: Tensor | None = None  # (head,) slopes
    softcap: float | None = None
    window: int | None = None  # causal: query i sees keys j with i - j < window; bidirectional: |i - j| <= window
    sinks: Tensor | None = None  # (head,) logits in each head's softmax denominator only (GPT-OSS's sinks)
    qk_norm_across_heads: bool = False  # q_norm / k_norm over all heads' features at once (OLMo 2, OLMoE), not per head
    relative_bias: RelativeBias | None = None  # T5's learned bias per head and relative-distance bucket

    n_heads = axis_size("W_Q", 0)
    n_kv_heads = axis_size("W_K", 0)
    d_head = axis_size("W_Q", 2)

    def _per_kv(self, t: Tensor, dim: int = 0) -> Tensor:
        """(kv_head, ...) -> (head, ...) by repeating each kv head for its query group (along ``dim``)."""
        g = self.n_heads // self.n_kv_heads
        return t if g == 1 else t.repeat_interleave(g, dim=dim)

    def _project(self, x: Tensor, W: Tensor, b: Tensor | None, per_head: bool, kv: bool) -> Tensor:
        """``x (..., pos, d_model)`` -> ``(..., head, pos, d_head)``; ``per_head``: ``x (..., pos, head, d_model)``,
        one input per query head, read by that head's weights (key/value weights repeated per query head)."""
        x = _on(x, W)
        if per_head:
            W, b = (self._per_kv(W), None if b is None else self._per_kv(b)) if kv else (W, b)
            out = torch.einsum("...phd,hde->...hpe", *_mix(x, W))
        else:
            out = torch.einsum("...pd,hde->...hpe", *_mix(x, W))
        return out if b is None else out + b[:, None, :]

    def _normed_across(self, norm: Norm | None, x: Tensor, W: Tensor, b: Tensor | None, per_head: bool,
                       kv: bool) -> Tensor:
        """Projections normed over all heads' features at once (``norm``'s weight ``(n * d_head,)``), as
        :meth:`_project` returns them. ``per_head``: each query head's own input is projected by every head's
        weights and normed, and the head keeps its own (a key: its key/value head's) part."""
        if not per_head:
            out = self._project(x, W, b, False, kv)  # (..., n, pos, e)
            if norm is None:
                return out
            flat = out.transpose(-3, -2)  # (..., pos, n, e)
            return norm(flat.reshape(*flat.shape[:-2], -1)).reshape(flat.shape).transpose(-3, -2)
        x = _on(x, W)
        full = torch.einsum("...phd,nde->...phne", *_mix(x, W))  # every head's projection of each input
        if b is not None:
            full = full + b
        if norm is not None:
            full = norm(full.reshape(*full.shape[:-2], -1)).reshape(full.shape)
        H = self.n_heads
        own = torch.arange(H, device=full.device)
        idx = own // (H // self.n_kv_heads) if kv else own
        return full[..., own, idx, :].transpose(-3, -2)  # (..., head, pos, e)

    def queries_keys(self, x: Tensor, positions: Tensor, *, x_k: Tensor | None = None,
                     per_head: bool = False) -> tuple[Tensor, Tensor]:
        """x (..., pos, d_model) -> q, k (..., head, pos, d_head) after norms and rotary (keys repeated per query
        head). ``x_k``: another input for the keys (default ``x``); ``per_head``: inputs ``(..., pos, head,
        d_model)``, one per query head."""
        xk = x if x_k is None else x_k
        if self.qk_norm_across_heads:
            q = self._normed_across(self.q_norm, x, self.W_Q, self.b_Q, per_head, kv=False)
            k = self._normed_across(self.k_norm, xk, self.W_K, self.b_K, per_head, kv=True)
        else:
            q = self._project(x, self.W_Q, self.b_Q, per_head, kv=False)
            k = self._project(xk, self.W_K, self.b_K, per_head, kv=True)
            if self.q_norm is not None:
                q = self.q_norm(q)
            if self.k_norm is not None:
                k = self._key_norm(per_head)(k)
        if self.rotary is not None:
            q = self.rotary.apply(q, positions)
            k = self.rotary.apply(k, positions)
        return q, k if per_head else self._per_kv(k, dim=-3)

    def _key_norm(self, per_head: bool) -> Norm:
        """The key norm for keys per key/value head, or (``per_head``) per query head: a weight per key/value head
        ``(kv_head, 1, d_head)`` (Cohere, StableLM) repeats for its query group."""
        n = self.k_norm
        if not per_head or n.weight is None or n.weight.dim() < 3 or self.n_kv_heads == self.n_heads:
            return n
        return Norm(n.kind, self._per_kv(n.weight), None if n.bias is None else self._per_kv(n.bias), n.eps)

    def values(self, x: Tensor, *, per_head: bool = False) -> Tensor:
        """x (..., pos, d_model) -> v (..., head, pos, d_head) per query head; ``per_head``: see queries_keys."""
        v = self._project(x, self.W_V, self.b_V, per_head, kv=True)
        return v if per_head else self._per_kv(v, dim=-3)

    def mask(self, n_q: int, n_k: int, device=None) -> Tensor:
        """Boolean (q, k) mask of the keys each query may attend to."""
        qi = torch.arange(n_q, device=device)[:, None]
        kj = torch.arange(n_k, device=device)[None, :]
        allowed = torch.ones(n_q, n_k, dtype=torch.bool, device=device)
        if self.causal:
            allowed &= kj <= qi
        if self.window is not None:
            if self.causal:
                allowed &= (qi - kj) < self.window
            else:  # transformers' bidirectional window is inclusive: |i - j| <= window
                allowed &= (qi - kj).abs() <= self.window
        return allowed

    def probs(self, q: Tensor, k: Tensor, positions: Tensor, sink_column: bool = False) -> Tensor:
        """Attention probabilities ``(..., head, pos, src)`` (float32) from queries and keys ``(..., head, pos,
        d_head)`` as :meth:`queries_keys` returns them: scale, soft-cap, ALiBi, mask, softmax. ``sink_column``:
        with attention sinks, the sink's probability as a last column ``(..., head, pos, src + 1)``."""
        scores = torch.einsum("...hqe,...hke->...hqk", q, k) * self.scale
        if self.softcap is not None:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        if self.alibi is not None:
            positions = _on(positions, scores)
            rel = (positions[None, :] - positions[:, None]).to(scores.dtype)  # key - query
            scores = scores + self.alibi.to(scores)[:, None, None] * rel
        if self.relative_bias is not None:
            scores = scores + _on(self.relative_bias(positions), scores).to(scores.dtype)
        allowed = self.mask(q.shape[-2], k.shape[-2], q.device)
        scores = scores.masked_fill(~allowed, float("-inf"))
        if self.sinks is not None:  # one more logit per head in the denominator, dropped after the softmax
            sink = _on(self.sinks, scores).to(scores.dtype)[:, None, None].expand(*scores.shape[:-1], 1)
            full = torch.softmax(torch.cat([scores, sink], -1).float(), dim=-1)
            return full if sink_column else full[..., :-1]
        return torch.softmax(scores.float(), dim=-1)

    def pattern(self, x: Tensor, positions: Tensor) -> Tensor:
        """Attention probabilities (..., head, pos, src) of the input ``x`` (..., pos, d_model)."""
        x = _on(x, self.W_Q)
        return self.probs(*self.queries_keys(x, positions), positions).to(x.dtype)

    def split(self, x_q: Tensor, x_k: Tensor, x_v: Tensor, positions: Tensor) -> Tensor:
        """Each head's output ``z (..., head, pos, d_head)`` when its queries, keys and values read their own
        normed inputs ``x_q, x_k, x_v (..., pos, head, d_model)`` (edge patching: one head's input differs)."""
        q, k = self.queries_keys(x_q, positions, x_k=x_k, per_head=True)
        v = self.values(x_v, per_head=True)
        probs = self.probs(q, k, positions)
        return torch.einsum("...hqk,...hke->...hqe", *_mix(probs, v))

    def head_outputs(self, probs: Tensor, x: Tensor) -> Tensor:
        """What each head writes, (head, pos, d_model), without ``b_O``."""
        z = torch.einsum("hqk,hke->hqe", *_mix(_on(probs, self.W_V), self.values(x)))
        return torch.einsum("hqe,hed->hqd", *_mix(z, self.W_O))

    def __call__(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """x (pos, d_model) -> (output (pos, d_model), probs (head, pos, src))."""
        x = _on(x, self.W_Q)
        probs = self.pattern(x, positions)
        z = torch.einsum("hqk,hke->qhe", *_mix(probs, self.values(x)))
        z, W_O = _mix(z, self.W_O)
        out = z.reshape(z.shape[0], -1) @ W_O.reshape(-1, W_O.shape[-1])
        if self.b_O is not None:
            out = out + self.b_O
        return out, probs

    def cross(self, x: Tensor, memory: Tensor) -> tuple[Tensor, Tensor]:
        """Cross-attention (an encoder-decoder model's decoder reading the encoder): queries from ``x (..., pos,
        d_model)``, keys and values from ``memory (..., src, d_model)``, every source visible. Returns ``(output
        (..., pos, d_model), probs (..., head, pos, src))``. Needs an attention without positions (no rotary,
        ALiBi, window, sinks: none of them is defined between two sequences)."""
        if (self.rotary is not None or self.alibi is not None or self.window is not None or self.sinks is not None
                or self.relative_bias is not None or self.causal):
            raise UnsupportedModelError("cross-attention with positions, a window, sinks or a causal mask is not "
                                        "modelled")
        x, memory = _on(x, self.W_Q), _on(memory, self.W_Q)
        q, k = self.queries_keys(x, torch.arange(x.shape[-2], device=x.device), x_k=memory)
        probs = self.probs(q, k, torch.arange(x.shape[-2], device=x.device))
        z = torch.einsum("...hqk,...hke->...qhe", *_mix(probs, self.values(memory)))
        z, W_O = _mix(z, self.W_O)
        out = z.reshape(*z.shape[:-2], -1) @ W_O.reshape(-1, W_O.shape[-1])
        if self.b_O is not None:
            out = out + self.b_O
        return out, probs.to(x.dtype)

    def __repr__(self) -> str:
        flags = [(self.rotary is not None, repr(self.rotary)), (self.alibi is not None, "alibi"),
                 (self.q_norm is not None, "qk_norm" + ("(across heads)" if self.qk_norm_across_heads else "")),
                 (self.softcap is not None, f"softcap={self.softcap or 0:g}"),
                 (self.window is not None, f"window={self.window}"), (self.sinks is not None, "sinks"),
                 (self.relative_bias is not None, repr(self.relative_bias))]
        parts = [f"heads={self.n_heads}", f"kv_heads={self.n_kv_heads}", f"d_head={self.d_head}",
                 "causal" if self.causal else "bidirectional"] + [text for on, text in flags if on]
        return "Attention(" + ", ".join(parts) + ")"


@dataclass(repr=False)
class MLP:
    """Feed-forward block: ``act(x W_in + b_in) W_out + b_out``, or gated:
    ``(act(x W_gate + b_gate) * (x W_in + b_in)) W_out + b_out``.

    Shapes: ``W_in, W_gate (d_model, d_mlp)``, ``W_out (d_mlp, d_model)``.
    """

    W_in: Tensor
    b_in: Tensor | None
    W_out: Tensor
    b_out: Tensor | None
    act: str
    W_gate: Tensor | None = None
    b_gate: Tensor | None = None
    # GPT-OSS's clamped SwiGLU: ``act(min(gate, gate_limit)) * (clamp(up, -up_limit, up_limit) + up_offset)`` with
    # ``act = silu`` of slope ``alpha`` (``x * sigmoid(alpha * x)``); the defaults leave the MLP as above
    alpha: float | None = None
    gate_limit: float | None = None
    up_limit: float | None = None
    up_offset: float = 0.0

    @property
    def gated(self) -> bool:
        return self.W_gate is not None

    @property
    def act_fn(self) -> Callable[[Tensor], Tensor]:
        """The activation of the (gate) pre-activation, with its slope ``alpha`` and the gate's clamp."""
        f = ACTIVATIONS[self.act]
        if self.alpha is not None:
            if self.act != "silu":
                raise UnsupportedModelError(f"a slope alpha applies to the silu activation only, not {self.act!r}")
            alpha = self.alpha
            f = lambda x: x * torch.sigmoid(alpha * x)  # noqa: E731
        if self.gate_limit is None:
            return f
        limit, g = self.gate_limit, f
        return lambda x: g(x.clamp(max=limit))

    @property
    def up_plain(self) -> bool:
        """Whether the linear branch enters the product as it is (no clamp, no offset)."""
        return self.up_limit is None and self.up_offset == 0.0

    def up_fn(self, u: Tensor) -> Tensor:
        """What the linear branch of a gated MLP multiplies: ``u`` itself, or clamped and offset (GPT-OSS)."""
        if self.up_limit is not None:
            u = u.clamp(-self.up_limit, self.up_limit)
        return u + self.up_offset if self.up_offset else u

    d_mlp = axis_size("W_in", 1)

    def pre(self, x: Tensor) -> tuple[Tensor, Tensor | None]:
        """(pre-activation of the activated branch, linear branch or None), each (pos, d_mlp)."""
        x = _on(x, self.W_in)
        lin = torch.matmul(*_mix(x, self.W_in))
        if self.b_in is not None:
            lin = lin + self.b_in
        if not self.gated:
            return lin, None
        gate = torch.matmul(*_mix(x, self.W_gate))
        if self.b_gate is not None:
            gate = gate + self.b_gate
        return gate, lin

    def hidden(self, x: Tensor, pre: tuple[Tensor, Tensor | None] | None = None) -> Tensor:
        """The hidden units (pos, d_mlp); ``pre``: :meth:`pre`'s two outputs when already computed."""
        pre, up = self.pre(x) if pre is None else pre
        h = self.act_fn(pre)
        return h * self.up_fn(up) if up is not None else h

    def __call__(self, x: Tensor, pre: tuple[Tensor, Tensor | None] | None = None) -> Tensor:
        out = torch.matmul(*_mix(self.hidden(x, pre), self.W_out))
        return out + self.b_out if self.b_out is not None else out

    def __repr__(self) -> str:
        extra = "" if self.alpha is None and self.gate_limit is None and self.up_plain else (
            f", alpha={self.alpha}, limit={self.gate_limit}/{self.up_limit}, up_offset={self.up_offset:g}")
        return f"MLP(d_mlp={self.d_mlp}, act={self.act}, gated={self.gated}, bias={self.b_in is not None}{extra})"


Placement = Literal["pre", "post", "sandwich", "parallel"]


@dataclass(repr=False)
class Layer:
    """One transformer block.

    - ``pre``: ``mid = h + attn(ln_attn(h))``; ``out = mid + mlp(ln_mlp(mid))``
    - ``sandwich``: as ``pre`` with ``ln_attn_out`` / ``ln_mlp_out`` applied to what each sub-layer writes
    - ``parallel``: ``out = h + attn(ln_attn(h)) + mlp(ln_mlp(h))``
    - ``post``: ``mid = ln_attn(h + attn(h))``; ``out = ln_mlp(mid + mlp(mid))``

    ``residual_scale`` multiplies what each sub-layer adds to the residual stream (Granite's
    ``residual_multiplier``): the write is ``residual_scale * ln_*_out(sub-layer output)`` (:meth:`write`).

    An encoder-decoder model's decoder block has a third sub-layer between the two, ``cross`` (attention over the
    encoder's output, ``memory``) with its norm ``ln_cross`` (docs/encoder-decoder.md): ``pre``: ``cm = mid +
    cross(ln_cross(mid), memory)``, ``out = cm + mlp(ln_mlp(cm))``; ``post``: ``cm = ln_cross(mid + cross(mid,
    memory))``, ``out = ln_mlp(cm + mlp(cm))``.
    """

    placement: Placement
    attn: Attention
    mlp: MLP | MoE
    ln_attn: Norm | None
    ln_mlp: Norm | None
    ln_attn_out: Norm | None = None
    ln_mlp_out: Norm | None = None
    residual_scale: float = 1.0
    cross: Attention | None = None
    ln_cross: Norm | None = None

    def write(self, which: Literal["attn", "cross", "mlp"], out: Tensor) -> Tensor:
        """What sub-layer ``which`` adds to the residual stream, from its output ``out (..., d_model)``: through
        its sandwich norm (when there is one), times ``residual_scale``."""
        norm = self.write_norm(which)
        w = norm(out) if norm is not None else out
        return w * self.residual_scale if self.residual_scale != 1.0 else w

    def write_norm(self, which: Literal["attn", "cross", "mlp"]) -> Norm | None:
        """The sandwich norm on sub-layer ``which``'s output, or None (cross-attention never has one)."""
        return {"attn": self.ln_attn_out, "mlp": self.ln_mlp_out}.get(which)

    def norms(self) -> dict[str, Norm]:
        """The block's norms by slot name."""
        slots = {"ln_attn": self.ln_attn, "ln_mlp": self.ln_mlp, "ln_attn_out": self.ln_attn_out,
                 "ln_mlp_out": self.ln_mlp_out, "ln_cross": self.ln_cross}
        return {k: v for k, v in slots.items() if v is not None}

    def forward(self, h: Tensor, positions: Tensor, routing: Tensor | None = None, *,
                memory: Tensor | None = None) -> dict[str, Tensor]:
        """Recompute the block from its input ``h`` (pos, d_model) with lenscope's own math (``routing (pos,
        expert)``: a mixture of experts' routing weights, by default its router's own; ``memory (src, d_model)``:
        the encoder's output, which a block with cross-attention reads).

        Returns every intermediate: ``attn_in, attn_out, attn_write, pattern, resid_mid,
        mlp_in, mlp_out, mlp_write, resid_post``; with cross-attention also ``cross_in, cross_out, cross_pattern,
        cross_write, resid_cross``.
        """
        h, positions = _on(h, self.attn.W_Q), _on(positions, self.attn.W_Q)
        r: dict[str, Tensor] = {"attn_in": h if self.placement == "post" else self.ln_attn(h)}
        r["attn_out"], r["pattern"] = self.attn(r["attn_in"], positions)
        r.update(self.after_attention(h, r["attn_out"], routing=routing, memory=memory))
        return r

    def after_attention(self, h: Tensor, attn_out: Tensor, mlp_in: Tensor | None = None, *,
                        routing: Tensor | None = None, memory: Tensor | None = None,
                        cross_out: Tensor | None = None) -> dict[str, Tensor]:
        """The rest of the block once attention has computed ``attn_out`` (..., pos, d_model) from the block
        input ``h``: ``attn_write, resid_mid, mlp_in, mlp_out, mlp_write, resid_post`` (and the cross-attention's
        ``cross_in, cross_out, cross_pattern, cross_write, resid_cross`` from ``memory (..., src, d_model)``).

        ``h`` and ``attn_out`` may carry leading batch axes (e.g. one altered attention output per row, as in
        value zeroing). ``mlp_in`` overrides what a parallel block's MLP reads (it reads ``ln_mlp(h)``);
        ``cross_out`` what the cross-attention outputs (its pattern is then not recomputed).
        """
        ref = self.mlp.W_in
        h, attn_out, mlp_in = _on(h, ref), _on(attn_out, ref), _on(mlp_in, ref)
        if (self.cross is None) != (memory is None):
            raise UnsupportedModelError("a block with cross-attention needs the encoder's output (memory=), and "
                                        "only such a block takes one")
        r: dict[str, Tensor] = {}
        r["attn_write"] = self.write("attn", attn_out)
        if self.placement == "post":
            r["resid_mid"] = self.ln_attn(h + r["attn_write"])
            r["mlp_in"] = r["resid_mid"]
        elif self.placement == "parallel":
            r["resid_mid"] = h + r["attn_write"]
            r["mlp_in"] = self.ln_mlp(h) if mlp_in is None else mlp_in
        else:
            r["resid_mid"] = h + r["attn_write"]
            r["mlp_in"] = self.ln_mlp(r["resid_mid"])
        before_mlp = r["resid_mid"]
        if self.cross is not None:
            post = self.placement == "post"
            r["cross_in"] = before_mlp if post else self.ln_cross(before_mlp)
            if cross_out is None:
                r["cross_out"], r["cross_pattern"] = self.cross.cross(r["cross_in"], memory)
            else:
                r["cross_out"] = _on(cross_out, ref)
            r["cross_write"] = self.write("cross", r["cross_out"])
            r["resid_cross"] = (self.ln_cross(before_mlp + r["cross_write"]) if post
                                else before_mlp + r["cross_write"])
            before_mlp = r["resid_cross"]
            r["mlp_in"] = before_mlp if post else self.ln_mlp(before_mlp)
        r["mlp_out"] = self.mlp(r["mlp_in"]) if routing is None else self.mlp(r["mlp_in"], routing)
        r["mlp_write"] = self.write("mlp", r["mlp_out"])
        if self.placement == "post":
            r["resid_post"] = self.ln_mlp(before_mlp + r["mlp_write"])
        else:
            r["resid_post"] = before_mlp + r["mlp_write"]
        return r

    @property
    def device(self) -> torch.device:
        """Where this block's weights sit, and so where lenscope recomputes it."""
        return self.attn.W_Q.device

    def __repr__(self) -> str:
        scale = f", residual_scale={self.residual_scale:g}" if self.residual_scale != 1.0 else ""
        cross = f", cross={self.cross!r}" if self.cross is not None else ""
        return f"Layer({self.placement}, {self.attn!r}{cross}, {self.mlp!r}{scale})"


@dataclass(repr=False)
class Unembed:
    """Logits = ``(transform(x) @ W_U + b_U) * logit_scale`` (Cohere's constant, 1 elsewhere), then a soft-cap.

    ``transform`` is the masked-LM head's dense + activation + norm of encoders, None for decoders.
    Shapes: ``W_U (d_model, vocab)``, ``b_U (vocab,)``.
    """

    W_U: Tensor
    b_U: Tensor | None = None
    softcap: float | None = None
    logit_scale: float = 1.0
    transform_W: Tensor | None = None  # (d_model, d_model)
    transform_b: Tensor | None = None
    transform_act: str | None = None
    transform_norm: Norm | None = None

    def transform(self, x: Tensor) -> Tensor:
        if self.transform_W is None:
            return x
        y = torch.matmul(*_mix(_on(x, self.transform_W), self.transform_W)) + self.transform_b
        y = ACTIVATIONS[self.transform_act](y)
        return self.transform_norm(y)

    def __call__(self, x: Tensor) -> Tensor:
        """Logits of final-normed states ``x (..., d_model)`` (:class:`~lenscope.models.weights.readout.Readout`)."""
        from .readout import Readout

        return Readout(None, self).logits(x)


@dataclass(repr=False)
class Anatomy:
    """A whole model in canonical form: ``embed`` -> ``layers`` -> ``final_norm`` -> ``unembed``."""

    family: str
    model_type: str
    d_model: int
    n_ctx: int
    vocab_size: int
    embed: Embedding
    layers: list[Layer]
    final_norm: Norm | None
    unembed: Unembed | None
    causal: bool = True
    extras: dict = field(default_factory=dict)
    # an encoder-decoder model: this Anatomy is its decoder (with cross-attention in its blocks), ``encoder`` the
    # encoder stack as an Anatomy of its own (bidirectional, its final norm, no unembedding); docs/encoder-decoder.md
    encoder: Anatomy | None = None

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def is_encoder_decoder(self) -> bool:
        return self.encoder is not None

    @property
    def is_encoder(self) -> bool:
        return not self.causal

    @property
    def placement(self) -> str:
        return self.layers[0].placement

    @property
    def devices(self) -> list[torch.device]:
        """Each layer's device: where its weights sit and lenscope recomputes it (``cpu`` for weights that
        accelerate offloads to CPU or disk: the Anatomy holds them materialised in CPU memory)."""
        return [layer.device for layer in self.layers]

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the Anatomy's weights (float32 for bfloat16 / float16 models: see ``docs/devices.md``)."""
        return self.layers[0].attn.W_Q.dtype

    def logits(self, resid: Tensor) -> Tensor:
        """Logits of final-layer residual states ``resid`` (..., d_model)."""
        from .readout import Readout

        return Readout.from_anatomy(self).logits(resid)

    def __repr__(self) -> str:
        lines = [
            f"Anatomy(family={self.family!r}, model_type={self.model_type!r}, layers={self.n_layers}, "
            f"d_model={self.d_model}, vocab={self.vocab_size}, n_ctx={self.n_ctx}, "
            f"{'causal' if self.causal else 'bidirectional'})",
            f"  embed: scale={self.embed.scale:g}, learned_pos={self.embed.W_pos is not None}, "
            f"norm={self.embed.norm!r}",
            f"  layer 0: {self.layers[0]!r}",
            f"  final_norm: {self.final_norm!r}",
            f"  unembed: {'none' if self.unembed is None else 'W_U ' + str(tuple(self.unembed.W_U.shape))}",
        ]
        if self.encoder is not None:
            lines.append("  encoder: " + repr(self.encoder).replace("\n", "\n  "))
        return "\n".join(lines)
