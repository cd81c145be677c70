"""``verify``: recompute every sub-layer from Anatomy + Trace with lenscope's own math and compare
with what the real model computed.

Each check starts from the real model's captured input of the part being checked, so errors do not
accumulate across layers: a norm from its captured input, attention (probabilities and output) and the
MLP from what they read, each whole block from the residual entering it, the embedding from the token
ids, and the logits from the last residual state. A mixture of experts' router is checked from what it read
(its logits, and its routing function from the model's logits); its experts and the whole block with the traced
routing. Errors are ``max |ours - real|`` divided by the RMS of the real tensor (attention probabilities and routing
weights: absolute), except the logits (absolute).

Tolerances depend on the dtype the model runs in (:func:`tolerances`): float32 (and float64) keep the fixed
``LOGIT_TOL`` / ``RESID_TOL``; a bfloat16 / float16 model computes every sub-layer with its own rounding while
lenscope recomputes it in float32 from the same weights, so the two differ by a few units of the dtype's
precision ``eps = torch.finfo(dtype).eps``. Their errors are then relative to the real tensor's largest
``|element|`` (the scale at which the dtype rounds; relative to the RMS, outlier dimensions would turn plain
rounding into hundreds of eps), the tolerance is ``RELATIVE_FACTOR * eps``, and the logits' is
``LOGIT_FACTOR * eps * max(1, max |logit|)`` (see ``docs/devices.md`` for the measurements behind the factors).
Captures where the model itself overflowed (inf / NaN, e.g. Gemma in float16) are listed and fail the check.
Models split across devices are checked layer by layer on each layer's device.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

import torch
from torch import Tensor

from ..loading.load import LoadedModel
from .trace import Trace, trace

# the report's (JSON) names of the pattern's and the routing weights' errors: older than the sites' names, kept
PATTERN_KEY, ROUTING_KEY = "attn_probs", "routing"
DEFAULT_TEXT = "The capital of France is Paris, and the capital of Germany is Berlin. When Mary and John went out"
TOLERANCE = 1e-3  # the one float32 tolerance: verify's logit error, and the invariant / completeness error
# beyond which every decomposition (attribution, mixing maps, the report) refuses (see completeness_tolerance)
LOGIT_TOL = TOLERANCE  # verify's name for it (tests and docs/devices.md use it)
RESID_TOL = 1e-4
# reduced precision (bfloat16, float16): tolerances in units of the dtype's eps (torch.finfo(dtype).eps)
# measured worst cases (docs/devices.md): smollm2 5.2 eps (bf16) / 3.9 eps (fp16) relative, 0.84 eps * max |logit|;
# gemma3-270m 2.7 eps (bf16); decompositions' completeness <= 3 eps; every tiny family <= 1.6 eps
RELATIVE_FACTOR = 16.0  # relative errors (sub-layers, residual stream; attention probabilities absolute)
LOGIT_FACTOR = 4.0  # the logits: LOGIT_FACTOR * eps * max(1, max |logit|)
COMPLETENESS_FACTOR = 16.0  # decompositions: parts + remainder vs the activation, relative to its RMS norm


@dataclass(frozen=True)
class Tolerances:
    """What :func:`verify` (and a decomposition's completeness check) accepts for a model in ``dtype``.

    ``logit`` is absolute (for reduced precision: scaled by the logits' size, ``logit_rel`` times
    ``max(1, max |logit|)``), ``resid`` relative to the RMS of the real tensor, ``completeness`` relative to the RMS
    vector norm of the decomposed activation."""

    dtype: str
    eps: float
    logit: float
    resid: float
    completeness: float
    logit_rel: float | None = None  # reduced precision: the logit tolerance per unit of max |logit|
    error_scale: str = "rms"  # relative errors are to the real tensor's RMS ("rms") or its largest |element| ("max")

    def logit_tol(self, logits: Tensor | None) -> float:
        if self.logit_rel is None or logits is None:
            return self.logit
        return self.logit_rel * max(1.0, float(logits.abs().max()))


def tolerances(dtype: torch.dtype | str = torch.float32) -> Tolerances:
    """The tolerances for a model running in ``dtype``: fixed for float32 / float64 (``LOGIT_TOL``, ``RESID_TOL``,
    completeness ``TOLERANCE`` = 1e-3), ``FACTOR * torch.finfo(dtype).eps`` for bfloat16 / float16."""
    from ..loading.devices import is_reduced, parse_dtype

    dtype = parse_dtype(dtype)
    eps = float(torch.finfo(dtype).eps)
    name = str(dtype).removeprefix("torch.")
    if not is_reduced(dtype):
        return Tolerances(name, eps, LOGIT_TOL, RESID_TOL, TOLERANCE)
    return Tolerances(name, eps, logit=LOGIT_FACTOR * eps, resid=RELATIVE_FACTOR * eps,
                      completeness=COMPLETENESS_FACTOR * eps, logit_rel=LOGIT_FACTOR * eps, error_scale="max")


def completeness_tolerance(lm_or_dtype, floor: float = TOLERANCE) -> float:
    """The completeness error a decomposition may show for a model (a LoadedModel) or dtype: ``floor`` (the float32
    limit the methods use) or, for bfloat16 / float16, ``COMPLETENESS_FACTOR * eps`` when larger. A decomposition
    computed in float32 from a reduced-precision model misses the model's activations by its rounding."""
    dtype = getattr(getattr(lm_or_dtype, "model", None), "dtype", None) or lm_or_dtype
    return max(floor, tolerances(dtype).completeness)


def rel_err(ours: Tensor, real: Tensor, scale: str = "rms") -> float:
    """``max |ours - real|`` relative to the RMS of ``real`` (``scale="rms"``, float32 models) or to its largest
    element (``scale="max"``, reduced precision: the scale at which the model's dtype rounds)."""
    real = real.float()
    ours = ours.to(real.device)  # a layer recomputed on its own device, compared where the capture is
    if scale == "max":
        ref = real.abs().max().clamp_min(1e-12)
    else:
        ref = real.pow(2).mean().sqrt().clamp_min(1e-12)
    return float((ours.float() - real).abs().max() / ref)


def _worst(values) -> float:
    """The largest error, NaN if any is NaN (Python's ``max`` would hide a NaN depending on its position)."""
    values = list(values)
    return float("nan") if any(math.isnan(v) for v in values) else max(values)


def nonfinite_captures(tr: Trace) -> list[str]:
    """Names of the trace's captures holding inf or NaN: the model itself overflowed (e.g. float16)."""
    named = {"embed": tr.embed, "resid_pre": tr.resid_pre, "resid_post": tr.resid_post, "attn_out": tr.attn_out,
             "mlp_out": tr.mlp_out, PATTERN_KEY: tr.pattern, "mlp_pre": tr.mlp_pre, "logits": tr.logits,
             ROUTING_KEY: tr.routing_weights}
    return [k for k, v in named.items() if v is not None and not bool(torch.isfinite(v).all())]


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
    dtype: str = "float32"  # the dtype the model ran in; the tolerances follow it (:func:`tolerances`)
    error_scale: str = "rms"  # relative errors: to the real tensor's RMS, or ("max", reduced precision) its max |x|
    devices: list[str] = field(default_factory=list)  # each layer's device (where lenscope recomputed it)
    nonfinite: list[str] = field(default_factory=list)  # captures where the model itself produced inf / NaN
    # an encoder-decoder model's encoder: {"embed_rel_error", "layers", "final_norm"} (its errors are in the maxima)
    encoder: dict | None = None

    @property
    def ok(self) -> bool:
        logit_ok = self.max_abs_logit_error is None or self.max_abs_logit_error <= self.logit_tol
        return (not self.nonfinite and logit_ok and self.max_rel_resid_error <= self.resid_tol
                and self.max_rel_sublayer_error <= self.resid_tol)

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
        extra = "" if self.dtype == "float32" else f", dtype={self.dtype!r}"
        if self.nonfinite:
            extra += f", nonfinite={self.nonfinite}"
        return (f"VerifyReport(model={self.model!r}, ok={self.ok}, max_abs_logit_error={logit}, "
                f"max_rel_resid_error={self.max_rel_resid_error:.2e}, "
                f"max_rel_sublayer_error={self.max_rel_sublayer_error:.2e}{extra})")


@torch.no_grad()
def verify(lm: LoadedModel, text: str = DEFAULT_TEXT, tr: Trace | None = None, *, source=None) -> VerifyReport:
    """Check lenscope's reading of ``lm`` against the real model on ``text`` (an encoder-decoder model: the target
    prefix, with ``source``, by default the text itself; both stacks are checked, the decoder's cross-attention
    from what it read)."""
    from ..loading.devices import parse_dtype

    A = lm.anatomy
    if A.is_encoder_decoder and source is None and tr is None:
        source = text
    if tr is not None and not isinstance(tr.pattern, torch.Tensor):
        # a lean trace recomputes its attention probabilities with lenscope's own math: comparing those with
        # themselves would prove nothing, so verify captures what the model computed
        tr = trace(lm, tr.input_ids, pattern="keep")
    tr = tr if tr is not None else trace(lm, text, pattern="keep", source=source)
    dtype = parse_dtype(getattr(lm.model, "dtype", None))
    tol = tolerances(dtype)
    scale = tol.error_scale
    embed_err, rows = _blocks(A, tr, scale)
    resid_keys = ("resid_mid", "resid_post", "resid_chain")
    enc = None
    if tr.encoder is not None:  # the encoder's blocks, then its final norm, the same checks
        e_embed, e_rows = _blocks(A.encoder, tr.encoder, scale)
        enc = {"embed_rel_error": e_embed, "layers": e_rows, "final_norm": None}
        if A.encoder.final_norm is not None:
            enc["final_norm"] = rel_err(A.encoder.final_norm(tr.encoder.site("ln_final.in")), tr.memory, scale)
        embed_err = _worst([embed_err, e_embed])
    every = rows + ([] if enc is None else enc["layers"] + [{"ln_final": enc["final_norm"] or 0.0}])
    max_resid = _worst([embed_err] + [r[k] for r in every for k in resid_keys if k in r])
    max_sub = _worst(v for r in every for k, v in r.items() if k not in resid_keys and k != "layer")
    logit_err = None
    if A.unembed is not None and tr.logits is not None:
        ours = A.logits(tr.final_resid)
        logit_err = float((ours.to(tr.logits.device) - tr.logits).abs().max())
        if tr.site("ln_final.out") is not None:
            max_sub = _worst([max_sub, rel_err(A.final_norm(tr.site("ln_final.in")), tr.site("ln_final.out"), scale)])
    return VerifyReport(
        model=lm.name, family=A.family, n_layers=A.n_layers, n_tokens=len(tr.tokens),
        max_abs_logit_error=logit_err, max_rel_resid_error=max_resid, max_rel_sublayer_error=max_sub,
        embed_rel_error=embed_err, layers=rows, logit_tol=tol.logit_tol(tr.logits), resid_tol=tol.resid,
        dtype=tol.dtype, error_scale=scale, devices=[str(d) for d in A.devices], nonfinite=nonfinite_captures(tr),
        encoder=enc,
    )


def _blocks(A, tr: Trace, scale: str) -> tuple[float, list[dict]]:
    """The embedding's error and each block's errors, of one stack (``A`` and its trace ``tr``)."""
    pos = tr.positions
    embed_err = rel_err(A.embed(tr.input_ids.to(pos.device), pos), tr.embed, scale)
    memory = tr.memory
    rows = []
    for i, layer in enumerate(A.layers):
        row: dict = {"layer": i}
        for slot, norm in layer.norms().items():
            row[slot] = rel_err(norm(tr.site(f"{slot}.in", i)), tr.site(f"{slot}.out", i), scale)
        out, probs = layer.attn(tr.attn_in[i], pos)
        row[PATTERN_KEY] = float((probs.to(tr.pattern.device) - tr.pattern[i]).abs().max())
        row["attn_out"] = rel_err(out, tr.attn_out[i], scale)
        if tr.routing_weights is not None:  # a mixture of experts: the router, then the experts with their routing
            logits = layer.mlp.router_logits(tr.mlp_in[i])
            row["router_logits"] = rel_err(logits, tr.router_logits[i], scale)
            # the routing function of the model's own logits (a reduced-precision model's logits round differently
            # from float32 ones, which may swap two experts of nearly equal weight)
            row[ROUTING_KEY] = float((layer.mlp.routing(tr.router_logits[i]) - tr.routing_weights[i]).abs().max())
            row["mlp_out"] = rel_err(layer.mlp(tr.mlp_in[i], tr.routing_weights[i]), tr.mlp_out[i], scale)
        else:
            pre, up = layer.mlp.pre(tr.mlp_in[i])
            row["mlp_pre"] = rel_err(pre, tr.mlp_pre[i], scale)
            if up is not None:
                row["mlp_up"] = rel_err(up, tr.mlp_up[i], scale)
            row["mlp_out"] = rel_err(layer.mlp(tr.mlp_in[i], pre=(pre, up)), tr.mlp_out[i], scale)  # one MLP pass
        if layer.cross is not None:  # a decoder block's cross-attention, from what it read and the memory
            out, probs = layer.cross.cross(tr.cross_in[i], memory)
            row["cross_pattern"] = float((probs.to(tr.cross_pattern.device) - tr.cross_pattern[i]).abs().max())
            row["cross_out"] = rel_err(out, tr.cross_out[i], scale)
        block = layer.forward(tr.resid_pre[i], pos, None if tr.routing_weights is None else tr.routing_weights[i],
                              memory=memory if layer.cross is not None else None)
        row["resid_mid"] = rel_err(block["resid_mid"], tr.resid_mid[i], scale)
        row["resid_post"] = rel_err(block["resid_post"], tr.resid_post[i], scale)
        if i + 1 < A.n_layers:  # the block's output is the next block's input
            row["resid_chain"] = rel_err(tr.resid_post[i], tr.resid_pre[i + 1], scale)
        rows.append(row)
    return embed_err, rows
