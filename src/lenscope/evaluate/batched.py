"""Traces of many examples at once for the evaluation.

:func:`traces`: one forward pass with hooks over ``ids (batch, pos)`` (examples of the same token length, no
padding), cut into one :class:`~lenscope.models.trace.Trace` per row, for the Logit and ALTI-Logit
explanations (the logits are kept at the last position only; other rows are NaN). The gradient, integrated
gradients and erasure methods take batches themselves (``lenscope.attribution.baselines.*_rows``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import UnsupportedModelError
from ..models.families import family_for
from ..models.trace import Trace, register_captures


def _device(lm):
    from ..models.devices import main_device

    return main_device(lm.model)  # accelerate's execution device of a split model, never "meta"


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


__all__ = ["traces"]
