"""The engine: the one way lenscope runs a real model with hooks, reads any site and edits it.

Every method reaches the model through :func:`run` (or :func:`capture`, the same without edits); ``Trace``,
``residual_states``, the interventions and the batched evaluation are views on it. The hooks go on the modules
that the family file names (:class:`~lenscope.models.families.LayerHooks`); nothing here asks which family it runs.

Sites: a name and a block index, written ``("resid_pre", 3)`` or ``"resid_pre.3"`` (block-less sites such as the
final norm's take ``None``: ``"ln_final.in"``). Shapes as a hook sees them, reshaped to a batch of rows
(``b``: batch row, ``p``: position, ``h``: head, ``hk``: key/value head, ``s``: source position):

==================  ======================  ======  =====================================================
site                shape                   edit    what it is
==================  ======================  ======  =====================================================
``resid_pre``       ``(b, p, d_model)``     yes     the residual stream entering block ``i``
``resid_mid``       ``(b, p, d_model)``     no      after the block's attention part (derived: the input
                                                    of ``ln_mlp``; ``ln_attn``'s output for Post-LN;
                                                    ``resid_pre + attn_out`` for parallel blocks)
``resid_post``      ``(b, p, d_model)``     yes     the residual stream leaving block ``i``
``attn_out``        ``(b, p, d_model)``     yes     the attention output projection's output (with bias)
``head``            ``(b, p, h, d_head)``   yes     per-head outputs: the output projection's input
``q``               ``(b, p, h, d_head)``   yes     per-head queries: the query projection's output
                                                    (before rotary / q-norm / scaling)
``k``, ``v``        ``(b, p, hk, d_head)``  yes     per key/value-head keys and values (fused q/k/v
                                                    projections are split: GPT-2, GPT-NeoX, BLOOM)
``pattern``         ``(b, h, p, s)``        no      attention probabilities (the attention module's
                                                    second output; computed inside transformers'
                                                    attention function, which has no module to edit)
``mlp_pre``         ``(b, p, d_mlp)``       yes     the activation's input (of the gate for gated MLPs)
``mlp_up``          ``(b, p, d_mlp)``       yes     the linear branch of a gated MLP
``mlp_hidden``      ``(b, p, d_mlp)``       yes     the down projection's input: act(pre) (·up)
``mlp_out``         ``(b, p, d_model)``     yes     the MLP's output (with bias)
``<slot>.in``       ``(b, p, d_model)``     yes     a norm's input; slots ``ln_attn``, ``ln_mlp``,
``<slot>.out``      ``(b, p, d_model)``     yes     ``ln_attn_out``, ``ln_mlp_out`` (sandwich) per block,
``<slot>.scale``    ``(b, p)``              no      ``ln_final`` (block ``None``); ``scale`` is the
                                                    per-token factor ``1/sqrt(var + eps)``
``logits``          ``(b, p, vocab)``       no      the model's output (block ``None``)
==================  ======================  ======  =====================================================

Edits (:class:`Edit`) set, add to or scale a site's entries per batch row and position (and head). Captures
keep what the model used, after the edits at that site. Padding: with ``attention_mask`` (``1`` = real token),
captured positions where the mask is ``0`` are NaN, so nothing downstream can read them by accident.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from ..errors import InputError, NotApplicableError, UnsupportedModelError
from .devices import compute_dtype, main_device
from .families import family_for
from .load import LoadedModel

NORM_SLOTS = ("ln_attn", "ln_mlp", "ln_attn_out", "ln_mlp_out")
NORM_SITES = tuple(f"{s}.{w}" for s in NORM_SLOTS for w in ("in", "out", "scale"))
LAYER_SITES = ("resid_pre", "resid_mid", "resid_post", "attn_out", "head", "q", "k", "v", "pattern", "mlp_pre",
               "mlp_up", "mlp_hidden", "mlp_out") + NORM_SITES
MODEL_SITES = ("ln_final.in", "ln_final.out", "ln_final.scale", "logits")
READ_ONLY = {"resid_mid", "pattern", "logits"} | {s for s in LAYER_SITES + MODEL_SITES if s.endswith(".scale")}
HEAD_SITES = ("head", "q", "k", "v")
_ALL = frozenset(LAYER_SITES + MODEL_SITES)
# the interventions' first vocabulary, still accepted in Edit / run
ALIASES = {"resid": "resid_pre", "attn": "attn_out", "mlp": "mlp_out", "hidden": "mlp_hidden"}


def site_key(site) -> tuple[str, int | None]:
    """``("resid_pre", 3)``, ``"resid_pre.3"``, ``"ln_final.in"`` -> ``(name, layer)`` (checked)."""
    if isinstance(site, str):
        head, _, tail = site.rpartition(".")
        name, layer = (head, int(tail)) if head and tail.isdigit() else (site, None)
    else:
        try:
            name, layer = site
        except (TypeError, ValueError):
            raise InputError(
                f"a site is a name and a block, e.g. ('resid_pre', 3) or 'resid_pre.3'; got {site!r}") from None
        layer = None if layer is None else int(layer)
    name = ALIASES.get(name, name)
    if name in MODEL_SITES:
        if layer is not None:
            raise InputError(f"site {name!r} belongs to the whole model, not to a block: use ({name!r}, None)")
    elif name in LAYER_SITES:
        if layer is None:
            raise InputError(f"site {name!r} needs a block index, e.g. ({name!r}, 0)")
    else:
        raise InputError(f"unknown site {name!r}; sites: {', '.join(LAYER_SITES + MODEL_SITES)}")
    return name, layer


@dataclass
class Edit:
    """Replace (``mode="set"``), add to (``"add"``) or multiply (``"scale"``) the activation at ``site`` of
    block ``layer`` for the entries ``(rows[n], pos[n])`` (and ``head[n]`` for the per-head sites).

    ``rows, pos, head: (n,)`` long; ``values: (n, d)`` where ``d`` is the site's last axis (``d_head`` for
    per-head sites), or ``(n,)``/``(n, d)`` factors for ``"scale"``. Edits at one site apply in list order.
    """

    site: str
    layer: int
    rows: Tensor
    pos: Tensor
    values: Tensor
    head: Tensor | None = None
    mode: str = "set"

    def __post_init__(self):
        self.site = ALIASES.get(self.site, self.site)
        if self.mode not in ("set", "add", "scale"):
            raise InputError(f"unknown edit mode {self.mode!r}; choose set, add or scale")


class Run(NamedTuple):
    """What :func:`run` returns: ``logits (b, p, vocab)`` (None when not asked or stopped early) and the
    captured sites."""

    logits: Tensor | None
    captured: Captures


class Captures(dict):
    """Captured sites by key ``(name, layer)``. The blocks of one site name share one preallocated
    ``(layer, ...)`` buffer (so a capture is never held twice); :meth:`stacked` returns it."""

    def __init__(self):
        super().__init__()
        self._bufs: dict[str, tuple[list[int], Tensor]] = {}

    @staticmethod
    def _key(key):
        return key if isinstance(key, tuple) and len(key) == 2 and key[0] in _ALL else site_key(key)

    def __getitem__(self, key):
        return super().__getitem__(self._key(key))

    def __contains__(self, key):
        try:
            return super().__contains__(self._key(key))
        except InputError:
            return False

    def get(self, key, default=None):
        return self[key] if key in self else default

    def pop(self, key, *default):
        return super().pop(self._key(key), *default)

    def stacked(self, name: str) -> Tensor:
        """Every captured block of ``name`` as one ``(layer, ...)`` tensor, blocks in ascending order."""
        name = ALIASES.get(name, name)
        if name in self._bufs:
            return self._bufs[name][1]
        layers = sorted(layer for (n, layer) in self if n == name)
        return torch.stack([self[(name, layer)] for layer in layers])


def forward_kwargs(lm: LoadedModel, ids: Tensor | None = None, *, inputs_embeds: Tensor | None = None,
                   attention_mask: Tensor | None = None, last_only: bool = False) -> dict:
    """The keyword arguments of the real model's forward pass (the only place they are built): inputs on the
    model's input device, an all-ones mask unless one is given, no cache for causal models, and (causal models)
    only the last position's logits when ``last_only``."""
    device = main_device(lm.model)  # accelerate's execution device of a split model, never "meta"
    x = ids if ids is not None else inputs_embeds
    if attention_mask is None:
        attention_mask = torch.ones(x.shape[:2], dtype=torch.long)
    kw = {"attention_mask": attention_mask.to(device)}
    if ids is not None:
        kw["input_ids"] = ids.to(device)
    else:
        kw["inputs_embeds"] = inputs_embeds.to(device)
    if lm.anatomy.causal:
        kw["use_cache"] = False
        if last_only:
            kw["logits_to_keep"] = 1
    return kw


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

    def __init__(self, lm, B, P, edits, capture, stop_after, grad, device, upcast):
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

    # -- what a hook does with a tensor ------------------------------------------------------------

    def shaped(self, name, layer, x):
        """``x`` as ``(b, p, ...)`` (some modules see ``(b * p, d)``: OPT's MLP); heads split for per-head sites."""
        if name == "pattern" or name.endswith(".scale"):
            return x
        x = x.reshape(self.B, self.P, x.shape[-1])
        if name in HEAD_SITES:
            H = _n_heads(self.lm, name, layer)
            x = x.reshape(self.B, self.P, H, x.shape[-1] // H)
        return x

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
        if layer is None or self.grad:
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
        return key in self.by_site or key in self.capture or key == self.stop_after

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
        if key in self.capture:
            v = self.shaped(name, layer, x)
            if self.grad and x.is_floating_point() and name not in READ_ONLY:
                if not v.requires_grad:
                    v = v.detach().requires_grad_(True)  # a leaf the gradient of the output reaches
                x = v.reshape(x.shape)  # the model goes on from the captured tensor itself
            self.keep(key, v)
        if key == self.stop_after:
            raise _Stop
        return x

    def norm_scale(self, slot, layer, x):
        A = self.lm.anatomy
        norm = A.final_norm if slot == "ln_final" else A.layers[layer].norms()[slot]
        return norm.scale(x.reshape(self.B, self.P, x.shape[-1]))


def _chain(*fns):
    """A forward pre-hook (``with_kwargs``) passing the module's first input (positional or ``hidden_states``)
    through ``fns`` in turn."""
    def f(mod, args, kwargs):
        if args:
            x = args[0]
            for fn in fns:
                x = fn(x)
            return (x,) + tuple(args[1:]), kwargs
        kwargs = dict(kwargs)
        x = kwargs["hidden_states"]
        for fn in fns:
            x = fn(x)
        kwargs["hidden_states"] = x
        return args, kwargs
    return f


def _register(s: _Session, hooks, handles: list) -> None:
    """Put on the real model the hooks the session needs (and only those)."""

    def pre(key, kw=False):
        if kw:
            def f(mod, args, kwargs):
                if args:
                    return (s.visit(key, args[0]),) + tuple(args[1:]), kwargs
                kwargs = dict(kwargs)
                kwargs["hidden_states"] = s.visit(key, kwargs["hidden_states"])
                return args, kwargs
            return f

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
            if layout == "heads":  # (head, [q k v], d_head) per position: GPT-NeoX, BLOOM
                parts = out.view(B, P, H, 3, -1).unbind(3)
            else:  # [q | k | v] (GPT-2; Phi-3, with fewer key/value heads than query heads)
                e = out.shape[-1] // (H + 2 * K)
                parts = out.view(B, P, -1).split([H * e, K * e, K * e], dim=-1)
            # the model goes on from the visited parts, put together anew (never written into a captured view: a
            # captured part must stay a node of the graph its gradient is taken through)
            new = [s.visit(k, part.reshape(B, P, -1)).reshape(part.shape) if s.wants(k) else part
                   for k, part in zip(keys, parts)]
            if not write:
                return out
            return (torch.stack(new, dim=3) if layout == "heads" else torch.cat(new, dim=-1)).reshape(out.shape)
        return f

    def second_half(key):  # a fused [gate | up] projection (Phi-3): the site is its second half
        def f(mod, args, out):
            gate, up = out.chunk(2, dim=-1)
            new = s.visit(key, up)
            return torch.cat([gate, new], dim=-1) if new is not up else out
        return f

    def norm(slot, layer, mod, reader=None):
        """Hooks of a norm slot: ``mod`` the norm (its input, output and scale), or ``None`` where the block has no
        norm there (the identity); ``reader`` the module reading its output, where the output is read there (a norm
        shared by two sub-layers, or none: the slot's input is then the reader's input too)."""
        kin, kout, kscale = ((f"{slot}.{w}", layer) for w in ("in", "out", "scale"))
        if mod is None:  # no norm: input, scale and output are all the reader's input
            if any(s.wants(k) for k in (kin, kout, kscale)):
                def g(key):
                    def f(x):
                        if s.wants(kscale) and key == kin:
                            s.visit(kscale, s.norm_scale(slot, layer, x))
                        return s.visit(key, x) if s.wants(key) else x
                    return f
                handles.append(reader.register_forward_pre_hook(_chain(g(kin), g(kout)), with_kwargs=True))
            return
        if s.wants(kin):
            handles.append(mod.register_forward_pre_hook(pre(kin)))
        if s.wants(kout) or s.wants(kscale):
            def f(mod, args, out):
                if s.wants(kscale):
                    s.visit(kscale, s.norm_scale(slot, layer, args[0]))
                return post(kout)(mod, args, out) if s.wants(kout) and reader is None else out
            handles.append(mod.register_forward_hook(f))
        if reader is not None and s.wants(kout):
            handles.append(reader.register_forward_pre_hook(pre(kout, kw=True), with_kwargs=True))

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
            norm(slot, i, mod, lh.readers.get(slot))
        for slot, reader in lh.readers.items():
            if slot not in lh.norms:
                norm(slot, i, None, reader)
        for slot in NORM_SLOTS:
            if slot not in lh.norms and slot not in lh.readers and any(w(f"{slot}.{x}")
                                                                       for x in ("in", "out", "scale")):
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
        logits: bool = True, last_only: bool = False, grad: bool = False, device=None, upcast: bool = False) -> Run:
    """Run the real model on ``ids (b, p)`` (or ``inputs_embeds (b, p, d_model)``) with ``edits`` applied and the
    sites in ``capture`` kept (see the module's site table). Returns :class:`Run` ``(logits, captured)``.

    - ``attention_mask (b, p)``: padding (``0``); captured positions there are NaN.
    - ``stop_after``: a site; the pass ends as soon as it is reached (cheap reads of early activations).
    - ``last_only``: logits of the last position only (``(b, 1, vocab)``).
    - ``grad``: run with autograd on; captures and logits keep their graph.
    - ``device``: move captures there as they arrive; ``upcast``: keep bfloat16 / float16 captures in float32.
    """
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
    if P > A.n_ctx:
        raise InputError(f"{P} positions are more than the model's context of {A.n_ctx}; shorten the input")
    if ids is not None and (int(ids.min()) < 0 or int(ids.max()) >= A.vocab_size):
        raise InputError(f"token ids must lie in 0..{A.vocab_size - 1}; got {int(ids.min())}..{int(ids.max())}")
    requested = [site_key(c) for c in capture]
    mids = sorted({layer for name, layer in requested if name == "resid_mid"})
    if mids and grad:
        raise NotApplicableError("resid_mid is derived from other sites, so no gradient reaches it; capture "
                                 "resid_pre of the next block, or attn_out, with grad=True")
    extra = [k for i in mids for k in _mid_needs(lm.anatomy.placement, i) if k not in requested]
    want = [k for k in requested if k[0] not in ("resid_mid", "logits")] + extra
    s = _Session(lm, B, P, list(edits), want, stop_after, grad, device, upcast)
    hooks = family_for(model).hooks(model)
    handles: list = []
    out = None
    try:
        _register(s, hooks, handles)
        with torch.set_grad_enabled(grad):
            out = model(**forward_kwargs(lm, ids, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                                         last_only=last_only))
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


__all__ = ["Captures", "Edit", "LAYER_SITES", "MODEL_SITES", "Run", "batches", "capture", "forward_kwargs", "run",
           "site_key"]
