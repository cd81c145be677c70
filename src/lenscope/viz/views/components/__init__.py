"""The components view: a logit as an exact sum of what the embedding, each attention head and each MLP wrote
(``ComponentAttribution``, whose class declares ``VIEW = "components"``)."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from ....errors import InputError
from ...report.payloads import rounded, rounded_list
from .. import Shown, View, meta_of


class ComponentsLike(Protocol):
    """A direct logit attribution (:class:`lenscope.attribution.ComponentAttribution`)."""

    names: list[str]
    layers: list[int]
    heads: list[int]
    values: Tensor
    target: str | None
    foil: str | None
    foil_id: int | None
    logit: float
    total: float
    completeness_error: float


def dla_view(res: ComponentsLike) -> dict:
    """One logit's direct logit attribution for ``components.js``: per layer the attention (its heads and the
    output-projection bias) and the MLP, per head ``heads (layer, head)`` (zeros without ``by_head``), and the
    embedding / bias terms as ``other``."""
    L = max((l for l in res.layers), default=-1) + 1
    H = max((h for h in res.heads), default=-1) + 1
    attn, mlp = [0.0] * L, [0.0] * L
    heads = torch.zeros(L, H)
    other = []
    for n, l, h, v in zip(res.names, res.layers, res.heads, res.values.tolist()):
        if h >= 0:
            heads[l, h] = v
            attn[l] += v
        elif l >= 0 and n.endswith(".mlp"):
            mlp[l] += v
        elif l >= 0:
            attn[l] += v  # the output-projection bias belongs to the attention sub-layer
        else:
            other.append({"name": n, "value": rounded(v)})
    return {"label": res.target, "minus": res.foil, "logit": rounded(res.logit), "total": rounded(res.total),
            "completeness_error": res.completeness_error, "attn": rounded_list(attn), "mlp": rounded_list(mlp),
            "heads": [rounded_list(r) for r in heads], "other": other}


def components_payload(views: dict[str, ComponentsLike] | ComponentsLike) -> dict:
    """The ``components`` view: ``{name: ComponentAttribution}`` (the report's ``difference``, ``target`` and
    ``foil``; the first one names the target and foil), or one result, shown as ``difference`` when it has a
    foil, else ``target``."""
    if not isinstance(views, dict):
        views = {"difference" if views.foil_id is not None else "target": views}
    first = next(iter(views.values()))
    return {"target": first.target, "foil": first.foil, "views": {k: dla_view(v) for k, v in views.items()}}


class Components(View):
    key = "components"
    title = "Direct logit attribution"
    blurb = ("The logit as an exact sum of what the embedding, each layer's attention (each head) and each MLP "
             "wrote.")
    order = 30
    height = 470

    def show(self, obj) -> Shown:
        if isinstance(obj, list):
            raise InputError("no view shows a list of direct logit attributions; give a dict {name: result} "
                             "(the report's difference, target and foil) or one result")
        first = next(iter(obj.values())) if isinstance(obj, dict) else obj
        what = repr(first.target) + (f" - {first.foil!r}" if first.foil is not None else "")
        return Shown(self.key, components_payload(obj), meta_of(first), f"{self.title} · {what}")


VIEW = Components()
