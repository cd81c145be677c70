"""Context-attribution baselines for one (contrastive) prediction: gradients, integrated gradients, erasure.

Following Yin & Neubig (2022), "Interpreting Language Models with Contrastive Explanations", each method
explains the scalar

    f = logit[position, target] - logit[position, foil]        (just logit[position, target] without a foil)

with one score per input token. ``e_j (d_model,)`` is token ``j``'s input embedding exactly as the model's
own input-embedding module returns it (``lm.model.get_input_embeddings()(ids)``; for Gemma this already
holds the sqrt(d_model) scale), fed to the model as ``inputs_embeds``; position embeddings, embedding
norms and the like are added by the model itself, so they are part of ``f``, not of ``e``.

- ``grad_norm``: ``||df/de_j||_2``.
- ``grad_x_input``: ``sum_d df/de_j,d * e_j,d`` (signed).
- ``integrated_gradients``: ``sum_d (e_j,d - b_d) * int_0^1 df/de_j,d(b + alpha (e - b)) d alpha`` from a
  baseline ``b`` (zero by default; the pad token's or the mean input embedding on request), the integral by
  Gauss-Legendre quadrature, all nodes in one batched forward and backward pass.
- ``erasure``: ``f(input) - f(input without token j)``, all ablated sequences in one batch.

An encoder-decoder model given its ``source`` (docs/encoder-decoder.md): the inputs are the source tokens' embeddings
and the target prefix's, each as its stack computes it from ids before adding positions
(:mod:`lenscope.attribution.inputs`), so every score vector runs over the source tokens first, then the target
prefix's (``Explanation.n_source``); integrated gradients walks both embeddings jointly; erasure removes a source
token from the source, or a prefix token from the prefix (as for a decoder).

Every function returns an :class:`~lenscope.attribution.explanation.Explanation` whose ``scores`` have
shape ``(src,)`` and whose ``info["f"]`` is ``f`` on the full input. ``grad_x_input``, ``integrated_gradients``
and ``erasure`` are linear in the explained scalar, so a contrastive score is the target's score minus the
foil's; ``grad_norm`` is the norm of the contrastive gradient, not a difference.

Batches (captum's ``attribute()`` contract: one implementation per method, batching as an argument): each
method has a ``*_rows`` form, the one implementation that the single-text function calls with a batch of one
(:func:`gradient_rows`, :func:`integrated_gradients_rows`, :func:`erasure_rows`, and :func:`logit_diff_rows`
for ``f`` alone). It takes ``ids (batch, pos)`` (equal-length rows, no padding), per-row ``target``/``foil
(batch,)`` ids, the explained ``position`` (one int, or one per row), ``internal_batch_size`` (rows per
forward/backward pass) or ``max_tokens`` (tokens per pass), and ``last_only`` (causal models at the last
position: only the last logits are computed), and returns per-row scores ``(batch, pos)`` and ``f (batch,)``.
The model runs in its own dtype (float32 unless loaded otherwise); scores come back as float32 on the CPU. The
model is not changed: gradients are taken with respect to the embeddings only, and dropout is off while the methods run.

Integrated gradients and the zero baseline: norms rescale their input, so near ``alpha = 0`` (where the
residual stream is smaller than ``sqrt(eps)``) ``f(alpha e)`` can change on a logarithmic scale (RMSNorm
models without biases, e.g. Llama) or even jump (Gemma's four RMSNorms per block each amplify a tiny input
about ``1/sqrt(eps)`` times, so ``f(1e-9 e)`` is already far from ``f(0)``). ``info["completeness_error"]``
shows it, and ``info["note"]`` says so when it exceeds 1%; on such models read IG scores with care. A mixture of
experts' router switches experts along the path, where ``f`` jumps: IG integrates the gradient between the switches
and misses the jumps (small on the tiny models; ``tests/attribution/test_baselines.py`` measures them).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from ..errors import InputError, NotApplicableError
from ..models.loading.load import LoadedModel, require_decoder, target_fields, token_ids
from ..models.runtime.request import Request, metric_of, position_in
from ..models.weights.algebra import gauss_legendre
from .explanation import Explanation
from .inputs import IG_BASELINES, Inputs, eval_mode, ig_baseline

__all__ = ["IG_BASELINES", "erasure", "erasure_rows", "eval_mode", "grad_norm", "grad_x_input", "gradient_rows",
           "ig_baseline", "integrated_gradients", "integrated_gradients_rows", "logit_diff_rows", "model_logits"]


# ----------------------------------------------------------------------------------------------
# shared plumbing

_NO_TARGET = "use a method that needs no target, e.g. --method alti"


class _Problem:
    """A validated single-text request: ids, the explained position and the target/foil ids."""

    def __init__(self, lm: LoadedModel, method: str, text, target, foil, position: int, source=None):
        from ..models.runtime.trace import source_ids

        _require(lm, method, source)
        self.lm = lm
        self.method = method
        self.ids = token_ids(lm, text)
        self.source = source_ids(lm, source)  # an encoder-decoder model's source ids (src,), else None
        self.n = n = self.ids.numel()
        req = Request.of(lm, target, foil, position, n=n, distinct=True, need=method)
        self.p, self.t_id, self.f_id = req.position, req.target, req.foil

    def rows(self) -> tuple[Tensor, list[int], list[int] | None]:
        """This text as a batch of one for the ``*_rows`` functions: ``ids (1, pos)``, target and foil ids."""
        return self.ids[None], [self.t_id], None if self.f_id is None else [self.f_id]

    def src(self) -> dict:
        """The ``*_rows`` functions' ``source=`` (a batch of one), or nothing."""
        return {} if self.source is None else {"source": self.source[None]}

    def explanation(self, scores: Tensor, info: dict) -> Explanation:
        lm = self.lm
        ids = self.ids if self.source is None else torch.cat([self.source, self.ids])  # the source's tokens first
        n_source = 0 if self.source is None else len(self.source)
        return Explanation(
            model=lm.name, method=self.method,
            tokens=lm.tokenizer.batch_decode([[int(i)] for i in ids]),
            position=n_source + self.p, **target_fields(lm, self.t_id, self.f_id),
            scores=scores.detach().float().cpu(), info=info, n_source=n_source,
        )


