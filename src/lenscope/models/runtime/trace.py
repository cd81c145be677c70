"""The Trace: one forward pass of the real model with what the methods need captured.

A Trace is a view on the engine (:mod:`lenscope.models.runtime.engine`): the sites of :func:`trace_sites`, captured in
one pass. All tensors are for a single sequence (no batch axis).

Devices and dtypes: a model split across devices runs as placed; each capture is copied into one ``(layer, ...)``
tensor on the trace's device (``trace(..., device=)``, see :func:`trace`). Captures of bfloat16 / float16 models are
stored in float32 (exact), the dtype the Anatomy computes in.

Long inputs: the per-head attention probabilities ``(layer, head, pos, src)`` grow as ``pos^2`` (1.1 GB for a
30-layer, 9-head model at 1,024 tokens), every position's logits as ``pos * vocab``. When what a lean trace
leaves out would exceed :data:`KEEP_BYTES` (and the model computes in float32), :func:`trace` makes a lean trace:

- ``pattern`` is a :class:`RecomputedProbs`: reading ``tr.pattern[l]`` recomputes layer ``l``'s
  probabilities from the traced attention input with the Anatomy's own attention
  (:meth:`~lenscope.models.weights.anatomy.Attention.pattern`, the code ``verify`` checks against the model);
- ``mlp_pre`` / ``mlp_up`` (:class:`RecomputedMLP`, from the MLP's traced input) and the block norms' outputs
  (:class:`RecomputedNorm`) likewise;
- a causal model computes the last position's logits only; ``tr.logits`` of other positions are recomputed from
  the final residual state with the readout when read (:class:`RecomputedLogits`);
- copies of tensors the model passes on unchanged are shared (``resid_post[l]`` is ``resid_pre[l + 1]``; a
  pre-norm's input is the block's input, the MLP norm's input is ``resid_mid``).

``trace(..., pattern="keep")`` keeps every capture whatever the length.

Names: a Trace field holding an engine site has the site's name (``pattern``, ``routing_weights``; the norms'
sites by their names in :attr:`Trace.norms`), and :meth:`Trace.site` reads any traced site by name and block. The
old names (:data:`RENAMED`) still work with a :class:`~lenscope.errors.RenamedWarning`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Literal

import torch
from torch import Tensor

from ...errors import InputError, warn_renamed
from ..loading.devices import compute_dtype, is_reduced
from ..loading.lazy import Lazy, Recomputed, RecomputedLogits, RecomputedMLP, RecomputedNorm, RecomputedProbs  # noqa: F401
from ..loading.load import LoadedModel, token_ids
from ..weights.moe import is_moe
from .engine import run
from .sites import ENC, MODEL_SITES, canonical, stack_of

# the old names of Trace fields (and of trace()'s keyword) -> the site they name; "norm_in" / "norm_out" were dicts
# by slot of the block norms' ".in" / ".out" sites
RENAMED = {"attn_probs": "pattern", "routing": "routing_weights", "final_in": "ln_final.in",
           "final_out": "ln_final.out", "norm_in": ".in", "norm_out": ".out"}
# the Trace fields that hold an engine site (besides the norms)
SITE_FIELDS = ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out", "pattern", "mlp_pre", "mlp_up",
               "router_logits", "routing_weights", "logits", "cross_out", "cross_pattern")


@dataclass(repr=False)
class Trace:
    """Captured activations of one forward pass (shapes use named axes).

    - ``input_ids (pos,)``, ``tokens`` (strings), ``positions (pos,)``
    - ``embed (pos, d_model)``: the residual stream entering layer 0
    - ``resid_pre, resid_mid, resid_post (layer, pos, d_model)``: before the block, after its attention
      part (for parallel blocks ``resid_pre + attn_write``, which the model never materialises), after it
    - ``attn_out, mlp_out (layer, pos, d_model)``: what each sub-layer computed (with output biases)
    - ``attn_write, mlp_write (layer, pos, d_model)``: what it added to the residual stream (after the
      sandwich norms of Gemma, times Granite's residual multiplier: ``Layer.write``; equal to ``*_out`` elsewhere)
    - ``pattern (layer, head, pos, src)``: the attention probabilities
    - ``mlp_pre (layer, pos, d_mlp)``: pre-activation of the activated branch; ``mlp_up``: the linear
      branch of gated MLPs (else None); both None for mixtures of experts, which hold instead
    - ``router_logits, routing_weights (layer, pos, expert)``: a mixture of experts' router logits and routing
      weights (0 for the experts not chosen; None for dense MLPs), read by decompositions as ``pattern`` is
    - ``norms``: the norms' sites by name: ``norms["ln_attn.in"], norms["ln_attn.out"] (layer, pos, d_model)`` for
      every norm slot of the blocks, ``norms["ln_final.in"], norms["ln_final.out"] (pos, d_model)``: the final
      norm's input and output (absent for encoders)
    - ``logits (pos, vocab)`` (None for a model without a language-model head)
    - an encoder-decoder model (the Trace is its decoder's, ``pos``: the target prefix): ``encoder``, the Trace of
      its encoder stack (``pos``: the source tokens; its last state, after its final norm, is what cross-attention
      reads); ``cross_out, cross_write (layer, pos, d_model)`` and ``cross_pattern (layer, head, pos, src)``: each
      decoder block's cross-attention output, what it added to the residual stream, its probabilities

    :meth:`site` reads any of these sites by the engine's name and block: ``tr.site("ln_mlp.in", 3)``.
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
    pattern: Tensor  # these three may be Recomputed (a lean trace), which index and compute like tensors
    mlp_pre: Tensor | None
    mlp_up: Tensor | None
    norms: dict[str, Tensor]
    logits: Tensor | None
    placement: str
    extras: dict = field(default_factory=dict)
    router_logits: Tensor | None = None
    routing_weights: Tensor | None = None
    encoder: Trace | None = None
    cross_out: Tensor | None = None
    cross_write: Tensor | None = None
    cross_pattern: Tensor | None = None

    def site(self, name: str, layer: int | None = None) -> Tensor | None:
        """The traced site ``name`` (the engine's name, :mod:`lenscope.models.runtime.sites`) of block ``layer``
        (``(pos, ...)``; every block, ``(layer, pos, ...)``, when ``layer`` is None), also written ``"name.layer"``;
        None where the model has no such site (``mlp_up`` of a plain MLP, ``ln_final.in`` of an encoder); a
        ``(name, layer)`` pair as the engine writes sites works too."""
        if isinstance(name, tuple) and layer is None:
            name, layer = name
        if layer is None and isinstance(name, str):
            head, _, tail = name.rpartition(".")
            if head and tail.isdigit():
                name, layer = head, int(tail)
        prefix, base = stack_of(name)
        if prefix:
            if self.encoder is None:
                raise InputError(f"site {name!r}: the sites 'enc.*' exist only in encoder-decoder models")
            return self.encoder.site(base, layer)
        name = canonical(name)
        if name.startswith("ln_") and name.endswith((".in", ".out")):
            value = self.norms.get(name)
        elif name in SITE_FIELDS:
            value = getattr(self, name)
        else:
            held = ", ".join(SITE_FIELDS + tuple(self.norms))
            raise InputError(f"a Trace does not hold the site {name!r}; it holds {held} (read other sites with "
                             "lenscope.models.runtime.engine.capture)")
        if layer is not None and name in MODEL_SITES:
            raise InputError(f"site {name!r} belongs to the whole model, not to a block: use tr.site({name!r})")
        return value if value is None or layer is None else value[layer]

    def __getattr__(self, name: str):  # the old field names (RENAMED), with a warning
        new = RENAMED.get(name)
        if new is None or "norms" not in self.__dict__:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        if new.startswith("."):
            warn_renamed(f"Trace.{name}[slot]", f"Trace.site('<slot>{new}') or Trace.norms['<slot>{new}']")
            return {k[: -len(new)]: v for k, v in self.norms.items()
                    if k.endswith(new) and not k.startswith("ln_final")}
        warn_renamed(f"Trace.{name}", f"Trace.site({new!r})" if "." in new else f"Trace.{new}")
        return self.site(new)

    @property
    def n_layers(self) -> int:
        return self.resid_pre.shape[0]

    @property
    def attn_in(self) -> Tensor:
        """What each attention sub-layer read (layer, pos, d_model)."""
        return self.resid_pre if self.placement == "post" else self.norms["ln_attn.out"]

    @property
    def mlp_in(self) -> Tensor:
        """What each MLP read (layer, pos, d_model)."""
        if self.placement != "post":
            return self.norms["ln_mlp.out"]
        return self.resid_mid if self.cross_out is None else self.norms["ln_cross.out"]

    @property
    def cross_in(self) -> Tensor | None:
        """What each decoder block's cross-attention read as its queries (layer, pos, d_model; None without one)."""
        if self.cross_out is None:
            return None
        return self.resid_mid if self.placement == "post" else self.norms["ln_cross.out"]

    @property
    def final_resid(self) -> Tensor:
        """The last residual state (pos, d_model): input of the final norm, or the encoder's output."""
        final_in = self.norms.get("ln_final.in")
        return final_in if final_in is not None else self.resid_post[-1]

    @property
    def memory(self) -> Tensor | None:
        """An encoder-decoder model's decoder trace: what its cross-attention reads (src, d_model), the encoder's
        output after its final norm; None for other models."""
        if self.encoder is None:
            return None
        out = self.encoder.norms.get("ln_final.out")
        return out if out is not None else self.encoder.resid_post[-1]

    def __repr__(self) -> str:
        enc = "" if self.encoder is None else f", encoder={self.encoder!r}"
        return f"Trace(pos={len(self.tokens)}, layers={self.n_layers}, placement={self.placement!r}{enc})"


KEEP_BYTES = 2**30  # trace(pattern="auto") is lean when it would leave out more than this (see lean_bytes)


# lean traces: copies the model passes on unchanged are shared. (slot.in/out, placements) -> the field it equals
SHARED = {
    "ln_attn.in": ("pre", "sandwich", "parallel"),  # == resid_pre: a pre-norm reads the block's input
    "ln_mlp.in": ("pre", "sandwich", "parallel"),  # == resid_mid (parallel blocks: resid_pre, both norms read it)
    "ln_attn.out": ("post",),  # == resid_mid (Post-LN: the state after attention is the norm's output)
    "ln_attn_out.in": ("sandwich",),  # == attn_out (the sub-layer's output before its sandwich norm)
    "ln_mlp_out.in": ("sandwich",),  # == mlp_out
    "ln_mlp.out": ("post",),  # == resid_post
}


RECOMPUTED = ("resid_post", "pattern", "mlp_pre", "mlp_up")  # not captured by a lean trace


def trace_sites(lm: LoadedModel, *, lean: bool = False, prefix: str = "") -> list[tuple]:
    """The engine's sites a :class:`Trace` holds, for every block (see :mod:`lenscope.models.runtime.engine`).

    ``lean``: without the attention probabilities, the MLP pre-activations and the block norms' outputs
    (recomputed: :class:`RecomputedProbs`, :class:`RecomputedMLP`, :class:`RecomputedNorm`), ``resid_post``
    (the next block's input; the last block's only where there is no final norm) and the norm inputs / outputs
    that equal another capture (:data:`SHARED`). An encoder-decoder model: the decoder's sites, its
    cross-attention's, and its encoder's (``prefix``: ``enc.``), never lean."""
    A = lm.anatomy.encoder if prefix else lm.anatomy
    L = A.n_layers
    names = ["resid_pre", "resid_mid", "resid_post", "pattern", "attn_out", "mlp_out"]
    if is_moe(A):  # the routing, read by the decompositions (small: kept by lean traces too)
        names += ["router_logits", "routing_weights"]
    else:
        names += ["mlp_pre"] + (["mlp_up"] if A.layers[0].mlp.gated else [])
    names += [f"{slot}.{w}" for slot in A.layers[0].norms() for w in ("in", "out")]
    if A.layers[0].cross is not None:
        names += ["cross_out", "cross_pattern"]
    if lean:
        names = [n for n in names if n not in RECOMPUTED and A.placement not in SHARED.get(n, ())
                 and not n.endswith(".out")]  # a block norm's output is recomputed from its input
    sites = [(prefix + n, i) for n in names for i in range(L)]
    if lean and A.final_norm is None:
        sites.append((prefix + "resid_post", L - 1))
    if A.final_norm is not None:
        sites += [(prefix + "ln_final.in", None), (prefix + "ln_final.out", None)]
    if not prefix and A.encoder is not None:
        sites += trace_sites(lm, prefix=ENC)
    return sites


def _view(lm: LoadedModel, cap, ids: Tensor, row: int, logits: Tensor | None, lean: bool = False,
          prefix: str = "", source: Tensor | None = None) -> Trace:
    """Row ``row`` of a batch captured with :func:`trace_sites` as a :class:`Trace` (views, no copies; ``lean``:
    captured with ``lean=True``, the shared fields filled in, one stacked copy of the residual stream).
    ``prefix``: the stack (``enc.``: an encoder-decoder model's encoder, whose input is ``ids``); ``source``: such a
    model's source ids (its decoder's Trace then holds the encoder's)."""
    A = lm.anatomy.encoder if prefix else lm.anatomy
    slots = list(A.layers[0].norms())

    def per_layer(name):
        return cap.stacked(prefix + name)[:, row]

    final_in, final_out = cap.get((prefix + "ln_final.in", None)), cap.get((prefix + "ln_final.out", None))
    resid_pre = per_layer("resid_pre")
    if final_in is not None:
        final_in, final_out = final_in[row].to(resid_pre.device), final_out[row].to(resid_pre.device)
    if lean:  # one (layer + 1, pos, d_model) stack: resid_post[l] is resid_pre[l + 1]
        last = final_in if final_in is not None else cap[("resid_post", A.n_layers - 1)][row].to(resid_pre.device)
        states = torch.cat([resid_pre, last[None]])
        del cap._bufs["resid_pre"]  # the engine's copy is no longer needed
        resid_pre, resid_post = states[:-1], states[1:]
        if final_in is not None:
            final_in = states[-1]
    else:
        resid_post = per_layer("resid_post")
    resid_mid, attn_out, mlp_out = per_layer("resid_mid"), per_layer("attn_out"), per_layer("mlp_out")
    same = {"ln_attn.in": resid_pre, "ln_mlp.in": resid_mid if A.placement != "parallel" else resid_pre,
            "ln_attn.out": resid_mid, "ln_attn_out.in": attn_out, "ln_mlp_out.in": mlp_out, "ln_mlp.out": resid_post}

    def norm(site):
        if not lean:
            return per_layer(site)
        if A.placement in SHARED.get(site, ()):
            return same[site]
        if site.endswith(".out"):
            slot = site[: -len(".out")]
            return RecomputedNorm([layer.norms()[slot] for layer in A.layers], norms[f"{slot}.in"])
        return per_layer(site)

    norms = {}
    for site in [f"{s}.{w}" for w in ("in", "out") for s in slots]:  # the inputs first: an output reads one
        norms[site] = norm(site)
    if final_in is not None:
        norms["ln_final.in"], norms["ln_final.out"] = final_in, final_out
    moe = is_moe(A)
    mlp_pre = mlp_up = None
    if lean:
        x = resid_pre if A.placement == "post" else norms["ln_attn.out"]
        probs = RecomputedProbs([layer.attn for layer in A.layers], x, torch.arange(ids.numel(), device=x.device),
                                A.causal)
        x = resid_mid if A.placement == "post" else norms["ln_mlp.out"]
        mlps = [layer.mlp for layer in A.layers]
        if not moe:
            mlp_pre = RecomputedMLP(mlps, x, 0)
            mlp_up = RecomputedMLP(mlps, x, 1) if mlps[0].gated else None
    else:
        probs = per_layer("pattern")
        if not moe:
            mlp_pre = per_layer("mlp_pre")
            mlp_up = per_layer("mlp_up") if (prefix + "mlp_up", 0) in cap else None
    cross = A.layers[0].cross is not None
    cross_out = per_layer("cross_out") if cross else None
    return Trace(
        input_ids=ids.cpu(),
        tokens=_tokens(lm, ids),
        positions=torch.arange(ids.numel(), device=resid_pre.device),
        embed=resid_pre[0],
        resid_pre=resid_pre,
        resid_mid=resid_mid,
        resid_post=resid_post,
        attn_out=attn_out,
        attn_write=_scaled(A, norms.get("ln_attn_out.out", attn_out), lean),
        mlp_out=mlp_out,
        mlp_write=_scaled(A, norms.get("ln_mlp_out.out", mlp_out), lean),
        pattern=probs,
        mlp_pre=mlp_pre,
        mlp_up=mlp_up,
        norms=norms,
        logits=_logits(A, logits, resid_pre.device, final_in if final_in is not None else resid_post[-1], lean),
        placement=A.placement,
        router_logits=per_layer("router_logits") if moe else None,
        routing_weights=per_layer("routing_weights") if moe else None,
        encoder=None if source is None else _view(lm, cap, source, row, None, prefix=ENC),
        cross_out=cross_out,
        cross_write=torch.stack([la.write("cross", cross_out[i]) for i, la in enumerate(A.layers)]) if cross else None,
        cross_pattern=per_layer("cross_pattern") if cross else None,
    )


def _tokens(lm: LoadedModel, ids: Tensor) -> list[str]:
    if lm.tokenizer is None:  # a model built in a test, without a tokenizer
        return [f"#{int(i)}" for i in ids]
    return lm.tokenizer.batch_decode([[int(i)] for i in ids])


def _scaled(A, x, lean: bool = False):
    """A sub-layer's output (through its sandwich norm) ``(layer, pos, d_model)`` times each block's
    ``residual_scale``: what it adds to the residual stream (``x`` itself where every scale is 1; a lean trace
    scales each layer when read)."""
    scales = [layer.residual_scale for layer in A.layers]
    if all(c == 1.0 for c in scales):
        return x
    if lean:
        return RecomputedNorm([partial(torch.mul, other=c) for c in scales], x)
    return x * torch.tensor(scales, dtype=x.dtype, device=x.device)[:, None, None]


def _logits(A, logits: Tensor | None, device, final_resid: Tensor, lean: bool):
    """The trace's logits: the model's, or (a lean trace of a causal model, which ran with the last position's
    logits only) :class:`RecomputedLogits`."""
    if logits is None:
        return None
    logits = logits.to(device=device, dtype=compute_dtype(logits.dtype))
    if lean and A.causal and logits.shape[0] == 1 < final_resid.shape[0]:
        from ..weights.readout import Readout

        return RecomputedLogits(Readout.from_anatomy(A), final_resid, logits[-1])
    return logits


def _math_device(lm: LoadedModel, device):
    device = device if device is not None else lm.anatomy.extras.get("placement", {}).get("math_device")
    return None if device is None else torch.device(device)


def lean_bytes(lm: LoadedModel, n: int) -> int:
    """What a lean trace of ``n`` tokens leaves out, in bytes: the attention probabilities, the MLP's
    pre-activations and (causal models) the logits of all but the last position."""
    A = lm.anatomy
    mlp = A.layers[0].mlp
    probs = A.n_layers * A.layers[0].attn.n_heads * n * n
    pre = 0 if is_moe(A) else A.n_layers * n * mlp.d_mlp * (2 if mlp.gated else 1)
    logits = (n - 1) * A.vocab_size if A.causal and A.unembed is not None else 0
    return 4 * (probs + pre + logits)


def recompute_probs(lm: LoadedModel, n: int, pattern: str = "auto") -> bool:
    """Whether :func:`trace` of ``n`` tokens makes a lean trace (recomputing the attention probabilities and the
    rest when read) instead of keeping every capture (``pattern``: ``"auto"``, ``"keep"`` or ``"recompute"``;
    ``"auto"``: when :func:`lean_bytes` exceeds :data:`KEEP_BYTES` and the model computes in float32)."""
    if pattern not in ("auto", "keep", "recompute"):
        raise InputError(f"pattern must be 'auto', 'keep' or 'recompute', not {pattern!r}")
    if pattern != "auto":
        return pattern == "recompute"
    dtype = getattr(lm.model, "dtype", torch.float32)
    return lean_bytes(lm, n) > KEEP_BYTES and not is_reduced(dtype)


def trace(lm: LoadedModel, text: str | list[int] | Tensor, *, device: str | torch.device | None = None,
          pattern: Literal["auto", "keep", "recompute"] = "auto", edits=(), source=None, **renamed) -> Trace:
    """Run the model once on ``text`` (or token ids) and capture everything lenscope's methods read.

    ``device``: where the captures are kept (default: the ``math_device`` the model was loaded with, else where the
    first block's capture arrives: the model's device for a model on one device). Captures of bfloat16 / float16
    models are kept in float32. ``pattern`` (its old name: :data:`RENAMED`): ``"keep"`` the captured attention
    probabilities, ``"recompute"`` them per layer when read (:class:`RecomputedProbs`: a lean trace), or ``"auto"``:
    a lean trace where it leaves out more than :data:`KEEP_BYTES` and the model computes in float32
    (:func:`recompute_probs`). ``edits``: engine edits (row 0, e.g. a steering vector) applied during the pass; with
    edits ``"auto"`` keeps every capture. ``source``: an encoder-decoder model's source token ids (``text``: then the
    target prefix's, from the decoder's start token); the Trace is the decoder's, ``Trace.encoder`` the
    encoder's (every capture kept)."""
    for old, value in renamed.items():
        if RENAMED.get(old) != "pattern":
            raise TypeError(f"trace() got an unexpected keyword argument {old!r}")
        warn_renamed(f"trace(..., {old}=)", "trace(..., pattern=)")
        pattern = value
    ids = token_ids(lm, text)
    edits = list(edits)
    src = source_ids(lm, source)
    pattern = "keep" if (edits or src is not None) and pattern == "auto" else pattern
    lean = recompute_probs(lm, ids.numel(), pattern)
    if lean and src is not None:
        raise InputError("an encoder-decoder model's trace keeps every capture (pattern='keep')")
    logits, cap = run(lm, ids[None], edits, capture=trace_sites(lm, lean=lean), device=_math_device(lm, device),
                      upcast=True, last_only=lean and lm.anatomy.causal, source=None if src is None else src[None])
    return _view(lm, cap, ids, 0, None if logits is None else logits[0], lean=lean, source=src)


def source_ids(lm: LoadedModel, source) -> Tensor | None:
    """An encoder-decoder model's source as token ids ``(src,)``: a text through the tokenizer (with its special
    tokens), or given ids (None: no source). The engine checks them against the model (``engine._check_source``:
    whether it reads a source, the encoder's context and vocabulary)."""
    if source is None:
        return None
    if isinstance(source, str):
        if not source.strip():
            raise InputError("the source is empty; give a non-empty source")
        return torch.as_tensor(lm.tokenizer(source)["input_ids"], dtype=torch.long)
    try:
        return torch.as_tensor(source, dtype=torch.long).reshape(-1).cpu()
    except (TypeError, ValueError, RuntimeError) as e:
        raise InputError(f"give the source as a text or a list of token ids, not {type(source).__name__} ({e})"
                         ) from None


@torch.no_grad()
def batch_traces(lm: LoadedModel, ids, *, source=None) -> list[Trace]:
    """One :class:`Trace` per row of ``ids (batch, pos)`` from a single forward pass (rows of equal length; the
    same sites as :func:`trace`). ``logits`` hold the last position only; earlier positions are NaN.

    An encoder-decoder model: ``source``, one source per row; the rows (target prefixes from the decoder's start
    token) and the sources may be lists of 1-D ids of any lengths, padded on the right for the pass (the engine's
    ``attention_mask`` and ``source_mask``), and each row's Trace holds its own positions only (every position's
    logits), as :func:`trace` of that row alone would, up to the rounding of another batch shape."""
    if source is not None:
        return _seq2seq_traces(lm, ids, source)
    ids = torch.as_tensor(ids, dtype=torch.long)
    B, n = ids.shape
    logits, cap = run(lm, ids, capture=trace_sites(lm), last_only=True)
    last = logits[:, -1]  # (batch, vocab)
    out = []
    for b in range(B):
        lg = last.new_full((n, last.shape[-1]), float("nan"))
        lg[-1] = last[b]
        out.append(_view(lm, cap, ids[b], b, lg))
    return out


def _padded(rows: list[Tensor], pad: int) -> tuple[Tensor, Tensor]:
    """Rows of ids padded on the right: ``(ids, mask)``, both ``(batch, longest)``."""
    n = max(len(r) for r in rows)
    ids = torch.full((len(rows), n), int(pad), dtype=torch.long)
    mask = torch.zeros((len(rows), n), dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, : len(r)], mask[b, : len(r)] = r, 1
    return ids, mask


def _seq2seq_traces(lm: LoadedModel, ids, source) -> list[Trace]:
    rows = [torch.as_tensor(r, dtype=torch.long).reshape(-1) for r in ids]
    srcs = [source_ids(lm, s) for s in source]
    if len(srcs) != len(rows) or not rows:
        raise InputError(f"give one source per target prefix; got {len(srcs)} sources for {len(rows)} rows")
    if any(len(r) == 0 for r in rows + srcs):
        raise InputError("every target prefix (from the decoder's start token) and source needs a token")
    pad = lm.tokenizer.pad_token_id if lm.tokenizer is not None and lm.tokenizer.pad_token_id is not None else 0
    dec, mask = _padded(rows, pad)
    src, src_mask = _padded(srcs, pad)
    logits, cap = run(lm, dec, capture=trace_sites(lm), device=_math_device(lm, None), upcast=True, source=src,
                      attention_mask=mask, source_mask=src_mask)
    return [_view(lm, _row_captures(cap, b, len(r), len(s)), r, 0, logits[b, : len(r)], source=s)
            for b, (r, s) in enumerate(zip(rows, srcs))]


def _row_captures(cap, row: int, n: int, n_src: int):
    """Row ``row`` of a padded batch's captures, cut to its ``n`` target and ``n_src`` source positions (views)."""
    from .sites import Captures

    def cut(name, x, lead):  # lead: the axes before the batch's (a buffer's block axis)
        prefix, bare = stack_of(name)
        own = n_src if prefix or bare in ("cross_k", "cross_v") else n
        x = x.narrow(lead, row, 1)
        if bare in ("pattern", "cross_pattern"):  # (b, h, p, s)
            keys = n_src if prefix or bare == "cross_pattern" else n
            return x.narrow(lead + 2, 0, own).narrow(lead + 3, 0, keys)
        return x.narrow(lead + 1, 0, own)

    out = Captures()
    for name, (layers, buf) in cap._bufs.items():
        part = cut(name, buf, 1)
        out._bufs[name] = (layers, part)
        for j, layer in enumerate(layers):
            out[(name, layer)] = part[j]
    for key, x in cap.items():
        if key not in out:
            out[key] = cut(key[0], x, 0)
    return out


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
    A = lm.anatomy
    L = A.n_layers
    last = ("ln_final.in", None) if A.final_norm is not None else ("resid_post", L - 1)
    sites = [("resid_pre", i) for i in range(L)] + [last] + ([("resid_mid", i) for i in range(L)] if mid else [])
    logits, cap = run(lm, ids, capture=sites, device=_math_device(lm, device), upcast=True)
    pre = cap.stacked("resid_pre")
    res = {"states": torch.cat([pre, cap[last].to(pre.device)[None]])}
    if mid:
        res["mid"] = cap.stacked("resid_mid")
    res["logits"] = None if logits is None else logits.to(device=pre.device, dtype=compute_dtype(logits.dtype))
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
        mlp_write=cut(tr.mlp_write, [1]), pattern=cut(tr.pattern, [2, 3]), mlp_pre=cut(tr.mlp_pre, [1]),
        mlp_up=cut(tr.mlp_up, [1]), logits=cut(tr.logits, [0]), encoder=tr.encoder, cross_out=cut(tr.cross_out, [1]),
        cross_write=cut(tr.cross_write, [1]), cross_pattern=cut(tr.cross_pattern, [2]),
        norms={k: cut(v, [0 if k.startswith("ln_final") else 1]) for k, v in tr.norms.items()},
        placement=tr.placement, extras=tr.extras,
        router_logits=cut(tr.router_logits, [1]), routing_weights=cut(tr.routing_weights, [1]),
    )
