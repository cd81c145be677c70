"""The Trace: one forward pass of the real model with what the methods need captured.

A Trace is a view on the engine (:mod:`lenscope.models.engine`): the sites of :func:`trace_sites`, captured in one
pass. All tensors are for a single sequence (no batch axis).

Devices and dtypes: a model split across devices (accelerate's ``device_map``) runs as placed; each capture
arrives on the device its block ran on and is copied into one ``(layer, ...)`` tensor on the trace's device
(``trace(..., device=)``; by default the ``math_device`` the model was loaded with, else the device of the first
block's capture, i.e. the model's own device for a model on one device). Captures of bfloat16 / float16 models are
stored in float32 (exact), the dtype the Anatomy computes in.

Long inputs: the per-head attention probabilities ``(layer, head, pos, src)`` grow as ``pos^2`` (1.1 GB for a
30-layer, 9-head model at 1,024 tokens), every position's logits as ``pos * vocab``. When what a lean trace
leaves out would exceed :data:`KEEP_BYTES` (and the model computes in float32), :func:`trace` makes a lean trace:

- ``attn_probs`` is a :class:`RecomputedProbs`: reading ``tr.attn_probs[l]`` recomputes layer ``l``'s
  probabilities from the traced attention input with the Anatomy's own attention
  (:meth:`~lenscope.models.anatomy.Attention.pattern`, the code ``verify`` checks against the model);
- ``mlp_pre`` / ``mlp_up`` (:class:`RecomputedMLP`, from the MLP's traced input) and the block norms' outputs
  (:class:`RecomputedNorm`) likewise;
- a causal model computes the last position's logits only; ``tr.logits`` of other positions are recomputed from
  the final residual state with the readout when read (:class:`RecomputedLogits`);
- copies of tensors the model passes on unchanged are shared (``resid_post[l]`` is ``resid_pre[l + 1]``; a
  pre-norm's input is the block's input, the MLP norm's input is ``resid_mid``).

``trace(..., attn_probs="keep")`` keeps every capture whatever the length.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Literal

import torch
from torch import Tensor

from ..errors import InputError
from .devices import compute_dtype, is_reduced
from .engine import run
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
      sandwich norms of Gemma, times Granite's residual multiplier: ``Layer.write``; equal to ``*_out`` elsewhere)
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
    attn_probs: Tensor  # these three may be Recomputed (a lean trace), which index and compute like tensors
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


KEEP_BYTES = 2**30  # trace(attn_probs="auto") is lean when it would leave out more than this (see lean_bytes)


class Lazy:
    """What a tensor that is computed when read has in common: ``shape``, ``dtype``, ``device``, ``size``,
    ``dim``; any use not provided by the subclass (a torch function, a tensor method) materialises it first."""

    _x: Tensor

    @property
    def shape(self) -> torch.Size:
        raise NotImplementedError

    def materialize(self) -> Tensor:
        raise NotImplementedError

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32 if self._x.dtype != torch.float64 else torch.float64

    @property
    def device(self) -> torch.device:
        return self._x.device

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def dim(self) -> int:
        return len(self.shape)

    def __len__(self) -> int:
        return self.shape[0]

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        def real(a):
            if isinstance(a, Lazy):
                return a.materialize()
            if isinstance(a, (list, tuple)):
                return type(a)(real(b) for b in a)
            return a

        return func(*real(args), **{k: real(v) for k, v in (kwargs or {}).items()})

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.materialize(), name)

    def __array__(self, dtype=None, copy=None):
        a = self.materialize().cpu().numpy()
        return a if dtype is None else a.astype(dtype)

    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shape={tuple(self.shape)})"


def _materializing(name: str):
    def op(self, *args):
        return getattr(self.materialize(), name)(*args)

    op.__name__ = name
    return op


for _name in ("add", "radd", "sub", "rsub", "mul", "rmul", "truediv", "rtruediv", "matmul", "rmatmul", "pow",
              "rpow", "neg", "abs", "lt", "le", "gt", "ge", "eq", "ne", "and", "or", "invert", "iter"):
    if _name not in vars(Lazy):
        setattr(Lazy, f"__{_name}__", _materializing(f"__{_name}__"))  # operators are looked up on the type


class Recomputed(Lazy):
    """A ``(layer, ...)`` capture that is not stored: ``self[l]`` recomputes layer ``l`` from the trace with the
    Anatomy's own math (the last layer read is kept, so a method reading one layer in chunks computes it once).

    Reads like the tensor it stands for: ``self[l]``, ``self[l, ...]``, ``self[l][:, rows]``, ``shape``,
    ``dtype``, ``device``, ``narrow`` from 0 along a position axis (what :func:`prefix_trace` cuts); any other use
    (a torch function, a tensor method, a slice over layers) materialises the whole tensor first."""

    def __init__(self, n_layers: int, shape: tuple, x: Tensor):
        self._n_layers, self._shape, self._x = n_layers, tuple(shape), x
        self._cache: tuple[int, Tensor] | None = None

    def _compute(self, l: int) -> Tensor:
        raise NotImplementedError

    def _cut(self, dim: int, length: int):
        """A copy narrowed to the first ``length`` along ``dim`` (>= 1), or None where that is not a prefix cut."""
        return None

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self._n_layers,) + self._shape)

    def layer(self, l: int) -> Tensor:
        """Layer ``l``'s values, ``shape[1:]``."""
        l = range(self._n_layers)[l]
        if self._cache is None or self._cache[0] != l:
            self._cache = None  # the old layer goes before the new one is made
            self._cache = (l, self._compute(l).to(device=self.device, dtype=self.dtype))
        return self._cache[1]

    def __iter__(self):
        return (self.layer(l) for l in range(self._n_layers))

    def materialize(self) -> Tensor:
        """Every layer's values as one tensor."""
        out = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        for l in range(self._n_layers):
            out[l] = self.layer(l)
        return out

    def __getitem__(self, key):
        if isinstance(key, tuple) and key and _is_index(key[0]):
            return self.layer(int(key[0]))[key[1:]]
        if _is_index(key):
            return self.layer(int(key))
        return self.materialize()[key]

    def narrow(self, dim: int, start: int, length: int):
        dim = dim % self.dim()
        cut = self._cut(dim, length) if start == 0 and dim > 0 else None
        return cut if cut is not None else self.materialize().narrow(dim, start, length)


