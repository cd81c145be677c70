"""BERT / RoBERTa encoders: learned positions and token types, embedding LayerNorm, Post-LN blocks,
bidirectional attention; the masked-LM head (dense, activation, LayerNorm, decoder) when present."""

from __future__ import annotations

from ..weights.anatomy import MLP, Anatomy, Attention, Embedding, Layer, Unembed, activation_name
from . import Family, ModelHooks, layer_norm, linear_in_out, split_bias, split_heads_in, split_heads_out, t


def _base(model):
    for name in ("bert", "roberta"):
        if hasattr(model, name):
            return getattr(model, name)
    return model


def _head(model, act: str) -> Unembed | None:
    if hasattr(model, "cls"):  # BertForMaskedLM
        p = model.cls.predictions
        tr = p.transform
        return Unembed(W_U=linear_in_out(p.decoder), b_U=t(p.decoder.bias), transform_W=linear_in_out(tr.dense),
                       transform_b=t(tr.dense.bias), transform_act=act, transform_norm=layer_norm(tr.LayerNorm))
    if hasattr(model, "lm_head"):  # RobertaForMaskedLM (its head always uses exact GELU)
        h = model.lm_head
        return Unembed(W_U=linear_in_out(h.decoder), b_U=t(h.decoder.bias), transform_W=linear_in_out(h.dense),
                       transform_b=t(h.dense.bias), transform_act="gelu", transform_norm=layer_norm(h.layer_norm))
    return None


def read(model) -> Anatomy:
    cfg = model.config
    base = _base(model)
    d, H = cfg.hidden_size, cfg.num_attention_heads
    dh = d // H
    layers = []
    for blk in base.encoder.layer:
        s, o = blk.attention.self, blk.attention.output
        attn = Attention(
            W_Q=split_heads_in(linear_in_out(s.query), H), W_K=split_heads_in(linear_in_out(s.key), H),
            W_V=split_heads_in(linear_in_out(s.value), H), W_O=split_heads_out(linear_in_out(o.dense), H),
            b_Q=split_bias(s.query.bias, H), b_K=split_bias(s.key.bias, H), b_V=split_bias(s.value.bias, H),
            b_O=t(o.dense.bias), scale=dh**-0.5, causal=False,
        )
        mlp = MLP(W_in=linear_in_out(blk.intermediate.dense), b_in=t(blk.intermediate.dense.bias),
                  W_out=linear_in_out(blk.output.dense), b_out=t(blk.output.dense.bias),
                  act=activation_name(cfg.hidden_act))
        layers.append(Layer("post", attn, mlp,
                            ln_attn=layer_norm(o.LayerNorm), ln_mlp=layer_norm(blk.output.LayerNorm)))
    e = base.embeddings
    pad = getattr(e, "padding_idx", None)
    offset = pad + 1 if cfg.model_type == "roberta" and pad is not None else 0
    embed = Embedding(W_E=e.word_embeddings.weight.detach(), W_pos=e.position_embeddings.weight.detach(),
                      pos_offset=offset, type_row=e.token_type_embeddings.weight.detach()[0],
                      norm=layer_norm(e.LayerNorm))
    return Anatomy(
        family="bert", model_type=cfg.model_type, d_model=d, n_ctx=cfg.max_position_embeddings - offset,
        vocab_size=cfg.vocab_size, embed=embed, layers=layers, final_norm=None,
        unembed=_head(model, activation_name(cfg.hidden_act)), causal=False,
    )


def hooks(model) -> ModelHooks:
    base = _base(model)
    return ModelHooks.of(base.encoder.layer, None, attn="attention.self", attn_out="attention.output.dense",
                         mlp_out="output.dense", act="intermediate.intermediate_act_fn", q="attention.self.query",
                         k="attention.self.key", v="attention.self.value",
                         norms={"ln_attn": "attention.output.LayerNorm", "ln_mlp": "output.LayerNorm"})


def _tiny_bert(tok: dict):
    from transformers import BertConfig

    return BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=256,
                      vocab_size=tok["vocab_size"], max_position_embeddings=128, pad_token_id=tok["pad"])


def _tiny_roberta(tok: dict):
    from transformers import RobertaConfig

    return RobertaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=256,
                         vocab_size=tok["vocab_size"], max_position_embeddings=128 + tok["pad"] + 1,
                         pad_token_id=tok["pad"], bos_token_id=tok["bos"], eos_token_id=tok["eos"])


FAMILY = Family(name="bert", model_types=("bert", "roberta"), read=read, hooks=hooks,
                tiny={"bert": _tiny_bert, "roberta": _tiny_roberta}, encoder=True)
