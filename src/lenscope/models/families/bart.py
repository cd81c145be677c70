"""The BART-like encoder-decoder models (translation, summarisation): an encoder and a decoder of blocks with
LayerNorms (query, key, value and output projections with biases, scores scaled by ``d_head ** -0.5``, a two-layer
MLP), the decoder's blocks with cross-attention over the encoder's output, the token embedding times
``sqrt(d_model)`` when ``scale_embedding``, the logits' ``final_logits_bias``. One reader for five layouts, which
differ in two things:

- where the norms sit: **Post-LN** blocks (BART, Marian) or **Pre-LN** blocks with a final LayerNorm on each stack
  (mBART and mBART-50, M2M-100 and NLLB, Pegasus); BART and mBART also normalise the embedding
  (``layernorm_embedding``);
- the positions: learned at offset 2 (BART, mBART), a fixed sinusoidal table read as ``W_pos`` (Marian and
  Pegasus: position ``p`` is row ``p``; M2M-100: row ``p + padding_idx + 1``, fairseq's positions, which count
  the tokens that are not padding, so a padding token inside a text is refused where lenscope tokenises).

The reader is checked block by block against the real model (``tests/models/test_encoder_decoder.py``); what the
methods do with an encoder-decoder model is in docs/encoder-decoder.md.
"""

from __future__ import annotations

from ..weights.anatomy import MLP, Anatomy, Attention, Embedding, Layer, Unembed, activation_name
from . import Family, ModelHooks, layer_norm, linear_in_out, require, separate_qkv, t

POST_LN = ("bart", "marian")
PRE_LN = ("mbart", "m2m_100", "pegasus")  # Pre-LN blocks, a final LayerNorm per stack
MODEL_TYPES = POST_LN + PRE_LN
# transformers' Marian and Pegasus decoders multiply even given decoder_inputs_embeds by their embed_scale (their
# encoders, and the other stacks, add positions to given inputs_embeds as they are): Anatomy.extras
# ["inputs_embeds_scale"] of the decoder says so to the methods that feed the model embeddings
EMBEDS_SCALED = ("marian", "pegasus")


def _attention(mod, n_heads: int, causal: bool) -> Attention:
    """A BartAttention (or mBART's, M2M-100's, Pegasus', Marian's: the same module): q, k, v, out projections with
    biases; scores scaled by its ``scaling``, ``d_head ** -0.5``."""
    w = separate_qkv(mod.q_proj, mod.k_proj, mod.v_proj, mod.out_proj, n_heads, n_heads)
    return Attention(**w, scale=float(mod.scaling), causal=causal)


def _mlp(blk, act: str) -> MLP:
    return MLP(W_in=linear_in_out(blk.fc1), b_in=t(blk.fc1.bias), W_out=linear_in_out(blk.fc2), b_out=t(blk.fc2.bias),
               act=act)


def _positions(pos) -> tuple:
    """A stack's position table and the row of position 0: M2M-100's sinusoidal module keeps its table in
    ``weights`` (a buffer, rebuilt when loaded) and numbers a text's tokens from ``padding_idx + 1``; the others
    are ``nn.Embedding`` tables, BART's and mBART's learned ones read at ``position + offset`` (2)."""
    if hasattr(pos, "weights"):  # M2M100SinusoidalPositionalEmbedding
        return pos.weights.detach(), int(pos.padding_idx) + 1
    return pos.weight.detach(), int(getattr(pos, "offset", 0))


def _embedding(stack) -> Embedding:
    """A stack's embedding: the token embedding times its scale (BART, mBART and M2M-100 keep it in the embedding
    module, Marian and Pegasus in the stack), positions (:func:`_positions`), the ``layernorm_embedding`` of BART
    and mBART."""
    tok = stack.embed_tokens
    scale = getattr(tok, "embed_scale", None)
    if scale is None:
        scale = getattr(stack, "embed_scale", 1.0)
    W_pos, offset = _positions(stack.embed_positions)
    ln = getattr(stack, "layernorm_embedding", None)
    return Embedding(W_E=tok.weight.detach(), scale=float(scale), W_pos=W_pos, pos_offset=offset,
                     norm=None if ln is None else layer_norm(ln))


def _base(model):
    return model.model if hasattr(model, "model") else model


def _stack(stack, cfg, placement: str, cross: bool) -> list[Layer]:
    act = activation_name(cfg.activation_function)
    heads = cfg.decoder_attention_heads if cross else cfg.encoder_attention_heads
    return [Layer(placement, _attention(b.self_attn, heads, cross), _mlp(b, act),
                  ln_attn=layer_norm(b.self_attn_layer_norm), ln_mlp=layer_norm(b.final_layer_norm),
                  cross=_attention(b.encoder_attn, heads, False) if cross else None,
                  ln_cross=layer_norm(b.encoder_attn_layer_norm) if cross else None)
            for b in stack.layers]


