"""Which features fire at each token of a prompt: one forward pass through the engine with every dictionary's
latents captured (:func:`active_features`), kept as the strongest ``top`` latents per dictionary and position."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ...errors import InputError
from ...models.dictionaries.dictionary import Dictionary
from ...models.loading.load import LoadedModel, token_str
from ...models.runtime.engine import run
from ...results import Result
from ...viz.notebook import ReportView


def latent_site(d: Dictionary) -> str:
    """The engine's site of ``d``'s latents: ``"resid_post.5"`` -> ``"resid_post.latents.5"``."""
    name, _, layer = d.site.rpartition(".")
    return f"{name}.latents.{layer}"


@dataclass(repr=False)
class FeatureActivations(ReportView, Result):
    """The active latents of each dictionary at each position. ``ids (dict, pos, top)`` latent indices, strongest
    first (-1 where fewer are active), ``values (dict, pos, top)`` their activations (0 there), ``l0 (dict, pos)``
    how many latents are active in all (more than ``top`` may be)."""

    VIEW = "features"  # its view: drawn by viz/views/features/features.js (lenscope.viz.views)

    model: str
    tokens: list[str]
    sites: list[str]
    widths: list[int]
    ids: Tensor
    values: Tensor
    l0: Tensor

    def active(self, position: int, site: str | None = None) -> list[tuple[str, int, float]]:
        """``(site, latent, activation)`` of the active latents at ``position`` (of one dictionary's ``site``)."""
        out = []
        for j, s in enumerate(self.sites):
            if site is not None and s != site:
                continue
            for i, v in zip(self.ids[j, position].tolist(), self.values[j, position].tolist()):
                if i >= 0:
                    out.append((s, i, v))
        return out

    def to_records(self) -> list[dict]:
        return [{"site": s, "position": p, "token": self.tokens[p], "feature": i, "activation": v}
                for p in range(len(self.tokens)) for s, i, v in self.active(p)]

    def to_frame(self):
        import pandas as pd

        return pd.DataFrame(self.to_records(), columns=["site", "position", "token", "feature", "activation"])

    def to_dict(self) -> dict:
        return {"model": self.model, "tokens": self.tokens, "sites": self.sites, "widths": self.widths,
                "l0": self.l0.tolist(), "active": self.to_records()}

    def __repr__(self) -> str:
        return (f"FeatureActivations({len(self.tokens)} tokens, sites={self.sites}, mean L0="
                f"{[round(float(x), 1) for x in self.l0.float().mean(1)]})")


def active_features(lm: LoadedModel, text: str | Tensor, dictionaries: list[Dictionary], *,
                    top: int = 32) -> FeatureActivations:
    """The latents of every dictionary at every token of ``text`` (a string or ids ``(pos,)``), from one forward
    pass; the strongest ``top`` per dictionary and position are kept."""
    if not dictionaries:
        raise InputError("no dictionary given")
    if top < 1:
        raise InputError("top must be at least 1")
    ids = lm.tokenizer(text, return_tensors="pt").input_ids[0] if isinstance(text, str) else torch.as_tensor(text)
    sites = [latent_site(d) for d in dictionaries]
    cap = run(lm, ids[None], capture=sites, dictionaries=dictionaries, logits=False).captured
    kept_ids, kept_vals, l0 = [], [], []
    for d, s in zip(dictionaries, sites):
        z = cap[s][0].float()  # (pos, width)
        n = min(top, d.width)
        vals, idx = z.topk(n, dim=-1)
        idx = torch.where(vals > 0, idx, torch.full_like(idx, -1))
        vals = torch.where(vals > 0, vals, torch.zeros_like(vals))
        if n < top:
            pad = top - n
            idx = torch.cat([idx, idx.new_full((idx.shape[0], pad), -1)], -1)
            vals = torch.cat([vals, vals.new_zeros((vals.shape[0], pad))], -1)
        kept_ids.append(idx)
        kept_vals.append(vals)
        l0.append((z > 0).sum(-1))
    return FeatureActivations(model=lm.name, tokens=[token_str(lm, int(t)) for t in ids],
                              sites=[d.site for d in dictionaries], widths=[d.width for d in dictionaries],
                              ids=torch.stack(kept_ids), values=torch.stack(kept_vals), l0=torch.stack(l0))


__all__ = ["FeatureActivations", "active_features", "latent_site"]
