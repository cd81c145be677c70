"""Llama-style decoders: Llama, SmolLM2, Mistral, Qwen2, Qwen3 — RMSNorm, rotary, grouped-query
attention, SwiGLU, optional q/k/v biases (Qwen2), q/k norms (Qwen3) and sliding windows."""

from __future__ import annotations

from ..anatomy import MLP, Anatomy, Attention, Embedding, Layer, Unembed, activation_name
from . import (
    Family,
    LayerHooks,
    ModelHooks,
    linear_in_out,
    rms_norm,
    rotary,
    split_bias,
    split_heads_in,
    split_heads_out,
    t,
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
            W_Q=split_heads_in(linear_in_out(a.q_proj), H), W_K=split_heads_in(linear_in_out(a.k_proj), KV),
            W_V=split_heads_in(linear_in_out(a.v_proj), KV), W_O=split_heads_out(linear_in_out(a.o_proj), H),
            b_Q=split_bias(a.q_proj.bias, H), b_K=split_bias(a.k_proj.bias, KV), b_V=split_bias(a.v_proj.bias, KV),
            b_O=t(a.o_proj.bias), scale=dh**-0.5, rotary=rot,
            q_norm=rms_norm(a.q_norm) if hasattr(a, "q_norm") else None,
            k_norm=rms_norm(a.k_norm) if hasattr(a, "k_norm") else None,
            window=layer_window(cfg, i),
        )
        m = blk.mlp
        mlp = MLP(W_in=linear_in_out(m.up_proj), b_in=t(m.up_proj.bias), W_gate=linear_in_out(m.gate_proj),
                  b_gate=t(m.gate_proj.bias), W_out=linear_in_out(m.down_proj), b_out=t(m.down_proj.bias),
                  act=activation_name(cfg.hidden_act))
        layers.append(Layer("pre", attn, mlp, ln_attn=rms_norm(blk.input_layernorm),
                            ln_mlp=rms_norm(blk.post_attention_layernorm)))
    return Anatomy(
        family="llama", model_type=cfg.model_type, d_model=d, n_ctx=cfg.max_position_embeddings,
        vocab_size=cfg.vocab_size, embed=Embedding(W_E=base.embed_tokens.weight.detach()), layers=layers,
        final_norm=rms_norm(base.norm), unembed=Unembed(W_U=linear_in_out(model.lm_head)),
    )


def hooks(model) -> ModelHooks:
    base = model.model
    return ModelHooks(
        layers=[
            LayerHooks(block=b, attn=b.self_attn, attn_out=b.self_attn.o_proj, mlp_out=b.mlp.down_proj,
                       act=b.mlp.act_fn, up=b.mlp.up_proj,
                       q=b.self_attn.q_proj, k=b.self_attn.k_proj, v=b.self_attn.v_proj,
                       norms={"ln_attn": b.input_layernorm, "ln_mlp": b.post_attention_layernorm})
            for b in base.layers
        ],
        final_norm=base.norm,
    )


def _tiny_llama(tok: dict):
    from transformers import LlamaConfig

    return LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=128, vocab_size=tok["vocab_size"], max_position_embeddings=128,
                       rope_theta=10000.0, bos_token_id=tok["bos"], eos_token_id=tok["eos"], pad_token_id=tok["pad"],
                       tie_word_embeddings=False)


def _tiny_qwen2(tok: dict):
    from transformers import Qwen2Config

    return Qwen2Config(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=128, vocab_size=tok["vocab_size"], max_position_embeddings=128,
                       bos_token_id=tok["bos"], eos_token_id=tok["eos"], pad_token_id=tok["pad"],
                       tie_word_embeddings=True)


FAMILY = Family(
    name="llama", model_types=("llama", "mistral", "qwen2", "qwen3"), read=read, hooks=hooks,
    tiny={"llama": _tiny_llama, "qwen2": _tiny_qwen2},
)