class RecomputedLogits(Lazy):
    """The logits ``(pos, vocab)`` of a lean trace of a causal model: the model computed the last position's
    (``last (vocab,)``, kept); any other row is recomputed from the final residual state ``x (pos, d_model)``
    with the readout (:class:`~lenscope.models.readout.Readout`) when read. Indexing by rows (an int, a slice,
    index tensors) computes only those rows; anything else materialises all of them (in blocks)."""

    def __init__(self, readout, x: Tensor, last: Tensor, n: int | None = None):
        self._readout, self._x, self._last = readout, x, last
        self._n = x.shape[0] if n is None else n

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self._n, self._last.shape[-1]))

    def rows(self, idx: Tensor) -> Tensor:
        """Logits of the positions ``idx (k,)``: ``(k, vocab)``."""
        idx = idx.to(self._x.device)
        out = self._readout.logits(self._x[idx]).to(device=self.device, dtype=self.dtype)
        is_last = idx == self._x.shape[0] - 1  # the row the model computed: its own values
        if bool(is_last.any()):
            out[is_last] = self._last.to(out)
        return out

    def materialize(self) -> Tensor:
        out = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        for a in range(0, self._n, 256):
            out[a:a + 256] = self.rows(torch.arange(a, min(self._n, a + 256)))
        return out

    def __getitem__(self, key):
        rest = ()
        if isinstance(key, tuple) and key:
            key, rest = key[0], key[1:]
        n = self._n
        if _is_index(key):
            return self.rows(torch.tensor([range(n)[int(key)]]))[0][rest]
        if isinstance(key, slice):
            idx = torch.arange(n)[key]
        elif isinstance(key, (list, Tensor)) and torch.as_tensor(key).dim() == 1 and \
                not torch.as_tensor(key).is_floating_point() and torch.as_tensor(key).dtype != torch.bool:
            idx = torch.arange(n)[torch.as_tensor(key)]
        else:
            return self.materialize()[(key,) + rest]
        return self.rows(idx)[(slice(None),) + rest]

    def narrow(self, dim: int, start: int, length: int):
        if dim % 2 == 0 and start == 0:
            return RecomputedLogits(self._readout, self._x, self._last, length)
        return self.materialize().narrow(dim, start, length)


class RecomputedProbs(Recomputed):
    """Attention probabilities ``(layer, head, pos, src)`` recomputed from the attention inputs ``x (layer, pos,
    d_model)`` with :meth:`~lenscope.models.anatomy.Attention.pattern` (see :class:`Recomputed`). On a causal
    model the first ``m`` positions' probabilities are recomputed from those positions alone."""

    def __init__(self, attns: list, x: Tensor, positions: Tensor, causal: bool, n_q: int | None = None,
                 n_k: int | None = None):
        n = x.shape[1]
        n_q, n_k = (n if n_q is None else n_q), (n if n_k is None else n_k)
        super().__init__(len(attns), (attns[0].n_heads, n_q, n_k), x)
        self._attns, self._positions, self._causal = attns, positions, causal

    def _compute(self, l: int) -> Tensor:
        n_q, n_k = self._shape[1:]
        m = max(n_k if self._causal else self._x.shape[1], n_q)  # causal: a prefix sees only itself
        return self._attns[l].pattern(self._x[l, :m], self._positions[:m])[:, :n_q, :n_k]

    def _cut(self, dim: int, length: int):
        if dim not in (2, 3):
            return None
        n_q, n_k = self._shape[1:]
        n_q, n_k = (length, n_k) if dim == 2 else (n_q, length)
        return RecomputedProbs(self._attns, self._x, self._positions, self._causal, n_q, n_k)


