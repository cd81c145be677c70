"""Heads on the edges of an attribution graph: each edge split exactly into the parts its attention heads carry.

An edge ``s -> t`` is the sum of the direct paths from ``s`` to ``t`` through the frozen replacement model
(:mod:`lenscope.features.graphs.replacement`). A path either takes no attention step (the residual stream, the norms and
the transcoders' skip paths, all position-wise: only possible when ``s`` and ``t`` share a position) or has a last
attention step, through one head ``(l, h)``. So, exactly,

    A[t, s] = R[t, s] + sum_{l, h} H[l, h][t, s]
    H[l, h][t, s] = J_s[l, h, p_t] . G_t[l]

``J_s[l, h, p_t]``: what ``s`` changes in head ``(l, h)``'s output at the target's position, along every path
(forward-mode derivatives of the frozen model, batched over sources); ``G_t[l]``: the gradient of ``t``'s input
with respect to block ``l``'s attention output at ``p_t`` along paths without another attention step (a backward
pass through the frozen model with every attention reading a detached input). ``R`` is computed on its own, the
edge through the model with every attention cut, and the identity is checked on every call: ``|A - R - sum H|``
relative to the edge's largest part.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from torch import Tensor

from ...errors import InputError
from ...models.loading.load import LoadedModel
from ...models.runtime.stop import checkpoint
from ...models.runtime.trace import trace
from .replacement import Frozen, check_parts, transcoders_by_layer


@dataclass
class EdgeHeads:
    """The head split of edges ``edges (n, 2)`` (``[target, source]`` node indices of the graph): ``heads (n, layer,
    head)`` the part each head carries as the last attention step, ``residual (n,)`` the part without attention;
    ``error``: the largest ``|A - residual - sum(heads)|`` relative to the sizes of what was summed (at most
    :func:`~lenscope.features.graphs.replacement.parts_rounding`)."""

    edges: Tensor
    heads: Tensor
    residual: Tensor
    error: float


def _sources(g, fz: Frozen) -> tuple[Tensor, Tensor]:
    """For every graph node that can be a source (features, errors, tokens): its kind (0 feature, 1 error, 2 token)
    and its index into ``fz``'s active features / flattened error nodes / positions."""
    o = g.offsets()
    key = {(int(a), int(b), int(c)): i for i, (a, b, c) in enumerate(zip(fz.layer, fz.pos, fz.feature))}
    try:
        feat = [key[(int(a), int(b), int(c))] for a, b, c in zip(g.feature_layer, g.feature_pos, g.feature_index)]
    except KeyError:
        raise InputError("the graph's features are not active in this model with these dictionaries: give the "
                         "model and the transcoders the graph was built with") from None
    n_err = o["token"] - o["error"]
    kind = torch.cat([torch.zeros(len(feat)), torch.ones(n_err), torch.full((g.n_pos,), 2.0)]).long()
    idx = torch.cat([torch.tensor(feat, dtype=torch.long), torch.arange(n_err), torch.arange(g.n_pos)])
    return kind, idx


@dataclass(frozen=True)
class HeadsMemory:
    """The estimated peak memory of :func:`edge_heads` in bytes (float32, ``s`` = 4 bytes a number), with ``P``
    tokens, ``L`` blocks, ``H`` heads, ``d`` = d_model, ``T`` targets, ``E`` edges, ``n_src`` source nodes, ``B``
    sources a forward-mode pass:

    - ``held``: what is held before it starts and throughout: the graph (the bytes of its tensors), the trace and
      the frozen model (:class:`~lenscope.features.graphs.memory.GraphMemory`'s ``trace`` and ``frozen``);
    - ``fixed``: the targets' gradients and attention-cut edges ``s T (L d + n_src)``, the retained attention-cut
      forward graph ``s (16 L P d + L H P d)``, the edges' head parts and their float64 copies ``12 E (L H + 1)``;
    - ``per_source``: one source of a pass: every head's output tangent, kept and stacked (``2 L H P d``), the
      tangents live while the frozen model runs forward (``4 L P d``) and its one-hot input (``n_active + 2
      n_src``), times ``s``;
    - ``edge_chunk``: the head tangents of a chunk of edges gathered at their targets' positions, their absolute
      values and products, ``3 s min(B P, E) L H d`` (a chunk holds at most ``P`` edges a source).

    - ``prune``: pruning the graph first, when no edges are given
      (:func:`~lenscope.features.graphs.prune.prune_memory` with every node kept), freed before the rest.

    ``total = held + max(prune, fixed + B per_source + edge_chunk)``."""

    held: int
    fixed: int
    per_source: int
    edge_chunk: int
    batch_size: int
    prune: int = 0

    @property
    def total(self) -> int:
        return self.held + max(self.prune, self.fixed + self.per_source * self.batch_size + self.edge_chunk)


