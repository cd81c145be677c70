"""Exact edge patching and circuit evaluation: the model run with chosen edges carrying the corrupted write.

In the patched run every receiver ``v`` reads

    input_v = sum over senders u with an edge u -> v of  (w_u(this run) if the edge is kept else w_u(ablated))

where ``w_u(ablated)`` is ``u``'s write in the corrupted run (or its mean over the clean prompts,
``ablation="mean"``). With every edge kept this is the clean run, with none the corrupted run; patching one edge
changes only that receiver's input, by ``w_u(ablated) - w_u(this run)``, and everything downstream is recomputed.
A head whose query, key and value inputs differ is computed by lenscope's own attention (``Attention.split``),
which equals the real model's heads (tests/models/test_anatomy.py); the first block's input is the clean run's.

One batch row per (circuit, prompt): the circuits of a faithfulness curve, or one circuit per edge for exact edge
patching, run together in chunks of rows bounded by ``memory_mb``.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor

from ..errors import InputError
from ..models.loading.load import LoadedModel
from ..models.runtime.engine import batches, run
from ..models.runtime.request import metric_of
from ..models.weights.algebra import head_writes
from .edges import EdgeAttribution
from .graph import (
    ComponentGraph,
    Group,
    end_metrics,
    groups,
    mlp_write,
    sender_writes,
    writer_sites,
)

ABLATIONS = ("corrupted", "mean")


def mean_writes(lm: LoadedModel, graph: ComponentGraph, reference, metric: str = "logit_diff") -> dict:
    """The mean sender writes of a reference set's clean prompts (pairs as for the methods): ``{length: (p, S, d)}``
    per token length, and ``"any": (S, d)``, the mean over every prompt and position, for prompts of another
    length."""
    out, total, count = {}, 0.0, 0
    for g in groups(lm, reference, metric):
        with torch.no_grad():
            _, cc = run(lm, g.clean, capture=writer_sites(graph.n_layers, graph.n_mlp > 1), logits=False)
            w = sender_writes(lm, graph, cc).float()
        out[w.shape[1]] = w.mean(0)
        total, count = total + w.sum((0, 1)), count + w.shape[0] * w.shape[1]
    out["any"] = total / count
    return out


def _writes(lm: LoadedModel, graph: ComponentGraph, g: Group, ablation: str,
            reference: dict | None = None) -> tuple[Tensor, Tensor]:
    """``(clean, ablated)`` sender writes ``(b, p, S, d)`` of a group of prompts. ``ablation="mean"``: the mean of
    ``reference`` (:func:`mean_writes`) at each position, or of the group's own clean prompts when None."""
    with torch.no_grad():
        _, cc = run(lm, g.clean, capture=writer_sites(graph.n_layers, graph.n_mlp > 1), logits=False)
        clean = sender_writes(lm, graph, cc).float()
        if ablation == "mean":
            if reference is None:
                return clean, clean.mean(0, keepdim=True).expand_as(clean)
            P = clean.shape[1]
            mean = reference[P] if P in reference else reference["any"][None].expand(P, -1, -1)
            return clean, mean[None].expand_as(clean)
        _, cx = run(lm, g.corrupted, capture=writer_sites(graph.n_layers, graph.n_mlp > 1), logits=False)
        return clean, sender_writes(lm, graph, cx).float()


@torch.no_grad()
def _patched(lm: LoadedModel, graph: ComponentGraph, clean: Tensor, ablated: Tensor, removed: Tensor,
             position: int) -> Tensor:
    """Final-position logits ``(N, vocab)`` of ``N`` patched rows: ``clean``/``ablated (N, p, S, d)`` writes of
    each row's prompt, ``removed (N, S, R)`` the edges that carry the ablated write."""
    A = lm.anatomy
    H = graph.n_heads
    N, P, S, d = clean.shape
    pos = torch.arange(P)
    W = torch.empty_like(clean)  # the writes of this run
    W[:, :, 0] = clean[:, :, 0]
    resid = W[:, :, 0].clone()

    def reads(upto: int, cols) -> Tensor | None:
        """The correction of the receivers ``cols`` by their removed edges from senders ``< upto``: a dense einsum
        when many edges are removed (a small circuit), a gather and index-add of just those edges when few are
        (exact patching of one edge per row)."""
        rem = removed[:, :upto, cols]
        n_rem = int(rem.sum())
        if n_rem == 0:
            return None
        if n_rem > 0.02 * rem.numel():
            D = ablated[:, :, :upto] - W[:, :, :upto]
            return torch.einsum("npsd,ns...->np...d", D, rem.to(D.dtype))
        single = rem.dim() == 2
        rem3 = rem[:, :, None] if single else rem
        n_i, s_i, r_i = rem3.nonzero(as_tuple=True)
        vals = ablated[n_i, :, s_i] - W[n_i, :, s_i]  # (edges, p, d)
        R = rem3.shape[2]
        out = vals.new_zeros(N * R, P, d).index_add_(0, n_i * R + r_i, vals)
        out = out.reshape(N, R, P, d).transpose(1, 2)
        return out[:, :, 0] if single else out

    for layer in range(graph.n_layers):
        blk = A.layers[layer]
        sl, hs, ms = graph.inputs_of(layer), graph.heads_of(layer), graph.mlps_of(layer)
        inp = resid[:, :, None, :].expand(N, P, 3 * H, d)
        c = reads(hs.start, slice(sl.start, sl.stop - 1))
        if c is not None:
            inp = inp + c
        xq, xk, xv = (blk.ln_attn(t) for t in inp.split(H, dim=2))
        z = blk.attn.split(xq, xk, xv, pos).transpose(1, 2)  # (N, p, head, d_head)
        W[:, :, hs] = head_writes(blk, z, "shared")[0].to(W.dtype)
        mid = resid + W[:, :, hs].sum(2)
        x_m = resid if graph.placement == "parallel" else mid
        c = reads(ms.start, sl.stop - 1)
        if c is not None:
            x_m = x_m + c
        if graph.n_mlp > 1:  # a mixture of experts routes the patched input itself, as the model would
            W[:, :, ms] = blk.mlp.expert_outputs(blk.ln_mlp(x_m)).to(W.dtype)
        else:
            W[:, :, ms.start] = mlp_write(blk, blk.mlp(blk.ln_mlp(x_m))).to(W.dtype)
        resid = mid + W[:, :, ms].sum(2)
    c = reads(S, len(graph.receivers) - 1)
    final = resid if c is None else resid + c
    return A.logits(final[:, position])


