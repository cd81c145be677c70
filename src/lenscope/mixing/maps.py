"""Norm-based context-mixing maps through the whole layer (Kobayashi et al. 2020, 2021, 2024).

For every layer and scope, an ``(pos, src)`` map whose cell ``(i, j)`` is ``||F_i(x_j)||_2``: the norm of the
part of output ``i`` that comes from the layer's input ``x_j``. The parts come from
:mod:`lenscope.models.weights.algebra` (``"remainder"`` convention: every bias goes to the remainder), carried one
sub-layer at a time; each scope's parts plus its remainder add up to the real activation read from the
trace, and the result reports how closely (``completeness_error``: the worst position's error norm relative
to the RMS of the activation's vector norms).

Scopes (names as in the papers' code):

- Post-LN (BERT, RoBERTa), layer = LN2 . RES2 . FF . LN1 . RES1 . ATTN:
  ``attention``, ``attn_2020``, ``attn``, ``atb``, ``atbff``, ``atbffres``, ``atbffresln``.
- Pre-LN decoders, layer = RES2 . FF . LN2 . RES1 . ATTN . LN1:
  ``attention``, ``attn_2020``, ``attn``, ``atb``, ``atbln``, ``atblnff``, ``atblnffres``,
  ``atblnffres_nextln``. Gemma's sandwich norms belong to the sub-layer they follow (``atb`` includes the
  post-attention norm, ``atblnff`` the post-feed-forward norm). In a parallel block (GPT-NeoX) the MLP reads
  ``LN2(x_i)``, a function of position ``i`` alone: ``atbln`` and ``atblnff`` are then diagonal and
  ``atblnffres`` adds them to ``atb``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..errors import InputError, InvariantError
from ..models.runtime.stop import checkpoint
from ..models.runtime.trace import Trace, prefix_trace
from ..models.weights.algebra import (
    Decomposition,
    Factored,
    activation_scale,
    add_residual,
    attention_parts,
    combine,
    f32,
    ff_step,
    layer_input,
    norm_step,
    relative_gap,
    write_step,
)
from ..results import Result
from ..viz.notebook import ReportView
from .alti import refuse_encoder_decoder

PRE_LN_SCOPES = ("attention", "attn_2020", "attn", "atb", "atbln", "atblnff", "atblnffres", "atblnffres_nextln")
POST_LN_SCOPES = ("attention", "attn_2020", "attn", "atb", "atbff", "atbffres", "atbffresln")
CHUNK_BYTES = 192 * 2**20


def scopes_for(A) -> tuple[str, ...]:
    """The scope names that apply to a model (Post-LN encoders or Pre-LN decoders)."""
    return POST_LN_SCOPES if A.placement == "post" else PRE_LN_SCOPES


def check_scopes(A, scopes) -> tuple[str, ...]:
    valid = scopes_for(A)
    if scopes is None:
        return valid
    if isinstance(scopes, str):
        scopes = (scopes,)
    bad = [s for s in scopes if s not in valid]
    if bad:
        kind = "Post-LN" if A.placement == "post" else "Pre-LN"
        raise InputError(f"scope {bad[0]!r} does not apply to this {kind} model; its scopes are: {', '.join(valid)}")
    return tuple(scopes)


def _real(tr: Trace, A, l: int) -> dict[str, Tensor]:
    """What each scope's parts must add up to, read from the trace (pos, d_model)."""
    if A.placement == "post":
        return {"attn_2020": tr.attn_out[l], "attn": tr.attn_out[l], "atb": tr.resid_mid[l],
                "atbff": tr.mlp_write[l], "atbffres": tr.site("ln_mlp.in", l), "atbffresln": tr.resid_post[l]}
    nxt = tr.site("ln_attn.out", l + 1) if l + 1 < A.n_layers else tr.site("ln_final.out")
    return {"attn_2020": tr.attn_out[l], "attn": tr.attn_out[l], "atb": tr.resid_mid[l], "atbln": tr.mlp_in[l],
            "atblnff": tr.mlp_write[l], "atblnffres": tr.resid_post[l], "atblnffres_nextln": nxt}


