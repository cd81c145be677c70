"""The information-flow view: ALTI (or value zeroing) contributions across layers and their rollout
(``MixingMatrices``, whose class declares ``VIEW = "flow"``; without its rollout the view does not apply and the
result shows its plot of the contributions)."""

from __future__ import annotations

from typing import Protocol

from torch import Tensor

from ...report.payloads import packed
from .. import Shown, View, meta_of, one


class MixingMatricesLike(Protocol):
    """ALTI or value-zeroing contributions with their rollout (:class:`lenscope.mixing.alti.MixingMatrices`)."""

    method: str
    tokens: list[str]
    contributions: Tensor
    rollout: Tensor | None
    degenerate_rows: int


def flow_payload(mm: MixingMatricesLike) -> dict:
    """The ``flow`` view: ALTI (or value zeroing) contributions per layer and the last layer's rollout."""
    return {"tokens": list(mm.tokens), "contributions": packed(mm.contributions), "rollout": packed(mm.rollout[-1]),
            "degenerate_rows": mm.degenerate_rows}


class Flow(View):
    key = "flow"
    title = "Information flow"
    blurb = ("ALTI contributions across layers: a node per token and layer, an edge where a token's state "
             "draws on another's above the threshold.")
    order = 60
    height = 620
    fallback_plot = {"which": "contributions"}

    def show(self, mm) -> Shown | None:
        one(mm, "a collection of mixing matrices", (dict, list))
        if mm.rollout is None:  # without its rollout (rollout=False) the view does not apply
            return None
        causal = bool((mm.contributions.triu(1) == 0).all())  # whether a position ever draws on a later one
        return Shown(self.key, flow_payload(mm), meta_of(mm, causal=causal), f"{self.title} · {mm.method}")


VIEW = Flow()
