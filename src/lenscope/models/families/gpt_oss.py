"""GPT-OSS: a mixture of experts with attention sinks (a learned logit per head in the softmax denominator),
alternating sliding-window and full attention layers, q/k/v/o biases, a router with a bias that takes the
``num_experts_per_tok`` largest logits and a softmax over them, and experts with biases whose unit is a clamped
SwiGLU: ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, limit)``."""

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

SITES = {"attn": "self_attn", "attn_out": "self_attn.o_proj", "mlp_out": "mlp", "act": "mlp.experts",
         "router": "mlp.router", "experts": "mlp.experts", **SEPARATE_QKV}


def read(model) -> Anatomy:
    cfg = model.config
    base = model.model
    d, H, KV = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
    require(activation_name(cfg.hidden_act) == "silu",
            f"GPT-OSS experts compute x * sigmoid(alpha x) whatever hidden_act says; got {cfg.hidden_act!r}")
    rot = rotary(base.rotary_emb)
    layers = []
    for blk in base.layers:
        a = blk.self_attn
        attn = Attention(**separate_qkv(a.q_proj, a.k_proj, a.v_proj, a.o_proj, H, KV), scale=a.scaling, rotary=rot,
                         window=a.sliding_window, sinks=a.sinks.detach())
        mlp = blk.mlp
        ex = mlp.experts
        experts = stacked_experts(ex, "silu", interleaved=True, transposed=True, alpha=float(ex.alpha),
                                  gate_limit=float(ex.limit), up_limit=float(ex.limit), up_offset=1.0)
        moe = moe_block(mlp.router, experts, mlp.router.top_k, softmax_first=False)
        layers.append(Layer("pre", attn, moe, ln_attn=rms_norm(blk.input_layernorm),
                            ln_mlp=rms_norm(blk.post_attention_layernorm)))
    return Anatomy(
        family="gpt_oss", model_type=cfg.model_type, d_model=d, n_ctx=rope_context(cfg, base.rotary_emb),
        vocab_size=cfg.vocab_size, embed=Embedding(W_E=base.embed_tokens.weight.detach()), layers=layers,
        final_norm=rms_norm(base.norm), unembed=Unembed(W_U=linear_in_out(model.lm_head)),
    )


def hooks(model) -> ModelHooks:
    base = model.model
    return ModelHooks.of(base.layers, base.norm, **SITES, norms=PRE_NORMS)


def _tiny(tok: dict):
    from transformers import GptOssConfig

    # 4 experts, 2 per token; a sliding window of 4 on every other layer; a small limit (0.3) so that the tiny
    # model's pre-activations reach both clamps; YaRN rotary as the real models (factor 32 over 4 positions)
    rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": False, "original_max_position_embeddings": 4}
    return GptOssConfig(rope_parameters=rope, num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, intermediate_size=32, num_local_experts=4,
                        num_experts_per_tok=2, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                        swiglu_limit=0.3, max_position_embeddings=128, tie_word_embeddings=False, **tiny_tokens(tok))


FAMILY = Family(name="gpt_oss", model_types=("gpt_oss",), read=read, hooks=hooks, tiny={"gpt-oss": _tiny})