def _rows_per_chunk(P: int, S: int, d: int, memory_mb: float) -> int:
    return max(1, int(memory_mb * 2**20 // (P * S * d * 4 * 4)))


def circuit_metrics(lm: LoadedModel, graph: ComponentGraph, g: Group, removed: Tensor, *,
                    ablation: str = "corrupted", memory_mb: float = 1024, writes=None) -> Tensor:
    """``(C, b)``: the metric of each prompt of ``g`` with the edges ``removed (C, S, R)`` (bool; only existing
    edges count) carrying the ablated write, for each of ``C`` circuits."""
    if ablation not in ABLATIONS:
        raise InputError(f"unknown ablation {ablation!r}; choose one of {', '.join(ABLATIONS)}")
    clean, ablated = writes if writes is not None else _writes(lm, graph, g, ablation)
    removed = removed & graph.valid
    C, b = removed.shape[0], g.size
    P, S, d = clean.shape[1], clean.shape[2], clean.shape[3]
    out = torch.empty(C * b)
    rows = torch.arange(C * b)
    for s, e in batches(C * b, _rows_per_chunk(P, S, d, memory_mb)):
        ci, pi = rows[s:e] // b, rows[s:e] % b
        lg = _patched(lm, graph, clean[pi], ablated[pi], removed[ci], g.position)
        out[s:e] = metric_of(lg, g.metric, g.target[pi], None if g.foil is None else g.foil[pi]).cpu()
    return out.reshape(C, b)


def exact_edge_patching(lm: LoadedModel, pairs, edges=None, *, metric: str = "logit_diff", position: int = -1,
                        ablation: str = "corrupted", reference=None, memory_mb: float = 1024,
                        progress=None) -> EdgeAttribution:
    """The exact counterpart of EAP: for each edge (``edges``: ``(src, dst)`` names or ``(S, R)`` bool mask; every
    edge by default), the mean over prompts of the metric with that edge alone carrying the ablated write, minus
    the clean metric. Edges not asked for score NaN. ``ablation="mean"``: the mean write over the clean prompts of
    ``reference`` (pairs; default: ``pairs`` themselves)."""
    t0 = time.perf_counter()
    graph = ComponentGraph.of(lm)
    if edges is None:
        mask = graph.valid.clone()
    elif isinstance(edges, Tensor):
        mask = edges.bool() & graph.valid
    else:
        mask = torch.zeros_like(graph.valid)
        for src, dst in edges:
            si, ri = graph.sender_index(src), graph.receiver_index(dst)
            if not graph.valid[si, ri]:
                raise InputError(f"there is no edge {src} -> {dst}: {dst} reads only what is written before it")
            mask[si, ri] = True
    es, er = mask.nonzero(as_tuple=True)
    scores = torch.full(graph.valid.shape, float("nan"))
    total = torch.zeros(len(es))
    gs = groups(lm, pairs, metric, position)
    n = sum(g.size for g in gs)
    ref = None if reference is None or ablation != "mean" else mean_writes(lm, graph, reference, metric)
    m_clean = m_corr = 0.0
    per = max(1, 256 // max(1, gs[0].size))  # edges per call: rows = edges x prompts
    for gi, g in enumerate(gs):
        mc, mx = end_metrics(lm, g, metric)
        m_clean, m_corr = m_clean + float(mc.sum()), m_corr + float(mx.sum())
        writes = _writes(lm, graph, g, ablation, ref)
        for s, e in batches(len(es), per):
            removed = torch.zeros((e - s,) + tuple(graph.valid.shape), dtype=torch.bool)
            removed[torch.arange(e - s), es[s:e], er[s:e]] = True
            ms = circuit_metrics(lm, graph, g, removed, ablation=ablation, memory_mb=memory_mb, writes=writes)
            total[s:e] += (ms - mc[None, :]).sum(1)
            if progress is not None:  # edges x prompt groups done, over all groups
                progress(gi * len(es) + e, len(gs) * len(es))
    scores[es, er] = total / n
    scores = torch.where(graph.valid, scores, torch.zeros(()))
    return EdgeAttribution(scores=scores, valid=graph.valid.clone(), senders=list(graph.senders),
                           receivers=list(graph.receivers), metric_clean=m_clean / n, metric_corrupted=m_corr / n,
                           n=n, method="exact", metric=metric, model=lm.name, seconds=time.perf_counter() - t0,
                           info={"ablation": ablation})
