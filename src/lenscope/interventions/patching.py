"""Activation patching: put one component's activation from one run into another, one patch per batch row.

Denoising (default): the base run is the corrupted prompt, patches come from the clean run. Noising: the base
run is the clean prompt, patches come from the corrupted run. The metric is read at ``position`` (default: the
last token):

- ``metric="logit_diff"``: ``LD = logit[target] - logit[foil]``, reported as the share restored
  ``(LD_patched - LD_corrupted) / (LD_clean - LD_corrupted)`` (0 = corrupted, 1 = clean);
- ``metric="prob"``: the probability of the target, as is.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..errors import InputError
from ..models.loading.load import LoadedModel, require_decoder, target_fields
from ..models.runtime.engine import Edit, batches, edits_within, new_cache, run
from ..models.runtime.request import METRICS, check_metric, contrast, metric_of, position_in, token_texts
from ..models.runtime.sites import PART_SITES, display_name
from ..results import Result

__all__ = ["METRICS", "WHATS", "PatchingResult", "activation_patching", "contrast", "metric_of", "patch_edits",
           "patch_nodes", "share_restored", "sweep_sites"]

WHATS = ("resid", "attn", "mlp", "heads")


@dataclass(repr=False)
class PatchingResult(Result):
    """Activation patching sweep.

    - ``values (layer, pos)`` for ``what`` in resid/attn/mlp, ``(layer, head)`` for heads: the metric after
      the patch (the share restored for ``logit_diff``, the target's probability for ``prob``)
    - ``raw`` (same shape): the un-normalised metric after the patch (logit difference or probability)
    - ``clean_metric``, ``corrupted_metric``: the raw metric of the unpatched runs
    - ``tokens``, ``corrupted_tokens``: the two prompts' tokens (same length)
    """

    values: Tensor
    raw: Tensor
    tokens: list[str]
    corrupted_tokens: list[str]
    what: str
    metric: str
    noising: bool
    target: str
    target_id: int
    foil: str | None
    foil_id: int | None
    clean_metric: float
    corrupted_metric: float
    position: int
    head_position: int | None = None
    model: str = ""
    info: dict = field(default_factory=dict)

    @property
    def columns(self) -> list[str]:
        if self.what == "heads":
            return [f"H{h}" for h in range(self.values.shape[1])]
        return list(self.tokens)

    def to_frame(self):
        import pandas as pd

        L, C = self.values.shape
        col = "head" if self.what == "heads" else "pos"
        rows = []
        for layer in range(L):
            for c in range(C):
                r = {"layer": layer, col: c, "value": float(self.values[layer, c]), "raw": float(self.raw[layer, c])}
                if col == "pos":
                    r["token"] = self.tokens[c]
                    r["corrupted_token"] = self.corrupted_tokens[c]
                rows.append(r)
        return pd.DataFrame(rows)

    def to_dict(self) -> dict:
        """JSON-ready fields (NaN, e.g. path patching's senders after the receiver, becomes None)."""

        def rows(t):
            return [[None if v != v else v for v in row] for row in t.tolist()]

        d = {
            "model": self.model, "tokens": self.tokens, "corrupted_tokens": self.corrupted_tokens, "what": self.what,
            "metric": self.metric, "direction": "noising" if self.noising else "denoising", "target": self.target,
            "target_id": self.target_id, "foil": self.foil, "foil_id": self.foil_id,
            "clean_metric": self.clean_metric, "corrupted_metric": self.corrupted_metric, "position": self.position,
            "head_position": self.head_position, "axes": ["layer", "head" if self.what == "heads" else "pos"],
            "values": rows(self.values), "raw": rows(self.raw),
        }
        if self.info.get("path"):
            d["receiver"] = self.info["receiver"]
        return d

    def top(self, k: int = 5) -> list[tuple[int, int, float]]:
        """The ``k`` entries with the largest value: ``(layer, pos or head, value)``."""
        flat = self.values.flatten()
        idx = flat.argsort(descending=True)[:k]
        C = self.values.shape[1]
        return [(int(i) // C, int(i) % C, float(flat[i])) for i in idx]

    def plot(self, ax=None):
        from ..viz.intervention_plots import heatmap

        what = {"resid": "residual stream", "attn": "attention output", "mlp": "MLP output", "heads": "head output"}
        label = "share of logit difference restored" if self.metric == "logit_diff" else f"P({self.target!r})"
        kind = "noising" if self.noising else "denoising"
        vs = f"{self.target!r}" + (f" vs {self.foil!r}" if self.foil is not None else "")
        title = f"Patching the {what[self.what]} ({kind}): {vs}"
        if self.info.get("path"):
            rec = self.info["receiver"]
            rec = "the logits" if rec == "logits" else f"head {display_name('head', rec[0], rec[1])}'s {rec[2]}"
            title = f"Path patching, {what[self.what]} -> {rec} ({kind}): {vs}"
        return heatmap(self.values, self.columns, title, label, ax=ax,
                       xlabel="head" if self.what == "heads" else "position (clean token)")

    def __repr__(self) -> str:
        return (f"PatchingResult(what={self.what!r}, metric={self.metric!r}, noising={self.noising}, "
                f"shape={tuple(self.values.shape)}, clean={self.clean_metric:.4f}, "
                f"corrupted={self.corrupted_metric:.4f})")


def share_restored(raw: Tensor, m_clean: float, m_corr: float, metric: str) -> Tensor:
    """The patched metrics as the share restored, ``(raw - corrupted) / (clean - corrupted)`` (0 = corrupted,
    1 = clean) for the logit difference; the probability itself otherwise."""
    if metric != "logit_diff":
        return raw.clone()
    denom = m_clean - m_corr
    if abs(denom) < 1e-6:
        raise InputError(
            f"the clean and corrupted prompts give the same logit difference ({m_clean:.6f}); nothing to restore: "
            "choose prompts (or target/foil) the model tells apart"
        )
    return (raw - m_corr) / denom


Node = tuple  # (site, layer, position or None: every position, head or None: the whole site)


def patch_edits(rows: list[tuple[int, Node, Tensor]], P: int) -> list[Edit]:
    """The one builder of patch edits: one engine :class:`Edit` per (site, layer, per-head or not) from ``(batch
    row, node, source value (pos, ...))``, a node ``(site, layer, pos or None, head or None)`` (``pos`` None: every
    position of the ``P``). A dictionary's latent is a node of its latent site with the latent's index as ``head``
    (``("resid_post.latents", 5, pos, latent)``: that latent alone set; the run needs the dictionary)."""
    merged: dict[tuple, list] = {}
    for row, (site, layer, p, h), value in rows:
        pos = torch.arange(P) if p is None else torch.tensor([p])
        v = value if p is None else value[p:p + 1]
        v = v if h is None else v[:, h]
        merged.setdefault((site, layer, h is None), []).append((torch.full_like(pos, row), pos, v,
                                                                 None if h is None else torch.full_like(pos, h)))
    out = []
    for (site, layer, whole), parts in merged.items():
        r, pos, v, hd = zip(*parts)
        out.append(Edit(site, layer, torch.cat(r), torch.cat(pos), torch.cat(v),
                        head=None if whole else torch.cat(hd)))
    return out


@torch.no_grad()
def patch_nodes(lm: LoadedModel, base: Tensor, source: dict, nodes: list[Node], metric: str, target, foil, *,
                position: int, batch_size: int = 32, last_only: bool = False, dictionaries=(),
                reuse: bool = True) -> Tensor:
    """The one node-patching loop: the metric of the run of ``base (b, pos)`` with one node set to its value in
    ``source`` (``{(site, layer): (b, pos, ...)}``, each prompt's own), for every (node, prompt) pair, one pair per
    batch row, ``batch_size`` rows per forward pass: ``(node, b)``. ``target``/``foil``: one id, or ``(b,)`` ids;
    the metric is read at ``position`` (``last_only``: the last position's logits only, ``position`` the last).
    ``dictionaries``: the sparse dictionaries whose latent nodes are patched (the engine's ``dictionaries=``).
    Activation patching's sweeps, the circuits' exact node scores and the features' exact latent patching are its
    uses.

    ``reuse`` (a causal decoder): a patch at block ``l`` and position ``p`` changes neither the blocks before ``l``
    nor the positions before ``p``, nor anything after the metric's position, so those are not run again: rows go
    in batches of nearby ``(l, p)`` (:func:`reuse_batches`), each run from the base run's residual stream entering
    its first block (the engine's ``start_at``) and its key/value cache of the positions before its first
    position (``past``), up to the metric's position. The same numbers as the full recomputation (``reuse=False``,
    every row the whole model over the whole prompt) up to float rounding; an encoder or encoder-decoder model
    always recomputes in full."""
    if batch_size < 1:
        raise InputError("batch_size must be at least 1")
    b, P = base.shape
    if reuse and lm.anatomy.causal and lm.anatomy.encoder is None:
        stop = P if last_only else position % P + 1
        return _patch_reusing(lm, base, source, nodes, metric, target, foil, stop, batch_size, dictionaries)
    out = []
    for s, e in batches(len(nodes) * b, batch_size):
        rows = torch.arange(s, e)
        node_i, prompt_j = rows // b, rows % b
        edits = patch_edits([(r, nodes[i], source[nodes[i][:2]][j]) for r, (i, j) in
                             enumerate(zip(node_i.tolist(), prompt_j.tolist()))], P)
        lg, _ = run(lm, base[prompt_j], edits, last_only=last_only, dictionaries=dictionaries)
        t = target[prompt_j] if isinstance(target, Tensor) else target
        f = foil[prompt_j] if isinstance(foil, Tensor) else foil
        out.append(metric_of(lg, metric, t, f, at=-1 if last_only else position).cpu())
    return torch.cat(out).reshape(len(nodes), b)


def _patch_reusing(lm: LoadedModel, base: Tensor, source: dict, nodes: list[Node], metric: str, target, foil,
                   stop: int, batch_size: int, dictionaries) -> Tensor:
    """:func:`patch_nodes` without what a patch cannot change, the metric read at position ``stop - 1``."""
    b, P = base.shape
    ids = base[:, :stop]
    L = lm.anatomy.n_layers
    lg, cap = run(lm, ids, capture=[("resid_pre", layer) for layer in range(1, L)], last_only=True)
    first = [0 if n[2] is None else int(n[2]) for n in nodes]  # the first position a node's patch changes
    out = metric_of(lg, metric, target, foil, at=-1).cpu()[None].repeat(len(nodes), 1)  # a patch after the metric
    live = [i for i in range(len(nodes)) if first[i] < stop]  # position changes nothing
    cache, cache_at = None, 0
    for chunk in reuse_batches([nodes[i][1] for i in live], [first[i] for i in live], b, batch_size):
        rows = torch.tensor([live[r // b] * b + r % b for r in chunk])
        node_i, prompt_j = rows // b, rows % b
        l0 = min(nodes[i][1] for i in node_i.tolist())
        p0 = min(first[i] for i in node_i.tolist())
        edits = patch_edits([(r, nodes[i], source[nodes[i][:2]][j]) for r, (i, j) in
                             enumerate(zip(node_i.tolist(), prompt_j.tolist()))], P)
        past = None
        if p0 > 0:
            if cache_at != p0:  # the batches come in ascending p0: one prefix cache at a time
                cache, cache_at = new_cache(lm), p0
                run(lm, base[:, :p0], past=cache, last_only=True, logits=False)
            past = copy.deepcopy(cache)
            past.batch_select_indices(prompt_j)
        start = cap[("resid_pre", l0)][prompt_j, p0:] if l0 > 0 else None
        lg, _ = run(lm, ids[prompt_j, p0:], edits_within(edits, 0, stop), last_only=True, past=past, start_at=l0,
                    start=start, dictionaries=dictionaries)
        t = target[prompt_j] if isinstance(target, Tensor) else target
        f = foil[prompt_j] if isinstance(foil, Tensor) else foil
        out[node_i, prompt_j] = metric_of(lg, metric, t, f, at=-1).cpu().to(out.dtype)
    return out


def reuse_batches(layers: list[int], firsts: list[int], b: int, batch_size: int) -> list[list[int]]:
    """The rows (``node * b + prompt`` over the nodes given by their block ``layers`` and first changed positions
    ``firsts``) of :func:`patch_nodes`'s reusing batches: each batch is run from its smallest block and position,
    so a batch should hold nearby ``(layer, position)`` cells. Buckets of ``c`` consecutive positions (by rank), each
    sorted by block and cut into near-equal batches of at most ``batch_size`` rows, ascending in position; ``c``
    balances the rows' wasted blocks against their wasted positions: a batch covers about the same share of the
    blocks as of the positions."""
    if not layers:
        return []
    ranks = {p: k for k, p in enumerate(sorted(set(firsts)))}
    nL, nP = len(set(layers)), len(ranks)
    area = batch_size * nL * nP / (len(layers) * b)  # the (layer, position) cells one batch covers
    c = min(nP, max(1, round(math.sqrt(area * nP / nL))))
    buckets: dict[int, list[int]] = {}
    for i in sorted(range(len(layers)), key=lambda i: (firsts[i], layers[i])):
        buckets.setdefault(ranks[firsts[i]] // c, []).append(i)
    out = []
    for k in sorted(buckets):
        rows = [i * b + j for i in sorted(buckets[k], key=lambda i: (layers[i], firsts[i])) for j in range(b)]
        n = math.ceil(len(rows) / batch_size)
        size = math.ceil(len(rows) / n)
        out += [rows[s:s + size] for s in range(0, len(rows), size)]
    return out


def sweep_sites(what: str, lm: LoadedModel, P: int, head_position: int | None):
    """The patches of a sweep, as ``(layer, index)`` pairs: index = position, or head."""
    L = lm.anatomy.n_layers
    if what == "heads":
        H = lm.anatomy.layers[0].attn.n_heads
        return [(layer, h) for layer in range(L) for h in range(H)], (L, H)
    return [(layer, p) for layer in range(L) for p in range(P)], (L, P)


@torch.no_grad()
def activation_patching(lm: LoadedModel, clean, corrupted, target, foil=None, *, what: str = "resid",
                        metric: str = "logit_diff", noising: bool = False, position: int = -1,
                        head_position: int | None = None, batch_size: int = 32, reuse: bool = True) -> PatchingResult:
    """Patch every (layer, position) — or every (layer, head) for ``what="heads"`` — from the source run into
    the base run, one patch per batch row, ``batch_size`` rows per forward pass.

    ``clean, corrupted``: texts (or token ids) of equal token length; ``target, foil``: token text or ``"#ID"``
    (``foil`` is needed for ``metric="logit_diff"``). ``head_position``: patch each head at that position only
    (default: all positions). ``reuse``: skip what a patch cannot change (the base run's earlier blocks and
    positions reused; :func:`patch_nodes`); False: every row the whole model. Returns a :class:`PatchingResult`
    with ``values (layer, pos | head)``.
    """
    if what not in WHATS:
        raise InputError(f"unknown what={what!r}; choose one of {', '.join(WHATS)}")
    check_metric(metric)
    if batch_size < 1:
        raise InputError("batch_size must be at least 1")
    require_decoder(lm, "activation patching", instead="use a model with a language-model head")
    cx = contrast(lm, clean, corrupted, target, foil, metric, position)
    c_ids, x_ids, tid, fid, pos = cx.clean, cx.corrupted, cx.target, cx.foil, cx.position
    P = c_ids.numel()
    hp = None if head_position is None else position_in(head_position, P)
    L = lm.anatomy.n_layers
    site = PART_SITES[what]
    keys = [(site, layer) for layer in range(L)]
    src_ids, base_ids = (x_ids, c_ids) if noising else (c_ids, x_ids)
    logits, got = run(lm, torch.stack([c_ids, x_ids]), capture=keys)
    m = metric_of(logits[:, pos], metric, tid, fid)
    m_clean, m_corr = float(m[0]), float(m[1])
    src = {k: v[1 if noising else 0] for k, v in got.items()}  # (pos, ...) per layer

    patches, shape = sweep_sites(what, lm, P, hp)
    nodes = [(site, layer, i, None) if what != "heads" else (site, layer, hp, i) for layer, i in patches]
    source = {k: v[None] for k, v in src.items()}  # a batch of one prompt
    raw = patch_nodes(lm, base_ids[None], source, nodes, metric, tid, fid, position=pos, batch_size=batch_size,
                      reuse=reuse)[:, 0]
    raw = raw.reshape(shape)
    values = share_restored(raw, m_clean, m_corr, metric)
    return PatchingResult(
        values=values, raw=raw, tokens=token_texts(lm, c_ids), corrupted_tokens=token_texts(lm, x_ids), what=what,
        metric=metric, noising=noising, **target_fields(lm, tid, fid), clean_metric=m_clean,
        corrupted_metric=m_corr, position=pos, head_position=hp, model=lm.name,
    )
