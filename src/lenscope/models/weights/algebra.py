"""The per-source decomposition: one hidden state written as a sum over source tokens plus a remainder.

    h[i] = sum_j parts[i, j, :] + rest[i, :]        parts: (row, src, d_model)   rest: (row, d_model)

``row`` indexes the query positions being decomposed (``rows``; all positions or a chunk of them, so
memory stays bounded on long inputs). Each sub-layer is a map from one decomposition to the next that
keeps the sum exact, with everything non-linear fixed by the trace:

- attention: linear in the values once the attention weights ``alpha`` are taken from the trace;
  ``T[i, j] = sum_h alpha[h, i, j] * value_j^h W_O^h``;
- a norm: affine given its traced per-token scale ``s_i`` (centring is linear);
- the residual connection: adds ``x_i`` to source ``i``.

Bias conventions differ between the lines of work that use this algebra, so attention takes one:

- ``"sources"`` (Ferrando et al.'s ALTI / ALTI-Logit reference, and Kobayashi et al. 2020's
  ``f(x) = (x W_V + b_V) W_O``): the pre-attention norm's bias and the value bias stay inside the value
  vector of each source, weighted by its attention weight; only the output-projection bias ``b_O`` goes to
  the remainder.
- ``"remainder"`` (Kobayashi et al. 2024): every bias goes to the remainder; source ``j`` carries only
  what is linear in ``x_j`` (for Pre-LN, the pre-attention norm's bias is split off too).
- ``"input"``: the attention's own input ``z_j`` stays whole with ``j`` (Pre-LN's ``attn`` scope), the
  attention's biases ``b_V W_O + b_O`` go to the remainder.

The feed-forward block is split among the sources with integrated gradients (:func:`ig_hidden`).

Attribution (Logit, ALTI-Logit), the ALTI maps, value zeroing, the norm-based mixing maps and the report
all call these functions; none of them re-derives the algebra.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from ..runtime.trace import Trace
from .anatomy import Anatomy, Attention, Layer

Convention = Literal["sources", "remainder", "input"]


@dataclass
class Decomposition:
    """``parts (row, src, d_model)``, ``rest (row, d_model)`` for query positions ``rows (row,)``."""

    parts: Tensor
    rest: Tensor
    rows: Tensor

    def total(self) -> Tensor:
        """The hidden states the decomposition adds up to, (row, d_model)."""
        return self.parts.sum(1) + self.rest

    def completeness_error(self, real: Tensor) -> float:
        """How far the parts plus remainder are from ``real (row, d_model)``: see :func:`relative_gap`."""
        return relative_gap(self.total(), real, activation_scale(real))


def activation_scale(real: Tensor) -> Tensor:
    """The root mean square of the vector norms ``||real_i||`` over positions (the scale errors are relative
    to)."""
    return real.double().pow(2).sum(-1).mean().sqrt().clamp_min(1e-30)


def relative_gap(total: Tensor, real: Tensor, scale: Tensor) -> float:
    """``max_i ||total_i - real_i||_2 / scale``: the completeness error of a decomposition, the worst position
    relative to the activation's RMS vector norm (float32 models land near 1e-7 .. 1e-6)."""
    return float((total.double() - real.double()).norm(dim=-1).max() / scale)


