"""StableLM (StableLM 2, StableLM-3B-4E1T, StableCode): the Llama layout with LayerNorms (with biases), partial
rotary, optional q/k/v biases (``use_qkv_bias``), optional per-head q/k LayerNorms (``qk_layernorm``) and an optional
parallel residual (``use_parallel_residual``: attention and the MLP both read ``input_layernorm``'s output)."""

from __future__ import annotations

from . import Family, tiny_tokens
from .llama import Layout

LAYOUT = Layout(family="stablelm", norm="layernorm")


def _tiny(tok: dict):
    from transformers import StableLmConfig

    # every switch on: parallel residual, per-head q/k norms, q/k/v biases, a quarter of each head rotated
    return StableLmConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                          intermediate_size=128, max_position_embeddings=128, partial_rotary_factor=0.25,
                          use_qkv_bias=True, qk_layernorm=True, use_parallel_residual=True,
                          tie_word_embeddings=False, **tiny_tokens(tok))


FAMILY = Family(name="stablelm", model_types=("stablelm",), read=LAYOUT.read, hooks=LAYOUT.hooks,
                tiny={"stablelm": _tiny})
