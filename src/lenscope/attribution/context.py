"""Logit and ALTI-Logit explanations (Ferrando et al., ACL 2023) and rollout rows (ALTI, value zeroing).

For a decoder explaining the logit of ``w`` (minus foil ``f``) at position ``t``, with the final norm affine
given its traced scale at ``t``, the residual-stream read-out direction is
``d = final_norm.pullback(U_w - U_f, s_t)``. Layer ``l``'s attention writes ``sum_j T^l_{t,j}(x_j) + rest``
(:mod:`lenscope.models.weights.algebra`), so

    Logit:       Delta^l_j = T^l_{t,j}(x_j) . d                  (per head as well; Eq. 8-9)
    ALTI-Logit:  sum_l Delta^l M^{l-1}   with the ALTI rollout M (M^{-1} = identity; Eq. 10-11)

and ``sum_j Delta^l_j + remainder^l`` equals the layer's attention logit update read from the trace,
``attn_write[l, t] . d``. Every call checks this (``invariant_error``) and refuses beyond 1e-3.

The parts are computed for a batch of read-out positions at once (:func:`logit_parts`,
:func:`attention_logit_rows`, :func:`alti_logit_rows`, :func:`rollout_rows`: one direction per row): ``explain``
passes one row, :func:`lenscope.generate` one per generated token, all from one trace.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import InvariantError
from ..mixing.alti import EncoderDecoderMixing, carry_back, encoder_decoder_mixing, mixing_matrices
from ..models.loading.load import LoadedModel, require_decoder, target_fields
from ..models.runtime.request import Request, position_in
from ..models.runtime.trace import Trace, prefix_trace, trace
from ..models.weights.algebra import (
    attention_input_parts,
    bias_through_attention,
    f32,
    projected_value_writes,
    write_pullback,
)
from ..models.weights.readout import Readout, traced_pullbacks
from .explanation import Explanation
from .methods import ALTI_LOGIT


def _tokens_and_trace(lm: LoadedModel, text, target, foil, position: int, tr: Trace | None,
                      need: str | None = None, source=None):
    req = Request.of(lm, target, foil, distinct=True, need=need)
    tr = tr if tr is not None else trace(lm, text, source=source)
    return req.target, req.foil, tr, position_in(position, len(tr.tokens))


def _readout(lm: LoadedModel, tr: Trace, rows: Tensor, t_ids: Tensor, f_ids: Tensor | None
             ) -> tuple[Tensor, Tensor, Tensor]:
    """For read-out positions ``rows (k,)`` with their target / foil ids ``(k,)``: the residual-stream direction
    read by each logit difference ``(k, d_model)``, the constant terms ``(k,)`` (final-norm bias and unembedding
    bias) and the model's logit differences ``(k,)`` (float64, before any final soft-capping)."""
    readout = Readout.from_anatomy(lm.anatomy)
    u = readout.direction(t_ids, f_ids).T  # (k, d_model): one unembedding difference per row
    final_in = tr.site("ln_final.in")  # None without a final norm (BART, Marian: Post-LN decoders)
    direction = u if final_in is None else readout.pullback(u, readout.scale(f32(final_in[rows])))
    pairs = list(zip(t_ids.tolist(), [None] * len(rows) if f_ids is None else f_ids.tolist()))
    const = torch.tensor([readout.constant(t, f) for t, f in pairs], dtype=torch.float64)
    logit = torch.tensor([readout.traced_logit(tr.logits[int(r)], t, f) for r, (t, f) in zip(rows, pairs)],
                         dtype=torch.float64)
    return direction, const, logit


def attention_logit_rows(A, tr: Trace, l: int, rows: Tensor, directions: Tensor) -> tuple[Tensor, Tensor]:
    """Layer ``l``'s attention write at positions ``rows (k,)``, each read along its own residual-stream direction
    ``directions (k, d_model)``, per head and source (``"sources"`` bias convention): ``(k, head, src)`` scores
    and the remainders ``(k,)``, with ``scores[r].sum() + remainder[r] == attn_write[l, rows[r]] . directions[r]``.

    The directions are pulled back through the write (a sandwich norm, a residual multiplier:
    :func:`~lenscope.models.weights.algebra.write_pullback`) and then through ``W_O`` / ``W_V``
    (:func:`~lenscope.models.weights.algebra.projected_value_writes`), so nothing of size (src, d_model) is built; one
    call serves every generated token of a text (``k`` rows) as well as one prediction (``k = 1``)."""
    layer = A.layers[l]
    z, beta = attention_input_parts(layer, tr, l, "sources")
    alpha = f32(tr.pattern[l][:, rows]).transpose(0, 1)  # (k, head, src)
    return value_logit_rows(layer, "attn", z, beta, alpha, f32(tr.attn_out[l][rows]), directions.float())


