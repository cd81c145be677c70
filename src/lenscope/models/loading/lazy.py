"""Tensors of a lean :class:`~lenscope.models.runtime.trace.Trace` that are computed when read (see :mod:`.trace`): a
layer's attention probabilities, MLP pre-activations and norm outputs recomputed from its traced inputs with the
Anatomy's math, and the logits of every position from the final residual state (re-exported by :mod:`.trace`)."""

from __future__ import annotations

import torch
from torch import Tensor


def _is_index(k) -> bool:
    return isinstance(k, int) or (isinstance(k, Tensor) and k.dim() == 0 and not k.is_floating_point()
                                  and k.dtype != torch.bool)


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
    with the readout (:class:`~lenscope.models.weights.readout.Readout`) when read. Indexing by rows (an int, a slice,
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
    d_model)`` with :meth:`~lenscope.models.weights.anatomy.Attention.pattern` (see :class:`Recomputed`). On a causal
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
    with :meth:`~lenscope.models.weights.anatomy.MLP.pre`: the activated branch (``which=0``) or a gated MLP's linear
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