def _require(lm: LoadedModel, method: str, source) -> None:
    """A model with a language-model head; an encoder-decoder model with its source, another without one."""
    require_decoder(lm, method, instead=_NO_TARGET, encoder_decoder=source is not None)
    if lm.anatomy.is_encoder_decoder and source is None:
        raise InputError(f"{method}: {lm.name} is an encoder-decoder model; give its source (source=, --source)")


def _rows(lm: LoadedModel, method: str, ids, target, foil, position, last_only: bool,
          source=None) -> tuple[Tensor, Tensor, Tensor | None, int | Tensor]:
    """A validated batch: ``ids (batch, pos)`` on the model's device, ``target``/``foil (batch,)`` ids (foil None
    for a plain logit) and the explained position ``p`` in ``0..pos-1``: one int for every row, or (``position``
    a sequence or tensor of ``batch`` ints) a ``(batch,)`` tensor, one per row. ``source``: an encoder-decoder
    model's source ids ``(batch, src)`` (checked, on the model's device: the caller's ``source``)."""
    from ..models.loading.devices import main_device

    _require(lm, method, source)
    device = main_device(lm.model)  # accelerate's execution device of a split model, never "meta"
    ids = torch.as_tensor(ids, dtype=torch.long).to(device)
    if ids.dim() != 2 or ids.shape[0] < 1 or ids.shape[1] < 1:
        raise InputError(f"ids must be token ids of shape (batch, pos), got shape {tuple(ids.shape)}")
    B, n = ids.shape
    if source is not None:
        src = torch.as_tensor(source, dtype=torch.long)
        if src.dim() != 2 or src.shape[0] != B or src.shape[1] < 1:
            raise InputError(f"source must be token ids of shape ({B}, src), got shape {tuple(src.shape)}")
        source = src.to(device)
    per_row = []
    for name, x in (("target", target), ("foil", foil)):
        x = None if x is None else torch.as_tensor(x, dtype=torch.long).to(device).reshape(-1)
        if x is not None and x.numel() != B:
            raise InputError(f"{name} must hold one token id per row ({B}), got {x.numel()}")
        per_row.append(x)
    if isinstance(position, (int, np.integer)) or isinstance(position, bool):
        p = position_in(position, n)
    else:
        p = torch.as_tensor(position, dtype=torch.long).reshape(-1)
        if p.numel() != B or bool(((p < -n) | (p >= n)).any()):
            raise InputError(f"position must be one int or one position per row ({B}) within -{n}..{n - 1}, got "
                             f"{position!r}")
        p = (p % n).to(device)
    if last_only and (not isinstance(p, int) or p != n - 1 or not lm.anatomy.causal):
        raise InputError("last_only reads the last position's logits only: it needs a causal model and the last "
                         "position")
    return ids, per_row[0], per_row[1], p, source


def _span(lm: LoadedModel, p: int | Tensor, rows, n: int) -> tuple[int, int | None]:
    """What a chunk of ``rows`` must run: ``(cut, keep)``, its leading ``cut`` positions, and the last ``keep``
    positions' logits (None: all of them). With one position per row in a causal decoder nothing after the
    chunk's last explained position changes its objectives (the gradients of the tokens cut off are exactly
    zero), and only the logits from its first explained position on are read, so a chunk of generated tokens
    runs just that prefix and unembeds just those positions (an unembedding as wide as smollm2's costs about
    a quarter of its forward and backward pass). Otherwise ``(n, None)``."""
    if isinstance(p, int) or not lm.anatomy.causal or lm.anatomy.is_encoder_decoder:  # (src + pos inputs: all)
        return n, None
    q = p[rows]
    cut = int(q.max()) + 1
    return cut, cut - int(q.min())


