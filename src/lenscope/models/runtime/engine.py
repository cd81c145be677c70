"""The engine: the one way lenscope runs a real model with hooks, reads any site and edits it.

Every method reaches the model through :func:`run` (or :func:`capture`, the same without edits), told how by one
:class:`RunOptions` (or the same fields as keywords); ``Trace``,
``residual_states``, the interventions and the batched evaluation are views on it. The hooks go on the modules
that the family file names (:class:`~lenscope.models.families.LayerHooks`); nothing here asks which family it runs.

Sites, their shapes and which can be edited: the table in :mod:`lenscope.models.runtime.sites`.

Edits (:class:`Edit`) set, add to or scale a site's entries per batch row and position (and head). Captures
keep what the model used, after the edits at that site. Padding: with ``attention_mask`` (``1`` = real token),
captured positions where the mask is ``0`` are NaN, so nothing downstream can read them by accident.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ...errors import InputError, NotApplicableError, UnsupportedModelError
from ..dictionaries.dictionary import Attached
from ..families import family_for
from ..loading.devices import compute_dtype, main_device
from ..loading.load import ENCODER_DECODER_METHODS, LoadedModel
from .hooking import register, skipping
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
    stack_of,
)
from .stop import checkpoint


class Run(NamedTuple):
    """What :func:`run` returns: ``logits (b, p, vocab)`` (None when not asked or stopped early) and the
    captured sites."""

    logits: Tensor | None
    captured: Captures


def forward_kwargs(lm: LoadedModel, ids: Tensor | None = None, *, inputs_embeds: Tensor | None = None,
                   attention_mask: Tensor | None = None, last_only: bool = False, past=None,
                   source: Tensor | None = None, source_mask: Tensor | None = None,
                   source_embeds: Tensor | None = None) -> dict:
    """The keyword arguments of the real model's forward pass (the only place they are built): inputs on the
    model's input device, an all-ones mask unless one is given, no cache for causal models unless ``past`` (a
    key/value cache of the earlier positions, :func:`new_cache`) is given, and (causal models) only the last
    position's logits when ``last_only``.

    An encoder-decoder model: ``source (b, s)`` ids (or ``source_embeds (b, s, d_model)``: what the encoder's
    blocks add positions to, i.e. the token embeddings already times the stack's embedding scale, which Marian and
    Pegasus apply to ids only) into the encoder with ``source_mask`` (``1`` = real token; default all ones), ``ids``
    (or ``inputs_embeds``: what that stack is given as embeddings, which Marian's and Pegasus' decoders multiply
    by their scale themselves, ``Anatomy.extras["inputs_embeds_scale"]``: :mod:`lenscope.attribution.inputs` makes
    both) into the decoder with ``attention_mask`` as its ``decoder_attention_mask``; never a cache."""
    device = main_device(lm.model)  # accelerate's execution device of a split model, never "meta"
    if source is not None or source_embeds is not None:
        src = source if source is not None else source_embeds
        _source_fits(lm, src.shape[1])  # every pass, also the baselines' own (never an index error in the model)
        if source_mask is None:
            source_mask = torch.ones(src.shape[:2], dtype=torch.long)
        kw = {"attention_mask": source_mask.to(device), "use_cache": False}
        if source is not None:
            kw["input_ids"] = source.to(device)
        else:
            kw["inputs_embeds"] = source_embeds.to(device)
        if ids is not None:
            kw["decoder_input_ids"] = ids.to(device)
        else:
            kw["decoder_inputs_embeds"] = inputs_embeds.to(device)
        if attention_mask is not None:
            kw["decoder_attention_mask"] = attention_mask.to(device)
        return kw
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


def _what(name: str) -> str:
    return "encoder" if stack_of(name)[0] else "model"


def _check_source(lm: LoadedModel, source: Tensor | None, B: int, other_inputs: bool,
                  source_mask: Tensor | None = None) -> int:
    """The number of source positions (0 without a source), the source (and its padding mask) checked against the
    model."""
    A = lm.anatomy
    if A.encoder is None:
        if source is not None:
            raise InputError(f"a source is the input of an encoder-decoder model's encoder; {A.model_type} has none")
        return 0
    if source is None:
        raise InputError(f"{A.model_type} is an encoder-decoder model: run it with the source (source=...; the CLI's "
                         f"--source; what reads one: {ENCODER_DECODER_METHODS}; docs/encoder-decoder.md)")
    if other_inputs:
        raise NotApplicableError("an encoder-decoder model runs from token ids, without a key/value cache (yet)")
    if source.dim() != 2 or source.shape[0] != B or source.shape[1] == 0:
        raise InputError(f"the source must be (b, s) token ids with the same {B} rows as the target prefix, at "
                         f"least one token each; got shape {tuple(source.shape)}")
    _source_fits(lm, source.shape[1])
    if int(source.min()) < 0 or int(source.max()) >= A.encoder.vocab_size:
        raise InputError(f"source token ids must lie in 0..{A.encoder.vocab_size - 1}")
    if source_mask is not None:
        _check_mask(source_mask, source.shape, "source_mask")
    return int(source.shape[1])


def _source_fits(lm: LoadedModel, n: int) -> None:
    """A one-line error when ``n`` source positions are more than the encoder's context."""
    if n > lm.anatomy.encoder.n_ctx:
        raise InputError(f"{n} source positions are more than the encoder's context of {lm.anatomy.encoder.n_ctx}; "
                         "shorten the source")


