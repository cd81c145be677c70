"""GPT-2: Conv1D weights stored as (in, out), fused QKV, learned positions, LayerNorm, Pre-LN."""

from __future__ import annotations

import math

from ..weights.anatomy import MLP, Anatomy, Attention, Embedding, Layer, Unembed, activation_name
from . import Family, ModelHooks, layer_norm, split_bias, split_heads_in, split_heads_out, t


def read(model) -> Anatomy:
    cfg = model.config
    tr = model.transformer
    d, H = cfg.n_embd, cfg.n_head
    dh = d // H
    layers = []
    for i, blk in enumerate(tr.h):
        W = blk.attn.c_attn.weight.detach()  # (d, 3d), Conv1D keeps (in, out)
        b = blk.attn.c_attn.bias.detach()
        Wq, Wk, Wv = W.split(d, dim=1)
        bq, bk, bv = b.split(d)
        scale = 1.0 / math.sqrt(dh) if cfg.scale_attn_weights else 1.0
        if getattr(cfg, "scale_attn_by_inverse_layer_idx", False):
            scale /= float(i + 1)
        attn = Attention(
            W_Q=split_heads_in(Wq, H), W_K=split_heads_in(Wk, H), W_V=split_heads_in(Wv, H),
            W_O=split_heads_out(blk.attn.c_proj.weight.detach(), H),
            b_Q=split_bias(bq, H), b_K=split_bias(bk, H), b_V=split_bias(bv, H),
            b_O=t(blk.attn.c_proj.bias), scale=scale,
        )
        mlp = MLP(
            W_in=blk.mlp.c_fc.weight.detach(), b_in=t(blk.mlp.c_fc.bias),
            W_out=blk.mlp.c_proj.weight.detach(), b_out=t(blk.mlp.c_proj.bias),
            act=activation_name(cfg.activation_function),
        )
        layers.append(Layer("pre", attn, mlp, ln_attn=layer_norm(blk.ln_1), ln_mlp=layer_norm(blk.ln_2)))
    return Anatomy(
        family="gpt2", model_type=cfg.model_type, d_model=d, n_ctx=cfg.n_positions, vocab_size=cfg.vocab_size,
        embed=Embedding(W_E=tr.wte.weight.detach(), W_pos=tr.wpe.weight.detach()),
        layers=layers, final_norm=layer_norm(tr.ln_f), unembed=Unembed(W_U=model.lm_head.weight.detach().T),
    )


def hooks(model) -> ModelHooks:
    tr = model.transformer
    return ModelHooks.of(tr.h, tr.ln_f, attn="attn", attn_out="attn.c_proj", mlp_out="mlp.c_proj", act="mlp.act",
                         qkv="attn.c_attn", qkv_layout="blocks", norms={"ln_attn": "ln_1", "ln_mlp": "ln_2"})


def _tiny(tok: dict):
    from transformers import GPT2Config

    return GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=128, vocab_size=tok["vocab_size"],
                      bos_token_id=tok["bos"], eos_token_id=tok["eos"])


FAMILY = Family(name="gpt2", model_types=("gpt2",), read=read, hooks=hooks, tiny={"gpt2": _tiny})
