"""A static picture of one feature's card (``FeatureCard.plot``): its activation histogram over held-out text, and
the tokens its decoder direction promotes and suppresses. It draws the card's dict (``to_dict()``, or the object),
so a saved card's JSON redraws it without the model."""

from __future__ import annotations

from ..errors import InputError


def plot_feature_card(card, *, title: str | None = None):
    """Two panels: the histogram of the active tokens' activations (with the density in the title) and horizontal
    bars of the promoted (green) and suppressed (red) tokens. Returns the figure."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    d = card.to_dict() if hasattr(card, "to_dict") else card
    if not isinstance(d, dict) or "histogram" not in d:
        raise InputError("give a feature card (lenscope.features.dictionaries.cards.feature_card) or its to_dict()")
    fig, (a, b) = plt.subplots(1, 2, figsize=(9.5, 3.6))
    counts, edges = d["histogram"]["counts"], d["histogram"]["edges"]
    a.bar(edges[:-1], counts, width=[hi - lo for lo, hi in zip(edges[:-1], edges[1:])], align="edge",
          color="#f08c2e")
    a.set_xlabel("activation (active tokens)")
    a.set_ylabel("tokens")
    a.set_title(f"density {d['density']:.4g} ({d['active']} of {d['tokens']})", fontsize=10)
    items = d["promoted"][::-1] + d["suppressed"]
    ys = range(len(items))
    b.barh(list(ys), [x["value"] for x in items], color=["#2f9e44" if x["value"] >= 0 else "#e03131" for x in items])
    b.set_yticks(list(ys), [repr(x["token"]) for x in items], fontsize=7)
    b.axvline(0, color="#9ca3af", lw=0.8)
    b.set_xlabel("logit change per unit activation")
    fig.suptitle(title or f"{d['site']} #{d['feature']}", fontsize=11)
    fig.tight_layout()
    return fig
