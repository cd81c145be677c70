"""The context-mixing view: norm-based maps of how much of each token's state comes from each input token, per scope
(``MixingMaps``, whose class declares ``VIEW = "mixing"``; a dict ``{scope: maps}`` as ``context_mixing`` returns)."""

from __future__ import annotations

from typing import Protocol

from torch import Tensor

from ...report.payloads import packed
from .. import Shown, View, keyed, meta_of


class MixingMapsLike(Protocol):
    """One scope's context-mixing maps (:class:`lenscope.mixing.maps.MixingMaps`)."""

    scope: str
    tokens: list[str]
    maps: Tensor
    completeness_error: float


def mixing_payload(maps: dict[str, MixingMapsLike] | MixingMapsLike) -> dict:
    """The ``mixing`` view: ``{scope: MixingMaps}`` (as :func:`~lenscope.mixing.maps.context_mixing` returns)
    or one scope's maps."""
    if not isinstance(maps, dict):
        maps = {maps.scope: maps}
    first = next(iter(maps.values()))
    out = {"tokens": list(first.tokens), "scopes": list(maps), "maps": {}, "completeness_error": {}}
    for scope, m in maps.items():
        out["maps"][scope] = packed(m.maps)
        out["completeness_error"][scope] = m.completeness_error
    return out


class Mixing(View):
    key = "mixing"
    title = "Context-mixing maps"
    blurb = ("Norm-based maps ||F_i(x_j)||: how much of token i's state after each scope of a layer comes from "
             "input token j (Kobayashi et al.). Rows: positions; columns: sources.")
    order = 50
    height = 720

    def show(self, obj) -> Shown:
        maps = keyed(obj, "scope")
        first = next(iter(maps.values()))
        return Shown(self.key, mixing_payload(maps), meta_of(first), f"{self.title} · " + ", ".join(maps))


VIEW = Mixing()
