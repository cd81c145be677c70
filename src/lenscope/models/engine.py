"""The engine: the one way lenscope runs a real model with hooks, reads any site and edits it.

Every method reaches the model through :func:`run` (or :func:`capture`, the same without edits); ``Trace``,
``residual_states``, the interventions and the batched evaluation are views on it. The hooks go on the modules
that the family file names (:class:`~lenscope.models.families.LayerHooks`); nothing here asks which family it runs.

Sites, their shapes and which can be edited: the table in :mod:`lenscope.models.sites`.

Edits (:class:`Edit`) set, add to or scale a site's entries per batch row and position (and head). Captures
keep what the model used, after the edits at that site. Padding: with ``attention_mask`` (``1`` = real token),
captured positions where the mask is ``0`` are NaN, so nothing downstream can read them by accident.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

import torch
from torch import Tensor

from ..errors import InputError, NotApplicableError, UnsupportedModelError
from .devices import compute_dtype, main_device
from .dictionary import Attached
from .families import family_for
from .load import LoadedModel
from .moe import MOE_SITES
from .sites import (  # noqa: F401 (the site table lives in sites.py; re-exported here)
    _ALL,
    HEAD_SITES,
    LATENT_SITES,
    LAYER_SITES,
    MODEL_SITES,
    NORM_SITES,
    NORM_SLOTS,
    READ_ONLY,
    ROUTER_SITES,
    Captures,
    Edit,
    canonical,
    edits_within,
    site_key,
)
from .stop import checkpoint


class Run(NamedTuple):
    """What :func:`run` returns: ``logits (b, p, vocab)`` (None when not asked or stopped early) and the
    captured sites."""

    logits: Tensor | None
    captured: Captures


def forward_kwargs(lm: LoadedModel, ids: Tensor | None = None, *, inputs_embeds: Tensor | None = None,
                   attention_mask: Tensor | None = None, last_only: bool = False, past=None) -> dict:
    """The keyword arguments of the real model's forward pass (the only place they are built): inputs on the
    model's input device, an all-ones mask unless one is given, no cache for causal models unless ``past`` (a
    key/value cache of the earlier positions, :func:`new_cache`) is given, and (causal models) only the last
    position's logits when ``last_only``."""
    device = main_device(lm.model)  # accelerate's execution device of a split model, never "meta"
    x = ids if ids is not None else inputs_embeds
    start = 0 if past is None else past.get_seq_length()
    if attention_mask is None:
        attention_mask = torch.ones((x.shape[0], start + x.shape[1]), dtype=torch.long)
    kw = {"attention_mask": attention_mask.to(device)}
    if ids is not None:
        kw["input_ids"] = ids.to(device)
    else:
        kw["inputs_embeds"] = inputs_embeds.to(device)
    if lm.anatomy.causal:
        kw["use_cache"] = past is not None
        if past is not None:
            kw["cache"] = past
        if last_only:
            kw["logits_to_keep"] = 1
    return kw


def new_cache(lm: LoadedModel):
    """An empty key/value cache for :func:`run`'s ``past`` (transformers' ``DynamicCache`` for this model's
    layers, sliding windows included)."""
    from transformers import DynamicCache

    return DynamicCache(config=lm.model.config)


class _Stop(Exception):
    pass


def _first(x):
    return x[0] if isinstance(x, (tuple, list)) else x


def _n_heads(lm: LoadedModel, name: str, layer: int) -> int:
    A = lm.anatomy.layers[layer].attn
    return A.n_kv_heads if name in ("k", "v") else A.n_heads


def _apply(view: Tensor, edits: list[Edit]) -> None:
    """Apply ``edits`` in place to ``view (b, p, ...)``."""
    for e in edits:
        idx = (e.rows, e.pos) if e.head is None else (e.rows, e.pos, e.head)
        idx = tuple(torch.as_tensor(i).to(view.device) for i in idx)
        v = e.values.to(view.device, view.dtype)
        if e.mode == "set":
            view[idx] = v
        elif e.mode == "add":
            view[idx] = view[idx] + v
        else:
            view[idx] = view[idx] * (v if v.dim() == view[idx].dim() else v[..., None])