def _read(p: int | Tensor, rows, last_only: bool, cut: int, keep: int | None) -> int | Tensor:
    """Where a chunk's logits are read: the last one (``last_only``), else each row's position, counted within
    the last ``keep`` positions of the ``cut`` the chunk ran (:func:`_span`)."""
    if last_only:
        return -1
    at = _at(p, rows)
    return at if keep is None else at - (cut - keep)


def _at(p: int | Tensor, rows) -> int | Tensor:
    """The explained position(s) of a chunk of ``rows`` (a slice or index tensor): ``p`` itself when it is one int."""
    return p if isinstance(p, int) else p[rows]


def _chunk(rows: int, row_tokens: int, internal_batch_size: int | None, max_tokens: int | None) -> int:
    """Rows per forward (and backward) pass: ``internal_batch_size``, else as many rows of ``row_tokens`` tokens
    as fit in ``max_tokens``, else all ``rows``."""
    if internal_batch_size is not None:
        return max(1, int(internal_batch_size))
    if max_tokens is not None:
        return max(1, int(max_tokens) // max(1, row_tokens))
    return max(1, rows)


def model_logits(lm: LoadedModel, *, input_ids: Tensor | None = None, inputs_embeds: Tensor | None = None,
                 last_only: bool = False, keep: int | None = None, source: Tensor | None = None,
                 source_embeds: Tensor | None = None) -> Tensor:
    """The real model's logits ``(batch, pos, vocab)`` (no padding, no cache); with ``last_only`` (causal
    models) only the last position's, ``(batch, 1, vocab)``, so a batch of long inputs stays small; with
    ``keep`` (causal models) the last ``keep`` positions', ``(batch, keep, vocab)``. An encoder-decoder model
    reads ``source (batch, src)`` ids or ``source_embeds (batch, src, d_model)``
    (:func:`lenscope.models.runtime.engine.forward_kwargs`); its logits are the decoder's (``last_only`` and ``keep``
    slice them: these models compute every position's)."""
    from ..models.runtime.engine import forward_kwargs
    from ..models.runtime.stop import checkpoint

    checkpoint()  # every forward pass of the baselines is a chunk a caller that no longer waits can stop before
    kw = forward_kwargs(lm, input_ids, inputs_embeds=inputs_embeds, last_only=last_only, source=source,
                        source_embeds=source_embeds)
    seq2seq = source is not None or source_embeds is not None
    if keep is not None and not last_only and not seq2seq:
        kw["logits_to_keep"] = int(keep)
    out = lm.model(**kw)
    logits = getattr(out, "logits", None)
    if logits is None:
        raise NotApplicableError(
            f"{lm.name} returned no logits, so there is no token to explain; use a method that needs no target, "
            "e.g. --method alti"
        )
    if seq2seq and (last_only or keep is not None):
        logits = logits[:, -(1 if last_only else int(keep)):]
    return logits


# ----------------------------------------------------------------------------------------------
# the methods on a batch: the one implementation of each (the single-text functions below call these)
#
# Every ``*_rows`` function takes ``ids (batch, pos)`` (rows of equal length, no padding, so each row computes
# what it computes alone), ``target``/``foil (batch,)`` per-row token ids (no foil: the target's logit alone)
# and the explained ``position`` (one int for every row, or one per row: e.g. every generated token of one
# text). ``last_only`` (causal models, ``position`` the last one): the model computes the last position's
# logits only. ``internal_batch_size`` rows per forward (and backward) pass, or as many as fit in ``max_tokens``
# tokens; default all rows in one pass.


@torch.no_grad()
def logit_diff_rows(lm: LoadedModel, ids: Tensor, target, foil=None, *, position: int = -1,
                    last_only: bool = False, source: Tensor | None = None) -> Tensor:
    """``f = logit[position, target] - logit[position, foil]`` per row, ``(batch,)`` float64 CPU (one forward
    pass, no gradient). ``source (batch, src)``: an encoder-decoder model's source ids."""
    ids, t, f, p, src = _rows(lm, "the logit difference", ids, target, foil, position, last_only, source)
    with eval_mode(lm.model):
        logits = model_logits(lm, input_ids=ids, last_only=last_only, source=src)
        return metric_of(logits, "logit_diff", t, f, at=-1 if last_only else p).double().cpu()


def gradient_rows(lm: LoadedModel, ids: Tensor, target, foil=None, *, position: int = -1, last_only: bool = False,
                  internal_batch_size: int | None = None, max_tokens: int | None = None,
                  source: Tensor | None = None) -> dict[str, Tensor]:
    """The gradient methods on a batch: ``{"grad-norm": (batch, pos), "grad-x-input": (batch, pos)}`` float32 CPU
    with ``grad-norm[b, j] = ||df_b/de_bj||_2`` and ``grad-x-input[b, j] = sum_d df_b/de_bj,d * e_bj,d``, and
    ``"f": (batch,)`` float64 CPU, from one forward and one backward pass per chunk of rows. ``source (batch,
    src)``: an encoder-decoder model's source ids; the scores are then ``(batch, src + pos)``, the source's first
    (:class:`~lenscope.attribution.inputs.Inputs`)."""
    ids, t, f, p, src = _rows(lm, "gradient attribution", ids, target, foil, position, last_only, source)
    inp = Inputs.of(lm, ids, src)
    e = inp.fed  # (batch, src + pos, d_model): what the model is given
    B, n = e.shape[:2]
    chunk = _chunk(B, n, internal_batch_size, max_tokens)
    grads, objs = [], []
    with eval_mode(lm.model), torch.enable_grad():
        for s in range(0, B, chunk):
            rows = slice(s, s + chunk)
            cut, keep = _span(lm, p, rows, n)
            x = e[rows, :cut].clone().requires_grad_(True)
            obj = metric_of(model_logits(lm, **inp.kwargs(x), last_only=last_only, keep=keep), "logit_diff",
                            t[rows], None if f is None else f[rows], at=_read(p, rows, last_only, cut, keep))
            (g,) = torch.autograd.grad(obj.sum(), x)
            grads.append(torch.nn.functional.pad(g.detach(), (0, 0, 0, n - cut)))
            objs.append(obj.detach())
    x, g = inp.embeddings_and_gradient(grads[0] if len(grads) == 1 else torch.cat(grads))
    return {"grad-norm": g.norm(dim=-1).cpu(), "grad-x-input": (g * x).sum(-1).cpu(),
            "f": torch.cat(objs).double().cpu()}


def integrated_gradients_rows(lm: LoadedModel, ids: Tensor, target, foil=None, *, position: int = -1, steps: int = 16,
                              baseline: str | Tensor = "zero", last_only: bool = False,
                              internal_batch_size: int | None = None, max_tokens: int | None = None,
                              source: Tensor | None = None) -> dict:
    """Integrated gradients on a batch, the one implementation behind :func:`integrated_gradients` (one text)
    and the evaluation.

    ``scores[b, j] = sum_d (e_bj,d - b_d) * int_0^1 df_b/de_bj,d(b + alpha (e_b - b)) d alpha`` with ``b`` the
    baseline (:func:`ig_baseline`), the integral by ``steps``-node Gauss-Legendre quadrature
    (:func:`lenscope.models.weights.algebra.gauss_legendre`); every (example, node) pair is one row of the forward and
    backward passes (``internal_batch_size`` rows, or ``max_tokens`` tokens, per pass; default all).

    Returns ``{"ig": (batch, pos) float32 CPU, "f_input", "f_baseline", "sum", "completeness_error",
    "completeness_abs": (batch,) float64 CPU, "info": the baseline's info}`` where ``completeness_abs =
    |sum_j scores[b, j] - (f(input) - f(baseline))|`` and ``completeness_error`` is that divided by
    ``max(|f(input) - f(baseline)|, 1e-6)`` (relative). ``source (batch, src)``: an encoder-decoder model's source
    ids; the path then runs from the baseline at every source and target-prefix position to both embeddings
    together, and the scores are ``(batch, src + pos)``, the source's first.
    """
    ids, t, f, p, src = _rows(lm, "integrated gradients", ids, target, foil, position, last_only, source)
    inp = Inputs.of(lm, ids, src)
    e = inp.fed  # what the model is given (the baseline too, Inputs.baseline)
    B, n = e.shape[:2]
    base, binfo = inp.baseline(lm, baseline)

    def objective(logits: Tensor, rb: Tensor, cut: int = n, keep: int | None = None) -> Tensor:
        return metric_of(logits, "logit_diff", t[rb], None if f is None else f[rb],
                         at=_read(p, rb, last_only, cut, keep))

    diff = e.float() if base is None else e.float() - base
    nodes, weights = gauss_legendre(int(steps), torch.float64, e.device)
    alphas, w = nodes.float(), weights
    rows_b = torch.arange(B, device=e.device).repeat_interleave(steps)  # row -> example
    rows_s = torch.arange(steps, device=e.device).repeat(B)  # row -> node
    chunk = _chunk(B * steps, n, internal_batch_size, max_tokens)
    integral = torch.zeros(e.shape, dtype=torch.float64, device=e.device)
    with eval_mode(lm.model):
        for s in range(0, B * steps, chunk):
            rb, rs = rows_b[s : s + chunk], rows_s[s : s + chunk]
            cut, keep = _span(lm, p, rb, n)
            path = alphas[rs, None, None] * diff[rb, :cut]
            x = (path if base is None else base + path).to(e.dtype).requires_grad_(True)
            with torch.enable_grad():
                obj = objective(model_logits(lm, **inp.kwargs(x), last_only=last_only, keep=keep), rb, cut, keep)
                (g,) = torch.autograd.grad(obj.sum(), x)
            part = w[rs, None, None] * g.detach().double()
            if B == 1:
                integral[0, :cut] += part.sum(0)
            else:
                integral[:, :cut].index_add_(0, rb, part)
        with torch.no_grad():  # the two ends of the path, for completeness
            b_emb = torch.zeros_like(e) if base is None else base.to(e.dtype).expand_as(e)
            rows = torch.arange(B, device=e.device)
            if B == 1:  # one pass for a single example, two for a batch: each caller's grouping of old, so
                # that f (and the completeness error) are bit-identical to the numbers computed before
                ends = objective(model_logits(lm, **inp.kwargs(torch.cat([e, b_emb])), last_only=last_only),
                                 rows.repeat(2))
            else:
                ends = torch.cat([objective(model_logits(lm, **inp.kwargs(x), last_only=last_only), rows)
                                  for x in (e, b_emb)])
            ends = ends.double()
    scores = (integral * diff.double()).sum(-1)
    f_input, f_base = ends[:B], ends[B:]
    total = scores.sum(-1)
    delta = f_input - f_base
    err_abs = (total - delta).abs()
    return {"ig": scores.float().cpu(), "f_input": f_input.cpu(), "f_baseline": f_base.cpu(), "sum": total.cpu(),
            "completeness_abs": err_abs.cpu(), "completeness_error": (err_abs / delta.abs().clamp_min(1e-6)).cpu(),
            "info": binfo}


def erasure_rows(lm: LoadedModel, ids: Tensor, target, foil=None, *, position: int = -1,
                 f_input: Tensor | None = None, last_only: bool = False, internal_batch_size: int | None = None,
                 max_tokens: int | None = None, source: Tensor | None = None) -> dict[str, Tensor]:
    """Leave-one-out erasure on a batch, the one implementation behind :func:`erasure` (one text) and the
    evaluation: ``{"erasure": (batch, pos) float32 CPU, "f": (batch,) float64 CPU}`` with ``erasure[b, j] =
    f(ids[b]) - f(ids[b] without token j)`` (see :func:`erasure` for where ``f`` is read and which tokens score
    0). Every example's ablated sequences are rows of one batch, in row order (example, erased token), each
    ``pos - 1`` tokens long (``position`` in a causal model); ``f_input (batch,)``, ``f`` on the full inputs, is
    computed (:func:`logit_diff_rows`) unless given. ``last_only`` applies to that pass; the ablated sequences
    of a causal model always keep only their last logits. ``position`` may also hold one position per row (causal
    models; e.g. every generated token of one text): see :func:`_erasure_per_row`. ``source (batch, src)``: an
    encoder-decoder model's source ids, the scores ``(batch, src + pos)``: see :func:`_erasure_source`.
    """
    ids, t, f, p, src = _rows(lm, "erasure", ids, target, foil, position, last_only, source)
    if src is not None:
        return _erasure_source(lm, src, ids, t, f, p, f_input, internal_batch_size, max_tokens)
    B, n = ids.shape
    causal = lm.anatomy.causal
    if n < 2:
        raise InputError("erasure needs at least 2 tokens: removing the only token leaves nothing to run")
    if causal and bool((torch.as_tensor(p) == 0).any()):
        raise InputError(
            "erasure cannot explain position 0 of a causal model: removing that token leaves no context to "
            "predict from; explain a later position"
        )
    if not isinstance(p, int):
        return _erasure_per_row(lm, ids, t, f, p, f_input, internal_batch_size, max_tokens)
    # causal: the prediction at p depends on tokens 0..p only, so erase among those (the rest score 0)
    m = p + 1 if causal else n
    src = torch.arange(m, device=ids.device)
    if not causal:
        src = src[src != p]
    S = len(src)
    keep = ~torch.eye(m, dtype=torch.bool, device=ids.device)  # (erased j, pos)
    ablated = ids[:, None, :m].expand(B, m, m)[:, keep].reshape(B, m, m - 1)[:, src].reshape(B * S, m - 1)
    tt = t.repeat_interleave(S)
    ff = None if f is None else f.repeat_interleave(S)
    read = torch.where(src < p, p - 1, p).repeat(B)  # bidirectional: where the explained position ends up
    chunk = _chunk(B * S, m - 1, internal_batch_size, max_tokens)
    if f_input is None:
        f_input = logit_diff_rows(lm, ids, t, f, position=p, last_only=last_only)
    with eval_mode(lm.model), torch.no_grad():
        parts = []
        for s in range(0, B * S, chunk):
            rows = slice(s, s + chunk)
            if causal:  # every ablated sequence ends at the read position: keep only the last logits
                logits, at = model_logits(lm, input_ids=ablated[rows], last_only=True), -1
            else:
                logits, at = model_logits(lm, input_ids=ablated[rows]), read[rows]
            parts.append(metric_of(logits, "logit_diff", tt[rows], None if ff is None else ff[rows], at=at))
        f_ablated = torch.cat(parts)
    f_input = torch.as_tensor(f_input).to(device=ids.device, dtype=torch.float64).reshape(B)
    scores = torch.zeros(B, n, dtype=torch.float32)
    scores[:, src.cpu()] = (f_input[:, None] - f_ablated.double().view(B, S)).float().cpu()
    return {"erasure": scores, "f": f_input.cpu()}


def _erasure_per_row(lm: LoadedModel, ids: Tensor, t: Tensor, f: Tensor | None, p: Tensor, f_input,
                     internal_batch_size: int | None, max_tokens: int | None) -> dict[str, Tensor]:
    """:func:`erasure_rows` with one explained position per row (``p (batch,)``, causal models): each distinct
    sequence is ablated once per erased token ``j`` (the copies no row needs are skipped), and that copy serves
    every row that explains a position ``p_b >= j``, read at ``p_b - 1`` (where ``p_b`` ends up once ``j`` is
    gone; for ``j = p_b`` the prediction at the token before). So the explanations of every generated token of
    one text cost one copy per source, not one per (token, source)."""
    if not lm.anatomy.causal:
        raise InputError("one explained position per row needs a causal model; give one position for every row")
    B, n = ids.shape
    dev = ids.device
    uniq, inverse = torch.unique(ids, dim=0, return_inverse=True)
    m = int(p.max()) + 1  # no row reads past m - 1, so the copies keep tokens 0..m-1 only
    U = uniq.shape[0]
    keep = ~torch.eye(m, dtype=torch.bool, device=dev)  # (erased j, pos)
    ablated = uniq[:, None, :m].expand(U, m, m)[:, keep].reshape(U * m, m - 1)
    b_idx, j_idx = (torch.arange(m, device=dev)[None, :] <= p[:, None]).nonzero(as_tuple=True)  # (row, erased j)
    f_ablated = _ablated(lm, ablated, inverse[b_idx] * m + j_idx, p[b_idx] - 1, t, f, b_idx, internal_batch_size,
                         max_tokens)
    if f_input is None:
        f_input = logit_diff_rows(lm, ids, t, f, position=p)
    f_input = torch.as_tensor(f_input).to(device=dev, dtype=torch.float64).reshape(B)
    scores = torch.zeros(B, n, dtype=torch.float32)
    scores[b_idx.cpu(), j_idx.cpu()] = (f_input[b_idx] - f_ablated).float().cpu()
    return {"erasure": scores, "f": f_input.cpu()}


def _ablated(lm: LoadedModel, copies: Tensor, copy: Tensor, read: Tensor, t: Tensor, f: Tensor | None,
             b_idx: Tensor, internal_batch_size: int | None, max_tokens: int | None,
             source: Tensor | None = None) -> Tensor:
    """``f`` of rows ``b_idx (k,)`` on ablated copies, ``(k,)`` float64: pair ``i`` reads copy ``copy[i]`` of
    ``copies (C, m)`` ids (with ``source (C, src)`` ids for an encoder-decoder model) at position ``read[i]``.
    Only the copies some pair reads run, a chunk at a time, each keeping the logits from the earliest position
    read on."""
    need, where = torch.unique(copy, return_inverse=True)  # the copies to run; each pair's among them
    m = copies.shape[1]
    keep = m - int(read.min())  # only the last `keep` positions are ever read
    chunk = _chunk(len(need), m + (0 if source is None else source.shape[1]), internal_batch_size, max_tokens)
    chunk = min(chunk, max(1, 2**26 // (keep * lm.anatomy.vocab_size)))  # the logits kept: <= 256 MB per chunk
    out = torch.empty(len(copy), dtype=torch.float64, device=copies.device)
    with eval_mode(lm.model), torch.no_grad():
        for s in range(0, len(need), chunk):
            run = need[s : s + chunk]
            logits = model_logits(lm, input_ids=copies[run], keep=keep, source=None if source is None else source[run])
            sel = ((where >= s) & (where < s + chunk)).nonzero(as_tuple=True)[0]
            out[sel] = metric_of(logits[where[sel] - s, read[sel] - (m - keep)], "logit_diff", t[b_idx[sel]],
                                 None if f is None else f[b_idx[sel]]).double()
    return out


def _erasure_source(lm: LoadedModel, src: Tensor, ids: Tensor, t: Tensor, f: Tensor | None, p: int | Tensor, f_input,
                    internal_batch_size: int | None, max_tokens: int | None) -> dict[str, Tensor]:
    """:func:`erasure_rows` of an encoder-decoder model, ``src (batch, src)`` source ids: source token ``j``'s
    score is ``f(input) - f(the source without token j, the whole prefix)``, read at the row's position; prefix
    token ``j <= p``'s as a causal decoder's (the prefix ``ids[:p + 1]`` without it, read at ``p - 1``); later
    prefix tokens score 0, and so does the decoder's start token at ``p = 0`` (nothing is left to predict from).
    Each distinct (source, prefix) row is ablated once per erased token, as in :func:`_erasure_per_row`."""
    B, n = ids.shape
    S, dev = src.shape[1], ids.device
    if S < 2:
        raise InputError("erasure needs a source of at least 2 tokens: removing the only one leaves no source to run")
    p = torch.full((B,), p, device=dev) if isinstance(p, int) else p
    uniq, inverse = torch.unique(torch.cat([src, ids], 1), dim=0, return_inverse=True)
    U, u_src, u_dec = len(uniq), uniq[:, :S], uniq[:, S:]
    if f_input is None:
        f_input = logit_diff_rows(lm, ids, t, f, position=p, source=src)
    f_input = torch.as_tensor(f_input).to(device=dev, dtype=torch.float64).reshape(B)
    scores = torch.zeros(B, S + n, dtype=torch.float32)
    # the source without token j (copy u * S + j) and the whole prefix, read at each row's position
    drop = ~torch.eye(S, dtype=torch.bool, device=dev)
    sources = u_src[:, None].expand(U, S, S)[:, drop].reshape(U * S, S - 1)
    b_idx, j_idx = torch.arange(B, device=dev).repeat_interleave(S), torch.arange(S, device=dev).repeat(B)
    f_ablated = _ablated(lm, u_dec.repeat_interleave(S, 0), inverse[b_idx] * S + j_idx, p[b_idx], t, f, b_idx,
                         internal_batch_size, max_tokens, source=sources)
    scores[b_idx.cpu(), j_idx.cpu()] = (f_input[b_idx] - f_ablated).float().cpu()
    # the prefix ids[:m] without token j (copy u * m + j) and the whole source, read at p - 1
    m = int(p.max()) + 1
    b_idx, j_idx = ((torch.arange(m, device=dev)[None, :] <= p[:, None]) & (p[:, None] > 0)).nonzero(as_tuple=True)
    if len(b_idx):
        drop = ~torch.eye(m, dtype=torch.bool, device=dev)
        copies = u_dec[:, None, :m].expand(U, m, m)[:, drop].reshape(U * m, m - 1)
        f_ablated = _ablated(lm, copies, inverse[b_idx] * m + j_idx, p[b_idx] - 1, t, f, b_idx, internal_batch_size,
                             max_tokens, source=u_src.repeat_interleave(m, 0))
        scores[b_idx.cpu(), S + j_idx.cpu()] = (f_input[b_idx] - f_ablated).float().cpu()
    return {"erasure": scores, "f": f_input.cpu()}


# ----------------------------------------------------------------------------------------------
# the methods on one text


def grad_norm(lm: LoadedModel, text: str | list[int] | Tensor, target: str | int, foil: str | int | None = None, *,
              position: int = -1, source=None) -> Explanation:
    """Gradient norm: ``scores[j] = ||df/de_j||_2`` with ``f = logit[target] - logit[foil]`` at ``position``.

    ``target``/``foil`` are a token's text (``" Paris"``), ``"#ID"`` or an int id; ``text`` may be token ids.
    ``source``: an encoder-decoder model's source (text or ids; ``text`` is then the target prefix, and the
    scores run over the source's tokens, then the prefix's). A batch: :func:`gradient_rows`.
    """
    pr = _Problem(lm, "grad-norm", text, target, foil, position, source)
    res = gradient_rows(lm, *pr.rows(), position=pr.p, **pr.src())
    return pr.explanation(res["grad-norm"][0], {"f": float(res["f"][0])})


def grad_x_input(lm: LoadedModel, text: str | list[int] | Tensor, target: str | int, foil: str | int | None = None,
                 *, position: int = -1, source=None) -> Explanation:
    """Gradient times input: ``scores[j] = sum_d df/de_j,d * e_j,d`` (signed), ``f`` and ``source`` as in
    :func:`grad_norm`. A batch: :func:`gradient_rows`."""
    pr = _Problem(lm, "grad-x-input", text, target, foil, position, source)
    res = gradient_rows(lm, *pr.rows(), position=pr.p, **pr.src())
    return pr.explanation(res["grad-x-input"][0], {"f": float(res["f"][0])})


def integrated_gradients(lm: LoadedModel, text: str | list[int] | Tensor, target: str | int,
                         foil: str | int | None = None, *, position: int = -1, steps: int = 16,
                         batch_size: int | None = None, baseline: str | Tensor = "zero", source=None) -> Explanation:
    """Integrated gradients from a baseline embedding along the straight path.

    ``scores[j] = sum_d (e_j,d - b_d) * int_0^1 df/de_j,d(b + alpha * (e - b)) d alpha``, the integral by
    ``steps``-node Gauss-Legendre quadrature on [0, 1]; all nodes go through the model in one batched forward
    and backward pass (in chunks of ``batch_size`` rows when given; a batch: :func:`integrated_gradients_rows`).
    ``baseline`` (:func:`ig_baseline`):
    ``"zero"`` (default), ``"pad"`` (the pad token's input embedding, else the unk token's), ``"mean"`` (the
    mean input embedding over the vocabulary) or a ``(d_model,)`` tensor, the same vector at every position.
    Position embeddings and the like, which the model adds to ``inputs_embeds`` itself, stay in the baseline.
    ``info`` holds ``f_input``, ``f_baseline``, ``sum_attributions``, ``completeness_abs = |sum - (f_input -
    f_baseline)|`` and ``completeness_error = completeness_abs / max(|f_input - f_baseline|, 1e-6)`` (relative;
    small when ``steps`` is enough for this input). ``source``: as in :func:`grad_norm` (the path runs over both
    embeddings together).
    """
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1:
        raise InputError(f"steps must be a positive integer, got {steps!r}")
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer))
                                   or batch_size < 1):
        raise InputError(f"batch_size must be a positive integer or None, got {batch_size!r}")
    pr = _Problem(lm, "ig", text, target, foil, position, source)
    steps = int(steps)
    res = integrated_gradients_rows(lm, *pr.rows(), position=pr.p, steps=steps, baseline=baseline,
                                    internal_batch_size=batch_size, **pr.src())
    f_input, f_baseline = float(res["f_input"][0]), float(res["f_baseline"][0])
    total, err = float(res["sum"][0]), float(res["completeness_error"][0])
    delta = f_input - f_baseline
    info = {
        "f": f_input, "f_input": f_input, "f_baseline": f_baseline, "sum_attributions": total,
        "completeness_error": err, "completeness_abs": float(res["completeness_abs"][0]), "steps": steps,
        **res["info"], "quadrature": "gauss-legendre",
    }
    if err > 1e-2:
        info["note"] = (
            f"the scores sum to {total:.4g} but f(input) - f(baseline) = {delta:.4g} ({err:.1%} off): the path from "
            f"the {info['baseline']} baseline is too nonlinear for {steps} steps; raise steps. (Where every norm "
            "rescales tiny inputs, e.g. Gemma's sandwich RMSNorms, f jumps right next to the zero baseline and more "
            "steps do not help; a mixture of experts' router switching experts along the path makes f jump too.)"
        )
    return pr.explanation(res["ig"][0], info)


