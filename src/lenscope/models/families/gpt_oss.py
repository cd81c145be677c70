"""GPT-OSS: a mixture of experts with attention sinks (a learned logit per head in the softmax denominator),
alternating sliding-window and full attention layers, q/k/v/o biases, a router with a bias that takes the
``num_experts_per_tok`` largest logits and a softmax over them, and experts with biases whose unit is a clamped
SwiGLU: ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, limit)``."""

from __future__ import annotations

from ..weights.anatomy import activation_name
from ..weights.moe import MoE
from . import Family, moe_block, require, stacked_experts, tiny_tokens
from .llama import Layout


def _check(cfg) -> None:
    require(activation_name(cfg.hidden_act) == "silu",
            f"GPT-OSS experts compute x * sigmoid(alpha x) whatever hidden_act says; got {cfg.hidden_act!r}")


def _moe(cfg, blk) -> MoE:
    mlp = blk.mlp
    ex = mlp.experts
    experts = stacked_experts(ex, "silu", interleaved=True, transposed=True, alpha=float(ex.alpha),
                              gate_limit=float(ex.limit), up_limit=float(ex.limit), up_offset=1.0)
    return moe_block(mlp.router, experts, mlp.router.top_k, softmax_first=False)


# the Llama layout (the sinks and the layer types' windows are read from the attention modules and the config) with
# the MoE block in place of the MLP
LAYOUT = Layout(family="gpt_oss", moe=_moe, check=_check)


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


FAMILY = Family(name="gpt_oss", model_types=("gpt_oss",), read=LAYOUT.read, hooks=LAYOUT.hooks,
                tiny={"gpt-oss": _tiny})