def layer_decompositions(A, tr: Trace, l: int, rows: Tensor, scopes, *, nodes: int = 32,
                         numeric_steps: int | None = None, dtype: torch.dtype = torch.float32
                         ) -> tuple[dict[str, Decomposition], float]:
    """Every requested scope of layer ``l`` at ``rows`` as a :class:`Decomposition` over the layer's sources,
    each sub-layer computed once and carried to the next. Returns them and the IG quadrature error."""
    layer = A.layers[l]
    post = layer.placement == "post"
    want = set(scopes)
    out: dict[str, Decomposition] = {}
    err = 0.0
    if "attn_2020" in want:
        out["attn_2020"] = attention_parts(A, tr, l, rows, "sources", dtype=dtype)
    if "attn" in want:
        out["attn"] = attention_parts(A, tr, l, rows, "input", dtype=dtype)
    deeper = [s for s in scopes if s not in ("attention", "attn_2020", "attn")]
    if not deeper:
        return out, err
    x = layer_input(tr, l, dtype)
    # kept factored (attention weights times per-source vectors) until the FF block's projection
    atb = attention_parts(A, tr, l, rows, "remainder", dtype=dtype, factored=True)
    # sandwich: the post-attention norm belongs to ATTN's write (so does a residual multiplier)
    atb = write_step(atb, layer, "attn", tr.attn_out[l][rows])
    atb = add_residual(atb, x)
    if post:
        atb = norm_step(atb, layer.ln_attn, tr.site("ln_attn.in", l)[rows])
    if post:
        ff_in = atb
    elif layer.placement == "parallel":  # the MLP reads LN2(x_i): position i's own input only
        zero = atb.alpha[:0]
        diag = Factored(zero, atb.scale, atb.V[:0], torch.zeros_like(atb.diag), torch.zeros_like(atb.rest), rows)
        ff_in = norm_step(add_residual(diag, x), layer.ln_mlp, tr.site("ln_mlp.in", l)[rows])
    else:
        ff_in = norm_step(atb, layer.ln_mlp, tr.site("ln_mlp.in", l)[rows])
    atb_dense = atb.dense()
    out["atb"] = atb_dense
    if not post and "atbln" in want:
        out["atbln"] = ff_in.dense()
    if not (want & {"atbff", "atbffres", "atbffresln", "atblnff", "atblnffres", "atblnffres_nextln"}):
        return out, err
    # a mixture of experts: the traced routing weights
    routing = None if tr.routing_weights is None else tr.routing_weights[l][rows]
    ff, err = ff_step(ff_in, layer.mlp, nodes=nodes, numeric_steps=numeric_steps, routing=routing)
    ff = write_step(ff, layer, "mlp", tr.mlp_out[l][rows])
    res = combine(ff, atb_dense)  # RES2 adds back the whole decomposed input of the FF block
    if post:
        out["atbff"], out["atbffres"] = ff, res
        out["atbffresln"] = norm_step(res, layer.ln_mlp, tr.site("ln_mlp.in", l)[rows])
    else:
        out["atblnff"], out["atblnffres"] = ff, res
        if "atblnffres_nextln" in want:
            if l + 1 < A.n_layers:
                out["atblnffres_nextln"] = norm_step(res, A.layers[l + 1].ln_attn, tr.site("ln_attn.in", l + 1)[rows])
            else:
                out["atblnffres_nextln"] = norm_step(res, A.final_norm, tr.site("ln_final.in")[rows])
    return out, err


def _chunks(n: int, A, causal: bool):
    """Row ranges so that one chunk's (row, src, d_mlp) tensors stay within CHUNK_BYTES."""
    width = max(A.layers[0].mlp.d_mlp * (3 if A.layers[0].mlp.gated else 2), 4 * A.d_model)
    step = max(1, CHUNK_BYTES // max(1, n * width * 4))
    return [(a, min(n, a + step)) for a in range(0, n, step)]


@dataclass(repr=False)
class MixingMaps(ReportView, Result):
    """Norm-based maps of one scope: ``maps (layer, pos, src)`` with ``maps[k, i, j] = ||F_i(x_j)||`` at layer
    ``layers[k]`` (``attention``: the attention weights averaged over heads). ``completeness_error``: the
    largest over layers and positions of ``||sum_j F_i(x_j) + b_i - real_i||`` relative to the RMS of
    ``||real_i||`` (0 for ``attention``);
    ``layer_errors (layer,)`` per layer."""

    VIEW = "mixing"  # its view: drawn by viz/views/mixing/mixing.js (lenscope.viz.views)

    model: str
    scope: str
    tokens: list[str]
    layers: list[int]
    maps: Tensor
    completeness_error: float
    layer_errors: Tensor
    info: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"model": self.model, "tokens": self.tokens, "scope": self.scope, "layer_indices": self.layers,
                "layers": self.maps.double().tolist(), "completeness_error": self.completeness_error,
                "layer_errors": self.layer_errors.double().tolist(), "info": self.info}

    def to_frame(self):
        """Long format: ``layer, pos, src, token, source_token, value``."""
        import pandas as pd

        L, n, _ = self.maps.shape
        idx = torch.cartesian_prod(torch.arange(L), torch.arange(n), torch.arange(n))
        return pd.DataFrame({
            "layer": [self.layers[i] for i in idx[:, 0].tolist()], "pos": idx[:, 1].numpy(),
            "src": idx[:, 2].numpy(), "token": [self.tokens[i] for i in idx[:, 1].tolist()],
            "source_token": [self.tokens[i] for i in idx[:, 2].tolist()],
            "value": self.maps.reshape(-1).double().numpy(),
        })

    def plot(self, layers=None, cols: int = 4):
        from ..viz.mixing_plots import plot_maps

        return plot_maps(self, layers=layers, cols=cols)

    def __repr__(self) -> str:
        return (f"MixingMaps({self.scope!r}, layers={self.layers if len(self.layers) <= 4 else len(self.layers)}, "
                f"pos={len(self.tokens)}, completeness_error={self.completeness_error:.1e})")


