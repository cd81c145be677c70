"""Features as the units of attribution: direct logit attribution over a dictionary's latents
(:func:`feature_dla`) and attribution patching over them, checked against exact patching (:func:`feature_atp`).

**Direct logit attribution over features.** Direct logit attribution
(:func:`lenscope.attribution.dla.direct_logit_attribution`) writes the logit of a target (minus a foil) at one
position as an exact sum over what each part wrote to the final residual state, read through the final norm with
its traced scale. A dictionary splits the activation ``x`` at its site exactly::

    x = sum_i z_i W_dec[i]  +  b_dec  (+ x_in @ W_skip.T, a skip transcoder)  +  (x - reconstruction)

(the last term: the reconstruction error), so its site's share of the logit splits into each active latent's
decoded write, the decoder bias, the skip path and the error. A sub-layer's site (``attn_out.L``, a transcoder's
``mlp_out.L``) reaches the residual stream through :meth:`~lenscope.models.weights.anatomy.Layer.write` (a sandwich
norm, affine given its traced scale, and a residual multiplier): the read-out direction is carried back through it
(:func:`lenscope.models.weights.algebra.write_pullback`), and the dictionary's parts replace that sub-layer's rows. A
residual-stream dictionary (``resid_post.L``, ``resid_pre.L``) stands for everything written up to its site: its
parts replace the embedding and every component before it; the components after it stay. The parts sum to the
model's logit; the completeness check runs on every call (:class:`~lenscope.errors.InvariantError` beyond the
float32 tolerance of the decompositions, relative to the size of the parts).

**Attribution patching over features.** A latent ``(dictionary, position, i)`` is a node: its AtP score is
``(z_corrupted - z_clean) * d metric / d z`` at the clean run (the engine's latents captured with ``grad=True`` are
leaves), and its exact effect the metric of the clean run with that latent set to the corrupted run's value (one
latent per batch row, :func:`lenscope.interventions.patching.patch_nodes` through the circuits' exact node effects),
minus the clean metric.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ...attribution.dla import LogitTarget, direct_logit_attribution
from ...circuits.atp import contrast_texts, exact_effects, one_length, prompts
from ...circuits.gradients import atp_product, corrupted_runs, metric_grads
from ...errors import InputError, InvariantError
from ...models.dictionaries.dictionary import Dictionary
from ...models.loading.load import LoadedModel, require_decoder
from ...models.runtime.engine import run
from ...models.runtime.request import Request, by_length, metric_of, position_in
from ...models.runtime.sites import display_name, site_key
from ...models.runtime.trace import Trace, trace
from ...models.runtime.verify import completeness_tolerance
from ...models.weights.algebra import write_pullback
from ...models.weights.readout import Readout
from ...results import Result
from ...stats import pearson, spearman_or_none
from .result import latent_site

RESIDUAL = ("resid_pre", "resid_post")
PARTS = ("component", "feature", "bias", "skip", "error", "readout")


@dataclass(repr=False)
class FeatureAttribution(LogitTarget, Result):
    """One logit (difference) as an exact sum over parts: the components direct logit attribution keeps, and for
    each dictionary its active features, its decoder bias, its skip path and its reconstruction error. Per row
    (``row`` axis): ``names`` (``"resid_post.5/F123"``, ``"L3.mlp"``), ``kinds`` (one of :data:`PARTS`:
    ``component``, ``feature``, ``bias``, ``skip``, ``error``, ``readout`` for the readout's biases), ``sites`` (the
    dictionary's site, None for components), ``features`` (the latent, -1 elsewhere), ``layers`` (-1 where none),
    ``activations (row,)`` (the latent's value, 0 elsewhere), ``values (row,)`` (the direct effect on the logit
    difference). ``logit``: the model's; ``completeness_error``: ``|sum(values) - logit|``. The first fields say
    which logit: :class:`~lenscope.attribution.dla.LogitTarget`."""

    dictionaries: list[str]
    names: list[str]
    kinds: list[str]
    sites: list
    features: list[int]
    layers: list[int]
    activations: Tensor
    values: Tensor
    logit: float
    completeness_error: float
    tolerance: float = 0.0

    @property
    def total(self) -> float:
        return float(self.values.double().sum())

    def to_records(self) -> list[dict]:
        return [{"name": n, "kind": k, "site": s, "feature": None if f < 0 else f, "layer": None if la < 0 else la,
                 "activation": float(a) if k == "feature" else None, "value": float(v)}
                for n, k, s, f, la, a, v in zip(self.names, self.kinds, self.sites, self.features, self.layers,
                                                self.activations.tolist(), self.values.tolist())]

    def to_dict(self) -> dict:
        return {**self.target_dict(), "dictionaries": self.dictionaries, "rows": self.to_records(),
                "logit": self.logit, "sum": self.total, "completeness_error": self.completeness_error}

    def to_frame(self):
        import pandas as pd

        return pd.DataFrame(self.to_records(), columns=["name", "kind", "site", "feature", "layer", "activation",
                                                        "value"])

    def top(self, k: int = 10, kind: str | None = "feature") -> list[dict]:
        """The ``k`` rows of largest absolute value (of one ``kind``; None: every row)."""
        recs = [r for r in self.to_records() if kind is None or r["kind"] == kind]
        return sorted(recs, key=lambda r: -abs(r["value"]))[:k]

    def plot(self, ax=None, top: int | None = 30):
        """Bars of the parts (the ``top`` largest; None: all), coloured by kind: the components' plot."""
        from ...viz.plots import plot_components

        return plot_components(self, ax=ax, top=top)

    def __repr__(self) -> str:
        n = sum(k == "feature" for k in self.kinds)
        return (f"FeatureAttribution({self.target_label()} at position {self.position}, {n} features of "
                f"{self.dictionaries}, {len(self.names) - n} other parts, logit={self.logit:.4f}, "
                f"completeness_error={self.completeness_error:.1e})")


def _covers(d: Dictionary) -> tuple[str, int]:
    return site_key(d.site)


def check_compatible(dicts: list[Dictionary]) -> None:
    """One decomposition holds at most one residual-stream dictionary, and sub-layer dictionaries only after it
    (a residual-stream dictionary stands for every part written before its site); one line otherwise."""
    res = [d for d in dicts if _covers(d)[0] in RESIDUAL]
    if len(res) > 1:
        raise InputError(f"the residual-stream dictionaries {', '.join(d.site for d in res)} each stand for "
                         "everything written before their site, so they are alternatives, not parts of one sum: "
                         "give one of them (--site)")
    if res:
        name, L = _covers(res[0])
        last = L if name == "resid_post" else L - 1  # the last block the residual dictionary stands for
        for d in dicts:
            n, layer = _covers(d)
            if n not in RESIDUAL and layer <= last:
                raise InputError(f"the dictionary at {d.site} writes into {res[0].site}, which its dictionary "
                                 "already splits: give one of the two (--site)")


@torch.no_grad()
def feature_dla(lm: LoadedModel, text, dictionaries: list[Dictionary], target=None, foil=None, *,
                position: int = -1, by_head: bool = False, tr: Trace | None = None) -> FeatureAttribution:
    """Direct logit attribution with ``dictionaries``' features as parts: the logit of ``target`` (minus ``foil``)
    at ``position`` (default: the last token) as each active feature's direct effect, each dictionary's decoder
    bias, skip path and reconstruction error, and the components the dictionaries do not cover (see the module's
    docstring). ``target``: a token's text, ``"#ID"`` or an id; default: the model's top prediction. ``by_head``:
    the uncovered attention writes as their heads. Checked on every call: the parts sum to the logit."""
    require_decoder(lm, "feature attribution", sum_of_blocks=True, instead="use a decoder model (e.g. smollm2)")
    dicts = list(dictionaries)
    if not dicts:
        raise InputError("no dictionary given")
    for d in dicts:
        d.check(lm)
    if len({d.site for d in dicts}) != len(dicts):
        raise InputError("two dictionaries for one site; give one per site")
    check_compatible(dicts)
    A = lm.anatomy
    tr = tr if tr is not None else trace(lm, text)
    p = position_in(position, len(tr.tokens))
    req = Request.of(lm, target, foil, top=tr.logits[p], distinct=True)
    comp = direct_logit_attribution(lm, text, req.target, req.foil, by_head=by_head, position=p, tr=tr)

    readout = Readout.from_anatomy(A)
    u = readout.direction(req.target, req.foil)
    w_res = readout.pullback(u, readout.scale(tr.site("ln_final.in")[p]))  # state . w_res = its logit share

    # which of DLA's rows each dictionary replaces
    covered: dict[int, int] = {}  # row -> dictionary
    for j, d in enumerate(dicts):
        name, L = _covers(d)
        for r, (n, layer, head) in enumerate(zip(comp.names, comp.layers, comp.heads)):
            if n == "bias":
                continue
            attn = n in (display_name("attn", layer), display_name("dla.attn_bias", layer)) or head >= 0
            if name == "resid_post":
                hit = layer <= L
            elif name == "resid_pre":
                hit = layer < L
            else:
                hit = layer == L and attn == (name == "attn_out")
            if hit:
                covered[r] = j

    rows: dict = {k: [] for k in ("names", "kinds", "sites", "features", "layers", "activations", "values")}

    def add(name, kind, site, feature, layer, activation, value):
        for k, v in zip(rows, (name, kind, site, feature, layer, activation, value)):
            rows[k].append(v)

    done = set()
    for r, (n, layer) in enumerate(zip(comp.names, comp.layers)):
        j = covered.get(r)
        if j is None:
            add(n, "readout" if n == "bias" else "component", None, -1, layer, 0.0, float(comp.values[r]))
        elif j not in done:
            done.add(j)
            for rec in _dictionary_parts(A, tr, dicts[j], p, w_res):
                add(*rec)
    for j, d in enumerate(dicts):  # a dictionary whose rows DLA does not have (none today): still its parts
        if j not in done:
            raise InputError(f"no part of direct logit attribution is written at {d.site}")

    values = torch.tensor(rows["values"], dtype=torch.float32)
    total = float(torch.tensor(rows["values"], dtype=torch.float64).sum())
    err = abs(total - comp.logit)
    scale = max(1.0, float(torch.tensor(rows["values"], dtype=torch.float64).abs().sum()))
    tol = completeness_tolerance(lm) * scale
    if not err <= tol:
        raise InvariantError(f"feature attribution: the parts sum to {total:.6g}, the model's logit is "
                             f"{comp.logit:.6g} (off by {err:.2e}, limit {tol:.2e}); run `lenscope verify --model "
                             f"{lm.name}`")
    return FeatureAttribution(
        model=lm.name, tokens=tr.tokens, position=p, target=comp.target, target_id=comp.target_id, foil=comp.foil,
        foil_id=comp.foil_id, dictionaries=[d.site for d in dicts], names=rows["names"], kinds=rows["kinds"],
        sites=rows["sites"], features=rows["features"], layers=rows["layers"],
        activations=torch.tensor(rows["activations"], dtype=torch.float32), values=values, logit=comp.logit,
        completeness_error=err, tolerance=tol)


def _dictionary_parts(A, tr: Trace, d: Dictionary, p: int, w_res: Tensor) -> list[tuple]:
    """The rows of dictionary ``d`` at position ``p``: ``(name, kind, site, feature, layer, activation, value)``
    for each active latent (strongest effect first), the decoder bias, the skip path and the error; ``w_res
    (d_model,)``: the read-out direction on the final residual state."""
    name, L = _covers(d)
    x = tr.site(name, L)[p].float()  # the site's activation
    if name in RESIDUAL:
        w, c = w_res, 0.0
    else:  # a sub-layer's output reaches the residual stream through Layer.write (sandwich norm, multiplier)
        w, c = write_pullback(A.layers[L], "attn" if name == "attn_out" else "mlp", w_res[None], x[None])
        w, c = w[0], float(c[0])
    x_in = tr.site(d.input_site)[p].float() if d.transcoder else x
    dd = d.to(torch.float32) if d.W_dec.dtype != torch.float32 else d
    z = dd.encode(x_in[None])[0]
    on = z.nonzero()[:, 0]
    per = z[on] * (dd.W_dec[on].to(w) @ w)  # each active latent's decoded write, read out
    order = per.abs().argsort(descending=True)
    lat = f"{name}.latents"
    out = [(display_name(lat, L, unit=int(on[i])), "feature", d.site, int(on[i]), L, float(z[on[i]]), float(per[i]))
           for i in order.tolist()]
    out.append((display_name(f"{lat}.bias", L), "bias", d.site, -1, L, 0.0, float(dd.b_dec.to(w) @ w) + c))
    recon = dd.decode(z[None], x_in[None])[0]
    if dd.W_skip is not None:
        out.append((display_name(f"{lat}.skip", L), "skip", d.site, -1, L, 0.0,
                    float((x_in @ dd.W_skip.T.to(x_in)) @ w)))
    out.append((display_name(f"{lat}.error", L), "error", d.site, -1, L, 0.0, float((x - recon.to(x)) @ w)))
    return out


# -- attribution patching over features -------------------------------------------------------------------------


@dataclass(repr=False)
class FeatureAtP(Result):
    """Attribution patching over dictionaries' latents, checked against exact patching of the top ones.

    - ``atp (pos, latent)``: every latent's AtP score at every position (the mean over prompts), the dictionaries'
      latents side by side in the order of ``sites`` (``widths`` each; :meth:`scores` splits them)
    - the checked nodes (the ``top`` latents by ``|atp|``): ``node_names`` (``"resid_post.5/F12@3"``),
      ``node_sites``, ``node_pos``, ``node_feature``, ``node_atp``, ``node_exact`` (the metric with that latent
      patched from the corrupted run, minus the clean metric)
    - ``agreement``: over the checked nodes, ``max_abs_error``, ``mae``, ``relative_error`` (``max |atp - exact| /
      max |exact|``), ``pearson``, ``spearman``, ``sign_agreement``
    """

    model: str
    tokens: list[str]
    corrupted_tokens: list[str]
    target: str
    foil: str | None
    metric: str
    position: int
    sites: list[str]
    widths: list[int]
    atp: Tensor
    node_names: list[str]
    node_sites: list[str]
    node_pos: Tensor
    node_feature: Tensor
    node_atp: Tensor
    node_exact: Tensor
    metric_clean: float
    metric_corrupted: float
    agreement: dict
    n: int = 1
    info: dict = field(default_factory=dict)

    def scores(self, site: str) -> Tensor:
        """The AtP scores ``(pos, width)`` of the dictionary at ``site``."""
        if site not in self.sites:
            raise InputError(f"no dictionary at {site}; these are at {', '.join(self.sites)}")
        j = self.sites.index(site)
        start = sum(self.widths[:j])
        return self.atp[:, start:start + self.widths[j]]

    def nodes(self) -> list[dict]:
        return [{"name": n, "site": s, "position": int(p), "feature": int(f), "atp": float(a), "exact": float(x),
                 "error": float(a - x)}
                for n, s, p, f, a, x in zip(self.node_names, self.node_sites, self.node_pos.tolist(),
                                            self.node_feature.tolist(), self.node_atp.tolist(),
                                            self.node_exact.tolist())]

    def to_dict(self) -> dict:
        return {"method": "feature_atp", "model": self.model, "metric": self.metric, "n": self.n,
                "metric_clean": self.metric_clean, "metric_corrupted": self.metric_corrupted, "target": self.target,
                "foil": self.foil, "position": self.position, "tokens": self.tokens,
                "corrupted_tokens": self.corrupted_tokens, "sites": self.sites, "nodes": self.nodes(),
                "agreement": self.agreement}

    def to_frame(self):
        import pandas as pd

        return pd.DataFrame(self.nodes(), columns=["name", "site", "position", "feature", "atp", "exact", "error"])

    def __repr__(self) -> str:
        a = self.agreement
        return (f"FeatureAtP({self.sites}, {len(self.node_names)} latents checked, max |atp - exact| = "
                f"{a.get('max_abs_error', float('nan')):.3g}, metric_clean={self.metric_clean:.4g}, "
                f"metric_corrupted={self.metric_corrupted:.4g})")


def agreement(atp: Tensor, exact: Tensor) -> dict:
    """How far AtP matches exact patching on the same nodes (see :class:`FeatureAtP`)."""
    a, x = atp.double(), exact.double()
    if a.numel() == 0:
        return {"nodes": 0}
    gap = (a - x).abs()
    return {"nodes": int(a.numel()), "max_abs_error": float(gap.max()), "mae": float(gap.mean()),
            "relative_error": float(gap.max() / x.abs().max().clamp_min(1e-30)),
            "pearson": pearson(a, x) if a.numel() > 1 else None,
            "spearman": spearman_or_none(a, x) if a.numel() > 1 else None,
            "sign_agreement": float(((a > 0) == (x > 0)).double().mean())}


def feature_atp(lm: LoadedModel, clean=None, corrupted=None, target=None, foil=None, *,
                dictionaries: list[Dictionary], pairs=None, metric: str = "logit_diff", position: int = -1,
                top: int = 10, batch_size: int = 32) -> FeatureAtP:
    """Attribution patching over ``dictionaries``' latents, every latent at every position a node: the AtP score
    ``(z_corrupted - z_clean) * d metric / d z`` at the clean run (the mean over prompts), and for the ``top``
    latents by ``|AtP|`` the exact effect of patching that one latent (at that position) from the corrupted run
    into the clean one. Prompts as :func:`lenscope.circuits.atp.attribution_patching` takes them (of one token
    length: the nodes are per position); ``metric`` read at ``position``."""
    require_decoder(lm, "feature attribution patching", instead="use a causal decoder", causal=True)
    dicts = list(dictionaries)
    if not dicts:
        raise InputError("no dictionary given")
    if top < 0:
        raise InputError("top must be at least 0")
    ps = prompts(lm, clean, corrupted, target, foil, metric, position, pairs, what="feature attribution patching")
    P = one_length(ps, "latents per position")
    sites = [site_key(latent_site(d)) for d in dicts]
    total = [torch.zeros(P, d.width, dtype=torch.float64) for d in dicts]
    for g, last_only, at, (_, corr) in corrupted_runs(lm, by_length(ps), sites, dictionaries=dicts, logits=False):
        _, cap, grads = metric_grads(lm, g.clean, sites, metric, g.target, g.foil, at=at, last_only=last_only,
                                     dictionaries=dicts, allow_unused=True)
        for j, s in enumerate(sites):
            if grads[s] is None:  # a latent the metric does not read (after the metric's position, say)
                continue
            total[j] += atp_product(corr[s], cap[s], grads[s], torch.float64).sum(0).cpu()
    n = len(ps)
    atp = torch.cat(total, -1) / n  # (pos, latent)

    # the top latents by |AtP|, those that move (a latent with the same value in both runs is no patch)
    flat = atp.abs().flatten()
    k = min(top, int((flat > 0).sum()))
    idx = flat.argsort(descending=True)[:k]
    offsets = torch.tensor([0] + [d.width for d in dicts]).cumsum(0)
    nodes, names, nsites, npos, nfeat = [], [], [], [], []
    for i in idx.tolist():
        pos, col = divmod(i, atp.shape[1])
        j = int((offsets[1:] <= col).sum())
        feat = col - int(offsets[j])
        name, layer = sites[j]
        nodes.append((name, layer, pos, feat))
        names.append(display_name(name, layer, unit=feat, pos=pos))
        nsites.append(dicts[j].site)
        npos.append(pos)
        nfeat.append(feat)
    if nodes:
        eff, m_clean, m_corr = exact_effects(lm, ps, nodes, metric, batch_size, dictionaries=dicts)
    else:
        eff = torch.zeros(0, dtype=torch.float64)
        m_clean, m_corr = _metrics(lm, ps, metric)
    node_atp = atp.flatten()[idx].double()
    return FeatureAtP(
        model=lm.name, **contrast_texts(lm, ps[0]), metric=metric, position=ps[0].position,
        sites=[d.site for d in dicts], widths=[d.width for d in dicts], atp=atp.float(),
        node_names=names, node_sites=nsites, node_pos=torch.tensor(npos, dtype=torch.long),
        node_feature=torch.tensor(nfeat, dtype=torch.long), node_atp=node_atp, node_exact=eff.double(),
        metric_clean=float(m_clean), metric_corrupted=float(m_corr), agreement=agreement(node_atp, eff), n=n)


@torch.no_grad()
def _metrics(lm, ps, metric) -> tuple[float, float]:
    """The mean clean and corrupted metric (where no latent was patched)."""
    mc = mx = 0.0
    for g, last_only, at, (lg_x, _) in corrupted_runs(lm, by_length(ps)):
        mc += float(metric_of(run(lm, g.clean, last_only=last_only).logits, metric, g.target, g.foil, at=at).sum())
        mx += float(metric_of(lg_x, metric, g.target, g.foil, at=at).sum())
    return mc / len(ps), mx / len(ps)


__all__ = ["FeatureAtP", "FeatureAttribution", "agreement", "check_compatible", "feature_atp", "feature_dla"]
