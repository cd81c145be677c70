"""StarCoder2: LayerNorm, rotary, grouped-query attention with biases, a plain (non-gated) MLP ``c_fc -> act ->
c_proj`` with biases, and a sliding window on every layer when ``sliding_window`` is set."""

from __future__ import annotations

from . import Family, tiny_tokens
from .llama import Layout

# the Llama layout with LayerNorms; the plain MLP, the biases and the window are read from the modules and the config
LAYOUT = Layout(family="starcoder2", norm="layernorm")


def _tiny(tok: dict):
    from transformers import Starcoder2Config

    # a small sliding window, so that tests exercise the windowed mask
    return Starcoder2Config(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                            intermediate_size=256, max_position_embeddings=128, sliding_window=5, use_bias=True,
                            tie_word_embeddings=False, **tiny_tokens(tok))


FAMILY = Family(name="starcoder2", model_types=("starcoder2",), read=LAYOUT.read, hooks=LAYOUT.hooks,
                tiny={"starcoder2": _tiny})
