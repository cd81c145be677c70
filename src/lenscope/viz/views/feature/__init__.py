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


def feature_label(labels: dict | None, site: str, feature: int, width: int | None = None) -> str | None:
    """Feature ``feature``'s label at ``site`` in ``labels`` (``{site: [label of each feature]}``, as
    :func:`lenscope.features.dictionaries.labels.labels_for` reads them from a dictionary folder); None where there
    is none: no labels for the site, too few, or (given the dictionary's ``width``) labels of another width (a
    dictionary overwritten since it was labelled)."""
    got = (labels or {}).get(site)
    if got is None or feature >= len(got) or (width is not None and len(got) != width):
        return None
    return got[feature]


def feature_payload(card: FeatureCardLike | dict, labels: dict | None = None) -> dict:
    """The ``feature`` view: one feature's card (its ``to_dict()``), floats to 5 significant digits, with its
    ``label`` from ``labels`` (:func:`feature_label`; None where there is none)."""
    d = rounded_tree(card.to_dict() if hasattr(card, "to_dict") else dict(card))
    d["label"] = feature_label(labels, d["site"], int(d["feature"]), d.get("width"))
    return d


class Feature(View):
    key = "feature"
    title = "Feature"
    blurb = ""
    order = 95
    height = 620

    def show(self, obj, labels: dict | None = None) -> Shown:
        """One feature's card with its label where ``labels`` has it (:func:`feature_label`); a list of cards is
        refused (show them through the features view)."""
        d = feature_payload(one(obj, "a list of feature cards"), labels)
        return Shown(self.key, d, view_meta(d["model"], ()), f"Feature {d['site']} #{d['feature']}")


VIEW = Feature()
