"""OPT: separate q/k/v projections with biases, learned positions offset by 2, ReLU, Pre-LN."""

from __future__ import annotations

from ..weights.anatomy import MLP, Anatomy, Attention, Embedding, Layer, Unembed, activation_name
from . import SEPARATE_QKV, Family, ModelHooks, layer_norm, linear_in_out, require, separate_qkv, t, tiny_tokens


def read(model) -> Anatomy:
    cfg = model.config
    dec = model.model.decoder
    require(cfg.do_layer_norm_before, "OPT with do_layer_norm_before=False (OPT-350m, Post-LN) is not supported")
    require(dec.project_in is None and dec.project_out is None,
            "OPT with word_embed_proj_dim != hidden_size (project_in/out) is not supported")
    d, H = cfg.hidden_size, cfg.num_attention_heads
    dh = d // H
    layers = []
    for blk in dec.layers:
        a = blk.self_attn
        attn = Attention(**separate_qkv(a.q_proj, a.k_proj, a.v_proj, a.out_proj, H, H), scale=dh**-0.5)
        mlp = MLP(W_in=linear_in_out(blk.fc1), b_in=t(blk.fc1.bias), W_out=linear_in_out(blk.fc2),
                  b_out=t(blk.fc2.bias), act=activation_name(cfg.activation_function))
        layers.append(Layer("pre", attn, mlp, ln_attn=layer_norm(blk.self_attn_layer_norm),
                            ln_mlp=layer_norm(blk.final_layer_norm)))
    return Anatomy(
        family="opt", model_type=cfg.model_type, d_model=d, n_ctx=cfg.max_position_embeddings,
        vocab_size=cfg.vocab_size,
        embed=Embedding(W_E=dec.embed_tokens.weight.detach(), W_pos=dec.embed_positions.weight.detach(),
                        pos_offset=dec.embed_positions.offset),
        layers=layers, final_norm=layer_norm(dec.final_layer_norm),
        unembed=Unembed(W_U=linear_in_out(model.lm_head)),
    )


def hooks(model) -> ModelHooks:
    dec = model.model.decoder
    return ModelHooks.of(dec.layers, dec.final_layer_norm, attn="self_attn", attn_out="self_attn.out_proj",
                         mlp_out="fc2", act="activation_fn", **SEPARATE_QKV,
                         norms={"ln_attn": "self_attn_layer_norm", "ln_mlp": "final_layer_norm"})


def _tiny(tok: dict):
    from transformers import OPTConfig

    return OPTConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, ffn_dim=256,
                     word_embed_proj_dim=64, max_position_embeddings=128, **tiny_tokens(tok))


FAMILY = Family(name="opt", model_types=("opt",), read=read, hooks=hooks, tiny={"opt": _tiny})
