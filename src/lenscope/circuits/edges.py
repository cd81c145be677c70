"""Edge attribution patching: EAP (Syed, Rager & Conmy 2023) and EAP-IG (Hanna, Pezzelle & Belinkov 2024).

An edge ``(sender u, receiver v)`` of the component graph (:mod:`lenscope.circuits.graph`) is scored by

    score(u, v) = mean over prompts of  sum_pos (w_u(corrupted) - w_u(clean)) . g_v

where ``w_u`` is what ``u`` writes to the residual stream and ``g_v`` the gradient of the metric with respect to
``v``'s own input (the residual stream before ``v``'s norm: head ``h``'s query input is a copy of the stream that
only ``h``'s query reads). EAP takes ``g_v`` at the clean run; EAP-IG averages it over ``steps`` runs whose input
embeddings go from the corrupted prompt's to the clean prompt's (``e_x + k/steps (e_c - e_x)``, ``k = 1..steps``).
The score estimates what exact edge patching (:func:`lenscope.circuits.patch.exact_edge_patching`) measures: the
metric when only that edge carries the corrupted write, minus the clean metric.

How: one engine run with gradients gives ``d metric / d z`` at every head's output, at every MLP's output and at the
final norm's input; per block, lenscope's own attention (``Attention.split``, each head reading its own q/k/v input)
and MLP turn these into the gradients at every receiver's input with one vector-Jacobian product; the scores of all
edges into a block are then one einsum over prompts, positions and ``d_model``. Prompts are processed in chunks of
rows so memory stays bounded by ``batch_size`` (the senders' writes and the receivers' gradients of one chunk).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..errors import InputError
from ..models.loading.load import LoadedModel
from ..models.runtime.engine import batches, run
from ..models.runtime.request import METRICS
from ..results import Result
from .gradients import metric_grads
from .graph import ComponentGraph, end_metrics, groups, sender_writes, writer_sites

METHODS = ("eap", "eap-ig")


@dataclass(repr=False)
class EdgeAttribution(Result):
    """Scores of every edge of the component graph.

    - ``scores (sender, receiver)``: the edge's score (0 where there is no edge; NaN for edges not scored)
    - ``valid (sender, receiver)``: whether the edge exists; ``senders``/``receivers``: their names
    - ``metric_clean``/``metric_corrupted``: the real model's metric, mean over the ``n`` prompts
    """

    scores: Tensor
    valid: Tensor
    senders: list
    receivers: list
    metric_clean: float
    metric_corrupted: float
    n: int
    method: str
    metric: str
    model: str
    steps: int = 0
    seconds: float = 0.0
    info: dict = field(default_factory=dict)

    @property
    def n_edges(self) -> int:
        return int(self.valid.sum())

    def edges(self, top: int | None = None) -> list[dict]:
        """``[{src, dst, score}]`` by decreasing ``|score|`` (the ``top`` first; every scored edge by default)."""
        s, r = (self.valid & ~self.scores.isnan()).nonzero(as_tuple=True)
        v = self.scores[s, r]
        order = v.abs().argsort(descending=True)[:top]
        return [{"src": self.senders[int(s[i])], "dst": self.receivers[int(r[i])], "score": float(v[i])}
                for i in order.tolist()]

    def ranking(self) -> Tensor:
        """``(n_edges, 2)``: every edge's ``(sender, receiver)`` index by decreasing ``|score|`` (unscored last)."""
        s, r = self.valid.nonzero(as_tuple=True)
        v = self.scores[s, r].abs().nan_to_num(-1.0)
        order = v.argsort(descending=True, stable=True)
        return torch.stack([s[order], r[order]], dim=1)

    def to_dict(self, top: int | None = None) -> dict:
        return {"method": self.method, "level": "edges", "model": self.model, "metric": self.metric, "n": self.n,
                "metric_clean": self.metric_clean, "metric_corrupted": self.metric_corrupted,
                "steps": self.steps, "seconds": self.seconds, "n_edges": self.n_edges, "edges": self.edges(top)}

    def to_frame(self):
        import pandas as pd

        return pd.DataFrame(self.edges())

    def __repr__(self) -> str:
        return (f"EdgeAttribution(method={self.method!r}, edges={self.n_edges}, n={self.n}, "
                f"metric_clean={self.metric_clean:.4g}, metric_corrupted={self.metric_corrupted:.4g})")


