"""Logit and ALTI-Logit explanations (Ferrando et al., ACL 2023) and rollout rows (ALTI, value zeroing).

For a decoder explaining the logit of ``w`` (minus foil ``f``) at position ``t``, with the final norm affine
given its traced scale at ``t``, the residual-stream read-out direction is
``d = final_norm.pullback(U_w - U_f, s_t)``. Layer ``l``'s attention writes ``sum_j T^l_{t,j}(x_j) + rest``
(:mod:`lenscope.models.algebra`), so

    Logit:       Delta^l_j = T^l_{t,j}(x_j) . d                  (per head as well; Eq. 8-9)
    ALTI-Logit:  sum_l Delta^l M^{l-1}   with the ALTI rollout M (M^{-1} = identity; Eq. 10-11)

and ``sum_j Delta^l_j + remainder^l`` equals the layer's attention logit update read from the trace,
``attn_write[l, t] . d``. Every call checks this (``invariant_error``) and refuses beyond 1e-3.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import InputError, InvariantError
from ..mixing.alti import mixing_matrices
from ..models.algebra import attention_logit_parts, f32
from ..models.load import LoadedModel, require_decoder, resolve_token, token_str
from ..models.readout import Readout
from ..models.trace import Trace, prefix_trace, trace
from .explanation import Explanation


def _tokens_and_trace(lm: LoadedModel, text, target, foil, position: int, tr: Trace | None):
    t_id = resolve_token(lm, target) if target is not None else None
    f_id = resolve_token(lm, foil) if foil is not None else None
    if f_id is not None and t_id is None:
        raise InputError("a foil needs a target; give --target too")
    if f_id is not None and f_id == t_id:
        raise InputError("the foil is the same token as the target; a contrastive explanation needs two tokens")
    tr = tr if tr is not None else trace(lm, text)
    n = len(tr.tokens)
    if not -n <= position < n:
        raise InputError(f"position {position} is outside the text's {n} tokens")
    return t_id, f_id, tr, position % n


def _readout(lm: LoadedModel, tr: Trace, p: int, t_id: int, f_id: int | None) -> tuple[Tensor, float, float]:
    """The residual-stream direction read by the logit difference at ``p``, the constant term (final-norm bias
    and unembedding bias), and the model's logit difference (before any final soft-capping)."""
    readout = Readout.from_anatomy(lm.anatomy)
    direction = readout.pullback(readout.direction(t_id, f_id), readout.scale(f32(tr.final_in[p])))
    return direction, readout.constant(t_id, f_id), readout.traced_logit(tr.logits[p], t_id, f_id)


def _logit_parts(lm: LoadedModel, tr: Trace, p: int, t_id: int, f_id: int | None):
    """Per layer: head scores (layer, head, src), remainder (layer,), attention and MLP updates (layer,), plus
    the embedding's direct term, the constant, the model's logit and the relative invariant error."""
    A = lm.anatomy
    direction, const, logit = _readout(lm, tr, p, t_id, f_id)
    heads, rems = [], []
    for l in range(A.n_layers):
        h, r = attention_logit_parts(A, tr, l, p, direction, "sources")
        heads.append(h)
        rems.append(r)
    head_scores = torch.stack(heads)  # (layer, head, src)
    rem = torch.stack(rems)
    attn_update = f32(tr.attn_write[:, p]) @ direction
    mlp_update = f32(tr.mlp_write[:, p]) @ direction
    embed = float(f32(tr.embed[p]) @ direction)
    layer_scores = head_scores.sum(1)
    gap = (layer_scores.double().sum(-1) + rem.double() - attn_update.double()).abs()
    scale = (attn_update.double().abs() + layer_scores.double().abs().sum(-1) + rem.double().abs()).max()
    inv = float(gap.max() / scale.clamp_min(1e-12))
    total = embed + const + float(attn_update.double().sum() + mlp_update.double().sum())
    return dict(head_scores=head_scores, remainder=rem, attention_update=attn_update, mlp_update=mlp_update,
                embed=embed, const=const, logit=logit, invariant_error=inv,
                completeness_error=abs(total - logit))


def tolerance(lm: LoadedModel) -> float:
    """The largest invariant / completeness error a method accepts: :data:`lenscope.models.verify.TOLERANCE` for
    float32 models, more for bfloat16 / float16 ones (their own rounding; see ``lenscope.models.verify.tolerances``)."""
    from ..models.verify import completeness_tolerance

    return completeness_tolerance(lm)


def _refuse(inv: float, method: str, lm: LoadedModel) -> None:
    tol = tolerance(lm)
    if not inv <= tol:
        raise InvariantError(
            f"{method}: the per-source parts miss the model's attention logit updates by {inv:.2e} (relative, "
            f"limit {tol:g}); lenscope's reading of {lm.name} does not match the model, run "
            "`lenscope verify` on it")


def _logit_request(lm: LoadedModel, method: str, title: str, text, target, foil, position: int, tr: Trace | None):
    """What both logit explanations start with: the checks, the trace, and the per-layer logit parts (refused
    when they do not add up). Returns ``(target_id, foil_id, trace, position, parts)``."""
    require_decoder(lm, title, sum_of_blocks=True, instead="use --method alti or value-zeroing for a context-mixing "
                    "explanation")
    if target is None:
        raise InputError(f"{title} needs a target token (--target)")
    t_id, f_id, tr, p = _tokens_and_trace(lm, text, target, foil, position, tr)
    parts = _logit_parts(lm, tr, p, t_id, f_id)
    _refuse(parts["invariant_error"], method, lm)
    return t_id, f_id, tr, p, parts