@dataclass
class Factored:
    """A decomposition kept in the form attention + residual produce, without expanding over ``d_model``:

        parts[r, j] = scale[r] * sum_h alpha[h, r, j] * V[h, j]  +  [j = rows[r]] * diag[r]

    ``alpha (head, row, src)``, ``scale (row,)``, ``V (head, src, d)``, ``diag (row, d)``, ``rest (row, d)``.
    Norms (affine given a per-row scale) and fixed linear maps keep this form, so a projection to the MLP's
    hidden units costs ``head * src * d * d_mlp`` instead of ``row * src * d * d_mlp`` (:meth:`project`).
    """

    alpha: Tensor
    scale: Tensor
    V: Tensor
    diag: Tensor
    rest: Tensor
    rows: Tensor

    def dense(self) -> Decomposition:
        parts = torch.einsum("hrs,hsd->rsd", self.alpha, self.V) * self.scale[:, None, None]
        r = torch.arange(len(self.rows), device=parts.device)
        parts[r, self.rows] += self.diag
        return Decomposition(parts, self.rest, self.rows)

    def total(self) -> Tensor:
        """The hidden states the parts add up to, (row, d_model), without expanding over sources."""
        mixed = torch.matmul(self.alpha, self.V).sum(0) if self.alpha.numel() else self.rest.new_zeros(())
        return mixed * self.scale[:, None] + self.diag + self.rest

    def project(self, W: Tensor, b: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """``(parts @ W, rest @ W + b)`` for a weight ``W (d, m)``: (row, src, m) and (row, m)."""
        VW = self.V @ W  # (head, src, m)
        parts = torch.einsum("hrs,hsm->rsm", self.alpha, VW) * self.scale[:, None, None]
        r = torch.arange(len(self.rows), device=parts.device)
        parts[r, self.rows] += self.diag @ W
        rest = self.rest @ W
        return parts, rest + b if b is not None else rest


def take_rows(t: Tensor, rows: Tensor, dim: int = 0) -> Tensor:
    """``t`` at ``rows`` along ``dim``: a view (no copy) when ``rows`` is a run of consecutive positions."""
    n = len(rows)
    if n and int(rows[-1]) - int(rows[0]) == n - 1 and (n < 3 or bool((rows.diff() == 1).all())):
        return t.narrow(dim, int(rows[0]), n)
    return t.index_select(dim, rows.to(t.device))


def f32(t: Tensor | None, dtype: torch.dtype = torch.float32) -> Tensor | None:
    """``t`` in the working dtype (float32 by default; ALTI works in float64, see :mod:`lenscope.mixing.alti`)."""
    return None if t is None else t.to(dtype)


def layer_input(tr: Trace, l: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """The residual stream entering layer ``l`` (pos, d_model): the sources of that layer."""
    return f32(tr.resid_pre[l], dtype)


def attention_input_parts(layer: Layer, tr: Trace, l: int, convention: Convention,
                          dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor | None]:
    """What attention reads from each source (pos, d_model), and the bias part it reads from no source.

    Pre-LN placements read ``z_j = LN1(x_j)``: with ``"sources"`` the whole ``z_j`` stays with ``j``; with
    ``"remainder"`` the norm's bias ``beta`` is split off (``z_j - beta``, returned ``beta``). Post-LN reads
    the residual stream itself.
    """
    if layer.placement == "post":
        return f32(tr.resid_pre[l], dtype), None
    z = f32(tr.attn_in[l], dtype)
    beta = layer.ln_attn.bias
    if convention == "remainder" and beta is not None:
        return z - beta.to(dtype), beta.to(dtype)
    return z, None


def head_values(attn: Attention, z: Tensor, value_bias: bool) -> Tensor:
    """Value vectors (head, src, d_head), key/value heads repeated for their query group."""
    v = torch.einsum("pd,hde->hpe", z, attn.W_V.to(z.dtype))
    if value_bias and attn.b_V is not None:
        v = v + attn.b_V.to(z.dtype)[:, None, :]
    return attn._per_kv(v)


def head_outputs(A: Anatomy, tr: Trace, l: int, rows: Tensor, dtype: torch.dtype = torch.float32,
                 which: str = "attn") -> Tensor:
    """Each head's output at positions ``rows`` from the trace (the engine's ``head`` site, the output
    projection's input): ``z[r, h] = sum_j alpha[h, rows[r], j] v_j^h``, ``(row, head, d_head)``.
    ``which="cross"``: an encoder-decoder block's cross-attention heads (``j`` over the source tokens, the values
    read from the encoder's output, :attr:`Trace.memory`)."""
    layer = A.layers[l]
    if which == "cross":
        attn, z, pattern = layer.cross, f32(tr.memory, dtype), tr.cross_pattern[l]
    else:
        attn, pattern = layer.attn, tr.pattern[l]
        z, _ = attention_input_parts(layer, tr, l, "sources", dtype)
    probs = f32(take_rows(pattern, rows, 1), dtype)  # (head, row, src)
    return torch.einsum("hrs,hse->rhe", probs, head_values(attn, z, True))


HeadBias = Literal["shared", "rest"]


def head_writes(layer: Layer, z: Tensor, bias: HeadBias, norm_input: Tensor | None = None,
                dtype: torch.dtype | None = None, which: str = "attn") -> tuple[Tensor, Tensor | None]:
    """What each head adds to the residual stream, ``(..., pos, head, d_model)``, from its outputs ``z (..., pos,
    head, d_head)``, and what no head writes, ``(..., pos, d_model)`` (None with ``"shared"``): the one head-write
    function (direct logit attribution, the circuits' senders, the app's head view).

    The bias convention: ``"shared"`` gives each head ``b_O / H`` (and, under a post-attention norm, ``1/H`` of the
    norm's bias), so the heads alone sum to what the attention part adds (the circuits' senders); ``"rest"`` keeps
    ``b_O`` (and the norm's bias) in the remainder (direct logit attribution's ``L{l}.attn_bias``). Under a
    post-attention (sandwich) norm the writes go through the norm, affine given its per-token scale: that of
    ``norm_input`` (the traced attention output) when given, else of what the heads and the bias wrote; then times
    the block's ``residual_scale``. ``dtype``: compute in it (default: the weights' own). ``which="cross"``: an
    encoder-decoder block's cross-attention heads (``z``: their outputs; no sandwich norm)."""
    attn = layer.cross if which == "cross" else layer.attn
    H = attn.n_heads
    W_O = attn.W_O if dtype is None else attn.W_O.to(dtype)
    w = torch.einsum("...phe,hed->...phd", z.to(W_O.dtype), W_O)
    b_O = attn.b_O if attn.b_O is None or dtype is None else attn.b_O.to(dtype)
    rest = None
    if bias == "shared":
        if b_O is not None:
            w = w + b_O / H
    else:
        rest = w.new_zeros(w.shape[:-2] + w.shape[-1:]) + (b_O if b_O is not None else 0)
    norm = layer.write_norm(which)
    if norm is not None:
        norm = norm if dtype is None else norm.to(dtype)
        total = w.sum(-2) if rest is None else w.sum(-2) + rest
        scale = norm.scale(total if norm_input is None else norm_input.to(w.dtype))[..., None]
        w = norm.linear(w, scale)
        if rest is None:
            w = w + norm.bias / H if norm.bias is not None else w
        else:
            rest = norm.linear(rest, scale[..., 0])
            rest = rest + norm.bias if norm.bias is not None else rest
    g = layer.residual_scale  # Granite's residual multiplier scales what the block writes (Layer.write)
    if g != 1.0:
        w, rest = w * g, (None if rest is None else rest * g)
    return w, rest


def bias_through_attention(attn: Attention, beta: Tensor | None, value_bias: bool,
                           dtype: torch.dtype = torch.float32, mass: Tensor | None = None) -> Tensor:
    """What attention writes independently of the sources, (d_model,): ``b_O``, plus (when the biases are not
    with the sources) ``sum_h (beta W_V^h + b_V^h) W_O^h``, which is exact because each row of ``alpha`` sums
    to one. With attention sinks the rows sum to less: ``mass (head, row)``, each row's sum of the traced weights,
    scales each head's bias term, and the result is ``(row, d_model)``."""
    W_O = attn.W_O.to(dtype)
    out = attn.b_O.to(dtype).clone() if attn.b_O is not None else W_O.new_zeros(W_O.shape[-1])
    vb = None
    if beta is not None:
        vb = attn._per_kv(torch.einsum("d,hde->he", beta.to(dtype), attn.W_V.to(dtype)))
    if value_bias and attn.b_V is not None:
        b = attn._per_kv(attn.b_V.to(dtype))
        vb = b if vb is None else vb + b
    if mass is not None:
        out = out.expand(mass.shape[1], -1).clone()
        return out if vb is None else out + torch.einsum("hr,he,hed->rd", mass.to(dtype), vb, W_O)
    if vb is not None:
        out = out + torch.einsum("he,hed->d", vb, W_O)
    return out


def value_writes(attn: Attention, z: Tensor, value_bias: bool = True) -> Tensor:
    """What each head would write from each source at full attention, ``v_j^h W_O^h``: (head, src, d_model)."""
    return torch.einsum("hse,hed->hsd", head_values(attn, z, value_bias), attn.W_O.to(z.dtype))


def projected_value_writes(attn: Attention, z: Tensor, direction: Tensor, value_bias: bool = True) -> Tensor:
    """``value_writes(...) . direction[r]`` without expanding over ``d_model``: (row, head, src).

    ``direction (row, d_model)`` is a read-out direction per query row (already pulled back through the
    norms that follow). The direction is pulled back through ``W_O^h`` and ``W_V^h`` first (key/value heads
    read by their query group, no repeated weights), so the cost is O(row * head * d_head * d_model + src *
    d_model * head).
    """
    dt = direction.dtype
    H, K, e = attn.n_heads, attn.n_kv_heads, attn.d_head
    r, d = direction.shape
    w = torch.matmul(attn.W_O.to(dt), direction.T)  # (head, d_head, row)
    w = w.permute(2, 0, 1).reshape(r, K, H // K, e)  # query heads grouped by the key/value head they read
    wv = torch.einsum("kde,rkge->rkgd", attn.W_V.to(dt), w).reshape(r, H, d)
    out = torch.matmul(wv, z.T)  # (row, head, src)
    if value_bias and attn.b_V is not None:
        out = out + torch.einsum("ke,rkge->rkg", attn.b_V.to(dt), w).reshape(r, H)[..., None]
    return out


def attention_parts(A: Anatomy, tr: Trace, l: int, rows: Tensor, convention: Convention = "sources",
                    *, writes: Tensor | None = None, dtype: torch.dtype = torch.float32,
                    factored: bool = False) -> Decomposition | Factored:
    """The attention sub-layer's output ``attn_out`` (with ``b_O``, before any sandwich norm) at ``rows``,
    as a sum over the layer's source tokens: parts (row, src, d_model).

    ``writes`` (head, src, d_model) may be passed when already computed for this layer and convention.
    """
    layer = A.layers[l]
    z, beta = attention_input_parts(layer, tr, l, convention, dtype)
    vb = convention == "sources"
    if writes is None:
        writes = value_writes(layer.attn, z, vb)
    probs = f32(take_rows(tr.pattern[l], rows, 1), dtype)  # (head, row, src)
    if layer.attn.sinks is not None:  # the weights over the tokens sum to less than one: per row and head
        rest = bias_through_attention(layer.attn, beta, not vb, dtype, mass=probs.sum(-1))
    else:
        rest = bias_through_attention(layer.attn, beta, not vb, dtype).expand(len(rows), -1).clone()
    if factored:
        return Factored(probs, probs.new_ones(len(rows)), writes, rest.new_zeros(rest.shape), rest, rows)
    parts = torch.einsum("hrs,hsd->rsd", probs, writes)
    return Decomposition(parts, rest, rows)


def norm_step(dec, norm, norm_input: Tensor):
    """Carry a decomposition (dense or :class:`Factored`) through a norm, affine given the per-token scale of
    its real input ``norm_input (row, d_model)``: parts are centred and scaled; the bias joins the remainder."""
    if norm is None:
        return dec
    dt = dec.rest.dtype
    norm = norm.to(dt)
    s = norm.scale(norm_input.to(dt)).to(dt)
    rest = norm.linear(dec.rest, s)
    if norm.bias is not None:
        rest = rest + norm.bias
    if isinstance(dec, Factored):
        ones = s.new_ones(())
        return Factored(dec.alpha, dec.scale * s, norm.linear(dec.V, ones.expand(dec.V.shape[:2])),
                        norm.linear(dec.diag, s), rest, dec.rows)
    parts = norm.linear(dec.parts, s[:, None].expand(dec.parts.shape[:2]))
    return Decomposition(parts, rest, dec.rows)


def add_residual(dec, x: Tensor, inplace: bool = False):
    """The residual connection: source ``i`` also carries ``x_i`` itself. ``x (pos, d_model)`` is the full
    residual stream; position ``rows[r]`` of it joins ``parts[r, rows[r]]`` (in ``dec``'s own tensor when
    ``inplace``)."""
    if isinstance(dec, Factored):
        return Factored(dec.alpha, dec.scale, dec.V, dec.diag + x[dec.rows].to(dec.diag.dtype), dec.rest, dec.rows)
    parts = dec.parts if inplace else dec.parts.clone()
    r = torch.arange(len(dec.rows), device=parts.device)
    parts[r, dec.rows] += x[dec.rows].to(parts.dtype)
    return Decomposition(parts, dec.rest, dec.rows)


def scale_step(dec, c: float):
    """A decomposition (dense or :class:`Factored`) times a constant ``c``: parts and remainder scaled."""
    if c == 1.0:
        return dec
    if isinstance(dec, Factored):
        return Factored(dec.alpha, dec.scale * c, dec.V, dec.diag * c, dec.rest * c, dec.rows)
    return Decomposition(dec.parts * c, dec.rest * c, dec.rows)


def write_step(dec, layer: Layer, which: str, sub_out: Tensor):
    """Carry a decomposition of sub-layer ``which``'s output (``"attn"``, ``"cross"`` or ``"mlp"``) to what it adds
    to the residual stream (:meth:`~lenscope.models.weights.anatomy.Layer.write`): through its sandwich norm, affine
    given the
    per-token scale of its real output ``sub_out (row, d_model)``, then times the block's ``residual_scale``."""
    norm = layer.write_norm(which)
    if norm is not None:
        dec = norm_step(dec, norm, sub_out)
    return scale_step(dec, layer.residual_scale)


def write_pullback(layer: Layer, which: str, u: Tensor, sub_out: Tensor) -> tuple[Tensor, Tensor]:
    """A read-out direction ``u (row, d_model)`` on sub-layer ``which``'s write carried back to its output (the
    transpose of :func:`write_step`): ``(w, c)`` with ``write . u == out . w + c`` for the real output ``sub_out
    (row, d_model)`` (``c (row,)``: the sandwich norm's bias read along ``u``)."""
    u = u * layer.residual_scale if layer.residual_scale != 1.0 else u
    norm = layer.write_norm(which)
    c = u.new_zeros(u.shape[0])
    if norm is None:
        return u, c
    if norm.bias is not None:
        c = c + u @ norm.bias.to(u.dtype)
    return norm.pullback(u, norm.scale(sub_out.to(u.dtype))), c


def attention_write_parts(A: Anatomy, tr: Trace, l: int, rows: Tensor, convention: Convention = "sources",
                          *, writes: Tensor | None = None, dtype: torch.dtype = torch.float32,
                          factored: bool = False) -> Decomposition | Factored:
    """What the attention sub-layer adds to the residual stream (:func:`write_step`: after Gemma's post-attention
    norm, times Granite's residual multiplier)."""
    dec = attention_parts(A, tr, l, rows, convention, writes=writes, dtype=dtype, factored=factored)
    return write_step(dec, A.layers[l], "attn", tr.attn_out[l][rows])


def resid_mid_parts(A: Anatomy, tr: Trace, l: int, rows: Tensor, convention: Convention = "sources",
                    *, writes: Tensor | None = None, dtype: torch.dtype = torch.float32,
                    factored: bool = False) -> Decomposition | Factored:
    """The residual stream after the attention sub-layer (``tr.resid_mid[l]``) as a sum over the layer's
    sources: ATTN (+ sandwich norm) + RES, and for Post-LN blocks the LayerNorm that follows (``factored``:
    kept as a :class:`Factored`, nothing of size (row, src, d_model) built)."""
    layer = A.layers[l]
    dec = attention_write_parts(A, tr, l, rows, convention, writes=writes, dtype=dtype, factored=factored)
    dec = add_residual(dec, layer_input(tr, l, dtype), inplace=True)
    if layer.placement == "post":
        dec = norm_step(dec, layer.ln_attn, tr.site("ln_attn.in", l)[rows])
    return dec


def combine(a: Decomposition, b: Decomposition) -> Decomposition:
    """The sum of two decompositions of the same rows (a residual connection adding a decomposed branch)."""
    return Decomposition(a.parts + b.parts, a.rest + b.rest, a.rows)


# ----------------------------------------------------------------------------------------------
# the feed-forward block: integrated gradients among the sources, in closed form where it exists


def gauss_legendre(n: int, dtype=torch.float64, device=None) -> tuple[Tensor, Tensor]:
    """Nodes and weights of ``n``-point Gauss-Legendre quadrature on [0, 1]."""
    import numpy as np

    x, w = np.polynomial.legendre.leggauss(n)
    return (torch.tensor((x + 1) / 2, dtype=dtype, device=device),
            torch.tensor(w / 2, dtype=dtype, device=device))


def _derivative(act, x: Tensor) -> Tensor:
    """``act'(x)`` element-wise (autograd on a detached copy)."""
    with torch.enable_grad():
        y = x.detach().clone().requires_grad_(True)
        (g,) = torch.autograd.grad(act(y).sum(), y)
    return g


def _clamp_integral(U: Tensor, limit: float) -> Tensor:
    """``int_0^1 clamp(a U, -limit, limit) da`` element-wise."""
    c = (limit / U.abs().clamp_min(1e-300)).clamp(max=1.0)
    return torch.where(U.abs() <= limit, U / 2, c * c * U / 2 + limit * U.sign() * (1 - c))


def _ig_gated_clamped(act, G_parts, G_rest, U_parts, U_rest, *, gate_limit, up_limit, up_offset, nodes,
                      numeric_steps) -> tuple[Tensor, Tensor, float]:
    """:func:`ig_hidden` for ``a = g(G) * phi(U)`` with ``phi(u) = clamp(u, -up_limit, up_limit) + up_offset`` and
    ``g`` clamped at ``gate_limit`` from above (GPT-OSS; ``act`` includes the clamp). ``IG_j = G_j A + U_j B``,
    ``B = int_0^1 g(aG) phi'(aU) da``: ``phi'(aU) = 1`` up to ``c = min(1, up_limit / |U|)`` and 0 after, and ``g(aG)``
    is constant past ``a* = gate_limit / G`` (``G > gate_limit``), so ``B`` is Gauss-Legendre on ``[0, min(c, a*)]``,
    where the integrand is smooth, plus the constant part; ``A = (g(G) phi(U) - U B) / G`` (integration by parts:
    the parts add up to ``g(G) phi(U)`` exactly whatever the quadrature's error)."""
    dt = torch.float64
    G = G_parts.sum(1).to(dt) + G_rest.to(dt)
    U = U_parts.sum(1).to(dt) + U_rest.to(dt)
    shape = (-1,) + (1,) * G.dim()

    def phi(u):
        u = u.clamp(-up_limit, up_limit) if up_limit is not None else u
        return u + up_offset

    if numeric_steps is not None:
        t = (torch.arange(numeric_steps, dtype=dt, device=G.device) + 0.5) / numeric_steps
        w = torch.full_like(t, 1.0 / numeric_steps)
        tG, tU = t.view(shape) * G, t.view(shape) * U
        I1 = torch.einsum("k,k...->...", w, _derivative(act, tG) * phi(tU))
        I2 = torch.einsum("k,k...->...", w, act(tG) * _derivative(phi, tU))
        I1, I2 = I1.to(G_parts.dtype), I2.to(G_parts.dtype)
        return G_parts * I1[:, None] + U_parts * I2[:, None], G_rest * I1 + U_rest * I2, 0.0
    c = torch.ones_like(U) if up_limit is None else (up_limit / U.abs().clamp_min(1e-300)).clamp(max=1.0)
    if gate_limit is not None:
        kink = torch.where(G > gate_limit, gate_limit / G.clamp_min(1e-300), torch.ones_like(G))
        c1 = torch.minimum(c, kink)
        flat = act(torch.full((), float(gate_limit), dtype=dt)) * (c - c1)  # g is constant on [a*, c]
    else:
        c1, flat = c, torch.zeros_like(G)

    def rule(n):
        t, w = gauss_legendre(n, dt, G.device)
        return c1 * torch.einsum("k,k...->...", w, act(t.view(shape) * c1 * G)) + flat

    B = rule(nodes)
    B_half = rule(max(1, nodes // 2))
    err = float((B - B_half).abs().max() / B.abs().max().clamp_min(1e-30))
    total = act(G) * phi(U)
    small = G.abs() < 1e-8
    safe = torch.where(small, torch.ones_like(G), G)
    g0 = float(_derivative(act, torch.zeros(1, dtype=dt))[0])
    # G ~ 0: A = int g'(aG) phi(aU) da ~ g'(0) int phi(aU) da
    mean_phi = up_offset + (_clamp_integral(U, up_limit) if up_limit is not None else U / 2)
    A = torch.where(small, g0 * mean_phi, (total - U * B) / safe)
    A, B = A.to(G_parts.dtype), B.to(G_parts.dtype)
    return G_parts * A[:, None] + U_parts * B[:, None], G_rest * A + U_rest * B, err


def ig_hidden(act, G_parts: Tensor, G_rest: Tensor, U_parts: Tensor | None = None, U_rest: Tensor | None = None, *,
              nodes: int = 32, numeric_steps: int | None = None, gate_limit: float | None = None,
              up_limit: float | None = None, up_offset: float = 0.0) -> tuple[Tensor, Tensor, float]:
    """Split the hidden activation of a feed-forward block among its players with integrated gradients from a
    zero baseline on the straight path (Kobayashi et al. 2024, App. C-D): the ``src`` pre-activation parts
    ``G_parts (row, src, unit)`` plus one remainder player ``G_rest (row, unit)`` (the biases).

    - Element-wise ``a = g(G)``, ``g(0) = 0``: ``IG_j = G_j * g(S) / S`` with ``S = sum of all players``
      (``G_j g'(0)`` where ``S = 0``): exact in closed form.
    - Gated ``a = g(G) * U``: ``IG_j = G_j I1 + U_j I2`` with ``I2 = int_0^1 g(aG) da`` (Gauss-Legendre,
      ``nodes`` points) and ``I1 = int_0^1 a g'(aG) U da = U (g(G) - I2) / G`` (integration by parts, so the
      parts add up to ``g(G) U`` exactly whatever the quadrature's error).

    ``numeric_steps`` replaces the closed forms by a midpoint rule on the same integrals (the paper's numeric
    IG), for comparison. Returns the hidden parts ``(row, src, unit)``, the remainder's ``(row, unit)`` and the
    quadrature's error estimate (largest change of ``I2`` between ``nodes // 2`` and ``nodes`` points, relative
    to the largest ``|I2|``: an upper bound for the coarser rule, so conservative; 0 for the closed forms).

    ``gate_limit``, ``up_limit``, ``up_offset``: GPT-OSS's clamped gated unit ``g(G) * (clamp(U) + offset)``
    (:func:`_ig_gated_clamped`; ``act`` then includes the gate's clamp).
    """
    if U_parts is not None and (gate_limit is not None or up_limit is not None or up_offset):
        return _ig_gated_clamped(act, G_parts, G_rest, U_parts, U_rest, gate_limit=gate_limit, up_limit=up_limit,
                                 up_offset=up_offset, nodes=nodes, numeric_steps=numeric_steps)
    dt = torch.float64
    G = G_parts.sum(1).to(dt) + G_rest.to(dt)
    if numeric_steps is not None:
        t = (torch.arange(numeric_steps, dtype=dt, device=G.device) + 0.5) / numeric_steps
        w = torch.full_like(t, 1.0 / numeric_steps)
    if U_parts is None:
        if numeric_steps is None:
            g0 = float(_derivative(act, torch.zeros(1, dtype=dt))[0])
            tiny = G.abs() < 1e-12
            ratio = torch.where(tiny, torch.full_like(G, g0), act(G) / torch.where(tiny, torch.ones_like(G), G))
        else:
            ratio = torch.einsum("k,k...->...", w, _derivative(act, t.view(-1, *[1] * G.dim()) * G))
        ratio = ratio.to(G_parts.dtype)
        return G_parts * ratio[:, None], G_rest * ratio, 0.0
    U = U_parts.sum(1).to(dt) + U_rest.to(dt)
    shape = (-1,) + (1,) * G.dim()
    if numeric_steps is None:
        t, w = gauss_legendre(nodes, dt, G.device)
        I2 = torch.einsum("k,k...->...", w, act(t.view(shape) * G))
        # error estimate: the rule with half the nodes (its error bounds the full rule's, conservatively)
        t2, w2 = gauss_legendre(max(1, nodes // 2), dt, G.device)
        I2_half = torch.einsum("k,k...->...", w2, act(t2.view(shape) * G))
        err = float((I2 - I2_half).abs().max() / I2.abs().max().clamp_min(1e-30))
        g0 = float(_derivative(act, torch.zeros(1, dtype=dt))[0])
        small = G.abs() < 1e-8
        safe = torch.where(small, torch.ones_like(G), G)
        I1 = U * torch.where(small, torch.full_like(G, g0 / 2), (act(G) - I2) / safe)
    else:
        tt = t.view(shape) * G
        I2 = torch.einsum("k,k...->...", w, act(tt))
        I1 = U * torch.einsum("k,k...->...", w * t, _derivative(act, tt))
        err = 0.0
    I1, I2 = I1.to(G_parts.dtype), I2.to(G_parts.dtype)
    parts = G_parts * I1[:, None] + U_parts * I2[:, None]
    rest = G_rest * I1 + U_rest * I2
    return parts, rest, err


def take(dec, idx: Tensor):
    """The decomposition (dense or :class:`Factored`) of the rows at ``idx`` (indices into its row axis)."""
    if isinstance(dec, Factored):
        return Factored(dec.alpha[:, idx], dec.scale[idx], dec.V, dec.diag[idx], dec.rest[idx], dec.rows[idx])
    return Decomposition(dec.parts[idx], dec.rest[idx], dec.rows[idx])


def moe_ff_step(dec, moe, routing: Tensor, *, nodes: int = 32,
                numeric_steps: int | None = None) -> tuple[Decomposition, float]:
    """:func:`ff_step` through a mixture of experts with the routing fixed: ``routing (row, expert)``, the rows'
    routing weights read from the trace. Each expert carries the rows routed to it (its own integrated gradients,
    the Kobayashi FF decomposition per expert); the parts are summed with the routing weights, so they add up to the
    block's output. Returns the decomposition and the largest quadrature error estimate."""
    dt = dec.rest.dtype
    w = routing.to(device=dec.rest.device, dtype=dt)
    src = dec.alpha.shape[-1] if isinstance(dec, Factored) else dec.parts.shape[1]
    parts = dec.rest.new_zeros(len(dec.rows), src, dec.rest.shape[-1])
    rest = dec.rest.new_zeros(dec.rest.shape)
    err = 0.0
    for e, t in moe._routed(w):
        sub, e_err = ff_step(take(dec, t), moe.expert(e), nodes=nodes, numeric_steps=numeric_steps)
        parts[t] += w[t, e, None, None] * sub.parts
        rest[t] += w[t, e, None] * sub.rest
        err = max(err, e_err)
    return Decomposition(parts, rest, dec.rows), err


def ff_step(dec, mlp, *, nodes: int = 32, numeric_steps: int | None = None,
            routing: Tensor | None = None) -> tuple[Decomposition, float]:
    """Carry a decomposition of the MLP's input (dense or :class:`Factored`, which projects to the hidden
    units without expanding over ``d_model``) through the whole MLP (output with its bias), splitting the
    activation among the sources with :func:`ig_hidden`. Returns it and the quadrature error estimate.
    A mixture of experts needs its ``routing (row, expert)`` from the trace (:func:`moe_ff_step`)."""
    from .moe import MoE

    if isinstance(mlp, MoE):
        if routing is None:
            raise ValueError("a mixture of experts' FF step needs the routing weights of its rows (from the trace)")
        return moe_ff_step(dec, mlp, routing, nodes=nodes, numeric_steps=numeric_steps)
    dt = dec.rest.dtype
    act = mlp.act_fn

    def pre(W, b):
        W = W.to(dt)
        b = b.to(dt) if b is not None else None
        if isinstance(dec, Factored):
            return dec.project(W, b)
        rest = dec.rest @ W
        return dec.parts @ W, rest + b if b is not None else rest

    if mlp.gated:
        Gp, Gr = pre(mlp.W_gate, mlp.b_gate)
        Up, Ur = pre(mlp.W_in, mlp.b_in)
    else:
        Gp, Gr = pre(mlp.W_in, mlp.b_in)
        Up = Ur = None
    hp, hr, err = ig_hidden(act, Gp, Gr, Up, Ur, nodes=nodes, numeric_steps=numeric_steps,
                            gate_limit=getattr(mlp, "gate_limit", None), up_limit=getattr(mlp, "up_limit", None),
                            up_offset=getattr(mlp, "up_offset", 0.0))
    W_out = mlp.W_out.to(dt)
    rest = hr @ W_out
    if mlp.b_out is not None:
        rest = rest + mlp.b_out.to(dt)
    return Decomposition(_sparse_rows_matmul(hp, W_out), rest, dec.rows), err


def _sparse_rows_matmul(x: Tensor, W: Tensor) -> Tensor:
    """``x @ W`` for ``x (row, src, m)`` whose (row, src) vectors are often exactly zero (causal models give
    nothing to later sources): only the non-zero vectors are multiplied."""
    nz = x.abs().amax(-1) > 0
    if nz.float().mean() > 0.75:
        return x @ W
    out = x.new_zeros(*x.shape[:-1], W.shape[-1])
    out[nz] = x[nz] @ W
    return out