@torch.no_grad()
def context_mixing(lm, text=None, scopes=None, *, layers=None, tr: Trace | None = None, nodes: int = 32,
                   numeric_steps: int | None = None, check: bool = True, progress=None,
                   dtype: torch.dtype = torch.float32) -> dict[str, MixingMaps]:
    """Norm-based context-mixing maps of ``text`` for every requested scope (default: all that apply) and
    layer (default: all): ``{scope: MixingMaps}``. One trace and one pass through each layer serve all scopes.

    ``nodes``: Gauss-Legendre points for gated MLPs (closed forms elsewhere); ``numeric_steps``: use the
    paper's numeric IG (midpoint rule) instead. With ``check`` (default) a scope whose parts miss the real
    activation by more than 1e-3 (relative to its RMS) raises :class:`InvariantError`: lenscope's reading of
    the model is then wrong (float32 rounding stays near 1e-5). With ``numeric_steps`` the FF scopes' error
    includes the quadrature's (gated MLPs: ~1e-2 at 20 steps) and is reported only.
    """
    from ..models.runtime.trace import trace

    A = lm.anatomy
    if tr is not None:
        refuse_encoder_decoder(tr, "context-mixing maps")
    scopes = check_scopes(A, scopes)
    for name, v in (("nodes", nodes), ("numeric_steps", numeric_steps)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise InputError(f"{name} must be a positive integer, not {v!r}")
    if tr is None:
        if text is None:
            raise InputError("give a text (or token ids)")
        tr = trace(lm, text)
    L = A.n_layers
    if layers is None:
        layers = list(range(L))
    elif isinstance(layers, int):
        layers = [layers]
    layers = [int(l) for l in layers]
    for l in layers:
        if not -L <= l < L:
            raise InputError(f"layer {l} does not exist; {lm.name} has layers 0..{L - 1}")
    layers = [l % L for l in layers]
    n = len(tr.tokens)
    causal = A.causal
    maps = {s: torch.zeros(len(layers), n, n) for s in scopes}
    errs = {s: torch.zeros(len(layers), dtype=torch.float64) for s in scopes}
    quad = 0.0
    chunks = _chunks(n, A, causal)
    for k, l in enumerate(layers):
        checkpoint()  # a layer is a chunk: a caller that no longer waits stops the loop here
        if "attention" in scopes:
            maps["attention"][k] = f32(tr.pattern[l]).mean(0).cpu()
        real = {s: f32(v) for s, v in _real(tr, A, l).items() if s in scopes}
        rms = {s: activation_scale(v) for s, v in real.items()}
        for a, b in chunks:
            sub = prefix_trace(tr, b) if causal else tr  # causal: rows < b never read sources >= b
            rows = torch.arange(a, b, device=tr.resid_pre.device)
            decs, e = layer_decompositions(A, sub, l, rows, scopes, nodes=nodes, numeric_steps=numeric_steps,
                                           dtype=dtype)
            quad = max(quad, e)
            for s, dec in decs.items():
                if s not in maps:
                    continue
                maps[s][k, a:b, : dec.parts.shape[1]] = dec.parts.norm(dim=-1).float().cpu()
                errs[s][k] = max(float(errs[s][k]), relative_gap(dec.total(), real[s][a:b], rms[s]))
        if progress is not None:
            progress(l)
    info = {"ig": "numeric" if numeric_steps else "exact", "nodes": nodes, "numeric_steps": numeric_steps,
            "quadrature_error": quad}
    from ..models.runtime.verify import completeness_tolerance

    tol = completeness_tolerance(lm)  # models.verify.TOLERANCE; more for bfloat16 / float16 models
    out = {}
    for s in scopes:
        err = float(errs[s].max()) if len(layers) else 0.0
        ff_scope = s not in ("attention", "attn", "attn_2020", "atb", "atbln")
        if numeric_steps is not None and ff_scope:
            pass  # the numeric rule is not complete by construction: its error is reported, not refused
        elif check and s != "attention" and not err <= tol:
            raise InvariantError(
                f"scope {s}: the parts miss the real activation by {err:.2e} of its RMS (limit "
                f"{tol:g}); run `lenscope verify --model {lm.name}`")
        out[s] = MixingMaps(model=lm.name, scope=s, tokens=list(tr.tokens), layers=layers, maps=maps[s],
                            completeness_error=err, layer_errors=errs[s].float(),
                            info=info if s not in ("attention", "attn", "attn_2020", "atb", "atbln") else {})
    return out
