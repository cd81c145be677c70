"""BLOOM: ALiBi instead of positions, LayerNorm on the embeddings, fused per-head QKV, Pre-LN."""

from __future__ import annotations

from ..weights.anatomy import MLP, Anatomy, Attention, Embedding, Layer, Unembed, alibi_slopes
from . import PRE_NORMS, Family, ModelHooks, layer_norm, linear_in_out, require, split_heads_out, t, tiny_tokens


def read(model) -> Anatomy:
    cfg = model.config
    tr = model.transformer
    require(not cfg.apply_residual_connection_post_layernorm,
            "BLOOM with apply_residual_connection_post_layernorm=True is not supported")
    d, H = cfg.hidden_size, cfg.n_head
    dh = d // H
    slopes = alibi_slopes(H)
    layers = []
    for blk in tr.h:
        qkv = blk.self_attention.query_key_value
        W = qkv.weight.detach().reshape(H, 3, dh, d)  # rows: per head [q | k | v]
        b = qkv.bias.detach().reshape(H, 3, dh)
        attn = Attention(
            W_Q=W[:, 0].transpose(1, 2), W_K=W[:, 1].transpose(1, 2), W_V=W[:, 2].transpose(1, 2),
            W_O=split_heads_out(linear_in_out(blk.self_attention.dense), H),
            b_Q=b[:, 0], b_K=b[:, 1], b_V=b[:, 2], b_O=t(blk.self_attention.dense.bias),
            scale=dh**-0.5, alibi=slopes,
        )
        mlp = MLP(W_in=linear_in_out(blk.mlp.dense_h_to_4h), b_in=t(blk.mlp.dense_h_to_4h.bias),
                  W_out=linear_in_out(blk.mlp.dense_4h_to_h), b_out=t(blk.mlp.dense_4h_to_h.bias), act="gelu_tanh")
        layers.append(Layer("pre", attn, mlp, ln_attn=layer_norm(blk.input_layernorm),
                            ln_mlp=layer_norm(blk.post_attention_layernorm)))
    return Anatomy(
        family="bloom", model_type=cfg.model_type, d_model=d, n_ctx=int(getattr(cfg, "seq_length", 2048) or 2048),
        vocab_size=cfg.vocab_size,
        embed=Embedding(W_E=tr.word_embeddings.weight.detach(), norm=layer_norm(tr.word_embeddings_layernorm)),
        layers=layers, final_norm=layer_norm(tr.ln_f), unembed=Unembed(W_U=linear_in_out(model.lm_head)),
    )


# where the engine's sites are in a BloomBlock (fused q/k/v laid out per head)
PATHS = {"attn": "self_attention", "attn_out": "self_attention.dense", "mlp_out": "mlp.dense_4h_to_h",
         "act": "mlp.gelu_impl", "qkv": "self_attention.query_key_value", "qkv_layout": "grouped", "norms": PRE_NORMS}


def hooks(model) -> ModelHooks:
    return ModelHooks.of(model.transformer.h, model.transformer.ln_f, **PATHS)


def _tiny(tok: dict):
    from transformers import BloomConfig

    return BloomConfig(n_layer=2, hidden_size=64, n_head=4, seq_length=128, **tiny_tokens(tok))


FAMILY = Family(name="bloom", model_types=("bloom",), read=read, hooks=hooks, tiny={"bloom": _tiny})
