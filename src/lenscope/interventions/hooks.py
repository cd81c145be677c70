"""Batched hooks that capture and *replace* activations, at the modules ``models/families`` names.

One forward pass of a batch ``ids (batch, pos)`` where every row may carry its own edits. The sites
(``layer`` indexes the blocks; shapes are what a hook sees, reshaped to ``(batch, pos, ...)``):

- ``"resid"``: the input of block ``layer``, the residual stream before it      ``(batch, pos, d_model)``
- ``"attn"``:  the output of the attention output projection (``attn_out``)     ``(batch, pos, d_model)``
- ``"mlp"``:   the output of the MLP down projection (``mlp_out``)               ``(batch, pos, d_model)``
- ``"head"``:  the input of ``attn_out``, the concatenated per-head outputs     ``(batch, pos, head, d_head)``
- ``"hidden"``: the input of ``mlp_out``, the MLP's hidden units (act(gate)·up for gated MLPs)
                                                                                  ``(batch, pos, d_mlp)``

The code never asks which family it runs on: it only uses :class:`~lenscope.models.families.LayerHooks`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..models.families import family_for
from ..models.load import LoadedModel

SITES = ("resid", "attn", "mlp", "head", "hidden")


@dataclass
class Edit:
    """Replace (``mode="set"``), add to (``"add"``) or multiply (``"scale"``) the activation at ``site`` of
    block ``layer`` for the entries ``(rows[n], pos[n])`` (and ``head[n]`` for ``site="head"``).

    ``rows, pos, head: (n,)`` long; ``values: (n, d)`` where ``d`` is the site's last axis (``d_head`` for
    heads), or ``(n,)``/``(n, d)`` factors for ``"scale"``. Edits at one site apply in list order.
    """

    site: str
    layer: int
    rows: Tensor
    pos: Tensor
    values: Tensor
    head: Tensor | None = None
    mode: str = "set"


def n_heads(lm: LoadedModel, layer: int) -> int:
    return int(lm.anatomy.layers[layer].attn.W_O.shape[0])


def _apply(x: Tensor, edits: list[Edit], B: int, P: int, H: int | None) -> Tensor:
    shape = x.shape
    x = x.reshape(B, P, shape[-1]).clone()  # some modules see (batch * pos, d) (OPT's MLP)
    view = x if H is None else x.view(B, P, H, shape[-1] // H)
    for e in edits:
        idx = (e.rows, e.pos) if e.head is None else (e.rows, e.pos, e.head)
        idx = tuple(i.to(x.device) for i in idx)
        v = e.values.to(x.device, x.dtype)
        if e.mode == "set":
            view[idx] = v
        elif e.mode == "add":
            view[idx] = view[idx] + v
        elif e.mode == "scale":
            view[idx] = view[idx] * (v if v.dim() == view[idx].dim() else v[..., None])
        else:
            raise ValueError(f"unknown edit mode {e.mode!r}")
    return x.reshape(shape)


def _view(x: Tensor, B: int, P: int, H: int | None) -> Tensor:
    x = x.reshape(B, P, x.shape[-1])
    return x if H is None else x.reshape(B, P, H, x.shape[-1] // H)


class _Stop(Exception):
    pass


def run(lm: LoadedModel, ids: Tensor, edits: list[Edit] = (), capture=(), *, stop_after: tuple | None = None,
        logits: bool = True, grad: bool = False):
    """Run the model on ``ids (batch, pos)`` with ``edits`` applied; return ``(logits, captured)``.

    ``logits (batch, pos, vocab)`` (None with ``stop_after``); ``captured[(site, layer)]`` is the activation as
    the model used it (after the edits at that site), shaped as in the module docstring. ``stop_after=(site,
    layer)`` ends the pass as soon as that capture is taken (cheap reads of early activations).
    """
    model = lm.model
    ids = torch.as_tensor(ids, dtype=torch.long)
    if ids.dim() == 1:
        ids = ids[None]
    B, P = ids.shape
    hooks = family_for(model).hooks(model)
    by_site: dict[tuple, list[Edit]] = {}
    for e in edits:
        if e.site not in SITES:
            raise ValueError(f"unknown site {e.site!r}")
        by_site.setdefault((e.site, e.layer), []).append(e)
    capture = set(capture)
    got: dict[tuple, Tensor] = {}
    handles = []

    def handle(key, x):
        H = n_heads(lm, key[1]) if key[0] == "head" else None
        es = by_site.get(key)
        if es:
            x = _apply(x, es, B, P, H)
        if key in capture:
            got[key] = _view(x if grad else x.detach(), B, P, H)
        if stop_after is not None and key == tuple(stop_after):
            raise _Stop
        return x

    def pre_kw(key):
        def f(mod, args, kwargs):
            if args:
                return (handle(key, args[0]),) + tuple(args[1:]), kwargs
            kwargs = dict(kwargs)
            kwargs["hidden_states"] = handle(key, kwargs["hidden_states"])
            return args, kwargs

        return f

    def pre(key):
        def f(mod, args):
            return (handle(key, args[0]),) + tuple(args[1:])

        return f

    def post(key):
        def f(mod, args, out):
            if isinstance(out, tuple):
                return (handle(key, out[0]),) + out[1:]
            return handle(key, out)

        return f

    wanted = set(by_site) | capture | ({tuple(stop_after)} if stop_after else set())
    try:
        for i, lh in enumerate(hooks.layers):
            if ("resid", i) in wanted:
                handles.append(lh.block.register_forward_pre_hook(pre_kw(("resid", i)), with_kwargs=True))
            if ("attn", i) in wanted:
                handles.append(lh.attn_out.register_forward_hook(post(("attn", i))))
            if ("mlp", i) in wanted:
                handles.append(lh.mlp_out.register_forward_hook(post(("mlp", i))))
            if ("head", i) in wanted:
                handles.append(lh.attn_out.register_forward_pre_hook(pre(("head", i))))
            if ("hidden", i) in wanted:
                handles.append(lh.mlp_out.register_forward_pre_hook(pre(("hidden", i))))
        from ..models.devices import main_device

        device = main_device(model)  # accelerate's execution device of a split model, never "meta"
        kwargs = {"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids).to(device)}
        if lm.anatomy.causal:
            kwargs["use_cache"] = False
        try:
            with torch.set_grad_enabled(grad):
                out = model(**kwargs)
        except _Stop:
            return None, got
    finally:
        for h in handles:
            h.remove()
    lg = getattr(out, "logits", None) if logits else None
    return (lg if grad or lg is None else lg.detach()), got


def batches(n: int, size: int):
    """``range`` chunks ``[start, stop)`` covering ``0..n`` in steps of ``size``."""
    size = max(1, int(size))
    for s in range(0, n, size):
        yield s, min(n, s + size)