def _check_mask(mask: Tensor, shape, what: str) -> None:
    """A padding mask: the inputs' shape, ``1`` on real tokens then ``0`` on padding (right padding), at least one
    real token per row."""
    if tuple(mask.shape) != tuple(shape):
        raise InputError(f"{what} must have the inputs' shape {tuple(shape)}, not {tuple(mask.shape)}")
    m = mask.to(torch.long).cpu()
    if bool(((m != 0) & (m != 1)).any()) or bool((m[:, 1:] > m[:, :-1]).any()) or bool((m[:, 0] == 0).any()):
        raise InputError(f"{what} must be 1 on each row's tokens, then 0 on its padding at the end (right padding)")


class _Stop(Exception):
    pass


def _first(x):
    return x[0] if isinstance(x, (tuple, list)) else x


def _stack(lm: LoadedModel, name: str):
    """The Anatomy of the stack a site name belongs to (an encoder-decoder model's encoder: prefix ``enc.``) and
    the name without the prefix."""
    prefix, base = stack_of(name)
    A = lm.anatomy.encoder if prefix else lm.anatomy
    if A is None:
        raise NotApplicableError(f"site {name!r}: the sites 'enc.*' exist only in encoder-decoder models (their "
                                 "encoder)")
    return A, base


def _apply(view: Tensor, edits: list[Edit]) -> None:
    """Apply ``edits`` in place to ``view (b, p, ...)``."""
    for e in edits:
        if e.mode == "call":  # the whole view replaced by what the function makes of it
            new = e.values(view.clone())
            if tuple(new.shape) != tuple(view.shape):
                raise InputError(f"a call edit of {e.site} returned shape {tuple(new.shape)}, not {tuple(view.shape)}")
            view.copy_(new)
            continue
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

    def __init__(self, lm, B, P, edits, capture, stop_after, grad, device, upcast, dictionaries=(), splice=False,
                 P_src=0, start_at=0):
        self.lm, self.B, self.P, self.grad, self.upcast, self.P_src = lm, B, P, grad, upcast, P_src
        self.start_at = start_at  # the decoder's blocks before it are skipped: no site of theirs is read or edited
        self.device = None if device is None else torch.device(device)
        self.by_site: dict[tuple, list[Edit]] = {}
        for e in edits:
            key = site_key((e.site, e.layer))
            if key[0] in READ_ONLY:
                instead = "q, k, v or head" if "pattern" in key[0] else "resid_pre, attn_out, mlp_out or resid_post"
                raise NotApplicableError(f"site {key[0]!r} can be captured but not edited; edit {instead} instead")
            L = _stack(lm, key[0])[0].n_layers
            if key[1] is not None and not 0 <= key[1] < L:
                raise InputError(f"edit at block {key[1]} of a {L}-block {_what(key[0])}")
            _after_start(key, start_at, "edit")
            self.by_site.setdefault(key, []).append(e)
        self.capture = {site_key(s) for s in capture}  # a set: every hook call asks "is this site kept?"
        self.stop_after = None if stop_after is None else site_key(stop_after)
        self.out = Captures()
        self.seen: set = set()
        # capture per name: the requested blocks, in ascending order (the buffer's first axis)
        self.layers_of: dict[str, list[int]] = {}
        for name, layer in self.capture:
            if layer is None:
                _stack(lm, name)
                continue
            L = _stack(lm, name)[0].n_layers
            if not 0 <= layer < L:
                raise InputError(f"capture at block {layer} of a {L}-block {_what(name)}")
            _after_start((name, layer), start_at, "capture")
            self.layers_of.setdefault(name, [])
            if layer not in self.layers_of[name]:
                self.layers_of[name].append(layer)
        for v in self.layers_of.values():
            v.sort()
        self.dicts = Attached(lm, dictionaries, splice, self.capture, self.by_site, self.stop_after)

    # -- what a hook does with a tensor ------------------------------------------------------------

    def positions(self, name) -> int:
        """How many positions a site has: the source's for the encoder's sites and cross-attention's keys and
        values, the (decoder's) input's otherwise."""
        prefix, base = stack_of(name)
        return self.P_src if prefix or base in ("cross_k", "cross_v") else self.P

    def n_heads(self, name, layer) -> int:
        A, base = _stack(self.lm, name)
        lay = A.layers[layer]
        attn = lay.cross if base.startswith("cross_") else lay.attn
        return attn.n_kv_heads if base in ("k", "v", "cross_k", "cross_v") else attn.n_heads

    def shaped(self, name, layer, x):
        """``x`` as ``(b, p, ...)`` (some modules see ``(b * p, d)``: OPT's MLP); heads split for per-head sites."""
        base = stack_of(name)[1]
        if base in ("pattern", "cross_pattern") or base.endswith(".scale"):
            return x
        P = self.positions(name)
        if base == "expert_out":
            return x.reshape(self.B, P, *x.shape[-2:])
        x = x.reshape(self.B, P, x.shape[-1])
        if base in HEAD_SITES:
            H = self.n_heads(name, layer)
            x = x.reshape(self.B, P, H, x.shape[-1] // H)
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

    def wanted(self) -> set:
        """The sites asked for by name (edits, captures, the stop)."""
        return set(self.by_site) | self.capture | ({self.stop_after} if self.stop_after else set())

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
        A, base = _stack(self.lm, slot)
        norm = A.final_norm if base == "ln_final" else A.layers[layer].norms()[base]
        return norm.scale(x.reshape(self.B, self.positions(slot), x.shape[-1]))


def _after_start(key, start_at: int, what: str) -> None:
    """A one-line error for a site of a block that a run starting at block ``start_at`` skips."""
    if key[1] is not None and key[1] < start_at and not stack_of(key[0])[0]:
        raise InputError(f"{what} at {key[0]}.{key[1]}: this run starts at block {start_at} (start_at), so the blocks "
                         "before it do not run")


def _derive_mid(lm, s: _Session, mids: list[tuple[str, int]]) -> None:
    """``resid_mid`` (each stack's: ``(prefix, block)``) from what the model materialises (see the site table)."""
    out = s.out
    for prefix in sorted({p for p, _ in mids}):
        layers = [i for p, i in mids if p == prefix]
        vals = [sum(out[k] for k in _mid_needs(lm, prefix, i)) for i in layers]
        buf = torch.stack(vals)
        out._bufs[prefix + "resid_mid"] = (layers, buf)
        for j, i in enumerate(layers):
            out[(prefix + "resid_mid", i)] = buf[j]


def _mid_needs(lm: LoadedModel, prefix: str, i: int) -> list[tuple]:
    """The captured sites whose sum is ``resid_mid`` of block ``i`` (of the stack ``prefix`` names)."""
    lay = _stack(lm, prefix + "resid_mid")[0].layers[i]
    if lay.placement == "post":
        names = ["ln_attn.out"]
    elif lay.placement == "parallel":
        names = ["resid_pre", "attn_out"]
    else:  # the next sub-layer's norm input: cross-attention's in a decoder block that has it
        names = ["ln_cross.in" if lay.cross is not None else "ln_mlp.in"]
    return [(prefix + n, i) for n in names]


@dataclass(frozen=True, eq=False)
class RunOptions:
    """How :func:`run` runs the model, in one object: every field is also :func:`run`'s keyword of the same name
    (``run(lm, ids, edits, capture=..., grad=True)`` builds one; ``run(lm, ids, edits, options=opts)`` takes it
    whole, and keywords given beside it replace its fields).

    - ``capture``: the sites kept (see the module's site table).
    - ``inputs_embeds (b, p, d_model)``: the input embeddings instead of token ids.
    - ``source (b, s)``: an encoder-decoder model's encoder input (``ids``: the decoder's, the target prefix from
      the decoder's start token); its encoder's sites are ``"enc.<site>"``. ``source_mask (b, s)``: the source's
      padding (``0``, after each row's tokens: right padding, as ``attention_mask`` then is for the target
      prefixes); captured source positions there (the ``enc.`` sites, ``cross_k``, ``cross_v``) are NaN.
    - ``attention_mask (b, p)``: padding (``0``); captured positions there are NaN.
    - ``stop_after``: a site; the pass ends as soon as it is reached (cheap reads of early activations).
    - ``logits``: return the logits (False: ``Run.logits`` is None). ``last_only``: logits of the last position
      only (``(b, 1, vocab)``).
    - ``grad``: run with autograd on; captures and logits keep their graph.
    - ``device``: move captures there as they arrive; ``upcast``: keep bfloat16 / float16 captures in float32.
    - ``past``: a key/value cache (:func:`new_cache`; causal decoders) holding the positions before ``ids``, which
      the model reads and extends: ``ids`` are then positions ``past.get_seq_length()`` onwards. Edit positions
      count from the start of the whole sequence (entries at other positions wait for their step:
      :func:`edits_within`); captures and logits hold the new positions only.
    - ``start_at``, ``start (b, p, d_model)``: begin at block ``start_at`` of a decoder, from ``start``, the
      residual stream entering it (what an earlier run captured as ``resid_pre``): the blocks before it do not run
      and none of their sites is captured or edited (the later part of a run whose start is known: patching at
      block ``start_at`` or later). With ``past``, the cache grows at the blocks that ran only.
    - ``dictionaries``: sparse dictionaries (:class:`~lenscope.models.dictionaries.dictionary.Dictionary`, each naming
    its site),
      whose latents are then the sites ``"<site>.latents"`` (capture; edit: the site changes by the decoded change,
      the reconstruction error kept). ``splice``: every dictionary's reconstruction replaces its site (the error
      dropped; all transcoders of a model at once: the replacement model).
    """

    capture: Iterable = ()
    inputs_embeds: Tensor | None = None
    attention_mask: Tensor | None = None
    stop_after: Any = None
    logits: bool = True
    last_only: bool = False
    grad: bool = False
    device: Any = None
    upcast: bool = False
    past: Any = None
    dictionaries: Iterable = ()
    splice: bool = False
    source: Tensor | None = None
    source_mask: Tensor | None = None
    start_at: int = 0
    start: Tensor | None = None


def run(lm: LoadedModel, ids: Tensor | None = None, edits: Iterable[Edit] = (), capture: Iterable = (), *,
        options: RunOptions | None = None, **kw) -> Run:
    """Run the real model on ``ids (b, p)`` (or ``inputs_embeds (b, p, d_model)``) with ``edits`` applied and the
    sites in ``capture`` kept, as ``options`` (:class:`RunOptions`) says; each keyword ``kw`` is one of its fields
    (``attention_mask=``, ``grad=``, ``source=``, ...: their meaning is there), given instead of the object or
    replacing its field. Returns :class:`Run` ``(logits, captured)``."""
    changes = {"capture": capture, **kw} if capture else kw
    if options is None:
        options = RunOptions(**changes)
    elif changes:
        options = replace(options, **changes)
    return _run(lm, ids, edits, options)


def _run(lm: LoadedModel, ids: Tensor | None, edits: Iterable[Edit], o: RunOptions) -> Run:
    checkpoint()
    model = lm.model
    ids, B, P = _shape(ids, o.inputs_embeds)
    edits, P_src = _check_inputs(lm, ids, B, P, edits, o)
    requested = [site_key(c) for c in o.capture]
    mids = sorted({(stack_of(name)[0], layer) for name, layer in requested if stack_of(name)[1] == "resid_mid"})
    if mids and o.grad:
        raise NotApplicableError("resid_mid is derived from other sites, so no gradient reaches it; capture "
                                 "resid_pre of the next block, or attn_out, with grad=True")
    extra = [k for p, i in mids for k in _mid_needs(lm, p, i) if k not in requested]
    want = [k for k in requested if stack_of(k[0])[1] not in ("resid_mid", "logits")] + extra
    s = _Session(lm, B, P, list(edits), want, o.stop_after, o.grad, o.device, o.upcast, o.dictionaries, o.splice,
                 P_src, o.start_at if o.start is not None else 0)
    hooks = family_for(model).hooks(model)
    handles: list = []
    out = None
    try:
        register(s, hooks, handles)
        with torch.set_grad_enabled(o.grad), skipping(hooks, o.start_at, o.start, main_device(model)):
            out = model(**forward_kwargs(lm, ids, inputs_embeds=o.inputs_embeds, attention_mask=o.attention_mask,
                                         last_only=o.last_only, past=o.past, source=o.source,
                                         source_mask=o.source_mask))
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
    if lg is not None and not o.grad:
        lg = lg.detach()
    if ("logits", None) in requested and lg is not None:
        x = lg if o.device is None else lg.to(o.device)
        cap[("logits", None)] = x.to(compute_dtype(x.dtype)) if o.upcast else x
    if o.attention_mask is not None or o.source_mask is not None:
        _blank_padding(cap, o.attention_mask, o.source_mask)
    return Run(lg if o.logits else None, cap)


def _shape(ids: Tensor | None, inputs_embeds: Tensor | None) -> tuple[Tensor | None, int, int]:
    """The token ids as a ``(b, p)`` long tensor (None with ``inputs_embeds``) and the batch's shape."""
    if ids is not None:
        ids = torch.as_tensor(ids, dtype=torch.long)
        if ids.dim() == 1:
            ids = ids[None]
        B, P = ids.shape
    elif inputs_embeds is not None:
        B, P = inputs_embeds.shape[:2]
    else:
        raise InputError("run() needs token ids or inputs_embeds")
    if B == 0 or P == 0:
        raise InputError(f"run() needs at least one row and one position; got shape ({B}, {P})")
    return ids, B, P


def _check_inputs(lm: LoadedModel, ids: Tensor | None, B: int, P: int, edits: Iterable[Edit],
                  o: RunOptions) -> tuple[Iterable[Edit], int]:
    """Refuse what the model cannot run (a cache where it does not apply, too many positions, ids outside the
    vocabulary, a source that does not fit); returns the edits of the new positions (with a cache) and the
    source's length."""
    A = lm.anatomy
    start = 0
    if o.past is not None:
        if not A.causal:
            raise NotApplicableError("a key/value cache (past) needs a causal decoder")
        if o.attention_mask is not None:
            raise InputError("run() with a cache (past) takes no attention_mask: padding is not supported there")
        start = o.past.get_seq_length()
        edits = list(edits)
        if any(e.mode == "call" for e in edits):
            raise NotApplicableError("a call edit computes a site in one pass; it does not run with a cache (past)")
        edits = edits_within(edits, start, start + P)
    if start + P > A.n_ctx:
        raise InputError(f"{start + P} positions are more than the model's context of {A.n_ctx}; shorten the input")
    if ids is not None and (int(ids.min()) < 0 or int(ids.max()) >= A.vocab_size):
        raise InputError(f"token ids must lie in 0..{A.vocab_size - 1}; got {int(ids.min())}..{int(ids.max())}")
    P_src = _check_source(lm, o.source, B, o.inputs_embeds is not None or o.past is not None, o.source_mask)
    if o.source is not None and o.attention_mask is not None:
        _check_mask(torch.as_tensor(o.attention_mask), (B, P), "attention_mask")
    if o.source_mask is not None and o.source is None:
        raise InputError("source_mask is the padding of a source; give the source too")
    if o.start is not None and (A.encoder is not None or not 0 < o.start_at < A.n_layers
                                or tuple(o.start.shape) != (B, P, A.d_model)):
        raise InputError(f"start_at must be a block 1..{A.n_layers - 1} of a single-stack model and start its input "
                         f"({B}, {P}, {A.d_model}); got {o.start_at} and {tuple(o.start.shape)}")
    return edits, P_src


def capture(lm: LoadedModel, ids: Tensor, sites: Iterable, **kw) -> Captures:
    """Only the ``sites`` asked for, from one forward pass without edits (see :func:`run` for ``kw``). Unless
    ``logits`` is among the sites, a causal model computes the last position's logits only."""
    sites = [site_key(s) for s in sites]
    kw.setdefault("last_only", ("logits", None) not in sites)
    return run(lm, ids, capture=sites, logits=False, **kw).captured


def _blank_padding(cap: Captures, mask: Tensor | None, source_mask: Tensor | None = None) -> None:
    """NaN at the positions ``mask`` marks as padding, in every capture (rows of patterns); ``source_mask``: the
    same for an encoder-decoder model's source positions (the encoder's sites, cross-attention's keys and
    values)."""
    pads = {False: None if mask is None else mask.to(torch.bool).logical_not(),
            True: None if source_mask is None else source_mask.to(torch.bool).logical_not()}
    done = set()
    for key, x in list(cap.items()):
        if not x.is_floating_point():
            continue
        name = key[0]
        prefix, bare = stack_of(name)
        pad = pads[bool(prefix) or bare in ("cross_k", "cross_v")]
        if pad is None or not pad.any():
            continue
        base = cap._bufs.get(name)
        target = base[1] if base is not None else x
        if id(target) in done:
            continue
        done.add(id(target))
        if bare in ("pattern", "cross_pattern"):  # (layer, b, h, p, s): padded query rows
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


__all__ = ["Captures", "Edit", "LAYER_SITES", "MODEL_SITES", "Run", "RunOptions", "batches", "capture",
           "edits_within", "forward_kwargs", "new_cache", "run", "site_key"]
