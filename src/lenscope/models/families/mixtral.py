"""Llama-style mixtures of experts: Mixtral and Qwen3-MoE — RMSNorm, rotary, grouped-query attention (Qwen3-MoE:
per-head q/k norms), an optional sliding window on every layer, and a sparse MoE block in place of the MLP: a
router without bias, a softmax over the experts, the ``num_experts_per_tok`` largest (renormalised always for
Mixtral, when ``norm_topk_prob`` for Qwen3-MoE), SwiGLU experts without biases."""

from __future__ import annotations

from ..weights.anatomy import activation_name
from ..weights.moe import MoE
from . import Family, moe_block, require, stacked_experts, tiny_tokens
from .llama import Layout


def moe_of(cfg, blk) -> MoE:
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


# the Llama layout with the MoE block in place of the MLP; the model's mask is a sliding window on every layer when
# config.sliding_window is set (Qwen3-MoE: with use_sliding_window), the Llama layout's reading of it
LAYOUT = Layout(family="mixtral", moe=moe_of)


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
    name="mixtral", model_types=("mixtral", "qwen3_moe"), read=LAYOUT.read, hooks=LAYOUT.hooks,
    tiny={"mixtral": _tiny_mixtral, "qwen3-moe": _tiny_qwen3_moe},
)
