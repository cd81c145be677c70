"""Path patching (Wang et al. 2022; Goldowsky-Dill et al. 2023): the effect of a sender through one path only.

Each sender (a head over all positions, or an attention or MLP output at one position) takes its value from the
source run (clean for denoising); every attention and MLP output between the sender and the receiver is frozen
at its base-run value, so the sender's change reaches the receiver through the residual stream only.

- ``receiver=None``: the receiver is the logits. The final residual is ``base + sender's change``, read by the
  final norm and the unembedding: the sender's direct effect.
- ``receiver=(layer, head, "q" | "k" | "v")``: the receiver head's query (or key, or value) input is the
  projection of the residual stream that reaches it from the sender, its other inputs come from the base run, and
  the rest of an otherwise clean base run recomputes after it. The engine's ``q``/``k``/``v`` sites carry the path
  run's projection into the real attention module, which computes the pattern (rotary, ALiBi, soft-capping,
  sliding window and q/k norms included).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import InputError, NotApplicableError
from ..models.loading.load import LoadedModel, require_decoder, target_fields
from ..models.runtime.engine import Edit, batches, run
from ..models.runtime.request import METRICS, contrast, metric_of, token_texts
from ..models.runtime.sites import PART_SITES
from .patching import PatchingResult, patch_edits, share_restored

SENDERS = ("heads", "attn", "mlp")


def _freezes(rows_layer: Tensor, rows: Tensor, base: dict, L_stop: int, what: str) -> list[tuple]:
    """Freeze every attention and MLP output after each row's sender (and the sender layer's MLP; for MLP
    senders, from the next layer on) up to layer ``L_stop - 1``, at the base run's values (all positions): the
    ``(row, node, value)`` patches of :func:`~lenscope.interventions.patching.patch_edits`."""
    out = []
    for j in range(L_stop):
        for site in ("attn_out", "mlp_out"):
            if what == "mlp":
                sel = rows_layer < j
            else:
                sel = rows_layer < j if site == "attn_out" else rows_layer <= j
            out += [(r, (site, j, None, None), base[(site, j)]) for r in rows[sel].tolist()]
    return out


def _receiver_logits(lm: LoadedModel, ids: Tensor, edits: list[Edit], receiver: tuple[int, int, str]) -> Tensor:
    """Logits of base runs ``ids (row, pos)`` where only the receiver head's ``which`` input comes from the path run
    (the run with ``edits``). The real attention module computes the head: the path run's query (or key, or value)
    projection is captured and set in a clean base run. A key/value head shared by a group of query heads
    (grouped-query attention) would carry the path to the whole group, so there the receiver head's output is
    computed in one more partial pass and set alone."""
    rl, rh, which = receiver
    at = lm.anatomy.layers[rl].attn
    group = at.n_heads // at.n_kv_heads
    h_in = rh // group if which in ("k", "v") else rh
    n, P = ids.shape

    def at_head(h, site, x):  # set head ``h`` of ``site`` at every row and position to ``x (row, pos, head, d)``
        return patch_edits([(r, (site, rl, None, h), x[r]) for r in range(n)], P)

    _, cap = run(lm, ids, edits, capture=[(which, rl)], stop_after=(which, rl))
    set_input = at_head(h_in, which, cap[(which, rl)])
    if which == "q" or group == 1:
        return run(lm, ids, set_input).logits
    _, cap = run(lm, ids, set_input, capture=[("head", rl)], stop_after=("head", rl))
    return run(lm, ids, at_head(rh, "head", cap[("head", rl)])).logits


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
        if not (0 < rl < L and 0 <= rh < lm.anatomy.layers[rl].attn.n_heads):
            H = lm.anatomy.layers[1].attn.n_heads
            raise InputError(f"receiver head ({rl}, {rh}) must lie in layers 1..{L - 1}, heads 0..{H - 1}")
    cx = contrast(lm, clean, corrupted, target, foil, metric, position)
    c_ids, x_ids, tid, fid, pos = cx.clean, cx.corrupted, cx.target, cx.foil, cx.position
    P = c_ids.numel()
    src_ids, base_ids = (x_ids, c_ids) if noising else (c_ids, x_ids)
    site = PART_SITES[senders]
    keys = [(s, j) for s in ("attn_out", "mlp_out", site) for j in range(L)]
    logits, got = run(lm, torch.stack([c_ids, x_ids]), capture=keys)
    m = metric_of(logits[:, pos], metric, tid, fid)
    m_clean, m_corr = float(m[0]), float(m[1])
    si, bi = (1, 0) if noising else (0, 1)
    src = {k: v[si] for k, v in got.items()}
    base = {k: v[bi] for k, v in got.items()}

    C = lm.anatomy.layers[0].attn.n_heads if senders == "heads" else P
    Ls = L if receiver is None else receiver[0]
    plist = torch.tensor([(j, c) for j in range(Ls) for c in range(C)], dtype=torch.long).reshape(-1, 2)
    raw = torch.full((L, C), float("nan"))
    out = torch.empty(len(plist))
    for s, e in batches(len(plist), batch_size):
        chunk = plist[s:e]
        n = e - s
        rows = torch.arange(n)
        patches = [(r, ("head", j, None, c) if senders == "heads" else (site, j, c, None), src[(site, j)])
                   for r, (j, c) in enumerate(chunk.tolist())]
        edits = patch_edits(patches + _freezes(chunk[:, 0], rows, base, Ls, senders), P)
        ids = base_ids[None].expand(n, P)
        lg = run(lm, ids, edits).logits if receiver is None else _receiver_logits(lm, ids, edits, receiver)
        out[s:e] = metric_of(lg[:, pos], metric, tid, fid).cpu()
    raw[plist[:, 0], plist[:, 1]] = out
    values = share_restored(raw, m_clean, m_corr, metric)
    return PatchingResult(
        values=values, raw=raw, tokens=token_texts(lm, c_ids), corrupted_tokens=token_texts(lm, x_ids), what=senders,
        metric=metric, noising=noising, **target_fields(lm, tid, fid), clean_metric=m_clean, corrupted_metric=m_corr,
        position=pos, model=lm.name,
        info={"path": True, "receiver": "logits" if receiver is None else list(receiver)},
    )
