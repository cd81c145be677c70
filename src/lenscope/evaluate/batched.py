"""The attribution methods of :mod:`lenscope.attribution` on many examples at once.

Examples of the same token length run as one batch (no padding, so every row computes exactly what the
single-example method computes; only the order of float operations differs). Each function explains the
prediction at the last position of ``ids (batch, pos)`` for per-row target and foil ids, with the same
definitions as :mod:`lenscope.attribution.baselines` (see that module and ``docs/attribution.md``):

- :func:`traces`: one forward pass with hooks, cut into one :class:`~lenscope.models.trace.Trace` per row, for
  the Logit and ALTI-Logit explanations (the logits are kept at the last position only; other rows are NaN);
- :func:`gradients`: ``grad-norm`` and ``grad-x-input`` from one forward and backward pass;
- :func:`integrated_gradients`: :func:`lenscope.attribution.baselines.integrated_gradients_rows` (zero, pad
  or mean baseline, Gauss-Legendre nodes, every (example, node) row in one batch, in chunks of at most
  ``max_tokens`` tokens);
- :func:`erasure`: every example's ``pos`` leave-one-out sequences in one batch (causal models).

Only causal decoders with a language-model head are supported here (the evaluation predicts a next word).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..attribution.baselines import _eval_mode, _logits, integrated_gradients_rows
from ..errors import UnsupportedModelError
from ..models.families import family_for
from ..models.trace import Trace, register_captures


def _device(lm):
    from ..models.devices import main_device

    return main_device(lm.model)  # accelerate's execution device of a split model, never "meta"


def _objective(logits_last: Tensor, t: Tensor, f: Tensor) -> Tensor:
    """``logit[t] - logit[f]`` per row from ``(rows, vocab)``."""
    rows = torch.arange(logits_last.shape[0], device=logits_last.device)
    return logits_last[rows, t] - logits_last[rows, f]


@torch.no_grad()
def traces(lm, ids: Tensor) -> list[Trace]:
    """One :class:`Trace` per row of ``ids (batch, pos)`` from a single forward pass (same hooks and fields as
    :func:`lenscope.models.trace.trace`; ``logits`` hold the last position only, earlier rows are NaN)."""
    model, tok, anatomy = lm
    ids = torch.as_tensor(ids, dtype=torch.long)
    B, n = ids.shape
    hooks = family_for(model).hooks(model)
    L = len(hooks.layers)
    store: dict = {}
    bufs: dict = {}
    seen: set = set()
    handles = []

    def put(key, value):
        if key in seen:
            raise UnsupportedModelError(f"hook {key} fired twice in one forward pass; this model variant is not "
                                        "supported")
        seen.add(key)
        if value is None:
            raise UnsupportedModelError(f"{key[0]} was not returned by the model; load it with "
                                        "attn_implementation='eager'")
        value = value.detach()
        if value.dim() == 2 and value.shape[0] == B * n:  # (batch * pos, d) layouts (OPT's MLP)
            value = value.reshape(B, n, value.shape[-1])
        base, i = key[:-1], key[-1]
        if base[-1] == "final":
            store[key] = value
            return
        buf = bufs.get(base)
        if buf is None:
            buf = bufs[base] = value.new_empty((L,) + tuple(value.shape))
        buf[i].copy_(value)

    try:
        register_captures(hooks, put, handles)
        device = _device(lm)
        kwargs = {"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids).to(device), "use_cache": False,
                  "logits_to_keep": 1}
        out = model(**kwargs)
    finally:
        for h in handles:
            h.remove()

    slots = list(hooks.layers[0].norms)
    placement = anatomy.placement
    last = out.logits.detach()[:, -1]  # (batch, vocab)
    result = []
    for b in range(B):
        norm_in = {s: bufs[("norm_in", s)][:, b] for s in slots}
        norm_out = {s: bufs[("norm_out", s)][:, b] for s in slots}
        resid_pre, attn_out, mlp_out = bufs[("resid_pre",)][:, b], bufs[("attn_out",)][:, b], bufs[("mlp_out",)][:, b]
        attn_write = norm_out.get("ln_attn_out", attn_out)
        mlp_write = norm_out.get("ln_mlp_out", mlp_out)
        if placement == "post":
            resid_mid = norm_out["ln_attn"]
        elif placement == "parallel":
            resid_mid = resid_pre + attn_write
        else:
            resid_mid = norm_in["ln_mlp"]
        logits = last.new_full((n, last.shape[-1]), float("nan"))
        logits[-1] = last[b]
        fi, fo = store.get(("norm_in", "final", 0)), store.get(("norm_out", "final", 0))
        result.append(Trace(
            input_ids=ids[b].cpu(), tokens=tok.batch_decode([[int(i)] for i in ids[b]]),
            positions=torch.arange(n, device=_device(lm)), embed=resid_pre[0], resid_pre=resid_pre,
            resid_mid=resid_mid, resid_post=bufs[("resid_post",)][:, b], attn_out=attn_out, attn_write=attn_write,
            mlp_out=mlp_out, mlp_write=mlp_write, attn_probs=bufs[("attn_probs",)][:, b],
            mlp_pre=bufs[("mlp_pre",)][:, b],
            mlp_up=bufs[("mlp_up",)][:, b] if hooks.layers[0].up is not None else None,
            norm_in=norm_in, norm_out=norm_out, final_in=None if fi is None else fi[b],
            final_out=None if fo is None else fo[b], logits=logits, placement=placement,
        ))
    return result


def _embed(lm, ids: Tensor) -> Tensor:
    with torch.no_grad():
        return lm.model.get_input_embeddings()(ids.to(_device(lm))).detach()


def _ids(lm, ids, t, f):
    dev = _device(lm)
    return (torch.as_tensor(ids, dtype=torch.long).to(dev), torch.as_tensor(t, dtype=torch.long).to(dev),
            torch.as_tensor(f, dtype=torch.long).to(dev))


def gradients(lm, ids, t, f) -> dict[str, Tensor]:
    """``{"grad-norm": (batch, pos), "grad-x-input": (batch, pos), "f": (batch,)}``: ``||df/de_j||_2`` and
    ``sum_d e_j,d df/de_j,d`` with ``f = logit[t] - logit[f]`` at the last position, one forward and one backward
    pass for the whole batch."""
    ids, t, f = _ids(lm, ids, t, f)
    e = _embed(lm, ids)
    x = e.clone().requires_grad_(True)
    with _eval_mode(lm.model), torch.enable_grad():
        obj = _objective(_logits(lm, inputs_embeds=x, last_only=True)[:, -1], t, f)
        (g,) = torch.autograd.grad(obj.sum(), x)
    g = g.detach().float()
    return {"grad-norm": g.norm(dim=-1).cpu(), "grad-x-input": (g * e.float()).sum(-1).cpu(),
            "f": obj.detach().float().cpu()}


def integrated_gradients(lm, ids, t, f, *, steps: int = 16, max_tokens: int = 1024,
                         baseline="zero") -> dict[str, Tensor]:
    """Integrated gradients at the last position of every row, ``steps`` Gauss-Legendre nodes, from
    ``baseline`` (``"zero"``, ``"pad"``, ``"mean"`` or a ``(d_model,)`` tensor): a call of
    :func:`lenscope.attribution.baselines.integrated_gradients_rows`, the one implementation that
    ``lenscope.explain`` uses too. ``{"ig": (batch, pos), "f_input", "f_baseline", "sum", "completeness_error",
    "completeness_abs": (batch,), "info"}``. The (example, node) rows run in chunks of at most ``max_tokens``
    tokens."""
    ids, t, f = _ids(lm, ids, t, f)
    return integrated_gradients_rows(lm, ids, t, f, steps=int(steps), baseline=baseline,
                                     rows_per_pass=max(1, int(max_tokens) // ids.shape[1]), last_only=True)


@torch.no_grad()
def erasure(lm, ids, t, f, *, f_full: Tensor | None = None, max_tokens: int = 4096) -> dict[str, Tensor]:
    """Leave-one-out erasure at the last position of a causal model (as
    :func:`lenscope.attribution.baselines.erasure`): ``scores[b, j] = f(ids[b]) - f(ids[b] without j)``, the
    prediction read at the last position of each shortened sequence. ``{"erasure": (batch, pos), "f": (batch,)}``.
    ``f_full`` (the unablated objective) is computed unless given."""
    ids, t, f = _ids(lm, ids, t, f)
    B, n = ids.shape
    if n < 2:
        raise ValueError("erasure needs at least 2 tokens")
    keep = ~torch.eye(n, dtype=torch.bool, device=ids.device)  # (ablated j, pos)
    abl = ids[:, None, :].expand(B, n, n)[:, keep].reshape(B * n, n - 1)  # rows: (example, j)
    tt, ff = t.repeat_interleave(n), f.repeat_interleave(n)
    chunk = max(1, int(max_tokens) // (n - 1))
    with _eval_mode(lm.model):
        if f_full is None:
            f_full = _objective(_logits(lm, input_ids=ids, last_only=True)[:, -1], t, f)
        f_abl = torch.cat([_objective(_logits(lm, input_ids=abl[s : s + chunk], last_only=True)[:, -1],
                                      tt[s : s + chunk], ff[s : s + chunk]) for s in range(0, B * n, chunk)])
    f_full = torch.as_tensor(f_full, dtype=torch.float64, device=ids.device)
    scores = f_full[:, None] - f_abl.double().view(B, n)
    return {"erasure": scores.float().cpu(), "f": f_full.float().cpu()}


@torch.no_grad()
def sentence_logprob(lm, ids: list[int]) -> float:
    """``sum_k log p(ids[k] | ids[:k])`` for ``k >= 1`` (the first id is the start token)."""
    x = torch.as_tensor(ids, dtype=torch.long, device=_device(lm))[None]
    with _eval_mode(lm.model):
        logp = torch.log_softmax(_logits(lm, input_ids=x)[0, :-1].double(), -1)
    return float(logp.gather(-1, x[0, 1:, None]).sum())


@torch.no_grad()
def last_logit_diff(lm, ids, t, f) -> Tensor:
    """``logit[t] - logit[f]`` at the last position of each row (one forward pass, no capture)."""
    ids, t, f = _ids(lm, ids, t, f)
    with _eval_mode(lm.model):
        return _objective(_logits(lm, input_ids=ids, last_only=True)[:, -1], t, f).float().cpu()


__all__ = ["erasure", "gradients", "integrated_gradients", "last_logit_diff", "sentence_logprob", "traces"]
