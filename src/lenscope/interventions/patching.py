"""Activation patching: put one component's activation from one run into another, one patch per batch row.

Denoising (default): the base run is the corrupted prompt, patches come from the clean run. Noising: the base
run is the clean prompt, patches come from the corrupted run. The metric is read at ``position`` (default: the
last token):

- ``metric="logit_diff"``: ``LD = logit[target] - logit[foil]``, reported as the share restored
  ``(LD_patched - LD_corrupted) / (LD_clean - LD_corrupted)`` (0 = corrupted, 1 = clean);
- ``metric="prob"``: the probability of the target, as is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..errors import InputError
from ..models.engine import Edit, batches, run
from ..models.load import LoadedModel, require_decoder, resolve_token, token_ids, token_str
from ..results import Result

WHATS = ("resid", "attn", "mlp", "heads")
METRICS = ("logit_diff", "prob")


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
            rec = "the logits" if rec == "logits" else f"head L{rec[0]}H{rec[1]}'s {rec[2]}"
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


def _tokens(lm, ids) -> list[str]:
    return lm.tokenizer.batch_decode([[int(i)] for i in ids])


def _position(position: int, P: int) -> int:
    pos = position + P if position < 0 else position
    if not 0 <= pos < P:
        raise InputError(f"position {position} is outside the {P} tokens")
    return pos


def contrast(lm: LoadedModel, clean, corrupted, target, foil, metric: str, position: int):
    """A clean/corrupted request checked once for every patching method: ``(clean_ids, corrupted_ids, target_id,
    foil_id, position)`` with equal token lengths, a foil when ``metric="logit_diff"``, the position in range."""
    c_ids, x_ids = token_ids(lm, clean), token_ids(lm, corrupted)
    if c_ids.numel() != x_ids.numel():
        raise InputError(
            f"the clean and corrupted prompts must have the same number of tokens; they have {c_ids.numel()} "
            f"{_tokens(lm, c_ids)} and {x_ids.numel()} {_tokens(lm, x_ids)}: reword one of them"
        )
    tid = resolve_token(lm, target)
    if metric == "logit_diff" and foil is None:
        raise InputError("metric='logit_diff' needs a foil token (--foil); or use metric='prob'")
    fid = resolve_token(lm, foil) if foil is not None else None
    return c_ids, x_ids, tid, fid, _position(position, c_ids.numel())


def metric_of(logits: Tensor, metric: str, target_id, foil_id=None, *, at: Tensor | int | None = None) -> Tensor:
    """``logits (rows, vocab)`` -> ``(rows,)``: the logit difference ``logit[target] - logit[foil]`` (``foil_id``
    None: the target's logit alone) or, for ``metric="prob"``, the target's probability.

    ``target_id`` / ``foil_id``: one token id for every row, or ``(rows,)`` ids, one per row. ``at``: read
    ``logits (rows, pos, vocab)`` at that position (an int, or ``(rows,)`` one per row). bfloat16 / float16 logits
    are read in float32; the one per-row metric of patching, attribution patching and the attribution baselines."""
    rows = torch.arange(logits.shape[0], device=logits.device)
    if at is not None:
        logits = logits[rows, _on(at, rows)] if isinstance(at, Tensor) else logits[:, at]
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    if metric == "prob":
        logits = logits.softmax(-1)
    t = _on(target_id, rows) if isinstance(target_id, Tensor) else target_id
    out = logits[rows, t]
    if metric == "logit_diff" and foil_id is not None:
        out = out - logits[rows, _on(foil_id, rows) if isinstance(foil_id, Tensor) else foil_id]
    return out


def _on(x: Tensor, like: Tensor) -> Tensor:
    return x.to(like.device)


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
                        head_position: int | None = None, batch_size: int = 32) -> PatchingResult:
    """Patch every (layer, position) — or every (layer, head) for ``what="heads"`` — from the source run into
    the base run, one patch per batch row, ``batch_size`` rows per forward pass.

    ``clean, corrupted``: texts (or token ids) of equal token length; ``target, foil``: token text or ``"#ID"``
    (``foil`` is needed for ``metric="logit_diff"``). ``head_position``: patch each head at that position only
    (default: all positions). Returns a :class:`PatchingResult` with ``values (layer, pos | head)``.
    """
    if what not in WHATS:
        raise InputError(f"unknown what={what!r}; choose one of {', '.join(WHATS)}")
    if metric not in METRICS:
        raise InputError(f"unknown metric={metric!r}; choose one of {', '.join(METRICS)}")
    if batch_size < 1:
        raise InputError("batch_size must be at least 1")
    require_decoder(lm, "activation patching", instead="use a model with a language-model head")
    c_ids, x_ids, tid, fid, pos = contrast(lm, clean, corrupted, target, foil, metric, position)
    P = c_ids.numel()
    hp = None if head_position is None else _position(head_position, P)
    L = lm.anatomy.n_layers
    site = {"resid": "resid_pre", "attn": "attn_out", "mlp": "mlp_out", "heads": "head"}[what]
    keys = [(site, layer) for layer in range(L)]
    src_ids, base_ids = (x_ids, c_ids) if noising else (c_ids, x_ids)
    logits, got = run(lm, torch.stack([c_ids, x_ids]), capture=keys)
    m = metric_of(logits[:, pos], metric, tid, fid)
    m_clean, m_corr = float(m[0]), float(m[1])
    src = {k: v[1 if noising else 0] for k, v in got.items()}  # (pos, ...) per layer

    patches, shape = sweep_sites(what, lm, P, hp)
    raw = torch.empty(len(patches))
    plist = torch.tensor(patches, dtype=torch.long)  # (n, 2): layer, index
    for s, e in batches(len(patches), batch_size):
        chunk = plist[s:e]
        n = e - s
        edits = []
        for layer in chunk[:, 0].unique().tolist():
            rows = (chunk[:, 0] == layer).nonzero()[:, 0]
            idx = chunk[rows, 1]
            vals = src[(site, layer)]
            if what != "heads":
                edits.append(Edit(site, layer, rows, idx, vals[idx]))
            else:
                ps = torch.arange(P) if hp is None else torch.tensor([hp])
                r = rows.repeat_interleave(len(ps))
                h = idx.repeat_interleave(len(ps))
                pp = ps.repeat(len(rows))
                edits.append(Edit(site, layer, r, pp, vals[pp, h], head=h))
        lg, _ = run(lm, base_ids[None].expand(n, P), edits)
        raw[s:e] = metric_of(lg[:, pos], metric, tid, fid).cpu()
    raw = raw.reshape(shape)
    values = share_restored(raw, m_clean, m_corr, metric)
    return PatchingResult(
        values=values, raw=raw, tokens=_tokens(lm, c_ids), corrupted_tokens=_tokens(lm, x_ids), what=what,
        metric=metric, noising=noising, target=token_str(lm, tid), target_id=tid,
        foil=None if fid is None else token_str(lm, fid), foil_id=fid, clean_metric=m_clean,
        corrupted_metric=m_corr, position=pos, head_position=hp, model=lm.name,
    )
