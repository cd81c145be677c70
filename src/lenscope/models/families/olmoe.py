"""OLMoE: a Llama-style mixture of experts whose query and key norms act over all heads' features at once (before
the split into heads), a router without bias, a softmax over the experts, the ``num_experts_per_tok`` largest
(renormalised when ``norm_topk_prob``), SwiGLU experts without biases. No sliding window (the model's mask is
causal whatever the config says)."""

from __future__ import annotations

from ..anatomy import Anatomy, Attention, Embedding, Layer, Unembed
from . import (
    PRE_NORMS,
    Family,
    ModelHooks,
    linear_in_out,
    require,
    rms_norm,
    rope_context,
    rotary,
    separate_qkv,
    tiny_tokens,
)
from .mixtral import MOE_SITES, moe_of


def read(model) -> Anatomy:
    cfg = model.config
    base = model.model
    d, H, KV = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
    # clamping q, k and v makes attention non-linear in its values: no exact decomposition of it
    require(getattr(cfg, "clip_qkv", None) is None, "OLMoE with clip_qkv is not supported (it clamps the values)")
    rot = rotary(base.rotary_emb)
    layers = []
    for blk in base.layers:
        a = blk.self_attn
        attn = Attention(**separate_qkv(a.q_proj, a.k_proj, a.v_proj, a.o_proj, H, KV), scale=a.scaling, rotary=rot,
                         q_norm=rms_norm(a.q_norm), k_norm=rms_norm(a.k_norm), qk_norm_across_heads=True)
        layers.append(Layer("pre", attn, moe_of(cfg, blk), ln_attn=rms_norm(blk.input_layernorm),
                            ln_mlp=rms_norm(blk.post_attention_layernorm)))
    return Anatomy(
        family="olmoe", model_type=cfg.model_type, d_model=d, n_ctx=rope_context(cfg, base.rotary_emb),
        vocab_size=cfg.vocab_size, embed=Embedding(W_E=base.embed_tokens.weight.detach()), layers=layers,
        final_norm=rms_norm(base.norm), unembed=Unembed(W_U=linear_in_out(model.lm_head)),
    )


def hooks(model) -> ModelHooks:
    base = model.model
    return ModelHooks.of(base.layers, base.norm, **MOE_SITES, norms=PRE_NORMS)


def _tiny(tok: dict):
    from transformers import OlmoeConfig

    # 5 experts, 2 per token, renormalised; 8 heads over 4 key/value heads
    return OlmoeConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=8, num_key_value_heads=4,
                       intermediate_size=40, num_experts=5, num_experts_per_tok=2, norm_topk_prob=True,
                       max_position_embeddings=128, tie_word_embeddings=False, **tiny_tokens(tok))


FAMILY = Family(name="olmoe", model_types=("olmoe",), read=read, hooks=hooks, tiny={"olmoe": _tiny})
