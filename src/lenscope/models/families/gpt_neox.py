"""GPT-NeoX / Pythia: fused per-head QKV, partial rotary, parallel residual (``use_parallel_residual``)."""

from __future__ import annotations

from ..weights.anatomy import MLP, Anatomy, Attention, Embedding, Layer, Unembed, activation_name
from . import PRE_NORMS, Family, ModelHooks, layer_norm, linear_in_out, rope_context, rotary, split_heads_out, t


def read(model) -> Anatomy:
    cfg = model.config
    base = model.gpt_neox
    d, H = cfg.hidden_size, cfg.num_attention_heads
    dh = d // H
    rot = rotary(base.rotary_emb)
    layers = []
    for blk in base.layers:
        qkv = blk.attention.query_key_value
        W = qkv.weight.detach().reshape(H, 3, dh, d)  # rows: per head [q | k | v]
        b = qkv.bias.detach().reshape(H, 3, dh) if qkv.bias is not None else None
        attn = Attention(
            W_Q=W[:, 0].transpose(1, 2), W_K=W[:, 1].transpose(1, 2), W_V=W[:, 2].transpose(1, 2),
            W_O=split_heads_out(linear_in_out(blk.attention.dense), H),
            b_Q=None if b is None else b[:, 0], b_K=None if b is None else b[:, 1], b_V=None if b is None else b[:, 2],
            b_O=t(blk.attention.dense.bias), scale=dh**-0.5, rotary=rot,
        )
        mlp = MLP(
            W_in=linear_in_out(blk.mlp.dense_h_to_4h), b_in=t(blk.mlp.dense_h_to_4h.bias),
            W_out=linear_in_out(blk.mlp.dense_4h_to_h), b_out=t(blk.mlp.dense_4h_to_h.bias),
            act=activation_name(cfg.hidden_act),
        )
        placement = "parallel" if cfg.use_parallel_residual else "pre"
        layers.append(Layer(placement, attn, mlp, ln_attn=layer_norm(blk.input_layernorm),
                            ln_mlp=layer_norm(blk.post_attention_layernorm)))
    return Anatomy(
        family="gpt-neox", model_type=cfg.model_type, d_model=d, n_ctx=rope_context(cfg, base.rotary_emb),
        vocab_size=cfg.vocab_size, embed=Embedding(W_E=base.embed_in.weight.detach()), layers=layers,
        final_norm=layer_norm(base.final_layer_norm), unembed=Unembed(W_U=linear_in_out(model.get_output_embeddings())),
    )


# where the engine's sites are in a GPTNeoXLayer (fused q/k/v laid out per head)
PATHS = {"attn": "attention", "attn_out": "attention.dense", "mlp_out": "mlp.dense_4h_to_h", "act": "mlp.act",
         "qkv": "attention.query_key_value", "qkv_layout": "grouped", "norms": PRE_NORMS}


def hooks(model) -> ModelHooks:
    return ModelHooks.of(model.gpt_neox.layers, model.gpt_neox.final_layer_norm, **PATHS)


def _tiny(tok: dict):
    from transformers import GPTNeoXConfig

    return GPTNeoXConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=256,
                         vocab_size=tok["vocab_size"], max_position_embeddings=128, rotary_pct=0.25,
                         use_parallel_residual=True, bos_token_id=tok["bos"], eos_token_id=tok["eos"])


FAMILY = Family(name="gpt-neox", model_types=("gpt_neox",), read=read, hooks=hooks, tiny={"gpt-neox": _tiny})
