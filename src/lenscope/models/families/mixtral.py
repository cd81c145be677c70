"""Llama-style mixtures of experts: Mixtral and Qwen3-MoE — RMSNorm, rotary, grouped-query attention (Qwen3-MoE:
per-head q/k norms), an optional sliding window on every layer, and a sparse MoE block in place of the MLP: a
router without bias, a softmax over the experts, the ``num_experts_per_tok`` largest (renormalised always for
Mixtral, when ``norm_topk_prob`` for Qwen3-MoE), SwiGLU experts without biases."""

from __future__ import annotations

from ..anatomy import Anatomy, Attention, Embedding, Layer, Unembed, activation_name
from . import (
    PRE_NORMS,
    SEPARATE_QKV,
    Family,
    ModelHooks,
    linear_in_out,
    moe_block,
    require,
    rms_norm,
    rope_context,
    rotary,
    separate_qkv,
    stacked_experts,
    tiny_tokens,
)

# where the MoE block's parts sit in Mixtral / Qwen3-MoE / OLMoE blocks (ModelHooks.of paths)
MOE_SITES = {"attn": "self_attn", "attn_out": "self_attn.o_proj", "mlp_out": "mlp", "act": "mlp.experts",
             "router": "mlp.gate", "experts": "mlp.experts", **SEPARATE_QKV}


def moe_of(cfg, blk):
    """The MoE block of a Mixtral / Qwen3-MoE / OLMoE decoder layer (refused where a layer has a dense MLP)."""
    mlp = blk.mlp
    require(hasattr(mlp, "experts") and hasattr(mlp, "gate"),
            f"{cfg.model_type} with dense MLP layers among the MoE layers (mlp_only_layers / decoder_sparse_step) is "
            "not supported; every layer must be a sparse MoE block")
    require(not getattr(mlp, "shared_expert", None), f"{cfg.model_type} with a shared expert is not supported")
    # Mixtral always renormalises the chosen experts' probabilities; Qwen3-MoE and OLMoE when norm_topk_prob
    renorm = bool(getattr(mlp.gate, "norm_topk_prob", True))
    ex = stacked_experts(mlp.experts, activation_name(cfg.hidden_act))
    return moe_block(mlp.gate, ex, mlp.gate.top_k, softmax_first=True, renormalize=renorm)


def read(model) -> Anatomy:
    cfg = model.config
    base = model.model
    d, H, KV = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
    rot = rotary(base.rotary_emb)
    layers = []
    for blk in base.layers:
        a = blk.self_attn
        attn = Attention(
            **separate_qkv(a.q_proj, a.k_proj, a.v_proj, a.o_proj, H, KV), scale=a.scaling, rotary=rot,
            q_norm=rms_norm(a.q_norm) if hasattr(a, "q_norm") else None,
            k_norm=rms_norm(a.k_norm) if hasattr(a, "k_norm") else None,
            # the model's mask is a sliding window on every layer when config.sliding_window is set
            window=getattr(cfg, "sliding_window", None),
        )
        layers.append(Layer("pre", attn, moe_of(cfg, blk), ln_attn=rms_norm(blk.input_layernorm),
                            ln_mlp=rms_norm(blk.post_attention_layernorm)))
    return Anatomy(
        family="mixtral", model_type=cfg.model_type, d_model=d, n_ctx=rope_context(cfg, base.rotary_emb),
        vocab_size=cfg.vocab_size, embed=Embedding(W_E=base.embed_tokens.weight.detach()), layers=layers,
        final_norm=rms_norm(base.norm), unembed=Unembed(W_U=linear_in_out(model.lm_head)),
    )


def hooks(model) -> ModelHooks:
    base = model.model
    return ModelHooks.of(base.layers, base.norm, **MOE_SITES, norms=PRE_NORMS)


def _tiny_mixtral(tok: dict):
    from transformers import MixtralConfig

    # 4 experts, 2 per token; a sliding window of 5 so that tests exercise it
    return MixtralConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=128,
                         sliding_window=5, rope_theta=10000.0, tie_word_embeddings=False, **tiny_tokens(tok))


def _tiny_qwen3_moe(tok: dict):
    from transformers import Qwen3MoeConfig

    # 6 experts, 3 per token, probabilities not renormalised (Qwen3-MoE's default), head_dim != d_model / heads
    return Qwen3MoeConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=24, intermediate_size=96, moe_intermediate_size=32, num_experts=6,
                          num_experts_per_tok=3, norm_topk_prob=False, max_position_embeddings=128,
                          tie_word_embeddings=False, **tiny_tokens(tok))


FAMILY = Family(
    name="mixtral", model_types=("mixtral", "qwen3_moe"), read=read, hooks=hooks,
    tiny={"mixtral": _tiny_mixtral, "qwen3-moe": _tiny_qwen3_moe},
)
