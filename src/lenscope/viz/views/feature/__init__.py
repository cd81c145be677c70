"""The feature view: one sparse-dictionary feature's card (``FeatureCard``, whose class declares
``VIEW = "feature"``); the features view opens these cards with this view's script."""

from __future__ import annotations

from typing import Protocol

from ...report.payloads import rounded_tree
from .. import Shown, View, one, view_meta


class FeatureCardLike(Protocol):
    """One feature's card (:class:`lenscope.features.dictionaries.cards.FeatureCard`)."""

    model: str
    site: str
    feature: int

    def to_dict(self) -> dict: ...


def feature_payload(card: FeatureCardLike | dict) -> dict:
    """The ``feature`` view: one feature's card (its ``to_dict()``), floats to 5 significant digits."""
    return rounded_tree(card.to_dict() if hasattr(card, "to_dict") else dict(card))


class Feature(View):
    key = "feature"
    title = "Feature"
    blurb = ""
    order = 95
    height = 620

    def show(self, obj) -> Shown:
        """One feature's card; a list of cards is refused (show them through the features view)."""
        d = feature_payload(one(obj, "a list of feature cards"))
        return Shown(self.key, d, view_meta(d["model"], ()), f"Feature {d['site']} #{d['feature']}")


VIEW = Feature()