def erasure(lm: LoadedModel, text: str | list[int] | Tensor, target: str | int, foil: str | int | None = None, *,
            position: int = -1, batch_size: int = 64, source=None) -> Explanation:
    """Leave-one-out erasure: ``scores[j] = f(input) - f(input without token j)``.

    ``f`` is read where the explained position ends up in each shorter sequence (one earlier when ``j`` came
    before it). In a causal model erasing the explained token itself reads the prediction at the token before
    it (the prediction from the context without that token), and tokens after ``position`` score 0 (they
    cannot change it, so only the ``position + 1`` ablations of ``ids[:position + 1]`` are run, each of length
    ``position``: the same logits as the full-length sequences up to float error). In a bidirectional
    encoder erasing the explained position is undefined: its score is 0 (``info["note"]`` says so). All
    ablated sequences run as one batch (chunks of ``batch_size``). ``source``: an encoder-decoder model's source
    (``text``: the target prefix): a source token is removed from the source, a prefix token from the prefix
    (:func:`_erasure_source`). A batch: :func:`erasure_rows`.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise InputError(f"batch_size must be a positive integer, got {batch_size!r}")
    pr = _Problem(lm, "erasure", text, target, foil, position, source)
    res = erasure_rows(lm, *pr.rows(), position=pr.p, internal_batch_size=batch_size, **pr.src())
    info: dict = {"f": float(res["f"][0])}
    if pr.source is not None and pr.p == 0:
        info["note"] = ("erasing the decoder's start token leaves no target prefix to predict the first token from; "
                        "its score is 0")
    if not lm.anatomy.causal:
        info["note"] = (f"erasing the explained position {pr.p} itself is undefined in a bidirectional encoder; "
                        "its score is 0")
    return pr.explanation(res["erasure"][0], info)