def _input_embeddings(lm: LoadedModel, ids: Tensor) -> Tensor:
    """What the model's input-embedding module returns (the ``inputs_embeds`` of a forward pass)."""
    return lm.model.get_input_embeddings()(ids.to(lm.model.device)).detach()


def _norm_vjp(norm, x: Tensor, g: Tensor) -> Tensor:
    """The gradient at a norm's input ``x (b, p, d)`` of ``g (b, p, n, d)``: ``n`` cotangents at its output (one per
    receiver that reads its own copy of ``x``)."""
    xx = x[:, :, None, :].expand(g.shape).clone().requires_grad_(True)
    with torch.enable_grad():
        (out,) = torch.autograd.grad(norm(xx), xx, g.to(x.dtype))
    return out


def receiver_grads(lm: LoadedModel, graph: ComponentGraph, *, ids: Tensor | None = None,
                   embeds: Tensor | None = None, target: Tensor, foil: Tensor | None, position: int,
                   metric: str) -> Tensor:
    """``(b, pos, R, d_model)``: the gradient of the summed metric with respect to every receiver's own input, in
    the run of ``ids`` (or of ``inputs_embeds=embeds``).

    From one engine run with gradients at each block's per-head queries, keys and values, head outputs and MLP
    input: a head's query (key, value) input gradient is its query's gradient times ``W_Q^h`` (``W_K``, ``W_V``)
    pulled back through the attention norm. Under grouped-query attention a key/value head serves several query
    heads, so each query head's share is recomputed: values through the pattern, keys with lenscope's attention
    (``Attention.split``) differentiated along the key input alone."""
    A = lm.anatomy
    L, H = graph.n_layers, graph.n_heads
    grouped = A.layers[0].attn.n_kv_heads != H
    per_layer = ["ln_attn.in", "head", "q", "k", "v", "ln_mlp.in", "ln_mlp.out"] + (["pattern"] if grouped else [])
    sites = [(name, layer) for layer in range(L) for name in per_layer] + [("ln_final.in", None)]
    P = (ids if ids is not None else embeds).shape[1]
    last = position in (-1, P - 1)  # then only the last position's logits are computed (the unembedding is big)
    wrt = [(name, layer) for layer in range(L) for name in ("head", "q", "k", "v", "ln_mlp.out")]
    _, cap, grads = metric_grads(lm, ids, wrt + [("ln_final.in", None)], metric, target, foil,
                                 at=-1 if last else position, capture=sites, inputs_embeds=embeds, last_only=last)
    first = cap["ln_attn.in", 0]
    b, _, d = first.shape
    G = first.new_empty(b, P, len(graph.receivers), d, requires_grad=False)
    pos = torch.arange(P)
    for layer in range(L):
        blk, attn = A.layers[layer], A.layers[layer].attn
        x = cap["ln_attn.in", layer].detach()
        g_z = grads["head", layer].detach()  # (b, p, head, d_head)
        gq = torch.einsum("bphe,hde->bphd", grads["q", layer].detach().to(attn.W_Q.dtype), attn.W_Q)
        if grouped:
            probs = cap["pattern", layer].detach().to(g_z.dtype)  # (b, head, p, s)
            g_v = torch.einsum("bhts,bthe->bshe", probs, g_z)
            gv = torch.einsum("bphe,hde->bphd", g_v.to(attn.W_V.dtype), attn._per_kv(attn.W_V))
            n = blk.ln_attn(x)[:, :, None, :].expand(b, P, H, d)
            xk = n.clone().requires_grad_(True)
            with torch.enable_grad():
                z = attn.split(n, xk, n, pos)
                (gk,) = torch.autograd.grad(z, xk, g_z.permute(0, 2, 1, 3).to(z.dtype))
        else:
            gk = torch.einsum("bphe,hde->bphd", grads["k", layer].detach().to(attn.W_K.dtype), attn.W_K)
            gv = torch.einsum("bphe,hde->bphd", grads["v", layer].detach().to(attn.W_V.dtype), attn.W_V)
        sl = graph.inputs_of(layer)
        G[:, :, sl.start:sl.stop - 1] = _norm_vjp(blk.ln_attn, x, torch.cat([gq, gk, gv], dim=2))
        G[:, :, sl.stop - 1] = _norm_vjp(blk.ln_mlp, cap["ln_mlp.in", layer].detach(),
                                         grads["ln_mlp.out", layer].detach()[:, :, None])[:, :, 0]
    G[:, :, -1] = grads["ln_final.in", None].detach()
    return G