class RecomputedMLP(Recomputed):
    """An MLP's pre-activations ``(layer, pos, d_mlp)`` recomputed from its inputs ``x (layer, pos, d_model)``
    with :meth:`~lenscope.models.anatomy.MLP.pre`: the activated branch (``which=0``) or a gated MLP's linear
    branch (``which=1``). See :class:`Recomputed`."""

    def __init__(self, mlps: list, x: Tensor, which: int):
        super().__init__(len(mlps), (x.shape[1], mlps[0].d_mlp), x)
        self._mlps, self._which = mlps, which

    def _compute(self, l: int) -> Tensor:
        return self._mlps[l].pre(self._x[l, : self._shape[0]])[self._which]

    def _cut(self, dim: int, length: int):
        if dim != 1:
            return None
        out = RecomputedMLP(self._mlps, self._x, self._which)
        out._shape = (length,) + self._shape[1:]
        return out


class RecomputedNorm(Recomputed):
    """A block norm's outputs ``(layer, pos, d_model)`` recomputed from its traced inputs ``x`` with the
    Anatomy's norm (see :class:`Recomputed`), or any other map of one layer's values (``norms``: one callable per
    layer; a residual multiplier's scaling)."""

    def __init__(self, norms: list, x: Tensor, n: int | None = None):
        super().__init__(len(norms), (x.shape[1] if n is None else n, x.shape[2]), x)
        self._norms = norms

    def _compute(self, l: int) -> Tensor:
        return self._norms[l](self._x[l, : self._shape[0]])

    def _cut(self, dim: int, length: int):
        return RecomputedNorm(self._norms, self._x, length) if dim == 1 else None


def _is_index(k) -> bool:
    return isinstance(k, int) or (isinstance(k, Tensor) and k.dim() == 0 and not k.is_floating_point()
                                  and k.dtype != torch.bool)


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


def trace_sites(lm: LoadedModel, *, lean: bool = False) -> list[tuple]:
    """The engine's sites a :class:`Trace` holds, for every block (see :mod:`lenscope.models.engine`).

    ``lean``: without the attention probabilities, the MLP pre-activations and the block norms' outputs
    (recomputed: :class:`RecomputedProbs`, :class:`RecomputedMLP`, :class:`RecomputedNorm`), ``resid_post``
    (the next block's input; the last block's only where there is no final norm) and the norm inputs / outputs
    that equal another capture (:data:`SHARED`)."""
    A = lm.anatomy
    L = A.n_layers
    names = ["resid_pre", "resid_mid", "resid_post", "pattern", "attn_out", "mlp_out", "mlp_pre"]
    if A.layers[0].mlp.gated:
        names.append("mlp_up")
    names += [f"{slot}.{w}" for slot in A.layers[0].norms() for w in ("in", "out")]
    if lean:
        names = [n for n in names if n not in RECOMPUTED and A.placement not in SHARED.get(n, ())
                 and not n.endswith(".out")]  # a block norm's output is recomputed from its input
    sites = [(n, i) for n in names for i in range(L)]
    if lean and A.final_norm is None:
        sites.append(("resid_post", L - 1))
    if A.final_norm is not None:
        sites += [("ln_final.in", None), ("ln_final.out", None)]
    return sites