def value_logit_rows(layer, which: str, z: Tensor, beta: Tensor | None, alpha: Tensor, out: Tensor,
                     directions: Tensor) -> tuple[Tensor, Tensor]:
    """One attention sub-layer's write (``which``: ``"attn"``, or an encoder-decoder block's ``"cross"``) read
    along ``directions (k, d_model)``, per head and source (``"sources"`` bias convention): ``(k, head, src)``
    scores and remainders ``(k,)`` adding up to ``write . directions[r]``. ``z (src, d_model)``: what the values
    read (the self-attention's input, or the encoder's output for cross-attention), ``beta``: a norm bias read
    from no source, ``alpha (k, head, src)``: the traced weights, ``out (k, d_model)``: the sub-layer's traced
    output (for a sandwich norm's scale). Computed in ``directions``' dtype."""
    attn = layer.cross if which == "cross" else layer.attn
    dt = directions.dtype
    d_post, const = write_pullback(layer, which, directions, out.to(dt))
    proj = projected_value_writes(attn, z.to(dt), d_post, True)  # (k, head, src)
    rem = const + d_post @ bias_through_attention(attn, beta, False, dt)
    return alpha.to(dt) * proj, rem


def logit_parts(lm: LoadedModel, tr: Trace, rows: Tensor, t_ids: Tensor, f_ids: Tensor | None) -> dict:
    """The logit parts of the predictions at positions ``rows (k,)``: head scores ``(k, layer, head, src)``,
    remainders, attention and MLP updates ``(k, layer)``, and per row the embedding's direct term, the constant,
    the model's logit difference, the relative invariant error and the completeness error ``(k,)``.

    An encoder-decoder model (a trace with its source): the scores are over the source tokens, then the target
    prefix's (``src`` = both): cross-attention's parts over the source, self-attention's over the prefix, in the
    same heads' rows; the attention updates hold both; each write is read along the direction carried back to it
    through the Post-LN blocks after it (:func:`~lenscope.models.weights.readout.traced_pullbacks`), whose norms' biases
    join the constant."""
    A = lm.anatomy
    direction, const, logit = _readout(lm, tr, rows, t_ids, f_ids)
    layer_dirs, embed_dir, norm_const = traced_pullbacks(A, tr, rows, direction)
    const = const + norm_const.double()

    def along(l: int, which: str) -> Tensor:
        return direction if layer_dirs is None else layer_dirs[l][which]

    heads, rems = [], []
    for l in range(A.n_layers):
        h, r = attention_logit_rows(A, tr, l, rows, along(l, "attn"))
        if tr.cross_write is not None:  # the source's parts first
            hc, rc = value_logit_rows(A.layers[l], "cross", f32(tr.memory), None,
                                      f32(tr.cross_pattern[l][:, rows]).transpose(0, 1),
                                      f32(tr.cross_out[l][rows]), along(l, "cross"))
            h, r = torch.cat([hc, h], -1), r + rc
        heads.append(h)
        rems.append(r)
    head_scores = torch.stack(heads, 1)  # (k, layer, head, src)
    rem = torch.stack(rems, 1)  # (k, layer)

    def update(write: Tensor, which: str) -> Tensor:  # (k, layer): each layer's write read along its direction
        if layer_dirs is None:
            return torch.einsum("lkd,kd->kl", f32(write[:, rows]), direction)
        return torch.stack([(f32(write[l][rows]) * along(l, which)).sum(-1) for l in range(A.n_layers)], 1)

    attn_update = update(tr.attn_write, "attn")
    if tr.cross_write is not None:
        attn_update = attn_update + update(tr.cross_write, "cross")
    mlp_update = update(tr.mlp_write, "mlp")
    embed = (f32(tr.embed[rows]) * embed_dir).sum(-1).double()
    layer_scores = head_scores.sum(2)
    gap = (layer_scores.double().sum(-1) + rem.double() - attn_update.double()).abs()
    scale = (attn_update.double().abs() + layer_scores.double().abs().sum(-1) + rem.double().abs()).amax(-1)
    inv = gap.amax(-1) / scale.clamp_min(1e-12)
    total = embed + const + attn_update.double().sum(-1) + mlp_update.double().sum(-1)
    return dict(head_scores=head_scores, remainder=rem, attention_update=attn_update, mlp_update=mlp_update,
                embed=embed, const=const, logit=logit, invariant_error=inv, completeness_error=(total - logit).abs())


