"""Attribution patching (AtP) for nodes (Nanda 2023; Syed, Rager & Conmy 2023): the first-order estimate of what
patching each component's corrupted activation into the clean run does to the metric.

For a node with activation ``a`` (the embedding, a head's output ``z`` over all positions, an MLP's output over all
positions): ``score = sum (a_corrupted - a_clean) * d metric / d a`` at the clean run. One clean forward and
backward pass (through the engine's sites with ``grad=True``) and one corrupted forward pass give every node's
score. The exact counterpart is noising activation patching of the same node (``activation_patching(...,
noising=True)``'s raw metric minus the clean metric); AtP is its linearisation, which errs where attention
saturates (AtP* and the checks against exact patching come next, issue 19).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..errors import InputError
from ..interventions.patching import METRICS, _tokens, contrast, metric_of
from ..models.engine import Edit, batches, run
from ..models.load import LoadedModel, require_decoder, token_str
from ..results import Result


@dataclass(repr=False)
class NodeAttribution(Result):
    """AtP scores of every node.

    - ``heads (layer, head)``: each head's output over all positions
    - ``mlps (layer,)``: each MLP's output over all positions
    - ``embed``: the residual stream entering block 0 (token and position embeddings)
    - ``metric_clean``, ``metric_corrupted``: the metric of the two runs (at ``position``)
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
    info: dict = field(default_factory=dict)

    def nodes(self) -> list[dict]:
        """``[{name, score}]`` with the names ``embed``, ``L{layer}H{head}``, ``L{layer}.mlp``."""
        out = [{"name": "embed", "score": self.embed}]
        L, H = self.heads.shape
        for layer in range(L):
            out += [{"name": f"L{layer}H{h}", "score": float(self.heads[layer, h])} for h in range(H)]
            out.append({"name": f"L{layer}.mlp", "score": float(self.mlps[layer])})
        return out

    def to_dict(self) -> dict:
        return {"method": self.method, "level": "nodes", "model": self.model, "metric": self.metric,
                "metric_clean": self.metric_clean, "metric_corrupted": self.metric_corrupted,
                "target": self.target, "foil": self.foil, "position": self.position, "tokens": self.tokens,
                "corrupted_tokens": self.corrupted_tokens, "nodes": self.nodes()}

    def to_frame(self):
        import pandas as pd

        return pd.DataFrame(self.nodes())

    def __repr__(self) -> str:
        return (f"NodeAttribution(method={self.method!r}, layers={self.heads.shape[0]}, heads={self.heads.shape[1]}, "
                f"metric_clean={self.metric_clean:.4g}, metric_corrupted={self.metric_corrupted:.4g})")


def _request(lm: LoadedModel, clean, corrupted, target, foil, metric: str, position: int):
    """Validated ids, target/foil ids and the metric's position."""
    if metric not in METRICS:
        raise InputError(f"unknown metric={metric!r}; choose one of {', '.join(METRICS)}")
    require_decoder(lm, "attribution patching", instead="use a causal decoder (GPT-2, Llama, ...)", causal=True)
    return contrast(lm, clean, corrupted, target, foil, metric, position)


def _result(lm, method, heads, mlps, embed, m_clean, m_corr, c_ids, x_ids, tid, fid, metric, pos, info=None):
    return NodeAttribution(
        heads=heads, mlps=mlps, embed=float(embed), metric_clean=float(m_clean), metric_corrupted=float(m_corr),
        tokens=_tokens(lm, c_ids), corrupted_tokens=_tokens(lm, x_ids), target=token_str(lm, tid),
        foil=None if fid is None else token_str(lm, fid), metric=metric, position=pos, model=lm.name, method=method,
        info=info or {})