def heads_memory(*, n_pos: int, n_layers: int, d_model: int, n_heads: int, n_active: int, n_targets: int,
                 n_edges: int, batch_size: int, held: int, prune: int = 0) -> HeadsMemory:
    """:class:`HeadsMemory` of splitting ``n_edges`` edges into ``n_targets`` targets over the heads (see there)."""
    s, P, L, d, H = 4, n_pos, n_layers, d_model, n_heads
    n_src = n_active + L * P + P
    return HeadsMemory(held=int(held),
                       fixed=s * (n_targets * (L * d + n_src) + 16 * L * P * d + L * H * P * d)
                       + 12 * n_edges * (L * H + 1),
                       per_source=s * (2 * L * H * P * d + 4 * L * P * d + n_active + 2 * n_src),
                       edge_chunk=3 * s * min(batch_size * P, n_edges) * L * H * d, batch_size=batch_size,
                       prune=prune)


def edge_heads(lm: LoadedModel, g, dictionaries, edges: Tensor | None = None, *, node_threshold: float = 0.8,
               edge_threshold: float = 0.98, batch_size: int = 32, max_memory: int | str | None = None,
               progress: bool = False) -> EdgeHeads:
    """Split ``edges`` (``(n, 2)`` ``[target, source]`` node indices; default: the edges of ``g`` pruned at the
    thresholds) of graph ``g`` over the heads that carry them (see the module's docstring); ``dictionaries``: the
    transcoders ``g`` was built with. Checked on every call. ``max_memory``: the budget for the whole process
    (bytes or a size such as ``"8GB"``; default: :func:`lenscope.memory.default_budget` now plus what ``g`` holds):
    the peak is estimated first (:class:`HeadsMemory`) and ``batch_size`` (sources a forward-mode pass) lowered as
    far as needed; where even one source a pass does not fit, an :class:`~lenscope.errors.InputError` says so."""
    from ...memory import default_budget, format_bytes, parse_size
    from .memory import graph_memory, nbytes
    from .prune import prune, prune_memory

    dicts = transcoders_by_layer(lm, list(dictionaries))
    if sorted(d.site for d in dicts.values()) != sorted(g.sites):
        raise InputError(f"the graph was built with transcoders at {', '.join(g.sites)}; give those")
    pruned = edges is None
    if pruned:
        edges = prune(g, node_threshold, edge_threshold).edge_mask.nonzero()
    edges = torch.as_tensor(edges).long().reshape(-1, 2)
    o = g.offsets()
    if edges.numel() and (bool((edges[:, 1] >= o["logit"]).any()) or
                          bool(((edges[:, 0] >= o["error"]) & (edges[:, 0] < o["logit"])).any())):
        raise InputError("an edge's target is a feature or a logit node, its source a feature, error or token node")
    if batch_size < 1:
        raise InputError("batch_size must be at least 1")
    tr = trace(lm, torch.tensor(g.input_ids))
    A = lm.anatomy
    dims = dict(n_pos=g.n_pos, n_layers=A.n_layers, d_model=A.d_model,
                n_heads=max(layer.attn.n_heads for layer in A.layers), n_active=g.n_active)
    g_bytes = nbytes(g)
    frozen = graph_memory(n_features=0, n_logits=0, batch_size=0, block_active=0, **dims).frozen
    limit = default_budget() + g_bytes if max_memory is None else parse_size(max_memory)

    sizes = dict(n_targets=int(edges[:, 0].unique().numel()), n_edges=edges.shape[0],
                 held=g_bytes + nbytes(tr) + frozen, prune=prune_memory(g.n_nodes) if pruned else 0, **dims)

    def est(b: int) -> HeadsMemory:
        return heads_memory(batch_size=b, **sizes)

    if est(batch_size).total > limit:
        if est(1).total > limit:
            raise InputError(f"heads on the edges: {edges.shape[0]} edges need about {format_bytes(est(1).total)} "
                             f"even one source a pass, more than the memory budget of {format_bytes(limit)}; "
                             "leave the heads out (--no-heads), prune harder (--edge-threshold) or raise --max-memory")
        lo, hi = 1, batch_size
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if est(mid).total <= limit else (lo, mid - 1)
        if progress:
            print(f"heads on the edges: batch size lowered from {batch_size} to {lo} to fit the memory budget "
                  f"{format_bytes(limit)} (estimated {format_bytes(est(lo).total)})", file=sys.stderr, flush=True)
        batch_size = lo
    fz = Frozen(lm, tr, dicts, skip_first=g.skip_first)
    if fz.n_active != g.n_active:
        raise InputError("the graph's features are not active in this model with these dictionaries")
    kind, idx = _sources(g, fz)
    P, L, last = g.n_pos, fz.n_layers, g.n_pos - 1
    H = fz.layers[0].attn.n_heads

    # the targets: each one's gradient on every block's attention output at its position (paths without another
    # attention step) and its edges through the model with every attention cut (R)
    targets = edges[:, 0].unique()
    G = torch.zeros(targets.numel(), L, fz.emb.shape[-1], dtype=fz.dtype)
    R_t = torch.zeros(targets.numel(), kind.numel(), dtype=fz.dtype)
    t_pos = torch.empty(targets.numel(), dtype=torch.long)
    ins = [t.clone().requires_grad_() for t in (fz.emb, fz.acts, fz.errs)]
    keep: dict = {}
    mlp_in, final = fz.forward(*ins, keep=keep, cut_attention=True)
    for k, t in enumerate(targets.tolist()):
        checkpoint()
        if t < o["error"]:
            Lt, p = int(g.feature_layer[t]), int(g.feature_pos[t])
            d = fz.dicts[Lt]
            cot = torch.zeros_like(mlp_in[Lt])
            cot[p] = d.W_enc[:, int(g.feature_index[t])]
            out = mlp_in[Lt]
        else:
            p = last
            cot = torch.zeros_like(final)
            cot[p] = fz.logit_pullbacks(p, g.logit_ids[t - o["logit"]: t - o["logit"] + 1], g.foil_id)[0]
            out = final
        grads = torch.autograd.grad(out, ins + keep["attn_out"], cot, retain_graph=True, allow_unused=True)
        t_pos[k] = p
        for layer, ga in enumerate(grads[3:]):
            if ga is not None:
                G[k, layer] = ga[p]
        ge, gaa, gr = (torch.zeros_like(x) if gx is None else gx for gx, x in zip(grads[:3], ins))
        per = [(gaa * fz.acts)[idx[kind == 0]], (gr * fz.errs).sum(-1).reshape(-1), (ge * fz.emb).sum(-1)]
        R_t[k] = torch.cat(per)
    t_row = torch.searchsorted(targets, edges[:, 0].contiguous())  # each edge's target row (targets: sorted, unique)

    # the sources: forward-mode derivatives of every head's output, a batch of sources at a time
    def heads_of(e, a, r):
        kp: dict = {}
        fz.forward(e, a, r, keep=kp)
        return torch.stack(kp["heads"])  # (layer, head, pos, d_model)

    primals = (fz.emb, fz.acts, fz.errs)
    sources = edges[:, 1].unique()
    out_heads = torch.zeros(edges.shape[0], L, H, dtype=fz.dtype)
    size = torch.zeros(edges.shape[0], dtype=torch.float64)  # the heads' parts' products, in absolute value
    for a in range(0, sources.numel(), batch_size):
        checkpoint()
        chunk = sources[a: a + batch_size]
        B = chunk.numel()
        te, ta, tr_ = (torch.zeros((B,) + x.shape, dtype=fz.dtype) for x in primals)
        for b, s in enumerate(chunk.tolist()):
            kd, i = int(kind[s]), int(idx[s])
            if kd == 0:
                ta[b, i] = fz.acts[i]
            elif kd == 1:
                ta_l, ta_p = divmod(i, P)
                tr_[b, ta_l, ta_p] = fz.errs[ta_l, ta_p]
            else:
                te[b, i] = fz.emb[i]
        J = torch.func.vmap(lambda x, y, z: torch.func.jvp(heads_of, primals, (x, y, z))[1])(te, ta, tr_)
        es_all = torch.isin(edges[:, 1], chunk).nonzero()[:, 0]  # the edges from this chunk's sources
        for c in range(0, es_all.numel(), B * P):  # at most P edges a source at a time (HeadsMemory)
            es = es_all[c: c + B * P]
            b, k = torch.searchsorted(chunk, edges[es, 1].contiguous()), t_row[es]
            J_e = J[b, :, :, t_pos[k]]
            out_heads[es] = torch.einsum("elhd,eld->elh", J_e, G[k])
            size[es] = torch.einsum("elhd,eld->e", J_e.abs(), G[k].abs()).double()
        del J
    residual = R_t[t_row, edges[:, 1]]
    A = g.adjacency[edges[:, 0], edges[:, 1]].double() if edges.numel() else torch.zeros(0, dtype=torch.float64)
    parts = torch.cat([out_heads.reshape(edges.shape[0], -1).double(), residual[:, None].double()], 1)
    if edges.numel():
        gap = A - parts.sum(1)
        # float32's rounding (replacement.parts_rounding) of what the passes read: the target's gradient carries
        # the sizes of all its terms, the last products the sizes of theirs
        node_size = g.adjacency.double().abs().sum(1) + g.biases.double().abs()
        size = size + node_size[edges[:, 0]] + residual.double().abs() + A.abs()
        err = check_parts("heads on the edges: an edge's head parts miss it", gap, size, L)
    else:
        err = 0.0
    return EdgeHeads(edges=edges, heads=out_heads.float(), residual=residual.float(), error=err)


__all__ = ["EdgeHeads", "HeadsMemory", "edge_heads", "heads_memory"]
