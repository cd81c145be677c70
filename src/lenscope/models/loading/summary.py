"""An Anatomy summarised in words: what ``lenscope models`` lists for each family, read from the Anatomy itself
rather than from a table kept by hand."""

from __future__ import annotations

import hashlib

import torch

from ..weights.anatomy import MLP, Anatomy


def summarize(A: Anatomy) -> dict:
    """What the Anatomy ``A`` holds, in words (``lenscope models`` lists it per family): ``kind`` (decoder /
    encoder / encoder-decoder: then the decoder stack's features, with cross-attention), ``block`` (placements, a
    residual multiplier), ``norms``, ``attention``, ``mlp`` and ``head`` (lists of features), and the flags
    ``parallel`` and ``moe``."""
    layers = A.layers
    norms = [n for layer in layers for n in layer.norms().values()] + [n for n in (A.final_norm,) if n]
    shared = any(layer.ln_mlp is layer.ln_attn for layer in layers if layer.ln_mlp and layer.ln_mlp.kind != "identity")
    norm = sorted({n.kind for n in norms}) + (["shared by attention and MLP"] if shared else [])
    if norms and all(n.bias is None for n in norms if n.kind == "layernorm") and "layernorm" in norm:
        norm.append("no bias")
    attns = [layer.attn for layer in layers]
    groups = {(a.n_heads, a.n_kv_heads) for a in attns}
    att = sorted({"multi-query" if k == 1 < h else "grouped-query" if k < h else "multi-head" for h, k in groups})
    rots = [a.rotary for a in attns if a.rotary is not None]
    if rots:
        att.append("rotary" + (" (interleaved)" if any(r.interleaved for r in rots) else "")
                   + (" (partial)" if any(a.rotary and a.rotary.dim < a.d_head for a in attns) else "")
                   + (" (not every layer)" if len(rots) < len(attns) else ""))
    att += [name for name, on in (
        ("alibi", any(a.alibi is not None for a in attns)), ("learned positions", A.embed.W_pos is not None),
        ("sliding window", any(a.window is not None for a in attns)), ("q/k norms", any(a.q_norm for a in attns)),
        ("q/k norms across heads", any(a.q_norm and a.qk_norm_across_heads for a in attns)),
        ("soft-capped", any(a.softcap is not None for a in attns)),
        ("biases", any(a.b_Q is not None or a.b_O is not None for a in attns)),
        ("bidirectional", not A.causal)) if on]
    moe = any(type(layer.mlp) is not MLP for layer in layers)  # the one other feed-forward kind: experts
    mlp = sorted({"mixture of experts" if type(m) is not MLP else "gated" if m.gated else "plain"
                  for m in (layer.mlp for layer in layers)})
    mlp += sorted({f"act {m.act}" for m in (layer.mlp for layer in layers) if hasattr(m, "act")})
    u = A.unembed
    head = [] if u is None else [name for name, on in (
        ("bias", u.b_U is not None), (f"logit scale {u.logit_scale:g}", u.logit_scale != 1),
        ("soft-capped", u.softcap is not None), ("masked-LM transform", u.transform_W is not None)) if on]
    block = sorted({x.placement for x in layers}) + (["residual scale"] if any(x.residual_scale != 1 for x in layers)
                                                     else [])
    kind = "encoder-decoder" if A.is_encoder_decoder else "encoder" if A.is_encoder else "decoder"
    if A.is_encoder_decoder:
        att.append("cross-attention")
        if any(a.relative_bias is not None for a in attns):
            att.append("relative position bias")
    return {"kind": kind, "block": block,
            "norms": norm, "attention": att, "mlp": mlp, "head": head if u is not None else ["none"],
            "parallel": any(x.placement == "parallel" for x in layers), "moe": moe}


def fingerprint(anatomy: Anatomy, *, legacy: bool = False) -> str:
    """A short hash of the model's shape and a sample of its weights (to refuse a lens, a dictionary or a direction
    made for another model). The sampled weights are rounded to bfloat16 first, so the model loaded in float32 or
    in bfloat16 has one fingerprint (a dictionary trained on the bfloat16 model runs on the float32 one).
    ``legacy``: the hash before that rounding, which files written until 2026-11-27 hold (:func:`same_model`)."""
    h = hashlib.sha256()
    h.update(f"{anatomy.family}:{anatomy.model_type}:{anatomy.d_model}:{anatomy.n_layers}:{anatomy.vocab_size}".encode())
    samples = [anatomy.embed.W_E[:: max(1, anatomy.vocab_size // 64), :16]]
    if anatomy.final_norm is not None and anatomy.final_norm.weight is not None:
        samples.append(anatomy.final_norm.weight)
    samples.append(anatomy.layers[-1].mlp.W_out[:16, :16])
    for s in samples:
        s = s.detach() if legacy else s.detach().to(torch.bfloat16)
        h.update(s.float().cpu().contiguous().numpy().round(5).tobytes())
    return h.hexdigest()[:16]


def same_model(stored: str | None, anatomy: Anatomy) -> bool:
    """Whether a file's recorded fingerprint ``stored`` names this model: today's :func:`fingerprint`, or the
    legacy one of files written before it (for the dtype they were made in)."""
    return stored in (fingerprint(anatomy), fingerprint(anatomy, legacy=True))
