"""ALTI (Ferrando et al., EMNLP 2022), value zeroing (Mohebbi et al., EACL 2023), and rollout.

Both read a layer as a map from the residual stream entering it (sources ``x_j``) to a state at each
position ``i`` and give a contribution matrix ``C[i, j]`` (rows non-negative, summing to one); rollout
composes the layers: ``M^0 = C^0``, ``M^l = C^l M^{l-1}``.

- ALTI (each contribution computed as a sum of element-wise terms that do not cancel, see
  :func:`factored_proximity`, so float32 suffices): the state after attention + residual (Post-LN: + its
  LayerNorm) decomposed exactly by :mod:`lenscope.models.weights.algebra` (``"sources"`` convention):
  ``y_i = sum_j T~_i(j) + rest_i``;
  ``c_ij = max(0, ||y_i||_1 - ||y_i - T~_i(j)||_1)``, rows normalised. The MLP does not mix tokens.
- Value zeroing: the whole block recomputed with source ``j``'s value vectors zeroed in every head;
  ``c_ij = 1 - cos(out_i, out_i^{-j})`` of the block's output, clipped at 0, rows normalised.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import InputError, NotApplicableError
from ..models.runtime.stop import checkpoint
from ..models.runtime.trace import Trace, prefix_trace
from ..models.weights.algebra import (
    Factored,
    activation_scale,
    add_residual,
    attention_input_parts,
    bias_through_attention,
    f32,
    layer_input,
    norm_step,
    relative_gap,
    resid_mid_parts,
    value_writes,
    write_step,
)
from ..models.weights.anatomy import Anatomy, astype
from ..results import Result
from ..viz.notebook import ReportView

CHUNK_BYTES = 128 * 2**20


def row_chunks(n: int, per_row_bytes: int, budget: int = CHUNK_BYTES):
    step = max(1, budget // max(per_row_bytes, 1))
    for a in range(0, n, step):
        yield torch.arange(a, min(n, a + step))


def normalize_rows(c: Tensor) -> tuple[Tensor, int]:
    """Rows divided by their sum, and the number of degenerate rows.

    A row in which no source gets a positive contribution (every part moves the state away from itself in
    L1, which random weights can produce, and where the reference implementation divides by zero) is set to
    the identity row: position ``i`` keeps itself. Rollout then stays a product of stochastic matrices; the
    count is reported so nothing is hidden."""
    s = c.sum(-1, keepdim=True)
    bad = s[:, 0] <= 0
    out = c / s.clamp_min(1e-30)
    if bool(bad.any()):
        eye = torch.eye(c.shape[0], c.shape[1], dtype=c.dtype, device=c.device)
        out = torch.where(bad[:, None], eye, out)
    return out, int(bad.sum())


def rollout(C: Tensor) -> Tensor:
    """``(layer, pos, src)`` contribution matrices -> rollout ``M^l = C^l ... C^0`` (same shape and dtype; the
    products are taken in float64, one layer at a time, so long inputs need no float64 copy of the stack)."""
    out = torch.empty_like(C)
    M = None
    for l in range(C.shape[0]):
        M = C[l].double() if M is None else C[l].double() @ M
        out[l] = M
    return out


_rollout = rollout  # mixing_matrices' keyword of the same name hides it there


def carry_back(contributions: Tensor, deltas: Tensor) -> Tensor:
    """Rows carried back to the input tokens through the rollout of the layers below them, without forming it.

    ``contributions (layer, pos, src)``: each layer's ``C^l``; ``deltas (layer, row, src)``: rows that live
    after layer ``l``'s mixing. Returns ``(layer, row, src)`` float64 with ``out[0] = deltas[0]`` and
    ``out[l] = deltas[l] @ M^{l-1}`` (``M^{l-1} = C^{l-1} ... C^0``, :func:`rollout`). The rows are applied to
    ``C^{l-1}``, ..., ``C^0`` from the top down, every layer's rows stacked: ``O(L^2 rows n^2)`` instead of
    the ``O(L n^3)`` of the rollout, and no ``(layer, pos, src)`` float64 stack."""
    L, n, _ = contributions.shape
    if deltas.shape[0] != L or deltas.shape[-1] != n:
        raise ValueError(f"deltas {tuple(deltas.shape)} do not match contributions {tuple(contributions.shape)}")
    out = deltas.to(torch.float64, copy=True)
    for k in range(L - 2, -1, -1):  # rows of layers k+1.. have still to pass through C^k, ..., C^0
        live = out[k + 1:]
        out[k + 1:] = (live.reshape(-1, n) @ contributions[k].double()).reshape(live.shape)
    return out


def proximity(parts: Tensor, y: Tensor) -> Tensor:
    """How much of ``y (..., d)`` each of its parts ``(..., k, d)`` makes up: ``max(0, ||y||_1 - ||y - part||_1)``,
    (..., k) (ALTI's contribution before normalising; information-flow routes' proximity)."""
    return (y.abs().sum(-1, keepdim=True) - (y.unsqueeze(-2) - parts).abs_().sum(-1)).clamp_min(0)


BLOCK_BYTES = 2 * 2**20  # one (src, row, d_model) block of the contribution kernel: stays in a core's cache
ROW_BLOCK = 64
DEVICE_BLOCK_BYTES, DEVICE_ROW_BLOCK = 256 * 2**20, 1024  # an accelerator: fewer, larger kernels


def factored_proximity(dec: Factored, y: Tensor, causal: bool = False) -> tuple[Tensor, Tensor]:
    """:func:`proximity` of every part of a :class:`Factored` decomposition of ``y (row, d)`` (ALTI's
    contributions before normalising), ``(row, src)``, without building the ``(row, src, d)`` parts; and the
    decomposition's total ``(row, d)`` (``dec.total()``, summed in the same pass, for the completeness check).

    Element-wise, with ``a = |y_ik|``, ``s = sign(y_ik)`` (+1 at zero) and ``u = s * parts_ijk``,
    ``|y_ik| - |y_ik - parts_ijk| = min(u, 2a - u)`` exactly, so ``c_ij = sum_k min(u, 2a - u)`` =
    ``sum_k u - 2 sum_k relu(u - a)`` has no difference of two large norms: each term is at most ``|u|``, and
    float32 is enough (the difference of the L1 norms needed float64). The parts are formed block by block
    (sources x rows, a few MB: they stay in cache) as one batched matmul over the heads. ``causal``: row ``r``
    reads no source after ``rows[r]`` (attention weights 0 there), so blocks of sources after a block's last row
    are skipped (their entries stay 0)."""
    alpha, V = dec.alpha, dec.V
    R, n = alpha.shape[1], alpha.shape[2]
    d = V.shape[-1]
    dt = V.dtype
    sign = torch.where(y >= 0, 1.0, -1.0).to(dt)
    a = y.abs().to(dt)
    su = sign * dec.scale[:, None].to(dt)  # (row, d): the sign and the row's norm scale
    sdiag = sign * dec.diag.to(dt)
    Vt = V.transpose(0, 1)  # (src, head, d)
    rows = dec.rows.to(alpha.device)
    first = int(rows[0]) if R else 0
    contiguous = R > 0 and bool((rows == torch.arange(first, first + R, device=rows.device)).all())
    out = alpha.new_zeros(R, n)
    mixed = V.new_zeros(R, d)
    cpu = V.device.type == "cpu"
    row_block, budget = (ROW_BLOCK, BLOCK_BYTES) if cpu else (DEVICE_ROW_BLOCK, DEVICE_BLOCK_BYTES)
    src_block = max(1, budget // (row_block * d * V.element_size()))
    for r0 in range(0, R, row_block):
        r1 = min(R, r0 + row_block)
        top = min(n, int(rows[r0:r1].max()) + 1) if causal else n
        rr = rows[r0:r1]
        al = alpha[:, r0:r1, :top].permute(2, 1, 0).contiguous()  # (src, row, head): one matmul per source
        for s0 in range(0, top, src_block):
            s1 = min(top, s0 + src_block)
            u = torch.bmm(al[s0:s1], Vt[s0:s1])  # (src, row, d): the attention parts, unscaled
            mixed[r0:r1] += u.sum(0)
            u.mul_(su[r0:r1])
            if contiguous:  # the rows whose own position lies in this block of sources
                lo, hi = max(r0, s0 - first), min(r1, s1 - first)
                here = torch.arange(lo, hi, device=u.device) if lo < hi else None
            else:
                here = ((rr >= s0) & (rr < s1)).nonzero()[:, 0] + r0
            if here is not None and here.numel():
                u[rows[here] - s0, here - r0] += sdiag[here]
            c = u.sum(-1) - 2 * u.sub_(a[r0:r1]).clamp_min_(0).sum(-1)
            out[r0:r1, s0:s1] = c.T
    total = mixed * dec.scale[:, None].to(dt) + dec.diag.to(dt) + dec.rest.to(dt)
    return out.clamp_min_(0), total


@torch.no_grad()
def alti_layer(A: Anatomy, tr: Trace, l: int, dtype: torch.dtype = torch.float32) -> tuple[Tensor, float, int]:
    """ALTI contributions of layer ``l``: ``(pos, src)`` rows summing to one, the relative completeness
    error of its decomposition (the parts plus remainder against the real residual after attention), and
    the number of degenerate rows (see :func:`normalize_rows`).

    The decomposition stays :class:`Factored` (attention weights times per-source vectors) and
    :func:`factored_proximity` reads it block by block, in ``dtype`` (float32: no cancellation to fear)."""
    layer = A.layers[l]
    z, _ = attention_input_parts(layer, tr, l, "sources", dtype)
    writes = value_writes(layer.attn, z, True)
    n, d = z.shape
    real = f32(tr.resid_mid[l], dtype)
    rms = activation_scale(real)
    C = real.new_zeros(n, n)
    err = 0.0
    for rows in row_chunks(n, n * layer.attn.n_heads * real.element_size() * 2):
        b = int(rows[-1]) + 1 if A.causal else n  # causal: these rows read no source at or after b
        sub = prefix_trace(tr, b) if A.causal else tr
        dec = resid_mid_parts(A, sub, l, rows, "sources", writes=writes[:, :b], dtype=dtype, factored=True)
        y = real[rows]
        C[rows, :b], total = factored_proximity(dec, y, causal=A.causal)
        err = max(err, relative_gap(total, y, rms))
    if A.causal:
        C = C.tril()
    C, bad = normalize_rows(C)
    return C.float(), err, bad


@torch.no_grad()
def cross_alti_layer(A: Anatomy, tr: Trace, l: int, dtype: torch.dtype = torch.float32) -> tuple[Tensor, float, int]:
    """ALTI contributions of an encoder-decoder block ``l``'s cross-attention sub-layer (ALTI+, Ferrando et al.
    2022): the state after it (Pre-LN: the stream plus the cross-attention's write; Post-LN: its LayerNorm of
    that) at every target position ``i`` as a sum over the ``src`` memory vectors (the encoder's output, through
    the cross-attention) and the block's own stream at ``i`` (the residual): ``(pos, src + pos)`` rows summing to
    one, column ``src + i`` holding row ``i``'s residual; the relative completeness error and the degenerate
    rows, as :func:`alti_layer`. The residual is one more source of a :class:`Factored` decomposition whose
    memory sources are attended and whose decoder sources are not, so :func:`factored_proximity` reads it."""
    layer = A.layers[l]
    memory = f32(tr.memory, dtype)
    S, T, H = memory.shape[0], len(tr.tokens), layer.cross.n_heads
    probs = f32(tr.cross_pattern[l], dtype)  # (head, pos, src)
    writes = value_writes(layer.cross, memory, True)  # (head, src, d_model)
    alpha = torch.cat([probs, probs.new_zeros(H, T, T)], -1)
    V = torch.cat([writes, writes.new_zeros(H, T, writes.shape[-1])], 1)
    rest = bias_through_attention(layer.cross, None, False, dtype).expand(T, -1).clone()
    rows = torch.arange(T) + S
    dec = Factored(alpha, alpha.new_ones(T), V, rest.new_zeros(rest.shape), rest, rows)
    dec = write_step(dec, layer, "cross", f32(tr.cross_out[l], dtype))
    stream = f32(tr.resid_mid[l], dtype)  # what the cross-attention sub-layer adds to
    dec = add_residual(dec, torch.cat([stream.new_zeros(S, stream.shape[-1]), stream]))
    real = stream + f32(tr.cross_write[l], dtype)
    if layer.placement == "post":
        dec = norm_step(dec, layer.ln_cross, real)
        real = f32(tr.mlp_in[l], dtype)
    C, total = factored_proximity(dec, real)
    err = relative_gap(total, real, activation_scale(real))
    C, bad = normalize_rows(C)
    return C.float(), err, bad


@torch.no_grad()
def encoder_decoder_mixing(A: Anatomy, tr: Trace, dtype: torch.dtype = torch.float32,
                           method: str = "alti") -> EncoderDecoderMixing:
    """ALTI+ of an encoder-decoder model (Ferrando et al. 2022) from its trace: the encoder's rollout ``memory
    (src, src)`` (each memory vector over the source tokens) and each decoder layer's contributions ``(layer,
    pos, src + pos)``: over the memory (through the cross-attention) and over the layer's input states (its
    self-attention's ALTI, weighted by the share the cross-attention sub-layer's residual keeps); every row sums
    to one. Also the largest completeness error and the degenerate rows of every decomposition.

    ``method="value-zeroing"``: the same structure by value zeroing (Mohebbi et al. 2023, who define it for one
    stack; lenscope's extension): the encoder's value-zeroing rollout, and each decoder layer's row over the memory
    and the layer's inputs from :func:`value_zeroing_decoder_layer`."""
    if method not in ("alti", "value-zeroing"):
        raise ValueError(f"unknown mixing method {method!r}")
    enc = mixing_matrices(A.encoder, tr.encoder, method, rollout=True)
    S, T = len(tr.encoder.tokens), len(tr.tokens)
    C = torch.empty(A.n_layers, T, S + T)
    err, bad = enc.completeness_error, enc.degenerate_rows
    for l in range(A.n_layers):
        checkpoint()
        if method == "value-zeroing":
            C[l], b = value_zeroing_decoder_layer(A, tr, l)
            bad += b
            continue
        own, e1, b1 = alti_layer(A, tr, l, dtype)
        cross, e2, b2 = cross_alti_layer(A, tr, l, dtype)
        keep = cross[torch.arange(T), S + torch.arange(T)]  # the residual's share: the block's own stream
        C[l, :, :S] = cross[:, :S]
        C[l, :, S:] = keep[:, None] * own
        err, bad = max(err, e1, e2), bad + b1 + b2
    return EncoderDecoderMixing(memory=enc.rollout[-1].double(), contributions=C, completeness_error=err,
                                row_sum_error=max(enc.row_sum_error, _row_sum_error(C)), degenerate_rows=bad)


@dataclass
class EncoderDecoderMixing:
    """:func:`encoder_decoder_mixing`'s result: the encoder's rollout ``memory (src, src)``, the decoder layers'
    ``contributions (layer, pos, src + pos)``, and the checks (as :class:`MixingMatrices`)."""

    memory: Tensor
    contributions: Tensor
    completeness_error: float
    row_sum_error: float
    degenerate_rows: int

    @property
    def n_source(self) -> int:
        return self.memory.shape[0]

    def carry_back(self, deltas: Tensor) -> Tensor:
        """Per-layer rows ``deltas (layer, row, src + pos)`` of the decoder carried back to the input tokens
        (:func:`carry_back_encoder_decoder`: the first ``src`` columns live on the memory vectors, the others on
        each layer's input states)."""
        S = self.n_source
        return carry_back_encoder_decoder(self, deltas[..., S:], deltas[..., :S])


def carry_back_encoder_decoder(mix: EncoderDecoderMixing, self_deltas: Tensor, cross_deltas: Tensor) -> Tensor:
    """Per-layer rows of a decoder carried back to the input tokens (source then target prefix), as
    :func:`carry_back` for an encoder-decoder model: ``self_deltas (layer, row, pos)`` live on each layer's input
    states (carried through the decoder's rollout below it, which itself reads the source through the memory),
    ``cross_deltas (layer, row, src)`` on the memory vectors (carried through the encoder's rollout). Returns
    ``(layer, row, src + pos)`` float64; rows that sum to one keep every row's sum."""
    M, C = mix.memory, mix.contributions.double()
    S, T = M.shape[0], C.shape[1]
    memory = torch.cat([M, M.new_zeros(S, T)], 1)  # (src, src + pos)
    R = torch.cat([M.new_zeros(T, S), torch.eye(T, dtype=M.dtype)], 1)  # before the first layer: the tokens
    out = []
    for l in range(C.shape[0]):
        out.append(self_deltas[l].double() @ R + cross_deltas[l].double() @ memory)
        R = C[l, :, :S] @ memory + C[l, :, S:] @ R
    return torch.stack(out)


@torch.no_grad()
def value_zeroing_layer(A: Anatomy, tr: Trace, l: int) -> tuple[Tensor, int]:
    """Value-zeroing contributions of layer ``l`` (pos, src), rows summing to one, and the number of
    degenerate rows (see :func:`normalize_rows`).

    All zeroed sources of a chunk run through the rest of the block in one batch: the attention output
    without source ``j`` is ``attn_out - T[:, j]`` (the algebra's per-source parts, value bias included)."""
    dt = torch.float64  # 1 - cos of nearly equal vectors cancels badly in float32
    layer = astype(A.layers[l], dt)
    z, _ = attention_input_parts(layer, tr, l, "sources", dt)
    writes = value_writes(layer.attn, z, True)  # (head, src, d)
    probs = f32(tr.pattern[l], dt)  # (head, pos, src)
    x = layer_input(tr, l, dt)
    attn_out = f32(tr.attn_out[l], dt)
    n, d = x.shape
    base = layer.after_attention(x, attn_out)["resid_post"]  # recomputed: same float path as the ablations
    C = x.new_zeros(n, n)
    per_src = n * (3 * layer.mlp.d_mlp + 8 * d) * 8
    for src in row_chunks(n, per_src):
        removed = torch.einsum("hij,hjd->jid", probs[:, :, src], writes[:, src])  # (chunk, pos, d)
        out = layer.after_attention(x[None], attn_out[None] - removed)["resid_post"]
        cos = torch.nn.functional.cosine_similarity(out, base[None], dim=-1)  # (chunk, pos)
        C[:, src] = (1 - cos).clamp_min(0).T
    if A.causal:
        C = C.tril()
    C, bad = normalize_rows(C)
    return C.float(), bad


@torch.no_grad()
def value_zeroing_decoder_layer(A: Anatomy, tr: Trace, l: int) -> tuple[Tensor, int]:
    """Value-zeroing contributions of an encoder-decoder model's decoder layer ``l``: ``(pos, src + pos)``, rows
    summing to one, and the number of degenerate rows. Column ``k < src``: the memory vector ``k`` with its value
    zeroed in the layer's cross-attention (``cross_out`` less that source's per-head part; the block's rest
    recomputed); column ``src + j``: target position ``j`` with its value zeroed in the self-attention (the
    cross-attention then recomputed from the changed stream, as :func:`value_zeroing_layer` recomputes the rest of a
    block). Each score is ``1 - cos`` between the block's output with and without the value, clamped at 0; the
    row normalised over both parts together (one block mixing the memory and the target positions)."""
    dt = torch.float64  # 1 - cos of nearly equal vectors cancels badly in float32
    layer = astype(A.layers[l], dt)
    memory = f32(tr.memory, dt)
    z, _ = attention_input_parts(layer, tr, l, "sources", dt)
    writes, probs = value_writes(layer.attn, z, True), f32(tr.pattern[l], dt)  # (head, pos, d), (head, pos, pos)
    cwrites, cprobs = value_writes(layer.cross, memory, True), f32(tr.cross_pattern[l], dt)  # (h, src, d), (h, p, src)
    x, attn_out = layer_input(tr, l, dt), f32(tr.attn_out[l], dt)
    (n, d), S = x.shape, memory.shape[0]
    base = layer.after_attention(x, attn_out, memory=memory)  # recomputed: the same float path as the ablations
    C = x.new_zeros(n, S + n)
    per_row = n * (3 * layer.mlp.d_mlp + 8 * d) * 8
    for src in row_chunks(S, per_row):
        removed = torch.einsum("hij,hjd->jid", cprobs[:, :, src], cwrites[:, src])  # (chunk, pos, d)
        out = layer.after_attention(x[None], attn_out[None], memory=memory,
                                    cross_out=base["cross_out"][None] - removed)["resid_post"]
        C[:, src] = (1 - torch.nn.functional.cosine_similarity(out, base["resid_post"][None], dim=-1)).clamp_min(0).T
    for j in row_chunks(n, per_row):
        removed = torch.einsum("hij,hjd->jid", probs[:, :, j], writes[:, j])
        out = layer.after_attention(x[None], attn_out[None] - removed, memory=memory)["resid_post"]
        C[:, S + j] = (1 - torch.nn.functional.cosine_similarity(out, base["resid_post"][None], dim=-1)
                       ).clamp_min(0).T
    C[:, S:] = C[:, S:].tril()
    total = C.sum(-1)
    bad = total <= 0  # as normalize_rows: a row with no positive part keeps itself (its own column S + i)
    C = C / total.clamp_min(1e-30)[:, None]
    if bool(bad.any()):
        rows = bad.nonzero()[:, 0]
        C[rows] = 0
        C[rows, S + rows] = 1
    return C.float(), int(bad.sum())


@dataclass(repr=False)
class MixingMatrices(ReportView, Result):
    """Layer-wise token-to-token contributions and their rollout.

    ``contributions (layer, pos, src)``: layer ``l``'s ``C^l``; ``rollout (layer, pos, src)``: ``M^l``
    (how much of position ``i`` after layer ``l`` comes from input token ``j``), or None when it was not
    asked for (``mixing_matrices(..., rollout=False)``; :func:`carry_back` reads ``C`` alone). ``completeness_error``:
    the decomposition's relative error (ALTI), 0 for value zeroing; ``row_sum_error``: the largest
    deviation of a contribution or rollout row sum from one; ``degenerate_rows``: rows where no source had
    a positive contribution, set to the identity row (see :func:`normalize_rows`)."""

    VIEW = "flow"  # its view: drawn by viz/views/flow/flow.js (lenscope.viz.views)

    model: str
    method: str
    tokens: list[str]
    contributions: Tensor
    rollout: Tensor | None
    completeness_error: float
    row_sum_error: float
    degenerate_rows: int = 0

    def to_frame(self):
        import pandas as pd

        L, n, _ = self.contributions.shape
        idx = pd.MultiIndex.from_product([range(L), range(n), range(n)], names=["layer", "pos", "src"])
        cols = {"contribution": self.contributions.reshape(-1).numpy()}
        if self.rollout is not None:
            cols["rollout"] = self.rollout.reshape(-1).numpy()
        return pd.DataFrame(cols, index=idx).reset_index()

    def plot(self, layer: int = -1, which: str = "rollout"):
        from ..viz.explain_plots import plot_matrix

        if which == "rollout" and self.rollout is None:
            raise InputError("these mixing matrices were computed without their rollout; plot which='contributions' "
                             "or compute them with mixing_matrices(..., rollout=True)")
        return plot_matrix(self, layer=layer, which=which)

    def __repr__(self) -> str:
        L, n, _ = self.contributions.shape
        return (f"MixingMatrices({self.method}, layers={L}, pos={n}, completeness_error={self.completeness_error:.1e}, "
                f"row_sum_error={self.row_sum_error:.1e})")


def refuse_encoder_decoder(tr: Trace, what: str) -> None:
    """A method that reads one stack refuses an encoder-decoder model's decoder trace: its cross-attention reads
    the source, which the method would leave out (a silent wrong answer)."""
    if tr.encoder is not None:
        raise NotApplicableError(f"{what} of an encoder-decoder model's decoder would leave out the source its "
                                 "cross-attention reads; ALTI-Logit (explain --method alti-logit --source) carries "
                                 "the source through ALTI+ (docs/encoder-decoder.md)")


def _row_sum_error(*mats: Tensor) -> float:
    err = 0.0
    for m in mats:
        s = m.double().sum(-1)
        err = max(err, float((s - 1).abs().max()))
    return err


@torch.no_grad()
def mixing_matrices(A: Anatomy, tr: Trace, method: str = "alti", *, model_name: str = "", progress=None,
                    rollout: bool = True) -> MixingMatrices:
    """ALTI or value-zeroing contributions of every layer, with their rollout (``rollout=False`` leaves it out,
    ``None``: callers that carry a few rows back use :func:`carry_back` and skip the ``O(L n^3)`` products)."""
    if method not in ("alti", "value-zeroing"):
        raise ValueError(f"unknown mixing method {method!r}")
    refuse_encoder_decoder(tr, f"{method} contributions")
    n = len(tr.tokens)
    C = torch.empty(A.n_layers, n, n)
    err, bad = 0.0, 0
    for l in range(A.n_layers):
        checkpoint()  # a layer is a chunk: a caller that no longer waits stops the loop here
        if method == "alti":
            C[l], e, b = alti_layer(A, tr, l)
            err = max(err, e)
        else:
            C[l], b = value_zeroing_layer(A, tr, l)
        bad += b
        if progress is not None:
            progress(l)
    M = _rollout(C) if rollout else None
    return MixingMatrices(model=model_name, method=method, tokens=list(tr.tokens), contributions=C.cpu(),
                          rollout=None if M is None else M.cpu(), completeness_error=err,
                          row_sum_error=_row_sum_error(C) if M is None else _row_sum_error(C, M),
                          degenerate_rows=bad)
