"""How much memory an attribution graph takes (:class:`GraphMemory`, estimated before anything big is allocated) and
the batch size that fits a budget (:func:`fit_memory`), for :func:`~lenscope.features.graphs.graph.attribution_graph`
and the head splits (:mod:`~lenscope.features.graphs.heads`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from torch import Tensor

from ...errors import InputError
from ...models.loading.load import LoadedModel
from .prune import CHUNK, prune_memory
from .replacement import Transcoders


@dataclass(frozen=True)
class GraphMemory:
    """The estimated peak memory of :func:`attribution_graph` in bytes (float32: 4 bytes a number, ``s`` below), by
    term, with ``P`` tokens, ``L`` blocks, ``H`` heads, ``d`` = d_model, ``n_active`` active features (at most
    ``block_active`` in one block), ``n_src = n_active + L P + P`` sources, ``rows`` = feature rows computed + logit
    rows, ``N = features + L P + P + logits`` nodes:

    - ``trace``: the real run's trace (its logits, patterns, residual streams, MLP activations), measured: the bytes
      of its tensors;
    - ``frozen``: the frozen model, held throughout: its attention patterns (``L H P^2``), each block's one-hot
      placement of its active features (``P n_active``), their decoder rows and decoded writes to each block they
      write (``2 n_writes d``; ``n_writes``: the sum over active features of the blocks each writes, ``n_active``
      for per-layer transcoders, up to ``L n_active`` for a cross-layer transcoder),
      the per-head outputs of the retained forward graph (``L H P d``) and about 16 ``(P, d)`` tensors per block
      (the error nodes, the forward graph's activations): ``s (L H P^2 + P n_active + 2 n_writes d + L H P d + 16 L
      P d)``;
    - ``rows``: the computed rows over every source, ``s rows n_src`` (held twice while they grow in order of
      influence, ``max_feature_nodes`` below the active count: the rows so far and their concatenation);
    - ``adjacency``: the dense graph, ``s N^2``;
    - ``check``: the assembly and the exactness check, :data:`CHUNK` rows at a time: a chunk's rows gathered, their
      float64 copy and its absolute values, ``5 s min(rows, CHUNK) N``;
    - ``per_row``: one row of a backward batch: the gradients of the error nodes, stacked and weighted (``3 L P
      d``), a block's per-head and residual gradients (``(H + 8) P d``), the gradient of a block's decoded writes
      and its product with the decoder rows (``2 block_active d``), the feature gradients and the row (``3 n_active
      + 2 n_src``), times ``s``;
    - ``backward``: ``per_row`` times the rows of a pass, ``max(batch_size, logits)`` (the logit rows are one pass);
    - ``prune``: pruning the graph (its JSON, page and export; :func:`~lenscope.features.graphs.prune.prune_memory`
      with every node kept, the most it can take).

    The peak: ``total = trace + frozen + max(k rows + backward, rows + adjacency + check, adjacency + prune)``
    (``k`` = 2 when the rows grow in order of influence, else 1): the backward passes come first, the graph after
    them, its pruning last. An estimate: the allocator's own overhead and the interpreter are not in it; the default
    budget's share leaves room for them."""

    trace: int
    frozen: int
    rows: int
    adjacency: int
    check: int
    per_row: int
    batch_size: int
    grows: bool
    prune: int = 0

    @property
    def backward(self) -> int:
        return self.per_row * self.batch_size

    @property
    def total(self) -> int:
        return self.trace + self.frozen + max((2 if self.grows else 1) * self.rows + self.backward,
                                              self.rows + self.adjacency + self.check, self.adjacency + self.prune)


