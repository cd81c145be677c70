"""Falcon: LayerNorm, rotary, one fused query-key-value projection, optional biases, and three layouts of the block:

- classic, ``parallel_attn=True`` (Falcon-7B): a parallel block whose attention and MLP read one norm
  (``input_layernorm``), multi-query attention (``multi_query``: one key/value head) or one key/value head per query
  head;
- classic, ``parallel_attn=False``: a sequential pre-norm block (``input_layernorm``, ``post_attention_layernorm``);
- ``new_decoder_architecture`` (Falcon-40B/180B): a parallel block with grouped key/value heads (``num_kv_heads``)
  and two norms (``ln_attn``, ``ln_mlp``), or one shared norm with ``num_ln_in_parallel_attn=1``.

The fused projection's output is laid out per key/value head as its query heads, then its key and value (the
engine's ``"grouped"`` layout; multi-query attention is one group). ALiBi (``alibi=True``) is refused: transformers
rounds Falcon's ALiBi bias to bfloat16, which lenscope does not model.
"""

from __future__ import annotations

from ..weights.anatomy import MLP, Anatomy, Attention, Embedding, Layer, Unembed, activation_name
from . import (
    Family,
    ModelHooks,
    layer_norm,
    linear_in_out,
    require,
    rope_context,
    rotary,
    split_heads_out,
    t,
    tiny_tokens,
)


def _norms(cfg) -> dict[str, str]:
    """The block's norm slots -> module names, as FalconDecoderLayer.forward reads them (checked: a combination that
    transformers' Falcon cannot run is refused)."""
    new, parallel, n_ln = cfg.new_decoder_architecture, cfg.parallel_attn, cfg.num_ln_in_parallel_attn
    if new:
        require(parallel, "Falcon with new_decoder_architecture=True and parallel_attn=False is not supported "
                          "(transformers' Falcon cannot run it)")
        require(n_ln in (1, 2), f"Falcon with new_decoder_architecture=True and num_ln_in_parallel_attn={n_ln} is "
                                "not supported (transformers' Falcon runs 1 or 2)")
        if n_ln == 2:
            return {"ln_attn": "ln_attn", "ln_mlp": "ln_mlp"}
        return {"ln_attn": "input_layernorm", "ln_mlp": "input_layernorm"}
    if not parallel:
        return {"ln_attn": "input_layernorm", "ln_mlp": "post_attention_layernorm"}
    require(n_ln != 2, "Falcon with num_ln_in_parallel_attn=2 needs new_decoder_architecture=True (transformers' "
                       "Falcon cannot run it otherwise)")
    return {"ln_attn": "input_layernorm", "ln_mlp": "input_layernorm"}


def _kv_heads(cfg, attn) -> int:
    H = attn.num_heads
    if cfg.new_decoder_architecture:
        K = cfg.num_kv_heads
    else:
        K = 1 if cfg.multi_query else H
        require(cfg.multi_query or cfg.num_kv_heads == H,
                f"classic Falcon without multi_query and num_kv_heads={cfg.num_kv_heads} != num_attention_heads={H} "
                "is not supported (transformers' Falcon cannot run it)")
    require(H % K == 0, f"Falcon with {H} query heads and {K} key/value heads is not supported")
    return K


def read(model) -> Anatomy:
    cfg = model.config
    tr = model.transformer
    require(not cfg.alibi, "Falcon with alibi=True is not supported: transformers rounds its ALiBi bias to bfloat16, "
                           "which lenscope does not model (rotary Falcon models, alibi=False, are)")
    norms = _norms(cfg)
    parallel = cfg.new_decoder_architecture or cfg.parallel_attn
    rot = rotary(tr.rotary_emb)
    layers = []
    for blk in tr.h:
        a = blk.self_attention
        H, dh, d = a.num_heads, a.head_dim, cfg.hidden_size
        K = _kv_heads(cfg, a)
        g = H // K
        qkv = a.query_key_value
        W = qkv.weight.detach().reshape(K, g + 2, dh, d)  # per key/value head: [q_1 .. q_g k v]
        b = None if qkv.bias is None else qkv.bias.detach().reshape(K, g + 2, dh)
        attn = Attention(
            W_Q=W[:, :g].reshape(H, dh, d).transpose(1, 2), W_K=W[:, g].transpose(1, 2),
            W_V=W[:, g + 1].transpose(1, 2), W_O=split_heads_out(linear_in_out(a.dense), H),
            b_Q=None if b is None else b[:, :g].reshape(H, dh), b_K=None if b is None else b[:, g],
            b_V=None if b is None else b[:, g + 1], b_O=t(a.dense.bias), scale=dh**-0.5, rotary=rot,
        )
        mlp = MLP(W_in=linear_in_out(blk.mlp.dense_h_to_4h), b_in=t(blk.mlp.dense_h_to_4h.bias),
                  W_out=linear_in_out(blk.mlp.dense_4h_to_h), b_out=t(blk.mlp.dense_4h_to_h.bias),
                  act=activation_name(cfg.activation))
        ln_attn = layer_norm(getattr(blk, norms["ln_attn"]))
        ln_mlp = ln_attn if norms["ln_mlp"] == norms["ln_attn"] else layer_norm(getattr(blk, norms["ln_mlp"]))
        layers.append(Layer("parallel" if parallel else "pre", attn, mlp, ln_attn=ln_attn, ln_mlp=ln_mlp))
    return Anatomy(
        family="falcon", model_type=cfg.model_type, d_model=cfg.hidden_size, n_ctx=rope_context(cfg, tr.rotary_emb),
        vocab_size=cfg.vocab_size, embed=Embedding(W_E=tr.word_embeddings.weight.detach()), layers=layers,
        final_norm=layer_norm(tr.ln_f),
        unembed=Unembed(W_U=linear_in_out(model.lm_head), b_U=t(model.lm_head.bias)),
    )


def hooks(model) -> ModelHooks:
    norms = _norms(model.config)
    shared = {"readers": {"ln_mlp": "mlp"}} if norms["ln_attn"] == norms["ln_mlp"] else {}
    return ModelHooks.of(model.transformer.h, model.transformer.ln_f, attn="self_attention",
                         attn_out="self_attention.dense", mlp_out="mlp.dense_4h_to_h", act="mlp.act",
                         qkv="self_attention.query_key_value", qkv_layout="grouped", norms=norms, **shared)


def _tiny(tok: dict):
    from transformers import FalconConfig

    # Falcon-7B's layout: parallel block, one shared norm, multi-query attention
    return FalconConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, multi_query=True,
                        parallel_attn=True, new_decoder_architecture=False, bias=False, alibi=False,
                        ffn_hidden_size=256, max_position_embeddings=128, **tiny_tokens(tok))


def _tiny_new(tok: dict):
    from transformers import FalconConfig

    # Falcon-40B's layout: parallel block with two norms, grouped key/value heads (here with biases)
    return FalconConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_kv_heads=2,
                        new_decoder_architecture=True, parallel_attn=True, bias=True, alibi=False,
                        ffn_hidden_size=256, max_position_embeddings=128, **tiny_tokens(tok))


FAMILY = Family(name="falcon", model_types=("falcon",), read=read, hooks=hooks,
                tiny={"falcon": _tiny, "falcon-new": _tiny_new})
