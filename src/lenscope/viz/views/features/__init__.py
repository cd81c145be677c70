"""The features view: which features of the sparse dictionaries fire at each token, with the cards of some of them
(``FeatureActivations``, whose class declares ``VIEW = "features"``; the cards drawn by the feature view's script)."""

from __future__ import annotations

from typing import Protocol

from torch import Tensor

from ...report.payloads import rounded
from .. import Shown, View, meta_of, one
from ..feature import feature_label, feature_payload


class FeatureActivationsLike(Protocol):
    """The features of a prompt (:class:`lenscope.features.dictionaries.result.FeatureActivations`)."""

    tokens: list[str]
    sites: list[str]
    widths: list[int]
    ids: Tensor
    values: Tensor
    l0: Tensor


def features_payload(fa: FeatureActivationsLike, cards=(), labels: dict | None = None) -> dict:
    """The ``features`` view: the prompt's tokens and, per dictionary (``sites``) and position, its active latents
    strongest first as ``[feature, activation]`` pairs, the L0 per position, the ``cards`` of some features
    (:func:`~lenscope.viz.views.feature.feature_payload`, keyed ``"site#feature"``) that a click opens, and
    ``labels``: ``{site: {feature: label}}`` of the active features that ``labels`` (``{site: [label of each
    feature]}``) labels (:func:`~lenscope.viz.views.feature.feature_label`)."""
    active, named = [], {}
    for j, site in enumerate(fa.sites):
        per = []
        for ids, vals in zip(fa.ids[j].tolist(), fa.values[j].tolist()):
            per.append([[i, rounded(v)] for i, v in zip(ids, vals) if i >= 0])
            for i in ids:
                label = feature_label(labels, site, i, int(fa.widths[j])) if i >= 0 else None
                if label is not None:
                    named.setdefault(site, {})[str(i)] = label
        active.append(per)
    out_cards = {}
    for c in cards:
        d = feature_payload(c, labels)
        out_cards[f"{d['site']}#{d['feature']}"] = d
    return {"tokens": list(fa.tokens), "sites": list(fa.sites), "widths": [int(w) for w in fa.widths],
            "l0": [[int(v) for v in row] for row in fa.l0.tolist()], "active": active, "cards": out_cards,
            "labels": named}


class Features(View):
    key = "features"
    title = "Features"
    blurb = ("Which features of the sparse dictionaries fire at each token (darker: stronger). Click a token for its "
             "active features; a feature in bold opens its card: its top-activating contexts on held-out text, its "
             "activation histogram and density, the tokens its decoder direction promotes and suppresses.")
    order = 90
    height = 560
    uses = ("feature",)

    def show(self, obj, cards=(), labels: dict | None = None) -> Shown:
        """The features of a prompt, with the ``cards`` of some of its features and their ``labels`` where cached
        (``{site: [label of each feature]}``)."""
        one(obj, "a list of feature activations")
        return Shown(self.key, features_payload(obj, cards, labels), meta_of(obj), "Features · " + ", ".join(obj.sites))


VIEW = Features()
