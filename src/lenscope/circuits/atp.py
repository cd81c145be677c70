"""Attribution patching (AtP) for nodes (Nanda 2023; Syed, Rager & Conmy 2023): the first-order estimate of what
patching each component's corrupted activation into the clean run does to the metric.

For a node with activation ``a`` (the embedding, a head's output ``z`` over all positions or at one position, an
MLP's output, the residual stream entering a block at one position): ``score = sum (a_corrupted - a_clean) *
d metric / d a`` at the clean run. One clean forward and backward pass (through the engine's sites with
``grad=True``) and one corrupted forward pass give every node's score; over many prompts, the mean of the
per-prompt scores (prompts of one token length form one batch, no padding). The exact counterpart
(:func:`exact_node_patching`) is noising activation patching of the same node; AtP is its linearisation, which
errs where attention saturates (:mod:`.atp_star` for AtP*).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..errors import InputError, NotApplicableError
from ..interventions.patching import patch_nodes
from ..models.loading.load import LoadedModel, token_str
from ..models.runtime.engine import run
from ..models.runtime.request import Contrast, by_length, contrasts, metric_of, token_texts
from ..models.runtime.sites import display_name
from ..models.weights.moe import is_moe
from ..results import Result
from .gradients import atp_delta, atp_product, corrupted_runs, metric_grads

FINE = ("heads_pos", "mlps_pos", "resid")
QKV = ("queries", "keys", "values")


@dataclass(repr=False)
class NodeAttribution(Result):
    """Scores of every node (the mean over ``n`` prompts of the per-prompt effect on the metric).

    - ``heads (layer, head)``: each head's output over all positions
    - ``mlps (layer,)``: each MLP's output over all positions
    - ``experts (layer, expert)``: a mixture of experts' per-expert weighted outputs over all positions (nodes
      ``L{l}.E{e}.mlp``; they add up to ``mlps``); None for dense MLPs
    - ``embed``: the residual stream entering block 0 (token and position embeddings)
    - optional, per position (prompts of one length): ``heads_pos (layer, pos, head)``, ``mlps_pos (layer, pos)``,
      ``resid (layer, pos)`` (the residual stream entering each block); AtP*'s ``queries (layer, pos, head)``,
      ``keys (layer, pos, kv_head)``, ``values (layer, pos, kv_head)``
    - ``metric_clean``, ``metric_corrupted``: the mean metric of the two runs (at ``position``)
    - ``tokens``, ``corrupted_tokens``, ``target``, ``foil``: the first prompt's (``info["prompts"]`` lists all
      when ``n > 1``)
    """

    heads: Tensor
    mlps: Tensor
    embed: float
    metric_clean: float
    metric_corrupted: float
    tokens: list[str]
    corrupted_tokens: list[str]
    target: str
    foil: str | None
    metric: str
    position: int
    model: str
    method: str = "atp"
    n: int = 1
    heads_pos: Tensor | None = None
    mlps_pos: Tensor | None = None
    resid: Tensor | None = None
    queries: Tensor | None = None
    keys: Tensor | None = None
    values: Tensor | None = None
    info: dict = field(default_factory=dict)
    experts: Tensor | None = None

    def nodes(self, fine: bool = False) -> list[dict]:
        """``[{name, score}]`` with the names ``embed``, ``L{layer}H{head}``, ``L{layer}.mlp`` (a mixture of
        experts: then its experts ``L{layer}.E{e}.mlp``); with ``fine`` also
        the per-position nodes present: ``L{l}H{h}@{pos}``, ``L{l}.mlp@{pos}``, ``L{l}.resid@{pos}``,
        ``L{l}H{h}.q@{pos}``, ``L{l}KV{g}.k@{pos}``, ``L{l}KV{g}.v@{pos}``."""
        out = [{"name": "embed", "score": self.embed}]
        L, H = self.heads.shape
        for layer in range(L):
            out += [{"name": display_name("head", layer, h), "score": float(self.heads[layer, h])} for h in range(H)]
            out.append({"name": display_name("mlp", layer), "score": float(self.mlps[layer])})
            if self.experts is not None:
                out += [{"name": display_name("mlp", layer, expert=e), "score": float(v)}
                        for e, v in enumerate(self.experts[layer])]
        if not fine:
            return out
        for key, kind in (("heads_pos", "head"), ("mlps_pos", "mlp"), ("resid", "resid"), ("queries", "q"),
                          ("keys", "kv.k"), ("values", "kv.v")):
            t = getattr(self, key)
            if t is None:
                continue
            t3 = t if t.dim() == 3 else t[..., None]
            for (l_, p, h), v in zip(torch.cartesian_prod(*(torch.arange(s) for s in t3.shape)).tolist(),
                                     t3.flatten().tolist()):
                out.append({"name": display_name(kind, l_, h, pos=p), "score": v})
        return out

    def to_dict(self) -> dict:
        return {"method": self.method, "level": "nodes", "model": self.model, "metric": self.metric, "n": self.n,
                "metric_clean": self.metric_clean, "metric_corrupted": self.metric_corrupted,
                "target": self.target, "foil": self.foil, "position": self.position, "tokens": self.tokens,
                "corrupted_tokens": self.corrupted_tokens, "nodes": self.nodes(fine=True)}

    def to_frame(self):
        import pandas as pd

        return pd.DataFrame(self.nodes(fine=True))

    def __repr__(self) -> str:
        return (f"NodeAttribution(method={self.method!r}, n={self.n}, layers={self.heads.shape[0]}, "
                f"heads={self.heads.shape[1]}, metric_clean={self.metric_clean:.4g}, "
                f"metric_corrupted={self.metric_corrupted:.4g})")


def prompts(lm: LoadedModel, clean, corrupted, target, foil, metric: str, position: int, pairs=None,
            what: str = "attribution patching") -> list[Contrast]:
    """The checked prompts of a node method (:func:`lenscope.models.runtime.request.contrasts`)."""
    return contrasts(lm, clean, corrupted, target, foil, metric, position, pairs, what)


def contrast_texts(lm: LoadedModel, p: Contrast) -> dict:
    """The texts of contrast ``p`` that a result keeps: ``tokens``, ``corrupted_tokens``, ``target`` and ``foil``
    (None without one)."""
    return {"tokens": token_texts(lm, p.clean), "corrupted_tokens": token_texts(lm, p.corrupted),
            "target": token_str(lm, p.target), "foil": None if p.foil is None else token_str(lm, p.foil)}


def one_length(ps: list[Contrast], what: str) -> int:
    lengths = sorted({p.length for p in ps})
    if len(lengths) > 1:
        raise NotApplicableError(f"{what} are per position, so every prompt needs the same token length; these "
                                 f"have {lengths}: pass prompts of one length (or leave the per-position nodes off)")
    return lengths[0]


def result(lm, method, ps: list[Contrast], scores: dict, m_clean: float, m_corr: float, metric: str,
           info=None) -> NodeAttribution:
    """A :class:`NodeAttribution` from the mean scores (``heads``, ``mlps``, ``embed`` and the optional fields)."""
    info = dict(info or {})
    if len(ps) > 1:
        info["prompts"] = [contrast_texts(lm, p) for p in ps]
    extra = {k: v.float().cpu() for k, v in scores.items() if k in FINE + QKV + ("experts",) and v is not None}
    return NodeAttribution(
        heads=scores["heads"].float().cpu(), mlps=scores["mlps"].float().cpu(), embed=float(scores["embed"]),
        metric_clean=float(m_clean), metric_corrupted=float(m_corr), **contrast_texts(lm, ps[0]), metric=metric,
        position=ps[0].position, model=lm.name, method=method, n=len(ps), info=info, **extra)


def atp_sites(L: int, fine: bool, moe: bool = False) -> list[tuple[str, int]]:
    """The engine sites AtP reads (``moe``: a mixture of experts' per-expert outputs too)."""
    sites = [("resid_pre", 0)] + [(s, layer) for layer in range(L) for s in ("head", "mlp_out")]
    sites += [("expert_out", layer) for layer in range(L)] if moe else []
    return sites + ([("resid_pre", layer) for layer in range(1, L)] if fine else [])


def atp_terms(L: int, corr: dict, clean: dict, grads: dict, fine: bool) -> dict[str, Tensor]:
    """Per row and position AtP terms from the corrupted and clean activations and the gradients (dicts by site):
    ``embed (rows,)``, ``heads_pos (rows, layer, pos, head)``, ``mlps_pos (rows, layer, pos)``, with ``fine``
    ``resid (rows, layer, pos)``; where ``expert_out`` was captured, ``experts_pos (rows, layer, pos, expert)``
    (each expert's output change times the gradient at the block's output, which every expert's output reaches
    unchanged)."""

    def dot(site):
        return atp_product(corr[site], clean[site], grads[site]).sum(-1)

    out = {"embed": dot(("resid_pre", 0)).sum(-1),
           "heads_pos": torch.stack([dot(("head", layer)) for layer in range(L)], 1),
           "mlps_pos": torch.stack([dot(("mlp_out", layer)) for layer in range(L)], 1)}
    if ("expert_out", 0) in corr:
        out["experts_pos"] = torch.stack([torch.einsum(
            "bped,bpd->bpe", atp_delta(corr["expert_out", layer], clean["expert_out", layer]),
            grads["mlp_out", layer].float()) for layer in range(L)], 1)
    if fine:
        out["resid"] = torch.stack([dot(("resid_pre", layer)) for layer in range(L)], 1)
    return out


def coarse(s: dict[str, Tensor]) -> dict[str, Tensor]:
    """``heads``/``mlps`` (and ``experts``) summed over positions, next to the per-position terms."""
    out = {**s, "heads": s["heads_pos"].sum(-2), "mlps": s["mlps_pos"].sum(-1)}
    if "experts_pos" in s:
        out["experts"] = out.pop("experts_pos").sum(-2)
    return out


def attribution_patching(lm: LoadedModel, clean=None, corrupted=None, target=None, foil=None, *, pairs=None,
                         metric: str = "logit_diff", position: int = -1, fine: bool = False) -> NodeAttribution:
    """AtP scores of every node for patching ``corrupted``'s activations into the run of ``clean`` (equal token
    lengths per pair); ``metric`` (``logit_diff`` needs a ``foil``, or ``prob``) read at ``position``.

    Many prompts: lists for ``clean``/``corrupted`` (``target``/``foil`` a list of the same length or one for
    all), or ``pairs`` (``ContrastPair``s); the scores are the mean over prompts, each prompt's metric read at its
    own ``position``. ``fine``: also ``heads_pos``, ``mlps_pos`` and ``resid`` (every prompt of one length)."""
    ps = prompts(lm, clean, corrupted, target, foil, metric, position, pairs)
    if fine:
        one_length(ps, "heads_pos, mlps_pos and resid")
    L = lm.anatomy.n_layers
    sites = atp_sites(L, fine, is_moe(lm.anatomy))
    total: dict[str, Tensor] = {}
    m_clean = m_corr = 0.0
    wrt = [s for s in sites if s[0] != "expert_out"]  # an expert's gradient is the block output's
    for g, last_only, at, (lg_x, corr) in corrupted_runs(lm, by_length(ps), sites):
        t, f = g.target, g.foil
        m, cap, grads = metric_grads(lm, g.clean, wrt, metric, t, f, at=at, capture=sites, last_only=last_only)
        terms = coarse(atp_terms(L, corr, cap, grads, fine))
        if not fine:  # per position: prompts of one length only
            del terms["heads_pos"], terms["mlps_pos"]
        for k, v in terms.items():
            total[k] = total.get(k, 0) + v.sum(0).detach()
        m_clean += float(m.detach().sum())
        m_corr += float(metric_of(lg_x, metric, t, f, at=at).sum())
    n = len(ps)
    scores = {k: v / n for k, v in total.items()}
    return result(lm, "atp", ps, scores, m_clean / n, m_corr / n, metric)


def node_list(lm: LoadedModel, kinds, P: int) -> dict[str, tuple[list[tuple], tuple]]:
    """The exact patches of each kind of node: ``{kind: ([(site, layer, pos or None, head or None)], shape)}``;
    ``pos`` None patches every position."""
    A = lm.anatomy
    L, H, G = A.n_layers, A.layers[0].attn.n_heads, A.layers[0].attn.n_kv_heads
    E = getattr(A.layers[0].mlp, "n_experts", 0)
    grid = {
        "embed": ([("resid_pre", 0, None, None)], ()),
        "experts": ([("expert_out", layer, None, e) for layer in range(L) for e in range(E)], (L, E)),
        "heads": ([("head", layer, None, h) for layer in range(L) for h in range(H)], (L, H)),
        "mlps": ([("mlp_out", layer, None, None) for layer in range(L)], (L,)),
        "heads_pos": ([("head", layer, p, h) for layer in range(L) for p in range(P) for h in range(H)], (L, P, H)),
        "mlps_pos": ([("mlp_out", layer, p, None) for layer in range(L) for p in range(P)], (L, P)),
        "resid": ([("resid_pre", layer, p, None) for layer in range(L) for p in range(P)], (L, P)),
        "queries": ([("q", layer, p, h) for layer in range(L) for p in range(P) for h in range(H)], (L, P, H)),
        "keys": ([("k", layer, p, g) for layer in range(L) for p in range(P) for g in range(G)], (L, P, G)),
        "values": ([("v", layer, p, g) for layer in range(L) for p in range(P) for g in range(G)], (L, P, G)),
    }
    return {k: grid[k] for k in kinds}


@torch.no_grad()
def exact_effects(lm: LoadedModel, ps: list[tuple], nodes: list[tuple], metric: str, batch_size: int = 32,
                  dictionaries=()):
    """The mean over prompts of (metric with the node patched from the corrupted run) - (clean metric), for each
    node ``(site, layer, pos or None, head or None)``: ``(effects (node,), mean clean metric, mean corrupted
    metric)``. Rows are (node, prompt) pairs, ``batch_size`` rows per forward pass. ``dictionaries``: those whose
    latents are nodes (``("resid_post.latents", 5, pos, latent)``: the features' attribution patching)."""
    if batch_size < 1:
        raise InputError("batch_size must be at least 1")
    sites = sorted({(s, layer) for s, layer, _, _ in nodes})
    out = torch.zeros(len(nodes), dtype=torch.float64)
    m_clean = m_corr = 0.0
    for g, last_only, at, (lg_x, corr) in corrupted_runs(lm, by_length(ps), sites, dictionaries=dictionaries):
        c, t, f = g.clean, g.target, g.foil
        lg_c, _ = run(lm, c, last_only=last_only)
        m0 = metric_of(lg_c, metric, t, f, at=at).double().cpu()
        m_clean += float(m0.sum())
        m_corr += float(metric_of(lg_x, metric, t, f, at=at).sum())
        patched = patch_nodes(lm, c, corr, nodes, metric, t, f, position=at, batch_size=batch_size,
                              last_only=last_only, dictionaries=dictionaries).double()  # (node, b)
        out += (patched - m0[None]).sum(1)
    n = len(ps)
    return out / n, m_clean / n, m_corr / n


def exact_node_patching(lm: LoadedModel, clean=None, corrupted=None, target=None, foil=None, *, pairs=None,
                        metric: str = "logit_diff", position: int = -1, batch_size: int = 32, fine: bool = False,
                        qkv: bool = False) -> NodeAttribution:
    """What AtP estimates, computed exactly: for every node, the metric of the clean run with that node's
    activation set to the corrupted run's, minus the clean metric (the mean over prompts; prompts as in
    :func:`attribution_patching`). One batch row per (node, prompt), ``batch_size`` rows per forward pass.

    ``fine``: also ``heads_pos``, ``mlps_pos``, ``resid`` (each block's ``resid_pre`` at one position). ``qkv``:
    AtP*'s ``queries``/``keys``/``values``: the engine's ``q`` (per head), ``k``/``v`` (per kv head) at one
    position (before rotary; the corrupted run's value). Per-position nodes need prompts of one length."""
    ps = prompts(lm, clean, corrupted, target, foil, metric, position, pairs, what="exact node patching")
    kinds = ["embed", "heads", "mlps"] + (["experts"] if is_moe(lm.anatomy) else []) + (list(FINE) if fine else []) + (
        list(QKV) if qkv else [])
    P = one_length(ps, "per-position nodes") if fine or qkv else ps[0].length
    spec = node_list(lm, kinds, P)
    flat = [n for k in kinds for n in spec[k][0]]
    eff, m_clean, m_corr = exact_effects(lm, ps, flat, metric, batch_size)
    scores, i = {}, 0
    for k in kinds:
        nodes, shape = spec[k]
        scores[k] = eff[i:i + len(nodes)].reshape(shape)
        i += len(nodes)
    return result(lm, "exact", ps, scores, m_clean, m_corr, metric)


def _ranks(x: Tensor) -> Tensor:
    r = torch.empty_like(x, dtype=torch.float64)
    r[x.argsort()] = torch.arange(x.numel(), dtype=torch.float64)
    return r


def check_against_exact(approx: NodeAttribution, exact: NodeAttribution, top: int = 10, *,
                        fine: bool = False, only: str | None = None) -> dict:
    """How far an approximation can be trusted on these prompts: Spearman correlation of the node scores, the
    recall of exact patching's ``top`` nodes (by absolute effect) among the approximation's ``top``, and the
    nodes exact patching ranks in its ``top`` that the approximation misses (false negatives); the mean absolute
    error too. Over the nodes ``exact`` scores (``fine``: with the per-position ones; ``only``: the names that
    contain that string, e.g. ``".q@"``), all of which ``approx`` must score."""
    a = {n["name"]: n["score"] for n in approx.nodes(fine)}
    x = {n["name"]: n["score"] for n in exact.nodes(fine) if only is None or only in n["name"]}
    if not x or not x.keys() <= a.keys():
        raise InputError("the two results score different nodes (another model or prompt, or per-position nodes "
                         "missing from the approximation?)")
    names = list(x)
    av = torch.tensor([a[n] for n in names], dtype=torch.float64)
    xv = torch.tensor([x[n] for n in names], dtype=torch.float64)
    ra, rx = _ranks(av), _ranks(xv)
    spearman = float(torch.corrcoef(torch.stack([ra, rx]))[0, 1])
    k = min(top, len(names))
    top_a = {names[i] for i in av.abs().argsort(descending=True)[:k].tolist()}
    top_x = [names[i] for i in xv.abs().argsort(descending=True)[:k].tolist()]
    missed = [n for n in top_x if n not in top_a]
    return {"spearman": spearman, f"top{top}_recall": (k - len(missed)) / k, "false_negatives": missed,
            "mae": float((av - xv).abs().mean()), "nodes": len(names)}