class _Session:
    """One forward pass: the requested captures, the edits by site, the hooks."""

    def __init__(self, lm, B, P, edits, capture, stop_after, grad, device, upcast, dictionaries=(), splice=False):
        self.lm, self.B, self.P, self.grad, self.upcast = lm, B, P, grad, upcast
        self.device = None if device is None else torch.device(device)
        self.by_site: dict[tuple, list[Edit]] = {}
        L = lm.anatomy.n_layers
        for e in edits:
            key = site_key((e.site, e.layer))
            if key[0] in READ_ONLY:
                instead = "q, k, v or head" if key[0] == "pattern" else "resid_pre, attn_out, mlp_out or resid_post"
                raise NotApplicableError(f"site {key[0]!r} can be captured but not edited; edit {instead} instead")
            if key[1] is not None and not 0 <= key[1] < L:
                raise InputError(f"edit at block {key[1]} of a {L}-block model")
            self.by_site.setdefault(key, []).append(e)
        self.capture = {site_key(s) for s in capture}  # a set: every hook call asks "is this site kept?"
        self.stop_after = None if stop_after is None else site_key(stop_after)
        self.out = Captures()
        self.seen: set = set()
        # capture per name: the requested blocks, in ascending order (the buffer's first axis)
        self.layers_of: dict[str, list[int]] = {}
        for name, layer in self.capture:
            if name in MODEL_SITES:
                continue
            if not 0 <= layer < L:
                raise InputError(f"capture at block {layer} of a {L}-block model")
            self.layers_of.setdefault(name, [])
            if layer not in self.layers_of[name]:
                self.layers_of[name].append(layer)
        for v in self.layers_of.values():
            v.sort()
        self.dicts = Attached(lm, dictionaries, splice, self.capture, self.by_site, self.stop_after)

    # -- what a hook does with a tensor ------------------------------------------------------------

    def shaped(self, name, layer, x):
        """``x`` as ``(b, p, ...)`` (some modules see ``(b * p, d)``: OPT's MLP); heads split for per-head sites."""
        if name == "pattern" or name.endswith(".scale"):
            return x
        if name == "expert_out":
            return x.reshape(self.B, self.P, *x.shape[-2:])
        x = x.reshape(self.B, self.P, x.shape[-1])
        if name in HEAD_SITES:
            H = _n_heads(self.lm, name, layer)
            x = x.reshape(self.B, self.P, H, x.shape[-1] // H)
        return x

    apply = staticmethod(lambda view, edits: _apply(view, edits))

    @staticmethod
    def stop():
        raise _Stop

    def keep(self, key, value):
        if key in self.seen:
            raise UnsupportedModelError(f"hook {key} fired twice in one forward pass; this model variant is not "
                                        "supported")
        self.seen.add(key)
        if value is None:
            raise UnsupportedModelError(f"{key[0]} was not returned by the model; load it with "
                                        "attn_implementation='eager'")
        if not self.grad:
            value = value.detach()
        if self.device is not None and value.device != self.device:
            value = value.to(self.device)
        if self.upcast:
            value = value.to(compute_dtype(value.dtype))
        name, layer = key
        if layer is None or self.grad or name in LATENT_SITES:  # latents: each dictionary its own width
            self.out[key] = value
            return
        layers = self.layers_of[name]
        if name not in self.out._bufs:  # preallocated: long inputs hold GBs of attention, never twice
            self.out._bufs[name] = (layers, value.new_empty((len(layers),) + tuple(value.shape)))
        buf = self.out._bufs[name][1]
        j = layers.index(layer)
        buf[j].copy_(value)
        self.out[key] = buf[j]

    def wants(self, key) -> bool:
        return key in self.by_site or key in self.capture or key == self.stop_after or self.dicts.hooks(key)

    def visit(self, key, x):
        """Edit and capture the site ``key`` whose tensor is ``x`` (as the module has it); return what the
        model goes on with."""
        name, layer = key
        es = self.by_site.get(key)
        if es:
            shape = x.shape
            x = x.clone()
            _apply(self.shaped(name, layer, x), es)
            x = x.reshape(shape)
        if self.dicts.hooks(key):  # a dictionary's site or a transcoder's input
            x = self.dicts.visit(key, x, self)
        if key in self.capture:
            v = self.shaped(name, layer, x)
            if self.grad and x.is_floating_point() and name not in READ_ONLY:
                if not v.requires_grad:
                    v = v.detach().requires_grad_(True)  # a leaf the gradient of the output reaches
                # the model goes on from the captured tensor (a copy in the graph: a model may add to a module's
                # output in place, as Falcon's block does to its MLP's, which must not change the capture)
                x = v.clone().reshape(x.shape)
            self.keep(key, v)
        if key == self.stop_after:
            raise _Stop
        return x

    def norm_scale(self, slot, layer, x):
        A = self.lm.anatomy
        norm = A.final_norm if slot == "ln_final" else A.layers[layer].norms()[slot]
        return norm.scale(x.reshape(self.B, self.P, x.shape[-1]))


def _register(s: _Session, hooks, handles: list) -> None:
    """Put on the real model the hooks the session needs (and only those)."""

    def on_input(fn):  # a pre-hook (with_kwargs) passing the first input (or ``hidden_states``) through ``fn``
        def f(mod, args, kwargs):
            if args:
                return (fn(args[0]),) + tuple(args[1:]), kwargs
            return args, {**kwargs, "hidden_states": fn(kwargs["hidden_states"])}
        return f

    def pre(key, kw=False):
        if kw:
            return on_input(lambda x: s.visit(key, x))

        def g(mod, args):
            return (s.visit(key, args[0]),) + tuple(args[1:])
        return g

    def post(key, index=0):
        def f(mod, args, out):
            if isinstance(out, tuple):
                return out[:index] + (s.visit(key, out[index]),) + out[index + 1:]
            return s.visit(key, out)
        return f

    def fused(layer, layout):
        keys = [(n, layer) for n in ("q", "k", "v")]

        def f(mod, args, out):
            if not any(s.wants(k) for k in keys):
                return out
            write = any(k in s.by_site or (s.grad and k in s.capture) for k in keys)
            B, P = s.B, s.P
            H, K = _n_heads(s.lm, "q", layer), _n_heads(s.lm, "k", layer)
            if layout == "blocks":  # [q | k | v], heads in order in each (GPT-2; Phi-3 with fewer key/value heads)
                e = out.shape[-1] // (H + 2 * K)
                parts, dim = out.view(B, P, -1).split([H * e, K * e, K * e], dim=-1), -1
            else:  # "grouped": per key/value head its query heads, key, value ([q_1 .. q_g k v], each d_head)
                parts, dim = out.view(B, P, K, H // K + 2, -1).split([H // K, 1, 1], dim=3), 3
            # the model goes on from the visited parts, put together anew (never written into a captured view: a
            # captured part must stay a node of the graph its gradient is taken through)
            new = [s.visit(k, part.reshape(B, P, -1)).reshape(part.shape) if s.wants(k) else part
                   for k, part in zip(keys, parts)]
            return torch.cat(new, dim=dim).reshape(out.shape) if write else out
        return f

    def router(layer):
        kl, kw = ("router_logits", layer), ("routing_weights", layer)

        def f(mod, args, out):  # out: router logits, the chosen experts' weights, their indices
            if s.wants(kl):
                s.visit(kl, out[0])
            if s.wants(kw):  # dense over the experts: 0 for those not chosen
                s.visit(kw, out[1].new_zeros(out[2].shape[0], out[0].shape[-1]).scatter(1, out[2], out[1]))
            return out
        return f

    def experts(layer):
        keys = {n: (n, layer) for n in MOE_SITES}

        def f(mod, args, out):
            if not any(s.wants(k) for k in keys.values()):
                return out
            if len(args) < 3:
                raise UnsupportedModelError("this mixture-of-experts block passes its experts keyword arguments")
            x, idx, w = args[:3]
            moe = s.lm.anatomy.layers[layer].mlp
            weights = w.new_zeros(idx.shape[0], moe.n_experts).scatter(1, idx, w)

            def visit(name, t):
                return s.visit(keys[name], t) if s.wants(keys[name]) else t

            if any(k in s.by_site for k in keys.values()):  # the edit's change, on the model's own output (with
                total = moe.run(x, weights, visit)  # gradients the unedited path cancels the model's own)
                return out + (total - moe.run(x, weights, lambda name, t: t)).to(out)
            total = moe.run(x.detach(), weights.detach(), visit)  # unedited: captures beside the model's own path
            return out + (total - total.detach()).to(out) if s.grad and any(k in s.capture for k in keys.values()) \
                else out  # with grad=True: the same numbers, and the gradient reaches the captures
        return f

    def second_half(key):  # a fused [gate | up] projection (Phi-3): the site is its second half
        def f(mod, args, out):
            gate, up = out.chunk(2, dim=-1)
            return out if (new := s.visit(key, up)) is up else torch.cat([gate, new], dim=-1)
        return f

    def norm(slot, layer, mod):
        kin, kout, kscale = ((f"{slot}.{w}", layer) for w in ("in", "out", "scale"))
        if s.wants(kin):
            handles.append(mod.register_forward_pre_hook(pre(kin)))
        if s.wants(kout) or s.wants(kscale):
            def f(mod, args, out):
                if s.wants(kscale):
                    s.visit(kscale, s.norm_scale(slot, layer, args[0]))
                return post(kout)(mod, args, out) if s.wants(kout) else out
            handles.append(mod.register_forward_hook(f))

    def absent_norm(slot, layer, reader):
        """The sites of a norm slot the block lacks (the Anatomy's identity norm: OLMo 2's pre-norms): its input,
        scale and output are all the input of ``reader``, the sub-layer that reads the slot."""
        kin, kout, kscale = ((f"{slot}.{w}", layer) for w in ("in", "out", "scale"))

        def f(x):
            if s.wants(kin):
                x = s.visit(kin, x)
            if s.wants(kscale):
                s.visit(kscale, s.norm_scale(slot, layer, x))
            return s.visit(kout, x) if s.wants(kout) else x
        if any(s.wants(k) for k in (kin, kout, kscale)):
            handles.append(reader.register_forward_pre_hook(on_input(f), with_kwargs=True))

    def shared_norm(layer, mod, reader):
        """The ``ln_mlp`` sites of a norm that attention and the MLP share (``LayerHooks.readers``): the MLP reads
        its own copy, the real norm module run again on the block's input as it entered the norm (before any
        ``ln_attn`` edit), after the ``ln_mlp`` edits."""
        keys = [(f"{slot}.{w}", layer) for slot in ("ln_attn", "ln_mlp") for w in ("in", "out", "scale")]
        if not any(s.wants(k) for k in keys):  # the model's own single norm then serves both
            return
        kin, kout, kscale = keys[3:]
        stash: list = []

        def keep_input(mod, args):  # registered before the ln_attn hooks: sees the input they may edit
            stash.append(args[0])

        def mlp_input(_, args):
            x = stash.pop()
            if s.wants(kin):
                x = s.visit(kin, x)
            if s.wants(kscale):
                s.visit(kscale, s.norm_scale("ln_mlp", layer, x))
            y = mod.forward(x)  # forward, not __call__: the norm's own hooks are the ln_attn sites
            if s.wants(kout):
                y = s.visit(kout, y)
            return (y,) + tuple(args[1:])

        handles.append(mod.register_forward_pre_hook(keep_input))
        handles.append(reader.register_forward_pre_hook(mlp_input))

    for i, lh in enumerate(hooks.layers):
        w = lambda name, i=i: s.wants((name, i))  # noqa: E731
        if w("resid_pre"):
            handles.append(lh.block.register_forward_pre_hook(pre(("resid_pre", i), kw=True), with_kwargs=True))
        if w("resid_post"):
            handles.append(lh.block.register_forward_hook(post(("resid_post", i))))
        if w("pattern"):
            handles.append(lh.attn.register_forward_hook(post(("pattern", i), index=1)))
        if w("attn_out"):
            handles.append(lh.attn_out.register_forward_hook(post(("attn_out", i))))
        if w("head"):
            handles.append(lh.attn_out.register_forward_pre_hook(pre(("head", i))))
        if w("mlp_out"):
            handles.append(lh.mlp_out.register_forward_hook(post(("mlp_out", i))))
        if lh.experts is not None:  # a mixture of experts: the MLP sites come from the experts module
            if any(w(n) for n in MOE_SITES):
                handles.append(lh.experts.register_forward_hook(experts(i)))
            if any(w(n) for n in ROUTER_SITES):
                handles.append(lh.router.register_forward_hook(router(i)))
        else:
            for n in (n for n in ROUTER_SITES + ("expert_out",) if w(n)):
                raise NotApplicableError(f"site {n!r} exists only for mixture-of-experts blocks; block {i} is dense")
            if w("mlp_hidden"):
                handles.append(lh.mlp_out.register_forward_pre_hook(pre(("mlp_hidden", i))))
            if w("mlp_pre"):
                handles.append(lh.act.register_forward_pre_hook(pre(("mlp_pre", i))))
            if w("mlp_up"):
                if lh.up is None:
                    raise NotApplicableError("site 'mlp_up' exists only for gated MLPs")
                handles.append(lh.up.register_forward_hook(second_half(("mlp_up", i)) if lh.up_fused
                                                           else post(("mlp_up", i))))
        if w("q") or w("k") or w("v"):
            if lh.qkv is not None:
                handles.append(lh.qkv.register_forward_hook(fused(i, lh.qkv_layout)))
            else:
                for name, mod in (("q", lh.q), ("k", lh.k), ("v", lh.v)):
                    if w(name):
                        handles.append(mod.register_forward_hook(post((name, i))))
        for slot, mod in lh.norms.items():
            if slot in lh.readers:  # a norm shared with ln_attn: the reader runs its own copy
                shared_norm(i, mod, lh.readers[slot])
        for slot, mod in lh.norms.items():
            if slot not in lh.readers:
                norm(slot, i, mod)
        for slot, reader in lh.readers.items():
            if slot not in lh.norms:
                absent_norm(slot, i, reader)
        for slot in NORM_SLOTS:
            if slot not in {**lh.norms, **lh.readers} and any(w(f"{slot}.{x}") for x in ("in", "out", "scale")):
                raise NotApplicableError(f"this model's blocks have no norm {slot!r}; they have "
                                         f"{', '.join(lh.norms)}")
    if any(s.wants((n, None)) for n in MODEL_SITES[:3]):
        if hooks.final_norm is None:
            raise NotApplicableError("this model has no final norm (site 'ln_final')")
        norm("ln_final", None, hooks.final_norm)


def _derive_mid(lm, s: _Session, layers: list[int]) -> None:
    """``resid_mid`` from what the model materialises (see the site table)."""
    placement = lm.anatomy.placement
    out = s.out
    vals = []
    for i in layers:
        if placement == "post":
            vals.append(out[("ln_attn.out", i)])
        elif placement == "parallel":
            vals.append(out[("resid_pre", i)] + out[("attn_out", i)])
        else:
            vals.append(out[("ln_mlp.in", i)])
    buf = torch.stack(vals)
    out._bufs["resid_mid"] = (layers, buf)
    for j, i in enumerate(layers):
        out[("resid_mid", i)] = buf[j]


def _mid_needs(placement: str, layer: int) -> list[tuple]:
    if placement == "post":
        return [("ln_attn.out", layer)]
    if placement == "parallel":
        return [("resid_pre", layer), ("attn_out", layer)]
    return [("ln_mlp.in", layer)]


def run(lm: LoadedModel, ids: Tensor | None = None, edits: Iterable[Edit] = (), capture: Iterable = (), *,
        inputs_embeds: Tensor | None = None, attention_mask: Tensor | None = None, stop_after=None,
        logits: bool = True, last_only: bool = False, grad: bool = False, device=None, upcast: bool = False,
        past=None, dictionaries: Iterable = (), splice: bool = False) -> Run:
    """Run the real model on ``ids (b, p)`` (or ``inputs_embeds (b, p, d_model)``) with ``edits`` applied and the
    sites in ``capture`` kept (see the module's site table). Returns :class:`Run` ``(logits, captured)``.

    - ``attention_mask (b, p)``: padding (``0``); captured positions there are NaN.
    - ``stop_after``: a site; the pass ends as soon as it is reached (cheap reads of early activations).
    - ``last_only``: logits of the last position only (``(b, 1, vocab)``).
    - ``grad``: run with autograd on; captures and logits keep their graph.
    - ``device``: move captures there as they arrive; ``upcast``: keep bfloat16 / float16 captures in float32.
    - ``past``: a key/value cache (:func:`new_cache`; causal decoders) holding the positions before ``ids``, which
      the model reads and extends: ``ids`` are then positions ``past.get_seq_length()`` onwards. Edit positions
      count from the start of the whole sequence (entries at other positions wait for their step:
      :func:`edits_within`); captures and logits hold the new positions only.
    - ``dictionaries``: sparse dictionaries (:class:`~lenscope.models.dictionary.Dictionary`, each naming its site),
      whose latents are then the sites ``"<site>.latents"`` (capture; edit: the site changes by the decoded change,
      the reconstruction error kept). ``splice``: every dictionary's reconstruction replaces its site (the error
      dropped; all transcoders of a model at once: the replacement model).
    """
    checkpoint()
    model = lm.model
    if ids is not None:
        ids = torch.as_tensor(ids, dtype=torch.long)
        if ids.dim() == 1:
            ids = ids[None]
        B, P = ids.shape
    elif inputs_embeds is not None:
        B, P = inputs_embeds.shape[:2]
    else:
        raise InputError("run() needs token ids or inputs_embeds")
    A = lm.anatomy
    if B == 0 or P == 0:
        raise InputError(f"run() needs at least one row and one position; got shape ({B}, {P})")
    start = 0
    if past is not None:
        if not A.causal:
            raise NotApplicableError("a key/value cache (past) needs a causal decoder")
        if attention_mask is not None:
            raise InputError("run() with a cache (past) takes no attention_mask: padding is not supported there")
        start = past.get_seq_length()
        edits = edits_within(edits, start, start + P)
    if start + P > A.n_ctx:
        raise InputError(f"{start + P} positions are more than the model's context of {A.n_ctx}; shorten the input")
    if ids is not None and (int(ids.min()) < 0 or int(ids.max()) >= A.vocab_size):
        raise InputError(f"token ids must lie in 0..{A.vocab_size - 1}; got {int(ids.min())}..{int(ids.max())}")
    requested = [site_key(c) for c in capture]
    mids = sorted({layer for name, layer in requested if name == "resid_mid"})
    if mids and grad:
        raise NotApplicableError("resid_mid is derived from other sites, so no gradient reaches it; capture "
                                 "resid_pre of the next block, or attn_out, with grad=True")
    extra = [k for i in mids for k in _mid_needs(lm.anatomy.placement, i) if k not in requested]
    want = [k for k in requested if k[0] not in ("resid_mid", "logits")] + extra
    s = _Session(lm, B, P, list(edits), want, stop_after, grad, device, upcast, dictionaries, splice)
    hooks = family_for(model).hooks(model)
    handles: list = []
    out = None
    try:
        _register(s, hooks, handles)
        with torch.set_grad_enabled(grad):
            out = model(**forward_kwargs(lm, ids, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                                         last_only=last_only, past=past))
    except _Stop:
        pass
    finally:
        for h in handles:
            h.remove()
    cap = s.out
    if mids and out is not None:
        _derive_mid(lm, s, mids)
    for k in extra:  # read only to derive resid_mid
        cap.pop(k, None)
    for name in [n for n in cap._bufs if not any(k[0] == n for k in cap)]:
        del cap._bufs[name]
    lg = None if out is None else getattr(out, "logits", None)
    if lg is not None and not grad:
        lg = lg.detach()
    if ("logits", None) in requested and lg is not None:
        x = lg if device is None else lg.to(device)
        cap[("logits", None)] = x.to(compute_dtype(x.dtype)) if upcast else x
    if attention_mask is not None:
        _blank_padding(cap, attention_mask)
    return Run(lg if logits else None, cap)


def capture(lm: LoadedModel, ids: Tensor, sites: Iterable, **kw) -> Captures:
    """Only the ``sites`` asked for, from one forward pass without edits (see :func:`run` for ``kw``). Unless
    ``logits`` is among the sites, a causal model computes the last position's logits only."""
    sites = [site_key(s) for s in sites]
    kw.setdefault("last_only", ("logits", None) not in sites)
    return run(lm, ids, capture=sites, logits=False, **kw).captured


def _blank_padding(cap: Captures, mask: Tensor) -> None:
    """NaN at the positions ``mask`` marks as padding, in every capture (rows of patterns)."""
    pad = mask.to(torch.bool).logical_not()
    if not pad.any():
        return
    done = set()
    for key, x in list(cap.items()):
        if not x.is_floating_point():
            continue
        name = key[0]
        base = cap._bufs.get(name)
        target = base[1] if base is not None else x
        if id(target) in done:
            continue
        done.add(id(target))
        if name == "pattern":  # (layer, b, h, p, s): padded query rows
            m = pad.to(target.device)[None, :, None, :, None] if base is not None else pad[:, None, :, None]
        else:
            m = pad.to(target.device)
            m = m[None] if base is not None else m
            m = m.reshape(m.shape + (1,) * (target.dim() - m.dim()))
        if target.requires_grad:
            cap[key] = torch.where(m, torch.full_like(target, float("nan")), target)
        else:
            target.masked_fill_(m, float("nan"))


def batches(n: int, size: int):
    """``range`` chunks ``[start, stop)`` covering ``0..n`` in steps of ``size``."""
    size = max(1, int(size))
    for s in range(0, n, size):
        yield s, min(n, s + size)


__all__ = ["Captures", "Edit", "LAYER_SITES", "MODEL_SITES", "Run", "batches", "capture", "edits_within",
           "forward_kwargs", "new_cache", "run", "site_key"]
