"""OLMo 2 and OLMo 3: the Llama layout with its norms on the sub-layers' outputs only (``post_attention_layernorm``
and ``post_feedforward_layernorm``; attention and the MLP read the residual stream itself) and q/k RMSNorms over
the whole projection (every head's features together); OLMo 3 adds sliding-window layers with their own rotary."""

from __future__ import annotations

from . import Family, tiny_tokens
from .llama import Layout

LAYOUT = Layout(family="olmo2", norms_after=True)


def _tiny(tok: dict):
    from transformers import Olmo2Config

    return Olmo2Config(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=128, max_position_embeddings=128, tie_word_embeddings=False,
                       **tiny_tokens(tok))


FAMILY = Family(name="olmo2", model_types=("olmo2", "olmo3"), read=LAYOUT.read, hooks=LAYOUT.hooks,
                tiny={"olmo2": _tiny})
