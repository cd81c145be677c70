"""SmolLM3: the Llama layout with layers that use no rotary embedding (``no_rope_layers``: NoPE every
``no_rope_layer_interval``-th layer) and optional sliding windows."""

from __future__ import annotations

from . import Family, tiny_tokens
from .llama import Layout

LAYOUT = Layout(family="smollm3")


def _tiny(tok: dict):
    from transformers import SmolLM3Config

    # three layers: the last without rotary
    return SmolLM3Config(num_hidden_layers=3, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, max_position_embeddings=128, no_rope_layer_interval=3,
                         tie_word_embeddings=True, **tiny_tokens(tok))


FAMILY = Family(name="smollm3", model_types=("smollm3",), read=LAYOUT.read, hooks=LAYOUT.hooks,
                tiny={"smollm3": _tiny})
