"""Heads on the edges of an attribution graph: each edge split exactly into the parts its attention heads carry.

An edge ``s -> t`` is the sum of the direct paths from ``s`` to ``t`` through the frozen replacement model
(:mod:`lenscope.features.replacement`). A path either takes no attention step (the residual stream, the norms and
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

from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import InputError
from ..models.load import LoadedModel
from ..models.stop import checkpoint
from ..models.trace import trace
from .replacement import Frozen, check_parts, transcoders_by_layer


@dataclass
class EdgeHeads:
    """The head split of edges ``edges (n, 2)`` (``[target, source]`` node indices of the graph): ``heads (n, layer,
    head)`` the part each head carries as the last attention step, ``residual (n,)`` the part without attention;
    ``error``: the largest ``|A - residual - sum(heads)|`` relative to the sizes of what was summed (at most
    :func:`~lenscope.features.replacement.parts_rounding`)."""

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


def edge_heads(lm: LoadedModel, g, dictionaries, edges: Tensor | None = None, *, node_threshold: float = 0.8,
               edge_threshold: float = 0.98, batch_size: int = 32) -> EdgeHeads:
    """Split ``edges`` (``(n, 2)`` ``[target, source]`` node indices; default: the edges of ``g`` pruned at the
    thresholds) of graph ``g`` over the heads that carry them (see the module's docstring); ``dictionaries``: the
    transcoders ``g`` was built with. Checked on every call."""
    from .graph_prune import prune

    dicts = transcoders_by_layer(lm, list(dictionaries))
    if sorted(d.site for d in dicts.values()) != sorted(g.sites):
        raise InputError(f"the graph was built with transcoders at {', '.join(g.sites)}; give those")
    if edges is None:
        edges = prune(g, node_threshold, edge_threshold).edge_mask.nonzero()
    edges = torch.as_tensor(edges).long().reshape(-1, 2)
    o = g.offsets()
    if edges.numel() and (bool((edges[:, 1] >= o["logit"]).any()) or
                          bool(((edges[:, 0] >= o["error"]) & (edges[:, 0] < o["logit"])).any())):
        raise InputError("an edge's target is a feature or a logit node, its source a feature, error or token node")
    tr = trace(lm, torch.tensor(g.input_ids))
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
        es = torch.isin(edges[:, 1], chunk).nonzero()[:, 0]  # the edges from this chunk's sources, all at once
        b, k = torch.searchsorted(chunk, edges[es, 1].contiguous()), t_row[es]
        J_e = J[b, :, :, t_pos[k]]
        out_heads[es] = torch.einsum("elhd,eld->elh", J_e, G[k])
        size[es] = torch.einsum("elhd,eld->e", J_e.abs(), G[k].abs()).double()
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


__all__ = ["EdgeHeads", "edge_heads"]
