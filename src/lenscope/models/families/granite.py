"""Granite (IBM Granite 3.x dense): the Llama layout with constant multipliers — the token embedding's
(``embedding_multiplier``), what each sub-layer adds to the residual stream (``residual_multiplier``), the attention
scale (``attention_multiplier``, instead of ``d_head ** -0.5``) and the logits' (divided by ``logits_scaling``:
the head's ``logit_scale``, ``1 / logits_scaling``, as Cohere's)."""

from __future__ import annotations

from . import Family, tiny_tokens
from .llama import Layout, Scales


def _scales(cfg) -> Scales:
    return Scales(embed=cfg.embedding_multiplier, residual=cfg.residual_multiplier,
                  attention=cfg.attention_multiplier, logits=1.0 / cfg.logits_scaling)


LAYOUT = Layout(family="granite", scales=_scales)


def _tiny(tok: dict):
    from transformers import GraniteConfig

    # multipliers far from 1 (and the attention's from d_head ** -0.5), so a missed one shows
    return GraniteConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, max_position_embeddings=128, embedding_multiplier=6.0,
                         residual_multiplier=0.3, attention_multiplier=0.6, logits_scaling=4.0,
                         tie_word_embeddings=True, **tiny_tokens(tok))


FAMILY = Family(name="granite", model_types=("granite",), read=LAYOUT.read, hooks=LAYOUT.hooks,
                tiny={"granite": _tiny})