def _accumulate(scores: Tensor, graph: ComponentGraph, delta: Tensor, G: Tensor) -> None:
    """``scores (S, R) += sum over rows and positions of delta (b, p, S, d) . G (b, p, R, d)``, block by block
    (a block's receivers only read the senders before them)."""
    for layer in range(graph.n_layers):
        sl, upto = graph.inputs_of(layer), graph.mlps_of(layer).stop
        scores[:upto, sl] += torch.einsum("bpsd,bprd->sr", delta[:, :, :upto], G[:, :, sl])
    scores[:, -1] += torch.einsum("bpsd,bpd->s", delta, G[:, :, -1])


def _rows_per_chunk(P: int, S: int, R: int, d: int, budget_mb: float) -> int:
    per_row = P * (S + R) * d * 4 * 2  # writes of both runs, gradients (and their running sum)
    return max(1, int(budget_mb * 2**20 // per_row))


def edge_attribution(lm: LoadedModel, pairs, *, method: str = "eap-ig", steps: int = 5, metric: str = "logit_diff",
                     position: int = -1, memory_mb: float = 2048, progress=None) -> EdgeAttribution:
    """EAP or EAP-IG scores of every edge for the prompt ``pairs`` (``(clean, corrupted, target, foil)`` tuples or
    ``ContrastPair``s; each pair's prompts of equal token length). ``memory_mb`` bounds the rows processed at once;
    ``progress(done, total)`` is called after each chunk of prompts."""
    if method not in METHODS:
        raise InputError(f"unknown edge method {method!r}; choose one of {', '.join(METHODS)}")
    if metric not in METRICS:
        raise InputError(f"unknown metric={metric!r}; choose one of {', '.join(METRICS)}")
    if method == "eap-ig" and steps < 1:
        raise InputError(f"steps must be at least 1 (got {steps})")
    t0 = time.perf_counter()
    graph = ComponentGraph.of(lm)
    gs = groups(lm, pairs, metric, position)
    n = sum(g.size for g in gs)
    A = lm.anatomy
    d = A.layers[0].attn.W_Q.shape[1]
    S, R = len(graph.senders), len(graph.receivers)
    scores = torch.zeros(S, R)
    m_clean = m_corr = 0.0
    done = 0
    for g in gs:
        mc, mx = end_metrics(lm, g, metric)
        m_clean, m_corr = m_clean + float(mc.sum()), m_corr + float(mx.sum())
        chunk = _rows_per_chunk(g.clean.shape[1], S, R, d, memory_mb)
        for s, e in batches(g.size, chunk):
            c_ids, x_ids = g.clean[s:e], g.corrupted[s:e]
            t, f = g.target[s:e], None if g.foil is None else g.foil[s:e]
            with torch.no_grad():
                _, cc = run(lm, c_ids, capture=writer_sites(graph.n_layers, graph.n_mlp > 1), logits=False)
                _, cx = run(lm, x_ids, capture=writer_sites(graph.n_layers, graph.n_mlp > 1), logits=False)
                delta = sender_writes(lm, graph, cx).float() - sender_writes(lm, graph, cc).float()
            kw = {"target": t, "foil": f, "position": g.position, "metric": metric}
            if method == "eap":
                G = receiver_grads(lm, graph, ids=c_ids, **kw).float()
            else:
                e_c, e_x = _input_embeddings(lm, c_ids), _input_embeddings(lm, x_ids)
                G = None
                for k in range(1, steps + 1):
                    Gk = receiver_grads(lm, graph, embeds=e_x + (k / steps) * (e_c - e_x), **kw).float()
                    G = Gk if G is None else G.add_(Gk)
                G /= steps
            with torch.no_grad():
                _accumulate(scores, graph, delta, G)
            done += e - s
            if progress is not None:
                progress(done, n)
    scores = torch.where(graph.valid, scores / n, torch.zeros(()))
    return EdgeAttribution(scores=scores, valid=graph.valid.clone(), senders=list(graph.senders),
                           receivers=list(graph.receivers), metric_clean=m_clean / n, metric_corrupted=m_corr / n,
                           n=n, method=method, metric=metric, model=lm.name, steps=steps if method == "eap-ig" else 0,
                           seconds=time.perf_counter() - t0)
