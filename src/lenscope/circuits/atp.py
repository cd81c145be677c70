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
from ..interventions.patching import METRICS, _position, _tokens, metric_of
from ..models.engine import run
from ..models.load import LoadedModel, require_decoder, resolve_token, token_ids, token_str
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


def attribution_patching(lm: LoadedModel, clean, corrupted, target, foil=None, *, metric: str = "logit_diff",
                         position: int = -1) -> NodeAttribution:
    """AtP scores of every node for patching ``corrupted``'s activations into the run of ``clean`` (equal token
    lengths); ``metric`` (``logit_diff`` needs a ``foil``, or ``prob``) read at ``position``."""
    if metric not in METRICS:
        raise InputError(f"unknown metric={metric!r}; choose one of {', '.join(METRICS)}")
    require_decoder(lm, "attribution patching", instead="use a causal decoder (GPT-2, Llama, ...)", causal=True)
    c_ids, x_ids = token_ids(lm, clean), token_ids(lm, corrupted)
    if c_ids.numel() != x_ids.numel():
        raise InputError(f"the clean and corrupted prompts must have the same number of tokens; they have "
                         f"{c_ids.numel()} and {x_ids.numel()}")
    tid = resolve_token(lm, target)
    if metric == "logit_diff" and foil is None:
        raise InputError("metric='logit_diff' needs a foil token; or use metric='prob'")
    fid = resolve_token(lm, foil) if foil is not None else None
    P = c_ids.numel()
    pos = _position(position, P)
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
    return NodeAttribution(
        heads=heads, mlps=mlps, embed=float(score(0)), metric_clean=float(m_clean.detach()), metric_corrupted=m_corr,
        tokens=_tokens(lm, c_ids), corrupted_tokens=_tokens(lm, x_ids), target=token_str(lm, tid),
        foil=None if fid is None else token_str(lm, fid), metric=metric, position=pos, model=lm.name,
    )
