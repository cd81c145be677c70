"""GPT-J: a parallel block whose attention and MLP read one LayerNorm (``ln_1``), partial rotary on the first
``rotary_dim`` features of each head with adjacent pairs rotated (rotate-every-two), q/k/v and output projections
without biases, an MLP ``fc_in -> act -> fc_out`` with biases and an LM head with a bias."""

from __future__ import annotations

import torch

from ..weights.anatomy import MLP, Anatomy, Attention, Embedding, Layer, Rotary, Unembed, activation_name
from . import Family, ModelHooks, layer_norm, linear_in_out, require, separate_qkv, t, tiny_tokens


def gptj_rotary(attn, n_embd: int) -> Rotary:
    """GPT-J's rotary: frequencies ``10000^(-2i / rotary_dim)`` computed as transformers does (its sinusoid table
    has no ``inv_freq``), on the first ``rotary_dim`` features of a head (the whole hidden size when unset, which runs
    only for one head)."""
    dim = attn.rotary_dim or n_embd
    require(dim <= attn.head_dim and dim % 2 == 0,
            f"GPT-J with rotary_dim={attn.rotary_dim} is not supported: it must be even and at most the head size "
            f"{attn.head_dim}")
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.int64) / dim))
    return Rotary(inv_freq=inv_freq.float(), dim=dim, interleaved=True)


def read(model) -> Anatomy:
    cfg = model.config
    tr = model.transformer
    layers = []
    for blk in tr.h:
        a = blk.attn
        H = a.num_attention_heads
        attn = Attention(**separate_qkv(a.q_proj, a.k_proj, a.v_proj, a.out_proj, H, H), scale=float(a.scaling),
                         rotary=gptj_rotary(a, cfg.n_embd))
        mlp = MLP(W_in=linear_in_out(blk.mlp.fc_in), b_in=t(blk.mlp.fc_in.bias), W_out=linear_in_out(blk.mlp.fc_out),
                  b_out=t(blk.mlp.fc_out.bias), act=activation_name(cfg.activation_function))
        ln = layer_norm(blk.ln_1)  # one norm read by both branches
        layers.append(Layer("parallel", attn, mlp, ln_attn=ln, ln_mlp=ln))
    return Anatomy(
        family="gptj", model_type=cfg.model_type, d_model=cfg.n_embd, n_ctx=cfg.n_positions,
        vocab_size=cfg.vocab_size, embed=Embedding(W_E=tr.wte.weight.detach()), layers=layers,
        final_norm=layer_norm(tr.ln_f),
        unembed=Unembed(W_U=linear_in_out(model.lm_head), b_U=t(model.lm_head.bias)),
    )


PATHS = {"attn": "attn", "attn_out": "attn.out_proj", "mlp_out": "mlp.fc_out", "act": "mlp.act",
         "q": "attn.q_proj", "k": "attn.k_proj", "v": "attn.v_proj", "readers": {"ln_mlp": "mlp"},
         "norms": {"ln_attn": "ln_1", "ln_mlp": "ln_1"}}


def hooks(model) -> ModelHooks:
    return ModelHooks.of(model.transformer.h, model.transformer.ln_f, **PATHS)


def _tiny(tok: dict):
    from transformers import GPTJConfig

    # rotary on 8 of each head's 16 features: partial, interleaved
    return GPTJConfig(n_layer=2, n_embd=64, n_head=4, rotary_dim=8, n_inner=128, n_positions=128,
                      **tiny_tokens(tok))


FAMILY = Family(name="gptj", model_types=("gptj",), read=read, hooks=hooks, tiny={"gptj": _tiny})