def _one(t_id: int, f_id: int | None) -> tuple[Tensor, Tensor | None]:
    """One prediction's target and foil as the ``(1,)`` id tensors of the row functions."""
    return torch.tensor([t_id]), None if f_id is None else torch.tensor([f_id])


def _row(parts: dict, r: int = 0) -> dict:
    """Row ``r`` of :func:`logit_parts` (numbers as Python floats): one prediction's parts."""
    return {k: (float(v[r]) if v.dim() == 1 else v[r]) for k, v in parts.items()}


def tolerance(lm: LoadedModel) -> float:
    """The largest invariant / completeness error a method accepts: :data:`lenscope.models.runtime.verify.TOLERANCE` for
    float32 models, more for bfloat16 / float16 ones (their own rounding; see
    ``lenscope.models.runtime.verify.tolerances``)."""
    from ..models.runtime.verify import completeness_tolerance

    return completeness_tolerance(lm)


def check_rows(method: str, inv: Tensor, lm: LoadedModel, where: list[str]) -> None:
    """Refuse many rows' results (a method table's ``rows``) whose invariant errors ``inv (k,)`` exceed the
    method's tolerance, naming the first (``where[i]``: e.g. ``"the step at position 7"``)."""
    tol = tolerance(lm)
    bad = (~(inv <= tol)).nonzero()[:, 0].tolist()
    if bad:
        i = bad[0]
        raise InvariantError(f"{method}: {where[i]} is off by {float(inv[i]):.2e} (relative, limit {tol:g}); run "
                             f"`lenscope verify --model {lm.name}`")


def _refuse(inv: float, method: str, lm: LoadedModel) -> None:
    tol = tolerance(lm)
    if not inv <= tol:
        raise InvariantError(
            f"{method}: the per-source parts miss the model's attention logit updates by {inv:.2e} (relative, "
            f"limit {tol:g}); lenscope's reading of {lm.name} does not match the model, run "
            "`lenscope verify` on it")


def _logit_request(lm: LoadedModel, method: str, title: str, text, target, foil, position: int, tr: Trace | None,
                   source=None):
    """What both logit explanations start with: the checks, the trace, and the per-layer logit parts (refused
    when they do not add up). Returns ``(target_id, foil_id, trace, position, parts)``. ``source``: an
    encoder-decoder model's source (the Logit explanation reads them)."""
    require_decoder(lm, title, sum_of_blocks=True, encoder_decoder=method == "logit",
                    instead="use --method alti or value-zeroing for a context-mixing explanation")
    t_id, f_id, tr, p = _tokens_and_trace(lm, text, target, foil, position, tr, need=title, source=source)
    parts = _row(logit_parts(lm, tr, torch.tensor([p]), *_one(t_id, f_id)))
    _refuse(parts["invariant_error"], method, lm)
    return t_id, f_id, tr, p, parts


def _explanation(lm, method, tr, p, t_id, f_id, scores, **kw) -> Explanation:
    source = [] if tr.encoder is None else list(tr.encoder.tokens)  # an encoder-decoder model's source tokens
    n = len(source) + len(tr.tokens)
    if scores.shape[-1] < n:  # computed on the causal prefix: later tokens get exactly zero
        pad = scores.new_zeros(*scores.shape[:-1], n - scores.shape[-1])
        scores = torch.cat([scores, pad], -1)
    for k in ("layer_scores", "head_scores"):
        v = kw.get(k)
        if v is not None and v.shape[-1] < n:
            kw[k] = torch.cat([v, v.new_zeros(*v.shape[:-1], n - v.shape[-1])], -1)
    kw = {k: (v.float().cpu() if isinstance(v, Tensor) else v) for k, v in kw.items()}
    return Explanation(
        model=lm.name, method=method, tokens=source + list(tr.tokens), position=len(source) + p,
        **target_fields(lm, t_id, f_id), scores=scores.float().cpu(), n_source=len(source), **kw)


