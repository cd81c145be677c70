"""``verify``: recompute every sub-layer from Anatomy + Trace with lenscope's own math and compare
with what the real model computed.

Each check starts from the real model's captured input of the part being checked, so errors do not
accumulate across layers: a norm from its captured input, attention (probabilities and output) and the
MLP from what they read, each whole block from the residual entering it, the embedding from the token
ids, and the logits from the last residual state. Errors are ``max |ours - real|`` divided by the RMS
of the real tensor (attention probabilities: absolute), except the logits (absolute).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

import torch
from torch import Tensor

from .load import LoadedModel
from .trace import Trace, trace

DEFAULT_TEXT = "The capital of France is Paris, and the capital of Germany is Berlin. When Mary and John went out"
LOGIT_TOL = 1e-3
RESID_TOL = 1e-4


def rel_err(ours: Tensor, real: Tensor) -> float:
    real = real.float()
    rms = real.pow(2).mean().sqrt().clamp_min(1e-12)
    return float((ours.float() - real).abs().max() / rms)


@dataclass
class VerifyReport:
    """Result of :func:`verify`. ``layers`` holds one dict of relative errors per block."""

    model: str
    family: str
    n_layers: int
    n_tokens: int
    max_abs_logit_error: float | None
    max_rel_resid_error: float
    max_rel_sublayer_error: float
    embed_rel_error: float
    layers: list[dict] = field(default_factory=list)
    logit_tol: float = LOGIT_TOL
    resid_tol: float = RESID_TOL

    @property
    def ok(self) -> bool:
        logit_ok = self.max_abs_logit_error is None or self.max_abs_logit_error <= self.logit_tol
        return logit_ok and self.max_rel_resid_error <= self.resid_tol and self.max_rel_sublayer_error <= self.resid_tol

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ok"] = self.ok
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def to_frame(self):
        import pandas as pd

        return pd.DataFrame(self.layers).set_index("layer")

    def __repr__(self) -> str:
        logit = "n/a (no LM head)" if self.max_abs_logit_error is None else f"{self.max_abs_logit_error:.2e}"
        return (f"VerifyReport(model={self.model!r}, ok={self.ok}, max_abs_logit_error={logit}, "
                f"max_rel_resid_error={self.max_rel_resid_error:.2e}, "
                f"max_rel_sublayer_error={self.max_rel_sublayer_error:.2e})")


@torch.no_grad()
def verify(lm: LoadedModel, text: str = DEFAULT_TEXT, tr: Trace | None = None) -> VerifyReport:
    """Check lenscope's reading of ``lm`` against the real model on ``text``."""
    A = lm.anatomy
    tr = tr if tr is not None else trace(lm, text)
    pos = tr.positions
    embed_err = rel_err(A.embed(tr.input_ids.to(pos.device), pos), tr.embed)
    rows = []
    for i, layer in enumerate(A.layers):
        row: dict = {"layer": i}
        for slot, norm in layer.norms().items():
            row[slot] = rel_err(norm(tr.norm_in[slot][i]), tr.norm_out[slot][i])
        out, probs = layer.attn(tr.attn_in[i], pos)
        row["attn_probs"] = float((probs - tr.attn_probs[i]).abs().max())
        row["attn_out"] = rel_err(out, tr.attn_out[i])
        pre, up = layer.mlp.pre(tr.mlp_in[i])
        row["mlp_pre"] = rel_err(pre, tr.mlp_pre[i])
        if up is not None:
            row["mlp_up"] = rel_err(up, tr.mlp_up[i])
        row["mlp_out"] = rel_err(layer.mlp(tr.mlp_in[i]), tr.mlp_out[i])
        block = layer.forward(tr.resid_pre[i], pos)
        row["resid_mid"] = rel_err(block["resid_mid"], tr.resid_mid[i])
        row["resid_post"] = rel_err(block["resid_post"], tr.resid_post[i])
        if i + 1 < A.n_layers:  # the block's output is the next block's input
            row["resid_chain"] = rel_err(tr.resid_post[i], tr.resid_pre[i + 1])
        rows.append(row)
    resid_keys = ("resid_mid", "resid_post", "resid_chain")
    max_resid = max([embed_err] + [r[k] for r in rows for k in resid_keys if k in r])
    max_sub = max(v for r in rows for k, v in r.items() if k not in resid_keys and k != "layer")
    logit_err = None
    if A.unembed is not None and tr.logits is not None:
        ours = A.logits(tr.final_resid)
        logit_err = float((ours - tr.logits).abs().max())
        if tr.final_out is not None:
            max_sub = max(max_sub, rel_err(A.final_norm(tr.final_in), tr.final_out))
    return VerifyReport(
        model=lm.name, family=A.family, n_layers=A.n_layers, n_tokens=len(tr.tokens),
        max_abs_logit_error=logit_err, max_rel_resid_error=max_resid, max_rel_sublayer_error=max_sub,
        embed_rel_error=embed_err, layers=rows,
    )
