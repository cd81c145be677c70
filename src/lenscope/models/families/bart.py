"""BART and Marian encoder-decoder models (translation, summarisation): an encoder and a decoder of Post-LN blocks,
the decoder's blocks with cross-attention over the encoder's output; learned positions at offset 2 (BART) or fixed
sinusoidal ones (Marian), ``scale_embedding``, BART's embedding LayerNorm, ``final_logits_bias``.

The reader is checked block by block against the real model (``tests/models/test_encoder_decoder.py``); what the
methods do with an encoder-decoder model is in docs/encoder-decoder.md.
"""

from __future__ import annotations

from ..anatomy import MLP, Anatomy, Attention, Embedding, Layer, Unembed, activation_name
from . import Family, ModelHooks, layer_norm, linear_in_out, require, separate_qkv, t

MODEL_TYPES = ("bart", "marian")


def _attention(mod, n_heads: int, causal: bool) -> Attention:
    """A BartAttention / MarianAttention (q, k, v, out projections with biases; scores scaled by
    ``d_head ** -0.5``)."""
    w = separate_qkv(mod.q_proj, mod.k_proj, mod.v_proj, mod.out_proj, n_heads, n_heads)
    return Attention(**w, scale=float(mod.scaling), causal=causal)


def _mlp(blk, act: str) -> MLP:
    return MLP(W_in=linear_in_out(blk.fc1), b_in=t(blk.fc1.bias), W_out=linear_in_out(blk.fc2), b_out=t(blk.fc2.bias),
               act=act)


def _embedding(stack) -> Embedding:
    """A stack's embedding: the token embedding times its scale (BART keeps it in the embedding module, Marian in
    the stack), positions (``offset``: BART's 2), BART's ``layernorm_embedding``."""
    tok = stack.embed_tokens
    scale = getattr(tok, "embed_scale", None)
    if scale is None:
        scale = getattr(stack, "embed_scale", 1.0)
    pos = stack.embed_positions
    ln = getattr(stack, "layernorm_embedding", None)
    return Embedding(W_E=tok.weight.detach(), scale=float(scale), W_pos=pos.weight.detach(),
                     pos_offset=int(getattr(pos, "offset", 0)), norm=None if ln is None else layer_norm(ln))


def _base(model):
    return model.model if hasattr(model, "model") else model


def read(model) -> Anatomy:
    cfg = model.config
    base = _base(model)
    require(cfg.model_type in MODEL_TYPES, f"the BART reader reads {', '.join(MODEL_TYPES)}, not {cfg.model_type!r}")
    for flag in ("normalize_before", "add_final_layer_norm"):  # mBART-style Pre-LN variants
        require(not getattr(cfg, flag, False), f"{cfg.model_type} with {flag}=True is not supported")
    act = activation_name(cfg.activation_function)
    enc, dec = base.encoder, base.decoder
    enc_layers = [Layer("post", _attention(b.self_attn, cfg.encoder_attention_heads, False), _mlp(b, act),
                        ln_attn=layer_norm(b.self_attn_layer_norm), ln_mlp=layer_norm(b.final_layer_norm))
                  for b in enc.layers]
    dec_layers = [Layer("post", _attention(b.self_attn, cfg.decoder_attention_heads, True), _mlp(b, act),
                        ln_attn=layer_norm(b.self_attn_layer_norm), ln_mlp=layer_norm(b.final_layer_norm),
                        cross=_attention(b.encoder_attn, cfg.decoder_attention_heads, False),
                        ln_cross=layer_norm(b.encoder_attn_layer_norm))
                  for b in dec.layers]
    n_ctx = int(cfg.max_position_embeddings)
    encoder = Anatomy(family="bart", model_type=cfg.model_type, d_model=cfg.d_model, n_ctx=n_ctx,
                      vocab_size=enc.embed_tokens.weight.shape[0], embed=_embedding(enc), layers=enc_layers,
                      final_norm=None, unembed=None, causal=False)
    unembed = None
    if hasattr(model, "lm_head"):
        bias = getattr(model, "final_logits_bias", None)
        unembed = Unembed(W_U=linear_in_out(model.lm_head), b_U=None if bias is None else bias.detach()[0])
    return Anatomy(family="bart", model_type=cfg.model_type, d_model=cfg.d_model, n_ctx=n_ctx,
                   vocab_size=dec.embed_tokens.weight.shape[0], embed=_embedding(dec), layers=dec_layers,
                   final_norm=None, unembed=unembed, causal=True, encoder=encoder)


SELF = {"attn": "self_attn", "attn_out": "self_attn.out_proj", "q": "self_attn.q_proj", "k": "self_attn.k_proj",
        "v": "self_attn.v_proj", "mlp_out": "fc2", "act": "activation_fn"}
CROSS = {"cross": "encoder_attn", "cross_out": "encoder_attn.out_proj", "cross_q": "encoder_attn.q_proj",
         "cross_k": "encoder_attn.k_proj", "cross_v": "encoder_attn.v_proj"}
NORMS = {"ln_attn": "self_attn_layer_norm", "ln_mlp": "final_layer_norm"}


def hooks(model) -> ModelHooks:
    """Where the engine's sites are: both stacks' blocks, the decoder's cross-attention."""
    base = _base(model)
    dec = ModelHooks.of(base.decoder.layers, None, norms=NORMS | {"ln_cross": "encoder_attn_layer_norm"}, **SELF,
                        **CROSS)
    dec.encoder = ModelHooks.of(base.encoder.layers, None, norms=NORMS, **SELF)
    return dec


def _tiny_bart(tok: dict):
    from transformers import BartConfig

    return BartConfig(vocab_size=tok["vocab_size"], d_model=64, encoder_layers=2, decoder_layers=2,
                      encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                      max_position_embeddings=128, scale_embedding=True, pad_token_id=tok["pad"],
                      bos_token_id=tok["bos"], eos_token_id=tok["eos"], decoder_start_token_id=tok["eos"],
                      forced_eos_token_id=None)


def _tiny_marian(tok: dict):
    from transformers import MarianConfig

    return MarianConfig(vocab_size=tok["vocab_size"], d_model=64, encoder_layers=2, decoder_layers=2,
                        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                        decoder_ffn_dim=128, max_position_embeddings=128, pad_token_id=tok["pad"],
                        eos_token_id=tok["eos"], decoder_start_token_id=tok["pad"])


TINY = {"bart": _tiny_bart, "marian": _tiny_marian}

FAMILY = Family("bart", MODEL_TYPES, read, hooks, tiny=TINY, encoder_decoder=True,
                notes="encoder-decoder, Post-LN blocks, cross-attention; learned (BART) or sinusoidal (Marian) "
                      "positions")
