"""The readout: the one way lenscope goes from a residual state to logits.

A decoder reads its last residual state ``h (..., d_model)`` as

    logits = cap( transform(final_norm(h)) @ W_U + b_U ),     cap(z) = c * tanh(z / c)  (when soft-capped)

(a head with a ``logit_scale`` multiplies the logits before the cap: ``W_U`` and ``b_U`` here are the scaled ones,
:attr:`Readout.W_U`, :attr:`Readout.b_U`)
with ``final_norm`` using ``h``'s own statistics and ``transform`` an encoder's masked-LM head (the identity for
decoders). :class:`Readout` holds the final norm and the unembedding and is the only code that writes this
equation; everything that needs part of it (a lens decoding a state, direct logit attribution, the Logit
explanations, prediction depth's top-1, causal basis extraction's influence, the tuned lens's training objective)
calls one of its methods:

- full readout: :meth:`Readout.logits` (states -> logits), :meth:`Readout.features` (what multiplies ``W_U``),
  :meth:`Readout.unembed` (features -> logits), :meth:`Readout.cap` / :meth:`Readout.uncap`;
- the linearised readout: with the final norm's per-token scale ``s`` taken from a trace the norm is affine,
  ``final_norm(h) = linear(h, s) + beta``, so the logit of a target (minus a foil) is a sum over any split of
  ``h`` into parts, ``sum_c linear(c, s) . u + const`` with ``u = W_U[:, target] - W_U[:, foil]`` and ``const``
  the biases (:meth:`Readout.direction`, :meth:`Readout.part_logits`, :meth:`Readout.pullback`,
  :meth:`Readout.constant`, :meth:`Readout.traced_logit`);
- fast paths and primitives: :meth:`Readout.top1` (bfloat16 matmul made exact), :meth:`Readout.unembedding` (the
  unembedding converted once per dtype), and the final norm's parts (:meth:`Readout.gain`, :meth:`Readout.center`,
  :meth:`Readout.variance`, :meth:`Readout.bias_logits`).

Kernels that serve one method live with it: the tuned lens's log-partition and KL terms in
:mod:`lenscope.lenses.training.objective`, causal basis extraction's factored logits of a rank-one edit in
:mod:`lenscope.lenses.influence`; both build on these primitives.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ...errors import UnsupportedModelError
from .anatomy import Norm, Unembed, _mix, _on, _up

if TYPE_CHECKING:
    from .anatomy import Anatomy, Layer

__all__ = ["Readout"]


# one converted unembedding (e.g. bfloat16) per process: converting a d_model x vocab matrix costs more than
# decoding a short text, and runs that follow (a resume, a second lens, another text) reuse it
_CONVERTED: dict = {}


def _converted(W: Tensor, dtype: torch.dtype) -> dict:
    """The cached conversion of this very tensor ``W`` (identity, through a weak reference, and its in-place version:
    a later model's unembedding allocated at a freed one's address must never reuse that one's conversion)."""
    e = _CONVERTED.get("entry")
    if e is None or e["src"]() is not W or e["version"] != W._version or e["dtype"] != dtype:
        e = {"src": weakref.ref(W), "version": W._version, "dtype": dtype, "W": W.to(dtype).contiguous()}
        _CONVERTED["entry"] = e
    return e


# one scaled unembedding per process (a model whose logits are multiplied by a constant: Cohere's logit_scale,
# Granite's 1 / logits_scaling): the readout works with ``W_U * logit_scale`` and ``b_U * logit_scale``, so every
# equation below holds unchanged. The scaled copy is float32 at least (a bfloat16 / float16 W_U is upcast before
# scaling, never rounded back), so it differs from the model's ``(x @ W_U) * c`` (Granite: ``/ logits_scaling``) by
# float32 rounding only, as every other product of the readout.
_SCALED: dict = {}


def _scaled(W: Tensor, scale: float) -> Tensor:
    """``W * scale``, cached for this very tensor (identity and in-place version, as :func:`_converted`)."""
    e = _SCALED.get("entry")
    if e is None or e["src"]() is not W or e["version"] != W._version or e["scale"] != scale:
        e = {"src": weakref.ref(W), "version": W._version, "scale": scale, "W": _up(W) * scale}
        _SCALED["entry"] = e
    return e["W"]


@dataclass(repr=False)
class Readout:
    """The final norm (``None`` for a model without one) and the unembedding of a model, with the readout's
    equations (see the module docstring). Named axes: ``d_model``, ``vocab``, ``tokens`` (any leading axes)."""

    norm: Norm | None
    head: Unembed

    @classmethod
    def from_anatomy(cls, anatomy: Anatomy) -> Readout:
        """The readout of a model; raises :class:`UnsupportedModelError` when it has no language-model head."""
        if anatomy.unembed is None:
            raise UnsupportedModelError("this model has no language-model head (no unembedding)")
        return cls(anatomy.final_norm, anatomy.unembed)

    @property
    def W_U(self) -> Tensor:
        """``(d_model, vocab)``: the unembedding times the head's ``logit_scale`` (the weight itself when 1)."""
        s = self.head.logit_scale
        return self.head.W_U if s == 1 else _scaled(self.head.W_U, s)

    @property
    def b_U(self) -> Tensor | None:
        """``(vocab,)`` or None, times the head's ``logit_scale``."""
        b, s = self.head.b_U, self.head.logit_scale
        return b if b is None or s == 1 else b * s

    @property
    def softcap(self) -> float | None:
        return self.head.softcap

    @property
    def linear_head(self) -> bool:
        """Whether the logits are ``final_norm(h) @ W_U + b_U`` exactly (no masked-LM transform, no soft-cap):
        what the fused paths that work on the logits themselves need."""
        return self.head.transform_W is None and self.head.softcap is None

    # ------------------------------------------------------------------------------------- full readout

    def features(self, h: Tensor) -> Tensor:
        """What multiplies the unembedding, ``(..., d_model)``: the final norm of ``h (..., d_model)`` with its own
        statistics, then an encoder's masked-LM transform."""
        x = self.norm(h) if self.norm is not None else h
        return self.head.transform(x)

    def unembed(self, x: Tensor) -> Tensor:
        """Logits ``(..., vocab)`` of features ``x (..., d_model)``: ``x @ W_U + b_U``, then the soft-cap."""
        W = self.W_U
        logits = torch.matmul(*_mix(_on(x, W), W))
        if self.b_U is not None:
            logits = logits + self.b_U
        return self.cap(logits)

    def logits(self, h: Tensor) -> Tensor:
        """Logits ``(..., vocab)`` of residual states ``h (..., d_model)`` (the final norm with their own
        statistics)."""
        return self.unembed(self.features(h))

    def cap(self, logits: Tensor) -> Tensor:
        """The final soft-cap ``c * tanh(z / c)`` (the identity without one)."""
        c = self.softcap
        return logits if c is None else torch.tanh(logits / c) * c

    def uncap(self, logits: Tensor) -> Tensor:
        """The inverse of :meth:`cap`: the logits before soft-capping (clamped inside the open interval)."""
        c = self.softcap
        return logits if c is None else torch.atanh((logits / c).clamp(-1 + 1e-7, 1 - 1e-7)) * c

    # ------------------------------------------------------------------------------- linearised readout

    def scale(self, final_in: Tensor) -> Tensor:
        """The final norm's per-token scale ``(...)`` of its input ``final_in (..., d_model)`` (the traced
        final residual state)."""
        return self.norm.scale(final_in)

    def linear(self, x: Tensor, scale: Tensor) -> Tensor:
        """The final norm without its bias, given a (traced) per-token ``scale``: linear in ``x (..., d_model)``."""
        return self.norm.linear(x, scale)

    def pullback(self, u: Tensor, scale: Tensor) -> Tensor:
        """A read-out direction ``u (d_model,)`` (e.g. :meth:`direction`) carried back through the final norm
        given its traced ``scale``: ``linear(x, scale) . u == x . pullback(u, scale)`` for every ``x``."""
        return self.norm.pullback(u, scale)

    def direction(self, target: int, foil: int | None = None) -> Tensor:
        """``W_U[:, target] - W_U[:, foil]`` in float32, ``(d_model,)`` (without a foil: the target's column)."""
        W = self.W_U
        u = W[:, target].float()
        return u - W[:, foil].float() if foil is not None else u

    def part_logits(self, parts: Tensor, scale: Tensor, u: Tensor) -> Tensor:
        """What each part of a residual state contributes to the logit (difference) read along ``u``,
        ``parts (..., d_model) -> (...)``, through the final norm made affine by its traced ``scale``."""
        return self.linear(parts, scale) @ u

    @property
    def has_bias(self) -> bool:
        """Whether the linearised logit has a constant term (a final-norm bias or an unembedding bias)."""
        return (self.norm is not None and self.norm.bias is not None) or self.b_U is not None

    def constant(self, target: int, foil: int | None = None) -> float:
        """The logit (difference)'s constant term: ``beta . u + b_U[target] - b_U[foil]``."""
        u = self.direction(target, foil)
        nb = self.norm.bias if self.norm is not None else None
        const = float(nb.float() @ u.to(nb.device)) if nb is not None else 0.0
        if self.b_U is not None:
            b = self.b_U
            const += float(b[target].float() - (b[foil].float() if foil is not None else 0))
        return const

    def traced_logit(self, logits: Tensor, target: int, foil: int | None = None) -> float:
        """The model's logit of ``target`` (minus ``foil``) before any soft-capping, from its output logits
        ``(vocab,)`` at one position: what the linearised parts add up to."""
        z = self.uncap(logits.float())
        return float(z[target] - (z[foil] if foil is not None else 0))

    # ------------------------------------------------------------------------------ fast paths: top-1

    def unembedding(self, dtype: torch.dtype) -> Tensor:
        """``W_U`` as a contiguous matrix in ``dtype`` (converted once per model and dtype; ``W_U`` itself when it
        already is one)."""
        W = self.W_U
        if W.dtype == dtype and W.is_contiguous():
            return W
        return _converted(W, dtype)["W"]

    def _max_column_norm(self, W: Tensor) -> float:
        entry = _converted(self.W_U, torch.bfloat16)
        if "wmax" not in entry:
            entry["wmax"] = float(W.norm(dim=0).max())
        return entry["wmax"]

    def top1(self, y: Tensor, *, exact: bool = False, candidates: int = 16) -> Tensor:
        """The top-1 token ``(tokens,)`` of features ``y (tokens, d_model)`` (:meth:`features`), equal to the
        argmax of the float32 logits (soft-capping is monotone and left out).

        Fast path: a bfloat16 matmul, the ``candidates`` best of each row recomputed in float32, and a row
        recomputed entirely in float32 unless its exact best beats every other token's bfloat16 logit by more
        than a rounding-error bound. ``exact=True``: float32 throughout.
        """
        W = self.W_U.float()
        b = self.b_U.float() if self.b_U is not None else None
        if exact:
            z = y @ W
            return (z if b is None else z + b).argmax(-1)
        Wb, wmax = self.unembedding(torch.bfloat16), self._max_column_norm(W)
        m = min(candidates, W.shape[1])
        z = (y.to(torch.bfloat16) @ Wb).float()
        if b is not None:
            z += b
        top_v, top_i = z.topk(m, dim=-1)
        ze = torch.einsum("nd,nmd->nm", y, W.T[top_i])  # exact logits of the candidates
        if b is not None:
            ze += b[top_i]
        best = ze.amax(-1)
        # exact ties go to the lowest token id, as argmax does
        pick = torch.where(ze == best[:, None], top_i, W.shape[1]).amin(-1)
        # |bf16 logit - exact| <= 2^-7 |y| max_v |W_v| (inputs rounded) + 2^-8 |z| (output rounded)
        bound = 1.5 * (2.0**-7 * y.norm(dim=-1) * wmax + 2.0**-8 * z.abs().amax(-1)) + 1e-6
        unsure = ~(best > top_v[:, -1] + bound) if m < W.shape[1] else torch.zeros_like(best, dtype=torch.bool)
        if unsure.any():
            zz = y[unsure] @ W
            pick[unsure] = (zz if b is None else zz + b).argmax(-1)
        return pick

    # ------------------------------------------------------------------ the final norm's parts

    def bias_logits(self) -> Tensor:
        """``beta W_U + b_U`` ``(vocab,)``: what the final norm's bias and the unembedding bias add to every
        logit (float32)."""
        W = self.W_U.float()
        zb = torch.zeros(W.shape[1])
        if self.norm is not None and self.norm.bias is not None:
            zb += self.norm.bias.float() @ W
        if self.b_U is not None:
            zb += self.b_U.float()
        return zb

    def gain(self, d: int) -> Tensor:
        """The final norm's element-wise weight ``(d_model,)`` in float32 (ones without one)."""
        n = self.norm
        return n.weight.float() if n is not None and n.weight is not None else torch.ones(d)

    def center(self, x: Tensor) -> Tensor:
        """What the final norm centres: ``x - mean(x)`` for LayerNorm, ``x`` for RMSNorm or no norm."""
        return self.norm.center(x) if self.norm is not None else x

    def variance(self, xc: Tensor) -> Tensor:
        """Per-token variance the final norm sees in centred states ``xc (tokens, d_model)``, eps included
        (float64; ones without a norm): ``scale = 1 / sqrt(variance)``."""
        if self.norm is None:
            return torch.ones(xc.shape[0], dtype=torch.float64)
        return xc.double().pow(2).mean(-1) + self.norm.eps

    def __repr__(self) -> str:
        return (f"Readout(norm={self.norm!r}, W_U={tuple(self.W_U.shape)}, bias={self.b_U is not None}, "
                f"softcap={self.softcap}, transform={self.head.transform_W is not None})")


def block_pullback(layer: Layer, u: Tensor, r: dict[str, Tensor]) -> tuple[dict[str, Tensor], Tensor, Tensor]:
    """A read-out direction ``u (row, d_model)`` on a block's output carried back along its residual path, given the
    block's traced intermediates ``r`` (``resid_pre``, ``attn_write``, ``resid_mid``, ``mlp_write``; with
    cross-attention ``cross_write``, ``resid_cross``; each ``(row, d_model)``): ``(directions, u_in, c)`` with
    ``resid_post . u == resid_pre . u_in + sum_w write_w . directions[w] + c`` (``w`` in ``attn``, ``cross``,
    ``mlp``; ``c (row,)``: the norms' biases read along their directions).

    Pre-LN, sandwich and parallel blocks add their writes to the stream: every direction is ``u``. A Post-LN
    block (BART, Marian, BERT) normalises the whole stream after each sub-layer; each norm is affine given its
    traced scale, so the direction is pulled back through the norms that follow each write (``Norm.pullback``),
    and a logit stays an exact sum over the writes (each read along its own direction)."""
    dt = u.dtype
    c = u.new_zeros(u.shape[0])
    if layer.placement != "post":
        dirs = {"attn": u, "mlp": u} | ({"cross": u} if layer.cross is not None else {})
        return dirs, u, c
    before_mlp = r["resid_cross"] if layer.cross is not None else r["resid_mid"]
    steps = [("mlp", layer.ln_mlp, before_mlp)]
    if layer.cross is not None:
        steps.append(("cross", layer.ln_cross, r["resid_mid"]))
    steps.append(("attn", layer.ln_attn, r["resid_pre"]))
    dirs = {}
    for which, norm, stream in steps:  # the norm after sub-layer ``which`` reads ``stream + write``
        norm = norm.to(dt)
        if norm.bias is not None:
            c = c + u @ norm.bias
        u = norm.pullback(u, norm.scale((stream + r[f"{which}_write"]).to(dt)))
        dirs[which] = u
    return dirs, u, c


def traced_pullbacks(A, tr, rows: Tensor, u: Tensor) -> tuple[list[dict[str, Tensor]] | None, Tensor, Tensor]:
    """Read-out directions ``u (k, d_model)`` on the last residual state at positions ``rows (k,)`` carried back
    through every block of the trace ``tr`` (:func:`block_pullback`, each Post-LN norm affine given its traced
    scale): per layer the direction each write (``attn``, ``cross``, ``mlp``) is read along ``(k, d_model)``, the
    direction of the embedding, and the norms' biases read along theirs ``(k,)``. Without a Post-LN block every
    write is read along ``u`` itself: ``(None, u, 0)``."""
    if all(layer.placement != "post" for layer in A.layers):
        return None, u, u.new_zeros(u.shape[0])
    dirs: list[dict[str, Tensor]] = [{}] * A.n_layers
    d, const = u, u.new_zeros(u.shape[0])
    for l in reversed(range(A.n_layers)):
        r = {"resid_pre": tr.resid_pre[l], "resid_mid": tr.resid_mid[l], "attn_write": tr.attn_write[l],
             "mlp_write": tr.mlp_write[l]}
        if tr.cross_write is not None:
            r |= {"cross_write": tr.cross_write[l], "resid_cross": tr.mlp_in[l]}
        dirs[l], d, c = block_pullback(A.layers[l], d, {k: v[rows].to(u.dtype) for k, v in r.items()})
        const = const + c
    return dirs, d, const