def _info(parts: dict) -> dict:
    return {"logit": parts["logit"], "embed_update": parts["embed"], "bias_update": parts["const"],
            "completeness_error": parts["completeness_error"]}


@torch.no_grad()
def logit_explanation(lm: LoadedModel, text, target, foil=None, *, position: int = -1,
                      tr: Trace | None = None, source=None) -> Explanation:
    """Logit explanation (Ferrando et al. 2023, Eq. 8-9): how much each context token, through each layer's
    attention (and each head), moved the logit of ``target`` (minus ``foil``) at ``position``.

    ``scores (src,)`` sum the layers; ``layer_scores (layer, src)``; ``head_scores (layer, head, src)``.
    ``source``: an encoder-decoder model's source text (``text``: the target prefix; ``position`` counts its
    tokens): the tokens are the source's then the prefix's (``n_source`` of them the source's), a source token's
    score what it moved the logit through the cross-attention, a prefix token's through the self-attention.
    """
    t_id, f_id, tr, p, parts = _logit_request(lm, "logit", "the logit explanation", text, target, foil, position, tr,
                                              source)
    ls = parts["head_scores"].sum(1)
    return _explanation(lm, "logit", tr, p, t_id, f_id, ls.sum(0), layer_scores=ls, head_scores=parts["head_scores"],
                        attention_update=parts["attention_update"], mlp_update=parts["mlp_update"],
                        remainder=parts["remainder"], invariant_error=parts["invariant_error"], info=_info(parts))


def alti_logit_rows(lm: LoadedModel, parts: dict, mm) -> tuple[Tensor, Tensor]:
    """ALTI-Logit of several predictions from one ALTI computation: the per-layer logit updates of
    :func:`logit_parts` ``(k, layer, src)`` carried back to the input tokens through the rollout of the layers
    below (:func:`~lenscope.mixing.alti.carry_back` on ``mm.contributions``, ``mixing_matrices(...,
    rollout=False)`` is enough). In a causal model a prefix's contributions are the top-left block of the full
    text's, and a prediction's updates are exactly zero after its position, so one ALTI of the whole text serves
    every position. Returns ``carried (k, layer, src)`` float64 and the invariant errors ``(k,)``: the
    logit parts' and how far carrying back moved each layer's sum. An encoder-decoder model's ``mm`` is its
    :func:`~lenscope.mixing.alti.encoder_decoder_mixing` (ALTI+ over the source and the target prefix)."""
    delta = parts["head_scores"].sum(2).double()  # (k, layer, src)
    if isinstance(mm, EncoderDecoderMixing):  # ALTI+: the source's columns carried through the encoder
        carried = mm.carry_back(delta.transpose(0, 1)).transpose(0, 1)
    else:
        carried = carry_back(mm.contributions, delta.transpose(0, 1)).transpose(0, 1)
    gap = (carried.sum(-1) - delta.sum(-1)).abs().amax(-1)
    scale = delta.abs().sum(-1).amax(-1).clamp_min(1e-12)
    inv = torch.maximum(parts["invariant_error"].double(), gap / scale).clamp_min(mm.row_sum_error)
    return carried, inv


def rollout_rows(mm, rows: Tensor) -> tuple[Tensor, Tensor]:
    """Rows ``rows (k,)`` of the ALTI / value-zeroing rollout after every layer, ``(k, layer, src)`` float64, from
    the contributions alone (``M^l[i] = C^l[i] M^{l-1}``, :func:`~lenscope.mixing.alti.carry_back`), and the
    invariant errors ``(k,)``: the decomposition's completeness error and the largest deviation of a
    contribution or carried row sum from one."""
    C = mm.contributions
    if isinstance(mm, EncoderDecoderMixing):  # over source + target prefix: the decoder's rollout reads the memory
        out = mm.carry_back(C[:, rows].double()).transpose(0, 1)
    else:
        out = carry_back(C, C[:, rows]).transpose(0, 1)
    row_err = (out.sum(-1) - 1).abs().amax(-1)
    return out, row_err.clamp_min(max(mm.row_sum_error, mm.completeness_error))


