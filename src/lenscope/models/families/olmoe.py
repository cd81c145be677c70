"""OLMoE: a Llama-style mixture of experts whose query and key norms act over all heads' features at once (before
the split into heads), a router without bias, a softmax over the experts, the ``num_experts_per_tok`` largest
(renormalised when ``norm_topk_prob``), SwiGLU experts without biases. No sliding window (the model's mask is
causal whatever the config says)."""

from __future__ import annotations

from . import Family, require, tiny_tokens
from .llama import Layout
from .mixtral import moe_of


def _check(cfg) -> None:
    # clamping q, k and v makes attention non-linear in its values: no exact decomposition of it
    require(getattr(cfg, "clip_qkv", None) is None, "OLMoE with clip_qkv is not supported (it clamps the values)")


# the Llama layout with Mixtral's MoE block; its q/k norms over the whole projection are read from their width
LAYOUT = Layout(family="olmoe", moe=moe_of, check=_check)


def _tiny(tok: dict):
    from transformers import OlmoeConfig

    # 5 experts, 2 per token, renormalised; 8 heads over 4 key/value heads
    return OlmoeConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=8, num_key_value_heads=4,
                       intermediate_size=40, num_experts=5, num_experts_per_tok=2, norm_topk_prob=True,
                       max_position_embeddings=128, tie_word_embeddings=False, **tiny_tokens(tok))


FAMILY = Family(name="olmoe", model_types=("olmoe",), read=LAYOUT.read, hooks=LAYOUT.hooks,
                tiny={"olmoe": _tiny})
