"""Static pictures of a steering evaluation and of where a steering vector acts. They draw the results' dicts
(``SteeringEvaluation.to_dict()``, ``SteeringLocus.to_dict()``, or the objects themselves), so a results file's
JSON redraws them without the model."""

from __future__ import annotations

from ..errors import InputError
from .plots import _figure

KINDS = ("effect", "damage", "slopes")


def _as_dict(x, need: str, what: str) -> dict:
    d = x.to_dict() if hasattr(x, "to_dict") else x
    if not isinstance(d, dict) or need not in d:
        raise InputError(f"give {what} or its to_dict(), not {type(x).__name__}")
    return d


def _nan(v):
    return float("nan") if v is None else v


def plot_steering(ev, kind: str = "effect", ax=None, *, title: str | None = None):
    """``kind="effect"``: the mean effect (change of ``logit(answer_positive) - logit(answer_negative)``) against
    the multiplier with its bootstrap interval, one line per layer; ``"damage"``: the change in next-token loss on
    held-out text against the mean effect, one point per multiplier (labelled); ``"slopes"``: every input's slope,
    per layer, sorted, with the anti-steerable ones (negative) in red. Returns the figure."""
    if kind not in KINDS:
        raise InputError(f"kind must be one of {', '.join(KINDS)}, not {kind!r}")
    d = _as_dict(ev, "layers", "a steering evaluation (lenscope.steering.evaluate_steering)")
    layers = d["layers"]
    fig, ax = _figure(ax, (6.0, 3.8))
    colours = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"]
    method = (d.get("direction") or {}).get("method", "")
    if kind == "effect":
        for c, (layer, r) in enumerate(layers.items()):
            a, m = r["multipliers"], [_nan(x) for x in r["mean_effect"]]
            lo = [_nan(x[0]) for x in r["effect_ci"]]
            hi = [_nan(x[1]) for x in r["effect_ci"]]
            col = colours[c % len(colours)]
            ax.plot(a, m, marker="o", ms=3, color=col, label=f"layer {layer}")
            ax.fill_between(a, lo, hi, color=col, alpha=0.18, lw=0)
        ax.axhline(0, color="black", lw=0.6)
        ax.set_xlabel("multiplier α")
        ax.set_ylabel("mean effect on logit(+) − logit(−)")
    elif kind == "damage":
        drawn = False
        for c, (layer, r) in enumerate(layers.items()):
            if r.get("delta_loss") is None:
                continue
            drawn = True
            col = colours[c % len(colours)]
            x, y = [_nan(v) for v in r["mean_effect"]], [_nan(v) for v in r["delta_loss"]]
            ax.plot(x, y, marker="o", ms=3, color=col, label=f"layer {layer}", lw=0.8)
            for xi, yi, a in zip(x, y, r["multipliers"]):
                ax.annotate(f"{a:g}", (xi, yi), fontsize=6, xytext=(2, 2), textcoords="offset points", color=col)
        if not drawn:
            raise InputError("this evaluation measured no damage (no held-out text); give damage text")
        ax.axvline(0, color="black", lw=0.6)
        ax.set_xlabel("mean effect on logit(+) − logit(−)")
        ax.set_ylabel("Δ next-token loss (nats)")
    else:
        for c, (layer, r) in enumerate(layers.items()):
            s = sorted(_nan(v) for v in r["slopes"])
            col = colours[c % len(colours)]
            ax.plot(range(len(s)), s, color=col, lw=1.2, label=f"layer {layer}: anti "
                    f"{r['anti_steerable_fraction']:.2f}, unmoved {r['unmoved_fraction']:.2f}")
        ax.axhline(0, color="#d62728", lw=0.8)
        ax.set_xlabel("held-out input (sorted by slope)")
        ax.set_ylabel("slope (logits per unit α)")
    ax.legend(fontsize=7, loc="best")
    ax.set_title(title or f"{d.get('model', '')}: {method} direction, {d.get('n_inputs', '')} inputs", fontsize=9)
    fig.tight_layout()
    return fig


def plot_locus(loc, top: int = 12):
    """Two panels: the lens's reading of the measure at the last position, state by state, unsteered and
    steered; and the ``top`` components whose direct logit attribution changed most. Returns the figure."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    d = _as_dict(loc, "lens_measure", "a steering locus (lenscope.steering.steering_locus)")
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.8))
    for run, col in (("unsteered", "#7f7f7f"), ("steered", "#1f77b4")):
        y = d["lens_measure"][run]
        a1.plot(range(len(y)), y, marker="o", ms=3, color=col, label=f"{run} (depth {d['depth'][run]})")
    a1.axhline(0, color="black", lw=0.6)
    for layer in d["layers"]:
        a1.axvline(layer, color="#1f77b4", lw=0.6, ls="--")
    a1.set_xlabel("state (0 = embeddings)")
    a1.set_ylabel(f"{d['lens']} lens: logit({d['answers'][0]!r}) − logit({d['answers'][1]!r})")
    a1.legend(fontsize=7)
    comps = sorted(d["components"], key=lambda c: -abs(c["change"]))[:top]
    a2.barh(range(len(comps)), [c["change"] for c in comps], color="#1f77b4")
    a2.set_yticks(range(len(comps)), [c["name"] for c in comps], fontsize=7)
    a2.invert_yaxis()
    a2.axvline(0, color="black", lw=0.6)
    a2.set_xlabel("change of direct logit attribution")
    fig.suptitle(f"α = {d['alpha']:g} at resid_pre {d['layers']}: measure {d['measure']['unsteered']:.2f} → "
                 f"{d['measure']['steered']:.2f}", fontsize=9)
    fig.tight_layout()
    return fig
