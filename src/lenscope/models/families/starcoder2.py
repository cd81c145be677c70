"""StarCoder2: LayerNorm, rotary, grouped-query attention with biases, a plain (non-gated) MLP ``c_fc -> act ->
c_proj`` with biases, and a sliding window on every layer when ``sliding_window`` is set."""

from __future__ import annotations

from ..anatomy import MLP, Anatomy, Attention, Embedding, Layer, Unembed, activation_name
from . import (
    PRE_NORMS,
    SEPARATE_QKV,
    Family,
    ModelHooks,
    layer_norm,
    linear_in_out,
    rope_context,
    rotary,
    separate_qkv,
    t,
    tiny_tokens,
)


def read(model) -> Anatomy:
    cfg = model.config
    base = model.model
    rot = rotary(base.rotary_emb)
    layers = []
    for blk in base.layers:
        a = blk.self_attn
        H = cfg.num_attention_heads
        KV = H // a.num_key_value_groups
        attn = Attention(**separate_qkv(a.q_proj, a.k_proj, a.v_proj, a.o_proj, H, KV), scale=float(a.scaling),
                         rotary=rot, window=cfg.sliding_window)
        mlp = MLP(W_in=linear_in_out(blk.mlp.c_fc), b_in=t(blk.mlp.c_fc.bias), W_out=linear_in_out(blk.mlp.c_proj),
                  b_out=t(blk.mlp.c_proj.bias), act=activation_name(cfg.hidden_act))
        layers.append(Layer("pre", attn, mlp, ln_attn=layer_norm(blk.input_layernorm),
                            ln_mlp=layer_norm(blk.post_attention_layernorm)))
    return Anatomy(
        family="starcoder2", model_type=cfg.model_type, d_model=cfg.hidden_size,
        n_ctx=rope_context(cfg, base.rotary_emb),
        vocab_size=cfg.vocab_size, embed=Embedding(W_E=base.embed_tokens.weight.detach()), layers=layers,
        final_norm=layer_norm(base.norm),
        unembed=Unembed(W_U=linear_in_out(model.lm_head), b_U=t(model.lm_head.bias)),
    )


PATHS = {"attn": "self_attn", "attn_out": "self_attn.o_proj", "mlp_out": "mlp.c_proj", "act": "mlp.act",
         **SEPARATE_QKV, "norms": PRE_NORMS}


def hooks(model) -> ModelHooks:
    return ModelHooks.of(model.model.layers, model.model.norm, **PATHS)


def _tiny(tok: dict):
    from transformers import Starcoder2Config

    # a small sliding window, so that tests exercise the windowed mask
    return Starcoder2Config(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                            intermediate_size=256, max_position_embeddings=128, sliding_window=5, use_bias=True,
                            tie_word_embeddings=False, **tiny_tokens(tok))


FAMILY = Family(name="starcoder2", model_types=("starcoder2",), read=read, hooks=hooks,
                tiny={"starcoder2": _tiny})
