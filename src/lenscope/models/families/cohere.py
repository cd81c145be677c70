"""Cohere (Command R): a parallel block whose attention and gated MLP read one LayerNorm without bias
(``input_layernorm``: mean-centred, weight only), rotary with adjacent pairs rotated (rotate-every-two), grouped-query
attention with optional biases and optional per-head q/k LayerNorms, and logits multiplied by ``logit_scale``."""

from __future__ import annotations

from . import Family, require, tiny_tokens
from .llama import Layout, Scales


def _scales(cfg) -> Scales:
    require(cfg.logit_scale is not None,
            "Cohere with logit_scale=None is not supported (the model itself cannot run it)")
    return Scales(logits=cfg.logit_scale)


# the Llama layout with LayerNorms, rotate-every-two and the logits' multiplier; the parallel block (no second norm),
# the biases and the per-head q/k norms are read from the modules
LAYOUT = Layout(family="cohere", norm="layernorm", scales=_scales, rotate_pairs=True)


def _tiny(tok: dict):
    from transformers import CohereConfig

    return CohereConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=128, max_position_embeddings=128, use_qk_norm=True, attention_bias=True,
                        logit_scale=0.25, tie_word_embeddings=True, **tiny_tokens(tok))


FAMILY = Family(name="cohere", model_types=("cohere",), read=LAYOUT.read, hooks=LAYOUT.hooks,
                tiny={"cohere": _tiny})
