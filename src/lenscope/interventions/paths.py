"""Path patching (Wang et al. 2022; Goldowsky-Dill et al. 2023): the effect of a sender through one path only.

Each sender (a head over all positions, or an attention or MLP output at one position) takes its value from the
source run (clean for denoising); every attention and MLP output between the sender and the receiver is frozen
at its base-run value, so the sender's change reaches the receiver through the residual stream only.

- ``receiver=None``: the receiver is the logits. The final residual is ``base + sender's change``, read by the
  final norm and the unembedding: the sender's direct effect.
- ``receiver=(layer, head, "q" | "k" | "v")``: the receiver head's query (or key, or value) input is computed
  from the residual stream that reaches it from the sender (norm ``ln_attn`` applied), its other inputs from the
  base run; its output (``z``, the head's slice of the attention output projection's input) is then put into an
  otherwise clean base run, whose later layers recompute. The receiver head is recomputed with lenscope's own
  attention math (:class:`~lenscope.models.anatomy.Attention`, checked against the real model by ``verify``),
  since the families name no hook inside the attention.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import InputError, NotApplicableError
from ..models.load import LoadedModel, require_decoder, resolve_token, token_ids, token_str
from .hooks import Edit, batches, n_heads, run
from .patching import METRICS, PatchingResult, _position, _tokens, metric_of, share_restored

SENDERS = ("heads", "attn", "mlp")


def _freeze_edits(rows_layer: Tensor, rows: Tensor, base: dict, L_stop: int, P: int, what: str) -> list[Edit]:
    """Freeze every attention and MLP output after each row's sender (and the sender layer's MLP; for MLP
    senders, from the next layer on) up to layer ``L_stop - 1``, at the base run's values (all positions)."""
    edits = []
    for j in range(L_stop):
        for site in ("attn", "mlp"):
            if what == "mlp":
                sel = rows_layer < j
            else:
                sel = rows_layer < j if site == "attn" else rows_layer <= j
            r = rows[sel]
            if r.numel() == 0:
                continue
            rr = r.repeat_interleave(P)
            pp = torch.arange(P).repeat(r.numel())
            edits.append(Edit(site, j, rr, pp, base[(site, j)][pp]))
    return edits


def _receiver_z(lm: LoadedModel, layer: int, head: int, which: str, x_base: Tensor, x_path: Tensor) -> Tensor:
    """The receiver head's output ``z (row, pos, d_head)`` with its ``which`` input from ``x_path (row, pos,
    d_model)`` (normed attention input) and the others from ``x_base (pos, d_model)``."""
    A = lm.anatomy.layers[layer].attn
    positions = torch.arange(x_base.shape[0], device=x_base.device)
    H = A.n_heads

    def one(xp):
        xq = xp if which == "q" else x_base
        xk = xp if which == "k" else x_base
        xv = xp if which == "v" else x_base
        q, _ = A.queries_keys(xq, positions)
        _, k = A.queries_keys(xk, positions)
        v = A.values(xv)
        scores = torch.einsum("qe,ke->qk", q[head], k[head]) * A.scale
        if A.softcap is not None:
            scores = torch.tanh(scores / A.softcap) * A.softcap
        if A.alibi is not None:
            rel = (positions[None, :] - positions[:, None]).to(scores.dtype)
            scores = scores + A.alibi.to(scores.dtype)[head] * rel
        allowed = A.mask(xp.shape[0], xp.shape[0], xp.device)
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")).float(), -1).to(xp.dtype)
        return probs @ v[head]

    if not 0 <= head < H:
        raise InputError(f"head {head} is outside 0..{H - 1}")
    return torch.vmap(one)(x_path)


