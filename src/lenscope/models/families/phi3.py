"""Phi-3 (Phi-3, Phi-3.5, Phi-4-mini): the Llama layout with a fused ``qkv_proj`` and ``gate_up_proj``, partial
rotary (``partial_rotary_factor``), an optional sliding window over every layer, and LongRoPE in the long-context
models (lenscope then runs them up to the original pretraining length: see ``rope_context``)."""

from __future__ import annotations

from . import Family, tiny_tokens
from .llama import Layout

LAYOUT = Layout(family="phi3")


def _tiny(tok: dict):
    from transformers import Phi3Config

    # grouped-query attention through the fused projection, half the head rotated, a window smaller than the texts
    return Phi3Config(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=128, max_position_embeddings=128, original_max_position_embeddings=128,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
                      sliding_window=6, tie_word_embeddings=False, **tiny_tokens(tok))


FAMILY = Family(name="phi3", model_types=("phi3",), read=LAYOUT.read, hooks=LAYOUT.hooks, tiny={"phi3": _tiny})
