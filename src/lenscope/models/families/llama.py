"""Llama-style decoders: Llama, SmolLM2, Mistral, Qwen2, Qwen3 — RMSNorm, rotary, grouped-query
attention, SwiGLU, optional q/k/v biases (Qwen2), q/k norms (Qwen3) and sliding windows."""

from __future__ import annotations

from ..anatomy import Anatomy, Attention, Embedding, Layer, Unembed, activation_name
from . import (
    GATED_SITES,
    PRE_NORMS,
    Family,
    ModelHooks,
    gated_mlp,
    linear_in_out,
    rms_norm,
    rotary,
    separate_qkv,
    tiny_tokens,
)


def layer_window(cfg, i: int) -> int | None:
    """Sliding window of layer ``i`` (None = full attention), as transformers decides it."""
    types = getattr(cfg, "layer_types", None)
    window = getattr(cfg, "sliding_window", None)
    if types is not None:
        return window if types[i] == "sliding_attention" else None
    if getattr(cfg, "use_sliding_window", True) is False:
        return None
    return window


def read(model) -> Anatomy:
    cfg = model.config
    base = model.model
    d, H, KV = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
    dh = getattr(cfg, "head_dim", None) or d // H
    rot = rotary(base.rotary_emb)
    layers = []
    for i, blk in enumerate(base.layers):
        a = blk.self_attn
        attn = Attention(
            **separate_qkv(a.q_proj, a.k_proj, a.v_proj, a.o_proj, H, KV), scale=dh**-0.5, rotary=rot,
            q_norm=rms_norm(a.q_norm) if hasattr(a, "q_norm") else None,
            k_norm=rms_norm(a.k_norm) if hasattr(a, "k_norm") else None,
            window=layer_window(cfg, i),
        )
        mlp = gated_mlp(blk.mlp, activation_name(cfg.hidden_act))
        layers.append(Layer("pre", attn, mlp, ln_attn=rms_norm(blk.input_layernorm),
                            ln_mlp=rms_norm(blk.post_attention_layernorm)))
    return Anatomy(
        family="llama", model_type=cfg.model_type, d_model=d, n_ctx=cfg.max_position_embeddings,
        vocab_size=cfg.vocab_size, embed=Embedding(W_E=base.embed_tokens.weight.detach()), layers=layers,
        final_norm=rms_norm(base.norm), unembed=Unembed(W_U=linear_in_out(model.lm_head)),
    )


def hooks(model) -> ModelHooks:
    base = model.model
    return ModelHooks.of(base.layers, base.norm, **GATED_SITES, norms=PRE_NORMS)


def _tiny_llama(tok: dict):
    from transformers import LlamaConfig

    return LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=128, max_position_embeddings=128, rope_theta=10000.0,
                       tie_word_embeddings=False, **tiny_tokens(tok))


def _tiny_qwen2(tok: dict):
    from transformers import Qwen2Config

    return Qwen2Config(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=128, max_position_embeddings=128, tie_word_embeddings=True,
                       **tiny_tokens(tok))


FAMILY = Family(
    name="llama", model_types=("llama", "mistral", "qwen2", "qwen3"), read=read, hooks=hooks,
    tiny={"llama": _tiny_llama, "qwen2": _tiny_qwen2},
)