def _view(lm: LoadedModel, cap, ids: Tensor, row: int, logits: Tensor | None, lean: bool = False) -> Trace:
    """Row ``row`` of a batch captured with :func:`trace_sites` as a :class:`Trace` (views, no copies; ``lean``:
    captured with ``lean=True``, the shared fields filled in, one stacked copy of the residual stream)."""
    A = lm.anatomy
    slots = list(A.layers[0].norms())

    def per_layer(name):
        return cap.stacked(name)[:, row]

    final_in, final_out = cap.get(("ln_final.in", None)), cap.get(("ln_final.out", None))
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
            return RecomputedNorm([layer.norms()[slot] for layer in A.layers], norm_in[slot])
        return per_layer(site)

    norm_in = {s: norm(f"{s}.in") for s in slots}
    norm_out = {s: norm(f"{s}.out") for s in slots}
    if lean:
        x = resid_pre if A.placement == "post" else norm_out["ln_attn"]
        probs = RecomputedProbs([layer.attn for layer in A.layers], x, torch.arange(ids.numel(), device=x.device),
                                A.causal)
        x = resid_mid if A.placement == "post" else norm_out["ln_mlp"]
        mlps = [layer.mlp for layer in A.layers]
        mlp_pre = RecomputedMLP(mlps, x, 0)
        mlp_up = RecomputedMLP(mlps, x, 1) if mlps[0].gated else None
    else:
        probs, mlp_pre = per_layer("pattern"), per_layer("mlp_pre")
        mlp_up = per_layer("mlp_up") if ("mlp_up", 0) in cap else None
    return Trace(
        input_ids=ids.cpu(),
        tokens=lm.tokenizer.batch_decode([[int(i)] for i in ids]),
        positions=torch.arange(ids.numel(), device=resid_pre.device),
        embed=resid_pre[0],
        resid_pre=resid_pre,
        resid_mid=resid_mid,
        resid_post=resid_post,
        attn_out=attn_out,
        attn_write=_scaled(A, norm_out.get("ln_attn_out", attn_out), lean),
        mlp_out=mlp_out,
        mlp_write=_scaled(A, norm_out.get("ln_mlp_out", mlp_out), lean),
        attn_probs=probs,
        mlp_pre=mlp_pre,
        mlp_up=mlp_up,
        norm_in=norm_in,
        norm_out=norm_out,
        final_in=final_in,
        final_out=final_out,
        logits=_logits(A, logits, resid_pre.device, final_in if final_in is not None else resid_post[-1], lean),
        placement=A.placement,
    )


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
        from .readout import Readout

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
    pre = A.n_layers * n * mlp.d_mlp * (2 if mlp.gated else 1)
    logits = (n - 1) * A.vocab_size if A.causal and A.unembed is not None else 0
    return 4 * (probs + pre + logits)


def recompute_probs(lm: LoadedModel, n: int, attn_probs: str = "auto") -> bool:
    """Whether :func:`trace` of ``n`` tokens makes a lean trace (recomputing the attention probabilities and the
    rest when read) instead of keeping every capture (``attn_probs``: ``"auto"``, ``"keep"`` or ``"recompute"``;
    ``"auto"``: when :func:`lean_bytes` exceeds :data:`KEEP_BYTES` and the model computes in float32)."""
    if attn_probs not in ("auto", "keep", "recompute"):
        raise InputError(f"attn_probs must be 'auto', 'keep' or 'recompute', not {attn_probs!r}")
    if attn_probs != "auto":
        return attn_probs == "recompute"
    dtype = getattr(lm.model, "dtype", torch.float32)
    return lean_bytes(lm, n) > KEEP_BYTES and not is_reduced(dtype)


def trace(lm: LoadedModel, text: str | list[int] | Tensor, *, device: str | torch.device | None = None,
          attn_probs: Literal["auto", "keep", "recompute"] = "auto") -> Trace:
    """Run the model once on ``text`` (or token ids) and capture everything lenscope's methods read.

    ``device``: where the captures are kept (default: the ``math_device`` the model was loaded with, else where the
    first block's capture arrives: the model's device for a model on one device). Captures of bfloat16 / float16
    models are kept in float32. ``attn_probs``: ``"keep"`` the captured attention probabilities, ``"recompute"``
    them per layer when read (:class:`RecomputedProbs`: a lean trace), or ``"auto"``: a lean trace where it leaves
    out more than :data:`KEEP_BYTES` and the model computes in float32 (:func:`recompute_probs`)."""
    ids = token_ids(lm, text)
    lean = recompute_probs(lm, ids.numel(), attn_probs)
    logits, cap = run(lm, ids[None], capture=trace_sites(lm, lean=lean), device=_math_device(lm, device),
                      upcast=True, last_only=lean and lm.anatomy.causal)
    return _view(lm, cap, ids, 0, None if logits is None else logits[0], lean=lean)


@torch.no_grad()
def batch_traces(lm: LoadedModel, ids: Tensor) -> list[Trace]:
    """One :class:`Trace` per row of ``ids (batch, pos)`` from a single forward pass (rows of equal length; the
    same sites as :func:`trace`). ``logits`` hold the last position only; earlier positions are NaN."""
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
        mlp_write=cut(tr.mlp_write, [1]), attn_probs=cut(tr.attn_probs, [2, 3]), mlp_pre=cut(tr.mlp_pre, [1]),
        mlp_up=cut(tr.mlp_up, [1]), norm_in={k: cut(v, [1]) for k, v in tr.norm_in.items()},
        norm_out={k: cut(v, [1]) for k, v in tr.norm_out.items()}, final_in=cut(tr.final_in, [0]),
        final_out=cut(tr.final_out, [0]), logits=cut(tr.logits, [0]), placement=tr.placement, extras=tr.extras,
    )
