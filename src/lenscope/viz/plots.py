"""Static plots. Math lives elsewhere; these functions only draw results."""

from __future__ import annotations

from pathlib import Path

KIND_COLORS = {"embed": "#7f7f7f", "attn": "#1f77b4", "head": "#1f77b4", "mlp": "#ff7f0e", "bias": "#2ca02c",
               "feature": "#9467bd", "skip": "#17becf", "error": "#d62728"}


def _kind(name: str, kind: str | None = None) -> str:
    """The colour group of a row: a feature attribution's own ``kind`` (feature, bias, skip, error; a component
    row by its name), else read from a component's name."""
    if kind in ("feature", "skip", "error"):
        return kind
    if kind == "bias":
        return "bias"
    if name.endswith(".mlp"):
        return "mlp"
    if ".H" in name or name.endswith(".attn") or name.endswith("attn_bias"):
        return "attn"
    if name == "bias":
        return "bias"
    return "embed"


def _figure(ax, size):
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    if ax is None:
        fig, ax = plt.subplots(figsize=size)
    return ax.figure, ax


def plot_components(result, ax=None, top: int | None = None):
    """Horizontal bars of a :class:`ComponentAttribution` or a
    :class:`~lenscope.features.dictionaries.attribution.FeatureAttribution` (features, dictionaries' bias, skip and
    error terms
    beside the components), in model order (or the ``top`` largest)."""
    recs = result.to_records()
    if top is not None:
        keep = {id(r) for r in sorted(recs, key=lambda r: -abs(r["value"]))[:top]}
        recs = [r for r in recs if id(r) in keep]
    fig, ax = _figure(ax, (7, max(3.0, 0.22 * len(recs) + 1.5)))
    names = [r["name"] for r in recs]
    vals = [r["value"] for r in recs]
    groups = [_kind(r["name"], r.get("kind")) for r in recs]
    ax.barh(range(len(recs)), vals, color=[KIND_COLORS[g] for g in groups])
    ax.set_yticks(range(len(recs)), names, fontsize=7)
    ax.invert_yaxis()
    ax.axvline(0, color="black", lw=0.6)
    what = repr(result.target) + (f" − {result.foil!r}" if result.foil is not None else "")
    ctx = "".join(result.tokens[max(0, result.position - 8) : result.position + 1])
    ax.set_title(f"Direct logit attribution of {what}\n…{ctx!r}  (logit {result.logit:.2f})", fontsize=9)
    ax.set_xlabel("contribution to the logit")
    from matplotlib.patches import Patch

    kinds = sorted(set(groups), key=list(KIND_COLORS).index)
    ax.legend(handles=[Patch(color=KIND_COLORS[k], label=k) for k in kinds], fontsize=7, loc="best")
    fig.tight_layout()
    return fig


def save_figure(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130, bbox_inches="tight", pad_inches=0.08)  # nothing (a colour-bar label) cut off
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