def graph_memory(*, n_pos: int, n_layers: int, d_model: int, n_heads: int, n_active: int, block_active: int,
                 n_features: int, n_logits: int, batch_size: int, trace_bytes: int = 0,
                 n_writes: int | None = None) -> GraphMemory:
    """:class:`GraphMemory` of a graph with ``n_features`` feature rows of ``n_active`` active features (see there
    for the terms; ``trace_bytes``: the trace's, :func:`nbytes`; ``n_writes``: default ``n_active``)."""
    n_writes = n_active if n_writes is None else n_writes
    s, P, L, d, H = 4, n_pos, n_layers, d_model, n_heads
    n_src = n_active + L * P + P
    rows = n_features + n_logits
    N = n_features + L * P + P + n_logits
    return GraphMemory(
        trace=int(trace_bytes),
        frozen=s * (L * H * P * P + P * n_active + 2 * n_writes * d + L * H * P * d + 16 * L * P * d),
        rows=s * rows * n_src, adjacency=s * N * N, check=5 * s * min(rows, CHUNK) * N,
        per_row=s * (3 * L * P * d + (H + 8) * P * d + 2 * block_active * d + 3 * n_active + 2 * n_src),
        batch_size=max(batch_size, n_logits), grows=n_features < n_active, prune=prune_memory(N))


def nbytes(x, _seen: set | None = None) -> int:
    """The bytes of the tensors in ``x`` (a tensor, a dataclass such as a Trace, a dict, list or tuple of them),
    each storage counted once (a lean trace's shared copies, views)."""
    seen = set() if _seen is None else _seen
    if isinstance(x, Tensor):
        st = x.untyped_storage()
        if st.data_ptr() in seen:
            return 0
        seen.add(st.data_ptr())
        return st.nbytes()
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return sum(nbytes(getattr(x, f.name), seen) for f in dataclasses.fields(x))
    if isinstance(x, dict):
        return sum(nbytes(v, seen) for v in x.values())
    if isinstance(x, (list, tuple)):
        return sum(nbytes(v, seen) for v in x)
    return 0


def fit_memory(lm: LoadedModel, tr, dicts: Transcoders, counts: dict[int, int], max_feature_nodes: int | None,
               n_logits: int, batch_size: int, max_memory: int, log) -> int:
    """The batch size the graph's rows are computed with: ``batch_size``, lowered as far as needed to fit
    ``max_memory`` (:class:`GraphMemory`; ``counts``: each block's active features, written by ``dicts`` to
    :meth:`~.replacement.Transcoders.n_targets` blocks each); an
    :class:`~lenscope.errors.InputError` when even one row a pass does not fit, naming the most feature nodes that
    do."""
    from ...memory import format_bytes

    A, n_active = lm.anatomy, sum(counts.values())
    cap = n_active if max_feature_nodes is None else min(max_feature_nodes, n_active)
    dims = dict(n_pos=len(tr.tokens), n_layers=A.n_layers, d_model=A.d_model, n_active=n_active,
                n_heads=max(layer.attn.n_heads for layer in A.layers), block_active=max(counts.values(), default=0),
                n_logits=n_logits, trace_bytes=nbytes(tr),
                n_writes=sum(n * dicts.n_targets(L) for L, n in counts.items()))

    def est(n: int, b: int) -> GraphMemory:
        return graph_memory(n_features=n, batch_size=b, **dims)

    want = est(cap, batch_size)
    if want.total <= max_memory:
        log(f"attribution graph: estimated peak {format_bytes(want.total)} of the memory budget "
            f"{format_bytes(max_memory)}")
        return batch_size
    lo, hi = 1, batch_size  # the largest batch that fits, if any (the estimate grows with the batch)
    if est(cap, 1).total <= max_memory:
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if est(cap, mid).total <= max_memory else (lo, mid - 1)
        log(f"attribution graph: batch size lowered from {batch_size} to {lo} to fit the memory budget "
            f"{format_bytes(max_memory)} (estimated {format_bytes(est(cap, lo).total)})")
        return lo
    lo, hi = 0, cap  # the most feature rows that fit with one row a pass (-1: not even none)
    if est(0, 1).total > max_memory:
        lo = -1
    else:
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if est(mid, 1).total <= max_memory else (lo, mid - 1)
    fix = (f"use --max-feature-nodes {lo} (the most that fit)" if lo >= 0 else
           f"even --max-feature-nodes 0 needs {format_bytes(est(0, 1).total)} ({dims['n_pos']} tokens, {n_active} "
           "active features): shorten the prompt")
    raise InputError(f"attribution graph: {cap} feature nodes need about {format_bytes(want.total)}, more than the "
                     f"memory budget of {format_bytes(max_memory)}; {fix}, or raise --max-memory")


__all__ = ["GraphMemory", "fit_memory", "graph_memory", "nbytes"]
