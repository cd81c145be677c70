"""The Trace: one forward pass of the real model with what the methods need captured.

Hooks go where the family module says (:class:`~lenscope.models.families.LayerHooks`); the tracer
itself knows nothing about families. All tensors are for a single sequence (no batch axis).

Devices and dtypes: a model split across devices (accelerate's ``device_map``) runs as placed; each capture
arrives on the device its block ran on and is copied into one ``(layer, ...)`` tensor on the trace's device
(``trace(..., device=)``; by default the ``math_device`` the model was loaded with, else the device of the first
block's capture, i.e. the model's own device for a model on one device). Captures of bfloat16 / float16 models are
stored in float32 (exact), the dtype the Anatomy computes in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..errors import UnsupportedModelError
from .devices import compute_dtype, main_device
from .families import family_for
from .load import LoadedModel, token_ids


@dataclass(repr=False)
class Trace:
    """Captured activations of one forward pass (shapes use named axes).

    - ``input_ids (pos,)``, ``tokens`` (strings), ``positions (pos,)``
    - ``embed (pos, d_model)``: the residual stream entering layer 0
    - ``resid_pre, resid_mid, resid_post (layer, pos, d_model)``: before the block, after its attention
      part (for parallel blocks ``resid_pre + attn_write``, which the model never materialises), after it
    - ``attn_out, mlp_out (layer, pos, d_model)``: what each sub-layer computed (with output biases)
    - ``attn_write, mlp_write (layer, pos, d_model)``: what it added to the residual stream (after the
      sandwich norms of Gemma; equal to ``*_out`` elsewhere)
    - ``attn_probs (layer, head, pos, src)``
    - ``mlp_pre (layer, pos, d_mlp)``: pre-activation of the activated branch; ``mlp_up``: the linear
      branch of gated MLPs (else None)
    - ``norm_in[slot], norm_out[slot] (layer, pos, d_model)`` for every norm slot of the blocks
    - ``final_in, final_out (pos, d_model)``: the final norm's input and output (None for encoders)
    - ``logits (pos, vocab)`` (None for a model without a language-model head)
    """

    input_ids: Tensor
    tokens: list[str]
    positions: Tensor
    embed: Tensor
    resid_pre: Tensor
    resid_mid: Tensor
    resid_post: Tensor
    attn_out: Tensor
    attn_write: Tensor
    mlp_out: Tensor
    mlp_write: Tensor
    attn_probs: Tensor
    mlp_pre: Tensor
    mlp_up: Tensor | None
    norm_in: dict[str, Tensor]
    norm_out: dict[str, Tensor]
    final_in: Tensor | None
    final_out: Tensor | None
    logits: Tensor | None
    placement: str
    extras: dict = field(default_factory=dict)

    @property
    def n_layers(self) -> int:
        return self.resid_pre.shape[0]

    @property
    def attn_in(self) -> Tensor:
        """What each attention sub-layer read (layer, pos, d_model)."""
        return self.resid_pre if self.placement == "post" else self.norm_out["ln_attn"]

    @property
    def mlp_in(self) -> Tensor:
        """What each MLP read (layer, pos, d_model)."""
        return self.resid_mid if self.placement == "post" else self.norm_out["ln_mlp"]

    @property
    def final_resid(self) -> Tensor:
        """The last residual state (pos, d_model): input of the final norm, or the encoder's output."""
        return self.final_in if self.final_in is not None else self.resid_post[-1]

    def __repr__(self) -> str:
        return f"Trace(pos={len(self.tokens)}, layers={self.n_layers}, placement={self.placement!r})"


