"""Gemma 3 (text): scaled embeddings, (1 + w) RMSNorms in sandwich placement, q/k norms, grouped-query
attention, local (sliding-window) and global layers with their own rotary bases, optional soft-capping."""

from __future__ import annotations

from ..anatomy import Anatomy, Attention, Embedding, Layer, Unembed, activation_name
from . import GATED_SITES, Family, ModelHooks, gated_mlp, linear_in_out, rms_norm, rotary, separate_qkv, tiny_tokens


def _base(model):
    return model.model if hasattr(model, "model") else model


def read(model) -> Anatomy:
    cfg = model.config
    base = _base(model)
    d, H, KV = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
    layers = []
    for i, blk in enumerate(base.layers):
        a = blk.self_attn
        kind = cfg.layer_types[i]
        attn = Attention(
            **separate_qkv(a.q_proj, a.k_proj, a.v_proj, a.o_proj, H, KV), scale=cfg.query_pre_attn_scalar**-0.5,
            rotary=rotary(base.rotary_emb, prefix=f"{kind}_"),
            q_norm=rms_norm(a.q_norm, offset=1.0), k_norm=rms_norm(a.k_norm, offset=1.0),
            # transformers' Gemma 3 attention does not pass attn_logit_softcapping to its kernels, so the
            # model that runs has no attention soft-capping whatever the config says (verify checks this)
            softcap=None,
            window=cfg.sliding_window if kind == "sliding_attention" else None,
            causal=not getattr(cfg, "use_bidirectional_attention", False),
        )
        mlp = gated_mlp(blk.mlp, activation_name(cfg.hidden_activation))
        layers.append(Layer(
            "sandwich", attn, mlp,
            ln_attn=rms_norm(blk.input_layernorm, offset=1.0),
            ln_mlp=rms_norm(blk.pre_feedforward_layernorm, offset=1.0),
            ln_attn_out=rms_norm(blk.post_attention_layernorm, offset=1.0),
            ln_mlp_out=rms_norm(blk.post_feedforward_layernorm, offset=1.0),
        ))
    emb = base.embed_tokens
    return Anatomy(
        family="gemma3", model_type=cfg.model_type, d_model=d, n_ctx=cfg.max_position_embeddings,
        vocab_size=cfg.vocab_size,
        embed=Embedding(W_E=emb.weight.detach(), scale=float(emb.embed_scale.to(emb.weight.dtype))),
        layers=layers, final_norm=rms_norm(base.norm, offset=1.0),
        unembed=Unembed(W_U=linear_in_out(model.lm_head), softcap=cfg.final_logit_softcapping),
        causal=not getattr(cfg, "use_bidirectional_attention", False),
    )


def hooks(model) -> ModelHooks:
    base = _base(model)
    return ModelHooks.of(base.layers, base.norm, **GATED_SITES,
                         norms={"ln_attn": "input_layernorm", "ln_mlp": "pre_feedforward_layernorm",
                                "ln_attn_out": "post_attention_layernorm", "ln_mlp_out": "post_feedforward_layernorm"})


def _tiny(tok: dict):
    from transformers import Gemma3TextConfig

    # a small sliding window so that tests exercise both the local and the global mask
    return Gemma3TextConfig(num_hidden_layers=3, hidden_size=64, num_attention_heads=4, num_key_value_heads=1,
                            head_dim=32, intermediate_size=128, max_position_embeddings=128, sliding_window=4,
                            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                            query_pre_attn_scalar=32, final_logit_softcapping=None, **tiny_tokens(tok))


FAMILY = Family(name="gemma3", model_types=("gemma3_text",), read=read, hooks=hooks, tiny={"gemma3": _tiny})
