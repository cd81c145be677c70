"""Gemma 2: the Gemma layout of ``gemma3.py`` ((1 + w) RMSNorms in sandwich placement, scaled embeddings,
``query_pre_attn_scalar``, alternating local (sliding-window) and global layers) without q/k norms, with one rotary
base, and with the soft-caps that transformers' Gemma 2 applies: the attention scores' (``attn_logit_softcapping``,
passed to its kernels) and the final logits'."""

from __future__ import annotations

from . import Family, tiny_tokens
from .gemma3 import hooks_gemma, read_gemma


def read(model):
    return read_gemma(model, family="gemma2", attn_softcap=True)


def _tiny(tok: dict):
    from transformers import Gemma2Config

    # larger weights (initializer_range) and soft-caps small enough that both caps bend the tiny
    # model's scores and logits; a window shorter than the texts
    return Gemma2Config(num_hidden_layers=3, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, intermediate_size=128, max_position_embeddings=128, sliding_window=4,
                        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                        query_pre_attn_scalar=16, attn_logit_softcapping=2.0, final_logit_softcapping=5.0,
                        initializer_range=0.1, **tiny_tokens(tok))


FAMILY = Family(name="gemma2", model_types=("gemma2",), read=read, hooks=hooks_gemma, tiny={"gemma2": _tiny})
