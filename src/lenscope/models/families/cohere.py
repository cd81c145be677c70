"""Cohere (Command R): a parallel block whose attention and gated MLP read one LayerNorm without bias
(``input_layernorm``: mean-centred, weight only), rotary with adjacent pairs rotated (rotate-every-two), grouped-query
attention with optional biases and optional per-head q/k LayerNorms, and logits multiplied by ``logit_scale``."""

from __future__ import annotations

import dataclasses

from ..anatomy import Anatomy, Attention, Embedding, Layer, Norm, Unembed, activation_name
from . import (
    GATED_SITES,
    Family,
    ModelHooks,
    gated_mlp,
    layer_norm,
    linear_in_out,
    require,
    rope_context,
    rotary,
    separate_qkv,
    tiny_tokens,
)


def head_norm(mod) -> Norm:
    """A CohereLayerNorm over each head's features with one weight per head ``(head, d_head)``, as a Norm whose weight
    ``(head, 1, d_head)`` broadcasts over ``(..., head, pos, d_head)``."""
    n = layer_norm(mod)
    return dataclasses.replace(n, weight=n.weight.unsqueeze(-2)) if n.weight.dim() == 2 else n


def read(model) -> Anatomy:
    cfg = model.config
    base = model.model
    rot = dataclasses.replace(rotary(base.rotary_emb), interleaved=True)
    scale = getattr(model, "logit_scale", 1.0)
    require(scale is not None, "Cohere with logit_scale=None is not supported (the model itself cannot run it)")
    layers = []
    for blk in base.layers:
        a = blk.self_attn
        H = cfg.num_attention_heads
        KV = H // a.num_key_value_groups
        qk = bool(getattr(a, "use_qk_norm", False))
        attn = Attention(**separate_qkv(a.q_proj, a.k_proj, a.v_proj, a.o_proj, H, KV), scale=float(a.scaling),
                         rotary=rot, q_norm=head_norm(a.q_norm) if qk else None,
                         k_norm=head_norm(a.k_norm) if qk else None)
        mlp = gated_mlp(blk.mlp, activation_name(cfg.hidden_act))
        ln = layer_norm(blk.input_layernorm)  # one norm read by both branches
        layers.append(Layer("parallel", attn, mlp, ln_attn=ln, ln_mlp=ln))
    return Anatomy(
        family="cohere", model_type=cfg.model_type, d_model=cfg.hidden_size, n_ctx=rope_context(cfg, base.rotary_emb),
        vocab_size=cfg.vocab_size, embed=Embedding(W_E=base.embed_tokens.weight.detach()), layers=layers,
        final_norm=layer_norm(base.norm),
        unembed=Unembed(W_U=linear_in_out(model.lm_head), logit_scale=float(scale)),
    )


def hooks(model) -> ModelHooks:
    return ModelHooks.of(model.model.layers, model.model.norm, **GATED_SITES, readers={"ln_mlp": "mlp"},
                         norms={"ln_attn": "input_layernorm", "ln_mlp": "input_layernorm"})


def _tiny(tok: dict):
    from transformers import CohereConfig

    return CohereConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=128, max_position_embeddings=128, use_qk_norm=True, attention_bias=True,
                        logit_scale=0.25, tie_word_embeddings=True, **tiny_tokens(tok))


FAMILY = Family(name="cohere", model_types=("cohere",), read=read, hooks=hooks, tiny={"cohere": _tiny})