def read(model) -> Anatomy:
    cfg = model.config
    base = _base(model)
    mt = cfg.model_type
    require(mt in MODEL_TYPES, f"the BART reader reads {', '.join(MODEL_TYPES)}, not {mt!r}")
    pre = mt in PRE_LN
    if not pre:
        for flag in ("normalize_before", "add_final_layer_norm"):  # Pre-LN settings transformers' BART ignores
            require(not getattr(cfg, flag, False), f"{mt} with {flag}=True is not supported (a Pre-LN model of "
                                                   "this layout is an mbart model)")
    enc, dec = base.encoder, base.decoder
    if mt == "m2m_100":  # a padding token in the decoder's input would take the position of padding
        require(cfg.decoder_start_token_id != cfg.pad_token_id,
                "m2m_100 whose decoder starts with the padding token is not supported (its position would be "
                "the padding row)")
    W_pos, offset = _positions(enc.embed_positions)
    n_ctx = min(int(cfg.max_position_embeddings), W_pos.shape[0] - offset)
    placement = "pre" if pre else "post"
    encoder = Anatomy(family="bart", model_type=mt, d_model=cfg.d_model, n_ctx=n_ctx,
                      vocab_size=enc.embed_tokens.weight.shape[0], embed=_embedding(enc),
                      layers=_stack(enc, cfg, placement, False), final_norm=layer_norm(enc.layer_norm) if pre else None,
                      unembed=None, causal=False)
    unembed = None
    if hasattr(model, "lm_head"):
        bias = getattr(model, "final_logits_bias", None)
        unembed = Unembed(W_U=linear_in_out(model.lm_head), b_U=None if bias is None else bias.detach()[0])
    return Anatomy(family="bart", model_type=mt, d_model=cfg.d_model, n_ctx=n_ctx,
                   vocab_size=dec.embed_tokens.weight.shape[0], embed=_embedding(dec),
                   layers=_stack(dec, cfg, placement, True), final_norm=layer_norm(dec.layer_norm) if pre else None,
                   unembed=unembed, causal=True, encoder=encoder,
                   extras={"inputs_embeds_scale": float(dec.embed_scale)} if mt in EMBEDS_SCALED else {})


SELF = {"attn": "self_attn", "attn_out": "self_attn.out_proj", "q": "self_attn.q_proj", "k": "self_attn.k_proj",
        "v": "self_attn.v_proj", "mlp_out": "fc2", "act": "activation_fn"}
CROSS = {"cross": "encoder_attn", "cross_out": "encoder_attn.out_proj", "cross_q": "encoder_attn.q_proj",
         "cross_k": "encoder_attn.k_proj", "cross_v": "encoder_attn.v_proj"}
NORMS = {"ln_attn": "self_attn_layer_norm", "ln_mlp": "final_layer_norm"}


def hooks(model) -> ModelHooks:
    """Where the engine's sites are: both stacks' blocks, the decoder's cross-attention, the Pre-LN stacks' final
    norms."""
    base = _base(model)
    enc, dec = base.encoder, base.decoder
    pre = model.config.model_type in PRE_LN  # the final norms of the Pre-LN stacks
    out = ModelHooks.of(dec.layers, dec.layer_norm if pre else None,
                        norms=NORMS | {"ln_cross": "encoder_attn_layer_norm"}, **SELF, **CROSS)
    out.encoder = ModelHooks.of(enc.layers, enc.layer_norm if pre else None, norms=NORMS, **SELF)
    return out


# the sizes every tiny encoder-decoder of this file shares
_TINY_SIZES = dict(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                   encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=128)


def _tiny(config: str, tok: dict, **kw):
    import transformers

    return getattr(transformers, config)(vocab_size=tok["vocab_size"], pad_token_id=tok["pad"],
                                         eos_token_id=tok["eos"], **_TINY_SIZES, **kw)


def _tiny_bart(tok: dict):
    return _tiny("BartConfig", tok, scale_embedding=True, bos_token_id=tok["bos"], decoder_start_token_id=tok["eos"],
                 forced_eos_token_id=None)


def _tiny_marian(tok: dict):
    return _tiny("MarianConfig", tok, decoder_start_token_id=tok["pad"])


def _tiny_mbart(tok: dict):
    return _tiny("MBartConfig", tok, scale_embedding=True, bos_token_id=tok["bos"], decoder_start_token_id=tok["eos"],
                 forced_eos_token_id=None)


def _tiny_m2m100(tok: dict):
    return _tiny("M2M100Config", tok, scale_embedding=True, bos_token_id=tok["bos"], decoder_start_token_id=tok["eos"])


def _tiny_pegasus(tok: dict):
    return _tiny("PegasusConfig", tok, scale_embedding=True, decoder_start_token_id=tok["pad"],
                 forced_eos_token_id=None)


TINY = {"bart": _tiny_bart, "marian": _tiny_marian, "mbart": _tiny_mbart, "m2m100": _tiny_m2m100,
        "pegasus": _tiny_pegasus}

FAMILY = Family("bart", MODEL_TYPES, read, hooks, tiny=TINY, encoder_decoder=True,
                notes="encoder-decoder, cross-attention; Post-LN blocks (BART, Marian) or Pre-LN blocks with final "
                      "norms (mBART, M2M-100 / NLLB, Pegasus); learned (BART, mBART) or sinusoidal (Marian, "
                      "M2M-100, Pegasus) positions")