def attribution_patching(lm: LoadedModel, clean, corrupted, target, foil=None, *, metric: str = "logit_diff",
                         position: int = -1) -> NodeAttribution:
    """AtP scores of every node for patching ``corrupted``'s activations into the run of ``clean`` (equal token
    lengths); ``metric`` (``logit_diff`` needs a ``foil``, or ``prob``) read at ``position``."""
    c_ids, x_ids, tid, fid, pos = _request(lm, clean, corrupted, target, foil, metric, position)
    L = lm.anatomy.n_layers
    sites = [("resid_pre", 0)] + [(s, layer) for layer in range(L) for s in ("head", "mlp_out")]
    with torch.no_grad():
        lg_x, corr = run(lm, x_ids[None], capture=sites)
    lg_c, clean_cap = run(lm, c_ids[None], capture=sites, grad=True)
    m_clean = metric_of(lg_c[:, pos], metric, tid, fid)[0]
    acts = [clean_cap[s] for s in sites]
    grads = torch.autograd.grad(m_clean, acts)

    def score(k: int) -> Tensor:  # summed over positions and the site's last axis (heads stay apart)
        d = (corr[sites[k]].float() - acts[k].detach().float()) * grads[k].float()
        return d.sum(dim=(0, 1, -1)) if sites[k][0] == "head" else d.sum()

    heads = torch.stack([score(1 + 2 * layer) for layer in range(L)]).cpu()
    mlps = torch.stack([score(2 + 2 * layer) for layer in range(L)]).cpu()
    m_corr = float(metric_of(lg_x[:, pos], metric, tid, fid)[0])
    return _result(lm, "atp", heads, mlps, score(0), m_clean.detach(), m_corr, c_ids, x_ids, tid, fid, metric, pos)


@torch.no_grad()
def exact_node_patching(lm: LoadedModel, clean, corrupted, target, foil=None, *, metric: str = "logit_diff",
                        position: int = -1, batch_size: int = 32) -> NodeAttribution:
    """What AtP estimates, computed exactly: for every node, the metric of the clean run with that node's
    activation (all positions) set to the corrupted run's, minus the clean metric. One batch row per node, in
    batches of ``batch_size`` rows."""
    c_ids, x_ids, tid, fid, pos = _request(lm, clean, corrupted, target, foil, metric, position)
    L, H, P = lm.anatomy.n_layers, lm.anatomy.layers[0].attn.n_heads, c_ids.numel()
    sites = [("resid_pre", 0)] + [(s, layer) for layer in range(L) for s in ("head", "mlp_out")]
    lg, both = run(lm, torch.stack([c_ids, x_ids]), capture=sites)
    m = metric_of(lg[:, pos], metric, tid, fid)
    nodes = [(("resid_pre", 0), None)] + [((s, layer), h) for layer in range(L)
                                          for s, h in [("head", h) for h in range(H)] + [("mlp_out", None)]]
    out = torch.empty(len(nodes))
    positions = torch.arange(P)
    for s, e in batches(len(nodes), batch_size):
        edits = []
        for row, (site, h) in enumerate(nodes[s:e]):
            value = both[site][1] if h is None else both[site][1, :, h]  # the corrupted run's, (pos, ...)
            edits.append(Edit(site[0], site[1], torch.full((P,), row), positions, value,
                              head=None if h is None else torch.full((P,), h)))
        lg_p, _ = run(lm, c_ids[None].expand(e - s, P), edits)
        out[s:e] = metric_of(lg_p[:, pos], metric, tid, fid).float().cpu() - float(m[0])
    rest = out[1:].reshape(L, H + 1)
    return _result(lm, "exact", rest[:, :H].clone(), rest[:, H].clone(), out[0], m[0], m[1], c_ids, x_ids, tid, fid,
                   metric, pos)


def _ranks(x: Tensor) -> Tensor:
    r = torch.empty_like(x, dtype=torch.float64)
    r[x.argsort()] = torch.arange(x.numel(), dtype=torch.float64)
    return r


def check_against_exact(approx: NodeAttribution, exact: NodeAttribution, top: int = 10) -> dict:
    """How far an approximation can be trusted on these prompts: Spearman correlation of the node scores, the
    recall of exact patching's ``top`` nodes (by absolute effect) among the approximation's ``top``, and the
    nodes exact patching ranks in its ``top`` that the approximation misses (false negatives)."""
    a = {n["name"]: n["score"] for n in approx.nodes()}
    x = {n["name"]: n["score"] for n in exact.nodes()}
    if a.keys() != x.keys():
        raise InputError("the two results score different nodes (another model or prompt?)")
    names = list(x)
    av = torch.tensor([a[n] for n in names], dtype=torch.float64)
    xv = torch.tensor([x[n] for n in names], dtype=torch.float64)
    ra, rx = _ranks(av), _ranks(xv)
    spearman = float(torch.corrcoef(torch.stack([ra, rx]))[0, 1])
    k = min(top, len(names))
    top_a = {names[i] for i in av.abs().argsort(descending=True)[:k].tolist()}
    top_x = [names[i] for i in xv.abs().argsort(descending=True)[:k].tolist()]
    missed = [n for n in top_x if n not in top_a]
    return {"spearman": spearman, f"top{top}_recall": (k - len(missed)) / k, "false_negatives": missed}