@torch.no_grad()
def alti_logit_explanation(lm: LoadedModel, text, target, foil=None, *, position: int = -1,
                           tr: Trace | None = None, source=None) -> Explanation:
    """ALTI-Logit explanation (Ferrando et al. 2023, Eq. 10-11): each layer's per-source logit update carried
    back to the input tokens through the ALTI rollout of the layers below it.

    ``layer_scores[l] = Delta^l M^{l-1}``; ``scores`` sums them. Mixing only redistributes:
    ``layer_scores[l].sum() == Delta^l.sum()`` for every layer (checked in ``invariant_error``). ``source``: an
    encoder-decoder model's source (as :func:`logit_explanation`): ALTI+ (Ferrando et al. 2022) carries the
    self-attention's updates back through the decoder's rollout (which reads the source through the memory) and
    the cross-attention's through the encoder's.
    """
    require_decoder(lm, "the ALTI-Logit explanation", sum_of_blocks=True, encoder_decoder=True,
                    instead="use --method alti or value-zeroing for a context-mixing explanation")
    t_id, f_id, tr, p = _tokens_and_trace(lm, text, target, foil, position, tr, need="the ALTI-Logit explanation",
                                          source=source)
    # causal: positions after p neither see nor reach p (an encoder-decoder trace is used whole)
    sub = prefix_trace(tr, p + 1) if tr.encoder is None else tr
    parts = logit_parts(lm, sub, torch.tensor([p]), *_one(t_id, f_id))
    _refuse(float(parts["invariant_error"][0]), ALTI_LOGIT, lm)
    if tr.encoder is not None:
        mm = encoder_decoder_mixing(lm.anatomy, tr)
    else:
        mm = mixing_matrices(lm.anatomy, sub, "alti", model_name=lm.name, rollout=False)
    carried, inv = alti_logit_rows(lm, parts, mm)
    inv = float(inv[0])
    _refuse(inv, ALTI_LOGIT, lm)
    one = _row(parts)
    info = _info(one) | {"alti_completeness_error": mm.completeness_error, "degenerate_rows": mm.degenerate_rows}
    return _explanation(lm, ALTI_LOGIT, tr, p, t_id, f_id, carried[0].sum(0), layer_scores=carried[0],
                        attention_update=one["attention_update"], mlp_update=one["mlp_update"],
                        remainder=one["remainder"], invariant_error=inv, info=info)


@torch.no_grad()
def rollout_explanation(lm: LoadedModel, text, *, method: str = "alti", position: int = -1, target=None, foil=None,
                        tr: Trace | None = None, source=None) -> Explanation:
    """The row of the ALTI (or value-zeroing) rollout at ``position``: how much each input token contributes
    to that position's state after the last layer (``scores`` sum to one). ``layer_scores[l]`` is the row
    after layer ``l``. A target/foil, if given, is only recorded: these methods do not read a logit. ``source``:
    an encoder-decoder model's source; the row is then over the source tokens and the target prefix
    (:func:`~lenscope.mixing.alti.encoder_decoder_mixing`: the decoder's rollout reads the source through the
    encoder's)."""
    t_id, f_id, tr, p = _tokens_and_trace(lm, text, target, foil, position, tr, source=source)
    A = lm.anatomy
    if tr.encoder is not None:
        mm = encoder_decoder_mixing(A, tr, method=method)
    else:
        sub = prefix_trace(tr, p + 1) if A.causal else tr
        mm = mixing_matrices(A, sub, method, model_name=lm.name, rollout=False)
    rows, err = rollout_rows(mm, torch.tensor([p]))
    rows, inv = rows[0], float(err[0])
    if not inv <= tolerance(lm):
        raise InvariantError(f"{method}: contribution rows or the decomposition are off by {inv:.2e} (limit "
                             f"{tolerance(lm):g}); run `lenscope verify --model {lm.name}`")
    info = {"completeness_error": mm.completeness_error, "row_sum_error": max(mm.row_sum_error, float(
        (rows.sum(-1) - 1).abs().max())), "degenerate_rows": mm.degenerate_rows}
    return _explanation(lm, method, tr, p, t_id, f_id, rows[-1], layer_scores=rows, invariant_error=inv, info=info)
