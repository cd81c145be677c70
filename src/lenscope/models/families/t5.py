"""T5 encoder-decoder models: Pre-RMSNorm blocks without biases, no positions in the embedding but a learned
relative position bias per stack (bidirectional in the encoder, causal in the decoder), scores not scaled, the
decoder's blocks with cross-attention (no position bias), ReLU or gated-GELU MLPs, a final RMSNorm per stack, and
with tied embeddings the decoder output times ``d_model ** -0.5`` before the unembedding.

The reader is checked block by block against the real model (``tests/models/test_encoder_decoder.py``); what the
methods do with an encoder-decoder model is in docs/encoder-decoder.md.
"""

from __future__ import annotations

from ..weights.anatomy import MLP, Anatomy, Attention, Embedding, Layer, RelativeBias, Unembed, activation_name
from . import Family, ModelHooks, linear_in_out, require, rms_norm, separate_qkv, t

MODEL_TYPES = ("t5",)


def _attention(mod, causal: bool, bias: RelativeBias | None) -> Attention:
    w = separate_qkv(mod.q, mod.k, mod.v, mod.o, mod.n_heads, mod.n_heads)
    return Attention(**w, scale=float(getattr(mod, "scaling", 1.0)), causal=causal, relative_bias=bias)


def _relative_bias(stack) -> RelativeBias:
    mod = stack.block[0].layer[0].SelfAttention
    require(mod.has_relative_attention_bias, "T5 without a relative attention bias in its first block")
    return RelativeBias(weight=mod.relative_attention_bias.weight.detach(), bidirectional=not mod.is_decoder,
                        max_distance=int(mod.relative_attention_max_distance))


def _mlp(ff, act: str) -> MLP:
    d = ff.DenseReluDense
    if hasattr(d, "wi_0"):  # gated: act(wi_0 x) * wi_1 x
        return MLP(W_in=linear_in_out(d.wi_1), b_in=None, W_gate=linear_in_out(d.wi_0), b_gate=None,
                   W_out=linear_in_out(d.wo), b_out=None, act=act)
    return MLP(W_in=linear_in_out(d.wi), b_in=None, W_out=linear_in_out(d.wo), b_out=None, act=act)


def _stack(stack, cfg, causal: bool) -> list[Layer]:
    act = activation_name(cfg.dense_act_fn)
    bias = _relative_bias(stack)
    layers = []
    for blk in stack.block:
        sa, ff = blk.layer[0], blk.layer[-1]
        cross = blk.layer[1] if causal else None
        layers.append(Layer("pre", _attention(sa.SelfAttention, causal, bias), _mlp(ff, act),
                            ln_attn=rms_norm(sa.layer_norm), ln_mlp=rms_norm(ff.layer_norm),
                            cross=None if cross is None else _attention(cross.EncDecAttention, False, None),
                            ln_cross=None if cross is None else rms_norm(cross.layer_norm)))
    return layers


def read(model) -> Anatomy:
    cfg = model.config
    require(cfg.model_type in MODEL_TYPES, f"the T5 reader reads t5, not {cfg.model_type!r}")
    n_ctx = int(getattr(cfg, "n_positions", 512) or 512)  # relative positions: no hard limit; T5's training length
    embed = Embedding(W_E=model.shared.weight.detach())
    enc, dec = model.encoder, model.decoder
    encoder = Anatomy(family="t5", model_type="t5", d_model=cfg.d_model, n_ctx=n_ctx, vocab_size=cfg.vocab_size,
                      embed=embed, layers=_stack(enc, cfg, False), final_norm=rms_norm(enc.final_layer_norm),
                      unembed=None, causal=False)
    unembed = None
    if hasattr(model, "lm_head"):
        scaled = getattr(cfg, "scale_decoder_outputs", cfg.tie_word_embeddings)
        unembed = Unembed(W_U=linear_in_out(model.lm_head), b_U=t(model.lm_head.bias),
                          logit_scale=cfg.d_model ** -0.5 if scaled else 1.0)
    return Anatomy(family="t5", model_type="t5", d_model=cfg.d_model, n_ctx=n_ctx, vocab_size=cfg.vocab_size,
                   embed=embed, layers=_stack(dec, cfg, True), final_norm=rms_norm(dec.final_layer_norm),
                   unembed=unembed, causal=True, encoder=encoder)


def hooks(model) -> ModelHooks:
    """Where the engine's sites are: both stacks' blocks (``layer.0`` self-attention, ``layer.1`` the decoder's
    cross-attention, ``layer.-1`` the MLP), the final norms."""
    gated = bool(model.config.is_gated_act)

    def stack(blocks, final_norm, cross: bool) -> ModelHooks:
        ff = f"layer.{2 if cross else 1}"
        paths = {"attn": "layer.0.SelfAttention", "attn_out": "layer.0.SelfAttention.o",
                 "q": "layer.0.SelfAttention.q", "k": "layer.0.SelfAttention.k", "v": "layer.0.SelfAttention.v",
                 "mlp_out": f"{ff}.DenseReluDense.wo", "act": f"{ff}.DenseReluDense.act"}
        if gated:
            paths["up"] = f"{ff}.DenseReluDense.wi_1"
        norms = {"ln_attn": "layer.0.layer_norm", "ln_mlp": f"{ff}.layer_norm"}
        if cross:
            paths |= {"cross": "layer.1.EncDecAttention", "cross_out": "layer.1.EncDecAttention.o",
                      "cross_q": "layer.1.EncDecAttention.q", "cross_k": "layer.1.EncDecAttention.k",
                      "cross_v": "layer.1.EncDecAttention.v"}
            norms["ln_cross"] = "layer.1.layer_norm"
        return ModelHooks.of(blocks, final_norm, norms=norms, pattern_index=-1, **paths)

    dec = stack(model.decoder.block, model.decoder.final_layer_norm, True)
    dec.encoder = stack(model.encoder.block, model.encoder.final_layer_norm, False)
    return dec


def _tiny_t5(tok: dict, **kw):
    from transformers import T5Config

    return T5Config(vocab_size=tok["vocab_size"], d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
                    num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=16,
                    pad_token_id=tok["pad"], eos_token_id=tok["eos"], decoder_start_token_id=tok["pad"], **kw)


def _tiny_t5_gated(tok: dict):
    return _tiny_t5(tok, feed_forward_proj="gated-gelu", tie_word_embeddings=False)


TINY = {"t5": _tiny_t5, "t5-gated": _tiny_t5_gated}

FAMILY = Family("t5", MODEL_TYPES, read, hooks, tiny=TINY, encoder_decoder=True,
                notes="encoder-decoder, Pre-RMSNorm blocks, relative position bias, ReLU or gated-GELU MLPs")