def _explanation(lm, method, tr, p, t_id, f_id, scores, **kw) -> Explanation:
    n = len(tr.tokens)
    if scores.shape[-1] < n:  # computed on the causal prefix: later tokens get exactly zero
        pad = scores.new_zeros(*scores.shape[:-1], n - scores.shape[-1])
        scores = torch.cat([scores, pad], -1)
    for k in ("layer_scores", "head_scores"):
        v = kw.get(k)
        if v is not None and v.shape[-1] < n:
            kw[k] = torch.cat([v, v.new_zeros(*v.shape[:-1], n - v.shape[-1])], -1)
    kw = {k: (v.float().cpu() if isinstance(v, Tensor) else v) for k, v in kw.items()}
    return Explanation(
        model=lm.name, method=method, tokens=list(tr.tokens), position=p,
        target=None if t_id is None else token_str(lm, t_id), target_id=t_id,
        foil=None if f_id is None else token_str(lm, f_id), foil_id=f_id, scores=scores.float().cpu(), **kw)


def _info(parts: dict) -> dict:
    return {"logit": parts["logit"], "embed_update": parts["embed"], "bias_update": parts["const"],
            "completeness_error": parts["completeness_error"]}


@torch.no_grad()
def logit_explanation(lm: LoadedModel, text, target, foil=None, *, position: int = -1,
                      tr: Trace | None = None) -> Explanation:
    """Logit explanation (Ferrando et al. 2023, Eq. 8-9): how much each context token, through each layer's
    attention (and each head), moved the logit of ``target`` (minus ``foil``) at ``position``.

    ``scores (src,)`` sum the layers; ``layer_scores (layer, src)``; ``head_scores (layer, head, src)``.
    """
    t_id, f_id, tr, p, parts = _logit_request(lm, "logit", "the logit explanation", text, target, foil, position, tr)
    ls = parts["head_scores"].sum(1)
    return _explanation(lm, "logit", tr, p, t_id, f_id, ls.sum(0), layer_scores=ls, head_scores=parts["head_scores"],
                        attention_update=parts["attention_update"], mlp_update=parts["mlp_update"],
                        remainder=parts["remainder"], invariant_error=parts["invariant_error"], info=_info(parts))


@torch.no_grad()
def alti_logit_explanation(lm: LoadedModel, text, target, foil=None, *, position: int = -1,
                           tr: Trace | None = None) -> Explanation:
    """ALTI-Logit explanation (Ferrando et al. 2023, Eq. 10-11): each layer's per-source logit update carried
    back to the input tokens through the ALTI rollout of the layers below it.

    ``layer_scores[l] = Delta^l M^{l-1}``; ``scores`` sums them. Mixing only redistributes:
    ``layer_scores[l].sum() == Delta^l.sum()`` for every layer (checked in ``invariant_error``).
    """
    t_id, f_id, tr, p, parts = _logit_request(lm, "alti-logit", "the ALTI-Logit explanation", text, target, foil,
                                              position, tr)
    sub = prefix_trace(tr, p + 1)  # causal: positions after p neither see nor reach p
    mm = mixing_matrices(lm.anatomy, sub, "alti", model_name=lm.name)
    delta = parts["head_scores"].sum(1)[:, : p + 1].double()  # (layer, src)
    carried = delta.clone()
    for l in range(1, delta.shape[0]):  # one layer at a time: no float64 copy of the whole rollout
        carried[l] = delta[l] @ mm.rollout[l - 1].double()
    gap = (carried.sum(-1) - delta.sum(-1)).abs().max()
    scale = delta.abs().sum(-1).max().clamp_min(1e-12)
    inv = max(parts["invariant_error"], float(gap / scale), mm.row_sum_error)
    _refuse(inv, "alti-logit", lm)
    info = _info(parts) | {"alti_completeness_error": mm.completeness_error, "degenerate_rows": mm.degenerate_rows}
    return _explanation(lm, "alti-logit", tr, p, t_id, f_id, carried.sum(0), layer_scores=carried,
                        attention_update=parts["attention_update"], mlp_update=parts["mlp_update"],
                        remainder=parts["remainder"], invariant_error=inv, info=info)


@torch.no_grad()
def rollout_explanation(lm: LoadedModel, text, *, method: str = "alti", position: int = -1, target=None, foil=None,
                        tr: Trace | None = None) -> Explanation:
    """The row of the ALTI (or value-zeroing) rollout at ``position``: how much each input token contributes
    to that position's state after the last layer (``scores`` sum to one). ``layer_scores[l]`` is the row
    after layer ``l``. A target/foil, if given, is only recorded: these methods do not read a logit."""
    t_id, f_id, tr, p = _tokens_and_trace(lm, text, target, foil, position, tr)
    A = lm.anatomy
    sub = prefix_trace(tr, p + 1) if A.causal else tr
    mm = mixing_matrices(A, sub, method, model_name=lm.name)
    rows = mm.rollout[:, p]  # (layer, src)
    inv = max(mm.row_sum_error, mm.completeness_error)
    if not inv <= tolerance(lm):
        raise InvariantError(f"{method}: contribution rows or the decomposition are off by {inv:.2e} (limit "
                             f"{tolerance(lm):g}); run `lenscope verify --model {lm.name}`")
    info = {"completeness_error": mm.completeness_error, "row_sum_error": mm.row_sum_error,
            "degenerate_rows": mm.degenerate_rows}
    return _explanation(lm, method, tr, p, t_id, f_id, rows[-1], layer_scores=rows, invariant_error=inv, info=info)
