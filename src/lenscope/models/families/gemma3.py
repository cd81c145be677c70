"""Gemma 3: scaled embeddings, (1 + w) RMSNorms in sandwich placement, q/k norms, grouped-query
attention, local (sliding-window) and global layers with their own rotary bases, optional soft-capping.

Both ways Hugging Face ships it: ``gemma3_text`` (Gemma3ForCausalLM: the 270M and 1B models) and ``gemma3``
(Gemma3ForConditionalGeneration, the multimodal checkpoints: a vision tower beside the same text model, whose text
part lenscope reads; text inputs never reach the vision tower). :func:`read_gemma` is the reader of the Gemma
layout, shared with Gemma 2 (``gemma2.py``)."""

from __future__ import annotations

from .. import families as fam
from ..weights.anatomy import Anatomy, Attention, Embedding, Layer, Unembed, activation_name

GEMMA_NORMS = {"ln_attn": "input_layernorm", "ln_mlp": "pre_feedforward_layernorm",
               "ln_attn_out": "post_attention_layernorm", "ln_mlp_out": "post_feedforward_layernorm"}


def text_parts(model):
    """``(text config, text model)`` of a Gemma model: a multimodal ``gemma3`` model's language model and the
    ``text_config`` inside its config, or the model's own."""
    base = model.model if hasattr(model, "model") else model
    return model.config.get_text_config(), getattr(base, "language_model", base)


def read_gemma(model, *, family: str, attn_softcap: bool) -> Anatomy:
    """The Anatomy of a Gemma-layout decoder (Gemma 2, Gemma 3). ``attn_softcap``: whether the attention passes
    ``attn_logit_softcapping`` to its kernels (Gemma 2 does; transformers' Gemma 3 does not, whatever its config
    says). The final soft-cap is read where the model applies it (its ``ForCausalLM`` head; Gemma 3's multimodal
    head applies none)."""
    cfg, base = text_parts(model)
    multimodal = base is not getattr(model, "model", model)  # the text model inside a multimodal wrapper
    bidirectional = bool(getattr(cfg, "use_bidirectional_attention", False))
    fam.require(not (bidirectional and (multimodal or family == "gemma2")),
            f"{model.config.model_type} with use_bidirectional_attention is not supported (its causal mask is built "
            "outside the text model); load a causal checkpoint")
    d, H, KV = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
    rot_mod = base.rotary_emb
    per_type = isinstance(getattr(rot_mod, "rope_type", None), dict)  # Gemma 3: one rotary base per layer type
    layers = []
    for i, blk in enumerate(base.layers):
        a = blk.self_attn
        kind = cfg.layer_types[i]
        attn = Attention(
            **fam.separate_qkv(a.q_proj, a.k_proj, a.v_proj, a.o_proj, H, KV),
            scale=cfg.query_pre_attn_scalar**-0.5,
            rotary=fam.rotary(rot_mod, prefix=f"{kind}_" if per_type else ""),
            q_norm=fam.rms_norm(a.q_norm, offset=1.0) if hasattr(a, "q_norm") else None,
            k_norm=fam.rms_norm(a.k_norm, offset=1.0) if hasattr(a, "k_norm") else None,
            # transformers' Gemma 3 attention does not pass attn_logit_softcapping to its kernels, so the
            # model that runs has no attention soft-capping whatever the config says (verify checks this)
            softcap=cfg.attn_logit_softcapping if attn_softcap else None,
            window=cfg.sliding_window if kind == "sliding_attention" else None,
            causal=not bidirectional,
        )
        mlp = fam.gated_mlp(blk.mlp, activation_name(cfg.hidden_activation))
        layers.append(Layer(
            "sandwich", attn, mlp,
            ln_attn=fam.rms_norm(blk.input_layernorm, offset=1.0),
            ln_mlp=fam.rms_norm(blk.pre_feedforward_layernorm, offset=1.0),
            ln_attn_out=fam.rms_norm(blk.post_attention_layernorm, offset=1.0),
            ln_mlp_out=fam.rms_norm(blk.post_feedforward_layernorm, offset=1.0),
        ))
    emb = base.embed_tokens
    return Anatomy(
        family=family, model_type=model.config.model_type, d_model=d, n_ctx=fam.rope_context(cfg, rot_mod),
        vocab_size=cfg.vocab_size,
        embed=Embedding(W_E=emb.weight.detach(), scale=float(emb.embed_scale.to(emb.weight.dtype))),
        layers=layers, final_norm=fam.rms_norm(base.norm, offset=1.0),
        unembed=Unembed(W_U=fam.linear_in_out(model.lm_head),
                        softcap=None if multimodal else cfg.final_logit_softcapping),
        causal=not bidirectional,
    )


def hooks_gemma(model) -> fam.ModelHooks:
    _, base = text_parts(model)
    return fam.ModelHooks.of(base.layers, base.norm, **fam.GATED_SITES, norms=GEMMA_NORMS)


def read(model) -> Anatomy:
    return read_gemma(model, family="gemma3", attn_softcap=False)


def _tiny_kwargs(tok: dict) -> dict:
    # a small sliding window so that tests exercise both the local and the global mask
    return dict(num_hidden_layers=3, hidden_size=64, num_attention_heads=4, num_key_value_heads=1,
                head_dim=32, intermediate_size=128, max_position_embeddings=128, sliding_window=4,
                layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                query_pre_attn_scalar=32, final_logit_softcapping=None, **fam.tiny_tokens(tok))


def _tiny(tok: dict):
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(**_tiny_kwargs(tok))


def _tiny_multimodal(tok: dict):
    from transformers import Gemma3Config, SiglipVisionConfig

    # the multimodal wrapper as the 4B-27B checkpoints ship it, with a minimal vision tower; the text config sets a
    # final soft-cap that the multimodal head does not apply (the Anatomy must follow the model), and a rotary
    # scaling of the global layers as the checkpoints have it
    text = _tiny_kwargs(tok) | dict(
        final_logit_softcapping=0.5,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})
    vision = SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                image_size=16, patch_size=8)
    return Gemma3Config(text_config=text, vision_config=vision.to_dict(), mm_tokens_per_image=4,
                        image_token_id=tok["vocab_size"] + 1, boi_token_id=tok["vocab_size"] + 2,
                        eoi_token_id=tok["vocab_size"] + 3, tie_word_embeddings=True)


FAMILY = fam.Family(name="gemma3", model_types=("gemma3_text", "gemma3"), read=read, hooks=hooks_gemma,
                tiny={"gemma3": _tiny, "gemma3-multimodal": _tiny_multimodal})