@torch.no_grad()
def path_patching(lm: LoadedModel, clean, corrupted, target, foil=None, *, senders: str = "heads",
                  receiver: tuple[int, int, str] | None = None, metric: str = "logit_diff", noising: bool = False,
                  position: int = -1, batch_size: int = 32) -> PatchingResult:
    """Path patching of every sender — each head over all positions (``senders="heads"``, values ``(layer,
    head)``) or each attention / MLP output at one position (values ``(layer, pos)``) — to the logits
    (``receiver=None``) or to one head's q, k or v input (``receiver=(layer, head, "q")``: only senders in
    earlier layers are run; the rows of later layers are NaN). Metric as in
    :func:`~lenscope.interventions.activation_patching`; ``info["receiver"]`` names the receiver."""
    if senders not in SENDERS:
        raise InputError(f"unknown senders={senders!r}; choose one of {', '.join(SENDERS)}")
    if metric not in METRICS:
        raise InputError(f"unknown metric={metric!r}; choose one of {', '.join(METRICS)}")
    require_decoder(lm, "path patching", instead="use a model with a language-model head")
    if lm.anatomy.placement == "post":
        raise NotApplicableError("path patching needs a Pre-LN (or parallel/sandwich) residual stream")
    L = lm.anatomy.n_layers
    if receiver is not None:
        rl, rh, which = receiver
        if which not in ("q", "k", "v"):
            raise InputError("the receiver's input must be 'q', 'k' or 'v'")
        if not (0 < rl < L and 0 <= rh < n_heads(lm, rl)):
            raise InputError(f"receiver head ({rl}, {rh}) must lie in layers 1..{L - 1}, heads 0..{n_heads(lm, 1) - 1}")
    c_ids, x_ids = token_ids(lm, clean), token_ids(lm, corrupted)
    if c_ids.numel() != x_ids.numel():
        raise InputError(f"the clean and corrupted prompts must have the same number of tokens; they have "
                         f"{c_ids.numel()} and {x_ids.numel()}")
    tid = resolve_token(lm, target)
    if metric == "logit_diff" and foil is None:
        raise InputError("metric='logit_diff' needs a foil token; or use metric='prob'")
    fid = resolve_token(lm, foil) if foil is not None else None
    P = c_ids.numel()
    pos = _position(position, P)
    src_ids, base_ids = (x_ids, c_ids) if noising else (c_ids, x_ids)
    site = "head" if senders == "heads" else senders
    keys = [(s, j) for s in ("attn", "mlp", "resid", site) for j in range(L)]
    logits, got = run(lm, torch.stack([c_ids, x_ids]), capture=keys)
    m = metric_of(logits[:, pos], metric, tid, fid)
    m_clean, m_corr = float(m[0]), float(m[1])
    si, bi = (1, 0) if noising else (0, 1)
    src = {k: v[si] for k, v in got.items()}
    base = {k: v[bi] for k, v in got.items()}

    C = n_heads(lm, 0) if senders == "heads" else P
    Ls = L if receiver is None else receiver[0]
    plist = torch.tensor([(j, c) for j in range(Ls) for c in range(C)], dtype=torch.long).reshape(-1, 2)
    raw = torch.full((L, C), float("nan"))
    out = torch.empty(len(plist))
    if receiver is not None:
        ln = lm.anatomy.layers[receiver[0]].ln_attn
        x_base = ln(base[("resid", receiver[0])]) if ln is not None else base[("resid", receiver[0])]
    for s, e in batches(len(plist), batch_size):
        chunk = plist[s:e]
        n = e - s
        rows = torch.arange(n)
        edits = []
        for j in chunk[:, 0].unique().tolist():
            r = rows[chunk[:, 0] == j]
            idx = chunk[r, 1]
            if senders == "heads":
                rr, hh = r.repeat_interleave(P), idx.repeat_interleave(P)
                pp = torch.arange(P).repeat(r.numel())
                edits.append(Edit("head", j, rr, pp, src[("head", j)][pp, hh], head=hh))
            else:
                edits.append(Edit(site, j, r, idx, src[(site, j)][idx]))
        edits += _freeze_edits(chunk[:, 0], rows, base, Ls, P, senders)
        ids = base_ids[None].expand(n, P)
        if receiver is None:
            lg, _ = run(lm, ids, edits)
        else:
            rl, rh, which = receiver
            _, cap = run(lm, ids, edits, capture=[("resid", rl)], stop_after=("resid", rl))
            x = cap[("resid", rl)]
            x_path = ln(x) if ln is not None else x
            z = _receiver_z(lm, rl, rh, which, x_base, x_path)  # (row, pos, d_head)
            lg, _ = run(lm, ids, [Edit("head", rl, rows.repeat_interleave(P), torch.arange(P).repeat(n),
                                       z.reshape(n * P, -1), head=torch.full((n * P,), rh))])
        out[s:e] = metric_of(lg[:, pos], metric, tid, fid).cpu()
    raw[plist[:, 0], plist[:, 1]] = out
    values = share_restored(raw, m_clean, m_corr, metric)
    return PatchingResult(
        values=values, raw=raw, tokens=_tokens(lm, c_ids), corrupted_tokens=_tokens(lm, x_ids), what=senders,
        metric=metric, noising=noising, target=token_str(lm, tid), target_id=tid,
        foil=None if fid is None else token_str(lm, fid), foil_id=fid, clean_metric=m_clean, corrupted_metric=m_corr,
        position=pos, model=lm.name,
        info={"path": True, "receiver": "logits" if receiver is None else list(receiver)},
    )
