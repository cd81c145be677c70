"""AtP* (Kramár, Lieberum, Shah & Nanda 2024, "AtP*: An efficient and scalable method for localizing LLM behaviour
to components"): attribution patching with two fixes.

- **QK fix.** A query node (layer, head, query position t) or key node (layer, kv head, key position s) acts
  through the attention softmax, where the linear estimate fails once attention saturates. Its effect on the
  pattern is recomputed exactly and only the rest of the model is linearised: with ``A`` the clean pattern and
  ``g_A = d metric / d A`` (``g_A[h, t, s] = g_z[t, h] . v[s, kv(h)]``, from the gradient at the engine's ``head``
  site, so the pattern is never hooked), a query node scores ``sum_s g_A[h,t,s] (A'[h,t,s] - A[h,t,s])`` with row
  ``t`` recomputed from the corrupted query, a key node ``sum_{h in its group} sum_t sum_s' g_A[h,t,s']
  (A'_(s)[h,t,s'] - A[h,t,s'])`` with key ``s`` replaced by the corrupted key. Queries and keys come from
  ``Attention.queries_keys`` and patterns from ``Attention.probs`` (scale, soft-cap, ALiBi, mask). What the fix
  does NOT change: a head-output node's AtP already uses the exact corrupted output of that head (``z_corr`` is
  measured, not extrapolated), so the fix matters for q/k nodes only; value nodes are AtP on the engine's ``v``
  site (the head output is linear in ``v``).
- **GradDrop.** A node's gradient can cancel along its paths through later layers. For each layer ``l``,
  ``AtP_l`` is AtP with the gradient through layer ``l``'s residual contributions dropped (an engine Edit sets
  ``attn_out`` and ``mlp_out`` of layer ``l`` to their own clean values, which keeps the forward pass and stops
  the gradient); all variants are batch rows of one gradient pass. ``score_GD(n) = sign(AtP(n)) *
  mean_{l != layer(n)} |AtP_l(n)|``: the magnitude of the paper's estimate with the sign of plain AtP (the
  paper's estimate is unsigned; the sign keeps the scores comparable to exact patching's signed effect). The
  mean runs over the ``L - 1`` layers other than the node's (the node writes through the dropped
  contributions: a head's ``AtP_{layer(n)}(n)`` is 0; an MLP node is read at the edited site itself, so that row
  holds its plain AtP, which the mean leaves out) and over all ``L`` layers for the embedding. For a node in the
  last layer no later layer exists, so its GradDrop score is plain AtP.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import InputError
from ..interventions.patching import patch_edits
from ..models.loading.load import LoadedModel
from ..models.runtime.engine import batches, run
from ..models.runtime.request import by_length, metric_of
from ..models.weights.moe import is_moe
from .atp import NodeAttribution, atp_terms, coarse, prompts, result
from .gradients import corrupted_runs, metric_grads


def pattern_grad(g_z: Tensor, v: Tensor, n_heads: int) -> Tensor:
    """``g_A (..., head, t, s) = g_z[..., t, head] . v[..., s, kv(head)]`` from the gradient at the ``head`` site
    ``g_z (..., pos, head, d_head)`` and the values ``v (..., pos, kv_head, d_head)``."""
    v = v.repeat_interleave(n_heads // v.shape[-2], dim=-2)
    return torch.einsum("...the,...she->...hts", g_z.double(), v.double())


def query_scores(attn, q: Tensor, k: Tensor, q_corr: Tensor, g_A: Tensor, positions: Tensor, *,
                 linear: bool = False) -> Tensor:
    """QK-fixed query nodes ``(..., head, t)``: ``sum_s g_A (A' - A)`` with row ``t`` of the pattern recomputed
    from the corrupted query. ``q, k, q_corr (..., head, pos, d_head)`` as ``queries_keys`` returns them.
    ``linear``: the softmax linearised instead, ``sum_s g_A A (D_s - sum_s' A D_s')`` with ``D`` the change of the
    row's log-probabilities (any shift of a row cancels), i.e. plain AtP through the pattern."""
    sink = attn.sinks is not None  # the sink's column joins the row (its logit never moves)
    A = attn.probs(q, k, positions, sink_column=sink).double()
    A_q = attn.probs(q_corr, k, positions, sink_column=sink).double()
    g_A = _sink_pad(g_A, sink)
    if not linear:
        return (g_A * (A_q - A)).sum(-1)
    D = torch.where(A > 0, A_q.log() - A.log(), 0.0)
    D = torch.where(torch.isfinite(D), D, 0.0)
    return (g_A * A * (D - (A * D).sum(-1, keepdim=True))).sum(-1)


def _sink_pad(g_A: Tensor, sink: bool) -> Tensor:
    """``g_A`` with a zero column for an attention sink (nothing reads the sink's weight)."""
    return torch.nn.functional.pad(g_A, (0, 1)) if sink else g_A


def key_scores(attn, q: Tensor, k: Tensor, k_corr: Tensor, g_A: Tensor, positions: Tensor, *,
               linear: bool = False) -> Tensor:
    """QK-fixed key nodes per query head ``(..., head, s)``: ``sum_t sum_s' g_A[t,s'] (A'_(s)[t,s'] - A[t,s'])``
    with key ``s`` alone replaced by the corrupted key, for every ``s`` at once. When only column ``s`` of row
    ``t`` moves from score ``S`` to ``S'``, the row becomes ``A[t,:] r`` and ``A'[t,s] = A[t,s] e^(S'-S) r`` with
    ``r = 1 / (1 + A[t,s] (e^(S'-S) - 1))``, so the change is ``u r (g_A[t,s] - sum_s' g_A[t,s'] A[t,s'])``,
    ``u = A[t,s] (e^(S'-S) - 1)``. ``S' - S`` is read from ``probs`` (never re-derived): with the even keys
    corrupted, the odd keys' log-probabilities all move by the same ``-log Z'/Z``, which fixes the row's shift
    (and the other way round for odd keys); a row with a single visible key does not change. Attention sinks
    (GPT-OSS) join each row as one more key that never moves (``Attention.probs(..., sink_column=True)``): the
    sink fixes the shift of a row whose keys all move, and a single key's row changes with it. ``linear``: the
    softmax linearised, ``u = A[t,s] (S'-S)``, ``r = 1`` (plain AtP through the pattern)."""
    P = k.shape[-2]
    sink = attn.sinks is not None  # attention sinks: the sink's column is one more key that never moves
    even = (torch.arange(P, device=k.device) % 2 == 0)[:, None]
    logA = attn.probs(q, k, positions, sink_column=sink).double().log()
    A = logA.exp()
    delta = torch.zeros_like(logA)
    for corrupted in (even, ~even):  # keys whose score moves this time
        moved = torch.cat([corrupted[:, 0], corrupted.new_zeros(1)]) if sink else corrupted[:, 0]
        diff = attn.probs(q, torch.where(corrupted, k_corr, k), positions, sink_column=sink).double().log() - logA
        ok = torch.isfinite(diff) & (A > 0)
        ref = ok & ~moved  # unchanged keys: log-prob moved by the row's shift only
        w = torch.where(ref, A, 0.0)
        shift = (torch.where(ref, diff, 0.0) * w).sum(-1, keepdim=True) / w.sum(-1, keepdim=True).clamp_min(1e-300)
        move = torch.where(moved & (A > 0), diff - shift, 0.0)
        delta = delta + torch.where(torch.isnan(move), 0.0, move)
    u = A * (delta if linear else torch.expm1(delta.clamp(max=700.0)))
    r = 1.0 if linear else 1.0 / (1.0 + u)
    g_A = _sink_pad(g_A, sink)
    G = (g_A * A).sum(-1, keepdim=True)
    out = (u * r * (g_A - G)).sum(-2)
    return out[..., :P] if sink else out


def _layer_nodes(attn, xn_c: Tensor, xn_x: Tensor, g_z: Tensor, v: Tensor, v_x: Tensor, positions: Tensor,
                 linear: bool):
    """One layer's QK-fixed (or ``linear``) ``queries (rows, pos, head)``, ``keys (rows, pos, kv_head)`` and the
    value nodes' AtP ``values (rows, pos, kv_head)``: ``sum_{h in group} sum_t A[h,t,s] g_z[t,h] . (v_x - v)[s]``
    (the head output is linear in ``v``; read through the pattern, since fused projections give ``v`` no
    gradient of its own)."""
    q, k = attn.queries_keys(xn_c, positions)
    q_x, k_x = attn.queries_keys(xn_x, positions)
    H, G = attn.n_heads, attn.n_kv_heads
    g_A = pattern_grad(g_z, v, H)
    qs = query_scores(attn, q, k, q_x, g_A, positions, linear=linear)
    ks = key_scores(attn, q, k, k_x, g_A, positions, linear=linear)
    vs = (pattern_grad(g_z, v_x.double() - v.double(), H) * attn.probs(q, k, positions).double()).sum(-2)

    def per_kv(t):  # (rows, head, pos) -> (rows, pos, kv_head)
        return t.reshape(*t.shape[:-2], G, H // G, t.shape[-1]).sum(-2).transpose(-1, -2)

    return qs.transpose(-1, -2), per_kv(ks), per_kv(vs)


def _grad_drop(rows: dict[str, Tensor], L: int) -> dict[str, Tensor]:
    """GradDrop scores per prompt from ``rows[kind] (prompt, 1 + L, ...)``: variant 0 plain AtP, variant
    ``1 + l`` with layer ``l``'s contributions dropped; a layer axis right after the variant's (not ``embed``)."""
    out = {}
    for kind, t in rows.items():
        plain, drops = t[:, 0], t[:, 1:].abs()
        if kind == "embed":
            mag = drops.mean(1)
        else:  # drop the node's own layer: the diagonal of (dropped layer, node layer)
            own = torch.diagonal(drops, dim1=1, dim2=2).movedim(-1, 1)
            mag = (drops.sum(1) - own) / (L - 1)
        out[kind] = torch.sign(plain) * mag
    return out


def atp_star(lm: LoadedModel, clean=None, corrupted=None, target=None, foil=None, *, pairs=None,
             metric: str = "logit_diff", position: int = -1, grad_drop: bool = True, qk_fix: bool = True,
             batch_size: int = 32) -> NodeAttribution:
    """AtP* scores (module docstring) of the embedding, every head and MLP (over all positions) and every query
    ``queries (layer, pos, head)``, key ``keys (layer, pos, kv_head)`` and value ``values (layer, pos, kv_head)``
    node; prompts as in :func:`attribution_patching` (the mean over prompts; the q/k/v nodes are per position, so
    they are left None when the prompts have several token lengths).

    ``qk_fix=False``: q/k nodes with the softmax linearised (plain AtP through the pattern: the attention scores
    of the corrupted query/key are still exact, which for a score bilinear in q and k, i.e. without soft-capping,
    is AtP at the post-rotary q/k); ``grad_drop=False``: no GradDrop
    (both off: plain AtP). The gradient pass has ``1 + n_layers`` rows per prompt with GradDrop (``batch_size``
    rows per pass). Exact counterparts: ``exact_node_patching(..., qkv=True)``."""
    ps = prompts(lm, clean, corrupted, target, foil, metric, position, pairs, what="AtP*")
    gs = by_length(ps)
    if batch_size < 1:
        raise InputError("batch_size must be at least 1")
    A = lm.anatomy
    L = A.n_layers
    V = 1 + (L if grad_drop and L > 1 else 0)
    qk_sites = [("ln_attn.out", layer) for layer in range(L)]
    grad_sites = [("resid_pre", 0)] + [(s, layer) for layer in range(L) for s in ("head", "mlp_out")]
    expert_sites = [("expert_out", layer) for layer in range(L)] if is_moe(lm.anatomy) else []
    qk_sites += [("v", layer) for layer in range(L)]
    drop_sites = [(s, layer) for layer in range(L) for s in ("attn_out", "mlp_out")] if V > 1 else []
    total: dict[str, Tensor] = {}
    m_clean = m_corr = 0.0
    for g, last_only, at, (lg_x, corr) in corrupted_runs(lm, gs, grad_sites + qk_sites + expert_sites):
        c, t, f = g.clean, g.target, g.foil
        b, P = c.shape
        positions = torch.arange(P)
        with torch.no_grad():
            lg_c, cl = run(lm, c, capture=drop_sites + qk_sites + expert_sites, last_only=last_only)
        m_clean += float(metric_of(lg_c, metric, t, f, at=at).sum())
        m_corr += float(metric_of(lg_x, metric, t, f, at=at).sum())
        per: dict[str, list] = {}
        for s, e in batches(b * V, batch_size):
            rows = torch.arange(s, e)
            j, var = rows // V, rows % V
            sel = (var > 0).nonzero()[:, 0].tolist() if V > 1 else []
            edits = patch_edits([(r, (site, int(var[r]) - 1, None, None), cl[(site, int(var[r]) - 1)][int(j[r])])
                                 for site in ("attn_out", "mlp_out") for r in sel], P)
            _, cap, grads = metric_grads(lm, c[j], grad_sites, metric, t[j], None if f is None else f[j], at=at,
                                         edits=edits, last_only=last_only)
            xs = {k: corr[k][j] for k in grad_sites + expert_sites}
            terms = coarse(atp_terms(L, xs, {**cap, **{k: cl[k][j] for k in expert_sites}}, grads, fine=False))
            del terms["heads_pos"], terms["mlps_pos"]
            qkv = [_layer_nodes(A.layers[i].attn, cl[("ln_attn.out", i)][j], corr[("ln_attn.out", i)][j],
                                grads[("head", i)], cl[("v", i)][j], corr[("v", i)][j], positions, not qk_fix)
                   for i in range(L)]
            for n_, kind in enumerate(("queries", "keys", "values")):
                terms[kind] = torch.stack([t_[n_] for t_ in qkv], 1)
            for kind, v in terms.items():
                per.setdefault(kind, []).append(v.detach().double().cpu())
        rows = {kind: torch.cat(v).reshape(b, V, *v[0].shape[1:]) for kind, v in per.items()}
        scores = _grad_drop(rows, L) if V > 1 else {kind: v[:, 0] for kind, v in rows.items()}
        for kind, v in scores.items():
            if len(gs) == 1 or kind not in ("queries", "keys", "values"):  # per position: one length only
                total[kind] = total.get(kind, 0) + v.sum(0)
    n = len(ps)
    info = {"grad_drop": V > 1, "qk_fix": qk_fix}
    return result(lm, "atp-star", ps, {k: v / n for k, v in total.items()}, m_clean / n, m_corr / n, metric, info)