def _run(lm: LoadedModel, ids: Tensor):
    """The real model's forward pass on ``ids (batch, pos)`` (no padding, no cache)."""
    device = main_device(lm.model)  # for a dispatched model: where accelerate takes the inputs
    kwargs = {"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids).to(device)}
    if lm.anatomy.causal:
        kwargs["use_cache"] = False
    return lm.model(**kwargs)


def _first(x):
    return x[0] if isinstance(x, (tuple, list)) else x


@torch.no_grad()
def register_captures(hooks, put, handles: list) -> None:
    """Forward hooks on the real model (``hooks``: its family's hook points) that hand every capture lenscope
    reads to ``put(key, tensor)``; the handles are appended to ``handles`` (the caller removes them).
    Keys: ``("resid_pre"|"resid_post"|"attn_probs"|"attn_out"|"mlp_out"|"mlp_pre"|"mlp_up", layer)`` and
    ``("norm_in"|"norm_out", slot, layer)`` (slot ``"final"``, layer 0, for the final norm)."""

    def on_in(key):
        def f(mod, args, kwargs):
            put(key, args[0] if args else kwargs["hidden_states"])

        return f

    def on_out(key, index=None):
        def f(mod, args, output):
            put(key, output[index] if index is not None else _first(output))

        return f

    def on_norm(key):
        def f(mod, args, output):
            put(("norm_in",) + key, args[0])
            put(("norm_out",) + key, _first(output))

        return f

    for i, lh in enumerate(hooks.layers):
        handles.append(lh.block.register_forward_pre_hook(on_in(("resid_pre", i)), with_kwargs=True))
        handles.append(lh.block.register_forward_hook(on_out(("resid_post", i))))
        handles.append(lh.attn.register_forward_hook(on_out(("attn_probs", i), index=1)))
        handles.append(lh.attn_out.register_forward_hook(on_out(("attn_out", i))))
        handles.append(lh.mlp_out.register_forward_hook(on_out(("mlp_out", i))))
        handles.append(lh.act.register_forward_pre_hook(lambda m, a, i=i: put(("mlp_pre", i), a[0])))
        if lh.up is not None:
            handles.append(lh.up.register_forward_hook(on_out(("mlp_up", i))))
        for slot, mod in lh.norms.items():
            handles.append(mod.register_forward_hook(on_norm((slot, i))))
    if hooks.final_norm is not None:
        handles.append(hooks.final_norm.register_forward_hook(on_norm(("final", 0))))


def trace(lm: LoadedModel, text: str | list[int] | Tensor, *, device: str | torch.device | None = None) -> Trace:
    """Run the model once on ``text`` (or token ids) and capture everything lenscope's methods read.

    ``device``: where the captures are kept (default: the ``math_device`` the model was loaded with, else where the
    first block's capture arrives: the model's device for a model on one device). Captures of bfloat16 / float16
    models are kept in float32."""
    model, tok, anatomy = lm
    device = device if device is not None else anatomy.extras.get("placement", {}).get("math_device")
    target = None if device is None else torch.device(device)
    ids = token_ids(lm, text)
    hooks = family_for(model).hooks(model)
    L = len(hooks.layers)
    store: dict[tuple, Tensor] = {}  # the final norm's input and output
    bufs: dict[tuple, Tensor] = {}  # per-layer captures, copied into one (layer, ...) tensor as they arrive
    seen: set = set()
    handles = []

    def put(key, value):
        if key in seen:
            raise UnsupportedModelError(
                f"hook {key} fired twice in one forward pass; this model variant is not supported")
        seen.add(key)
        if value is None:
            raise UnsupportedModelError(
                f"{key[0]} was not returned by the model; load it with attn_implementation='eager'"
            )
        value = value.detach()
        if target is not None and value.device != target:
            value = value.to(target)
        value = value.to(compute_dtype(value.dtype))
        # drop the batch axis; some modules see (batch * pos, d) instead (OPT's MLP), batch is 1 here
        value = value[0] if value.dim() >= 3 else value
        base, i = key[:-1], key[-1]
        if base[-1] == "final":
            store[key] = value
            return
        buf = bufs.get(base)
        if buf is None:  # preallocated, so no capture is ever held twice (long inputs: GBs of attention)
            buf = bufs[base] = value.new_empty((L,) + tuple(value.shape))
        buf[i].copy_(value)  # from the device the block ran on to the trace's device

    try:
        register_captures(hooks, put, handles)
        out = _run(lm, ids[None])
    finally:
        for h in handles:
            h.remove()

    def stack(name):
        return bufs[(name,)]

    slots = list(hooks.layers[0].norms)
    norm_in = {s: bufs[("norm_in", s)] for s in slots}
    norm_out = {s: bufs[("norm_out", s)] for s in slots}
    resid_pre, resid_post = stack("resid_pre"), stack("resid_post")
    attn_out, mlp_out = stack("attn_out"), stack("mlp_out")
    attn_write = norm_out["ln_attn_out"] if "ln_attn_out" in norm_out else attn_out
    mlp_write = norm_out["ln_mlp_out"] if "ln_mlp_out" in norm_out else mlp_out
    placement = anatomy.placement
    if placement == "post":
        resid_mid = norm_out["ln_attn"]
    elif placement == "parallel":
        resid_mid = resid_pre + attn_write
    else:
        resid_mid = norm_in["ln_mlp"]
    logits = getattr(out, "logits", None)
    if logits is not None:
        logits = logits.detach()[0].to(device=resid_pre.device, dtype=compute_dtype(logits.dtype))
    final_in, final_out = store.get(("norm_in", "final", 0)), store.get(("norm_out", "final", 0))
    if final_in is not None:
        final_in, final_out = final_in.to(resid_pre.device), final_out.to(resid_pre.device)
    return Trace(
        input_ids=ids.cpu(),
        tokens=tok.batch_decode([[int(i)] for i in ids]),
        positions=torch.arange(ids.numel(), device=resid_pre.device),
        embed=resid_pre[0],
        resid_pre=resid_pre,
        resid_mid=resid_mid,
        resid_post=resid_post,
        attn_out=attn_out,
        attn_write=attn_write,
        mlp_out=mlp_out,
        mlp_write=mlp_write,
        attn_probs=stack("attn_probs"),
        mlp_pre=stack("mlp_pre"),
        mlp_up=stack("mlp_up") if hooks.layers[0].up is not None else None,
        norm_in=norm_in,
        norm_out=norm_out,
        final_in=final_in,
        final_out=final_out,
        logits=logits,
        placement=placement,
    )


@torch.no_grad()
def residual_states(lm: LoadedModel, ids: Tensor, *, mid: bool = False,
                    device: str | torch.device | None = None) -> dict[str, Tensor]:
    """Lean batched capture for lenses: ``ids (batch, pos)`` ->

    - ``states (layer + 1, batch, pos, d_model)``: the residual entering each block, then the last state
    - ``mid (layer, batch, pos, d_model)`` (when ``mid=True``): the residual after each block's attention
    - ``logits (batch, pos, vocab)``: the model's output

    All on ``device`` (default: the model's ``math_device``, else where the first block's input arrives); float32
    for bfloat16 / float16 models.
    """
    model, _, anatomy = lm
    ids = torch.as_tensor(ids, dtype=torch.long)
    if ids.dim() == 1:
        ids = ids[None]
    hooks = family_for(model).hooks(model)
    store: dict = {}
    handles = []
    placement = anatomy.placement
    shape = ids.shape

    device = device if device is not None else anatomy.extras.get("placement", {}).get("math_device")
    where = [None if device is None else torch.device(device)]

    def keep(key, x):
        x = x.detach()
        if where[0] is None:
            where[0] = x.device
        store[key] = x.to(device=where[0], dtype=compute_dtype(x.dtype)).reshape(*shape, x.shape[-1])

    try:
        for i, lh in enumerate(hooks.layers):
            handles.append(lh.block.register_forward_pre_hook(
                lambda m, a, k, i=i: keep(("pre", i), a[0] if a else k["hidden_states"]), with_kwargs=True))
            if mid and placement in ("pre", "sandwich"):
                handles.append(lh.norms["ln_mlp"].register_forward_pre_hook(lambda m, a, i=i: keep(("mid", i), a[0])))
            elif mid and placement == "post":
                handles.append(lh.norms["ln_attn"].register_forward_hook(
                    lambda m, a, o, i=i: keep(("mid", i), _first(o))))
            elif mid:  # parallel: what attention wrote, added to the block input below
                handles.append(lh.attn_out.register_forward_hook(lambda m, a, o, i=i: keep(("attn", i), _first(o))))
        last = hooks.layers[-1].block
        handles.append(last.register_forward_hook(lambda m, a, o: keep(("last", 0), _first(o))))
        if hooks.final_norm is not None:
            handles.append(hooks.final_norm.register_forward_pre_hook(lambda m, a: keep(("final", 0), a[0])))
        out = _run(lm, ids)
    finally:
        for h in handles:
            h.remove()
    L = anatomy.n_layers
    final = store.get(("final", 0), store[("last", 0)])
    res = {"states": torch.stack([store[("pre", i)] for i in range(L)] + [final])}
    if mid:
        if placement == "parallel":
            res["mid"] = torch.stack([store[("pre", i)] + store[("attn", i)] for i in range(L)])
        else:
            res["mid"] = torch.stack([store[("mid", i)] for i in range(L)])
    logits = getattr(out, "logits", None)
    res["logits"] = None if logits is None else logits.detach().to(device=where[0], dtype=compute_dtype(logits.dtype))
    return res


def prefix_trace(tr: Trace, n: int) -> Trace:
    """The trace of the first ``n`` tokens, cut from ``tr``. Exact for causal models only (a position never
    sees later ones), where it lets a method that explains position ``n - 1`` skip the rest of the text."""
    if n >= len(tr.tokens):
        return tr

    def cut(x, axes):
        if x is None:
            return None
        for ax in axes:
            x = x.narrow(ax, 0, n)
        return x

    return Trace(
        input_ids=tr.input_ids[:n], tokens=tr.tokens[:n], positions=tr.positions[:n], embed=tr.embed[:n],
        resid_pre=cut(tr.resid_pre, [1]), resid_mid=cut(tr.resid_mid, [1]), resid_post=cut(tr.resid_post, [1]),
        attn_out=cut(tr.attn_out, [1]), attn_write=cut(tr.attn_write, [1]), mlp_out=cut(tr.mlp_out, [1]),
        mlp_write=cut(tr.mlp_write, [1]), attn_probs=cut(tr.attn_probs, [2, 3]), mlp_pre=cut(tr.mlp_pre, [1]),
        mlp_up=cut(tr.mlp_up, [1]), norm_in={k: cut(v, [1]) for k, v in tr.norm_in.items()},
        norm_out={k: cut(v, [1]) for k, v in tr.norm_out.items()}, final_in=cut(tr.final_in, [0]),
        final_out=cut(tr.final_out, [0]), logits=cut(tr.logits, [0]), placement=tr.placement, extras=tr.extras,
    )
