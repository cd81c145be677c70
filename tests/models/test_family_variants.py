"""The families of issue 31 in other shapes and switch settings than their ``tiny:<name>`` models (which every
all-family test runs): verify, direct logit attribution, the Logit / ALTI-Logit explanations, the mixing maps and
the per-head attention split on each; longer inputs than LongRoPE's original context and switches lenscope does not
model give a one-line error."""

from __future__ import annotations

import pytest
import torch

import lenscope
from lenscope.errors import InputError, UnsupportedModelError
from lenscope.mixing.maps import context_mixing
from lenscope.models.families import family_for
from lenscope.models.loading.load import LoadedModel, random_model
from lenscope.models.loading.tokenizer import tiny_special_ids, tiny_tokenizer
from lenscope.models.runtime.verify import TOLERANCE
from tests.tolerances import assert_same_computation

TEXT = "The capital of France is Paris, and the capital of Germany is"


def build(cfg) -> LoadedModel:
    """A random model of ``cfg``, made as ``lenscope.load("tiny:...")`` makes its tiny models."""
    model = random_model(cfg)
    model.eval()
    model.requires_grad_(False)
    return LoadedModel(model=model, tokenizer=tiny_tokenizer(), anatomy=family_for(model).read(model),
                       name=f"variant:{cfg.model_type}")


def _tok() -> dict:
    t = tiny_special_ids()
    return dict(vocab_size=t["vocab_size"], bos_token_id=t["bos"], eos_token_id=t["eos"], pad_token_id=t["pad"])


SMALL = dict(hidden_size=64, intermediate_size=96, max_position_embeddings=64)


def _gemma2_mha():
    from transformers import Gemma2Config

    # every head its own key/value head, d_head != d_model / heads, no soft-caps, one global layer between windows
    return Gemma2Config(num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2, head_dim=24,
                        query_pre_attn_scalar=24, attn_logit_softcapping=None, final_logit_softcapping=None,
                        sliding_window=3, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                        **SMALL, **_tok())


def _phi3_gqa():
    from transformers import Phi3Config

    # 8 query heads over 2 key/value heads through the fused projection, three quarters rotated (Phi-4-mini)
    return Phi3Config(num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75},
                      original_max_position_embeddings=64, **SMALL, **_tok())


def _phi3_longrope():
    from transformers import Phi3Config

    dh = 16
    short = [1.0 + 0.1 * i for i in range(dh // 2)]
    long = [2.0 + 0.5 * i for i in range(dh // 2)]
    return Phi3Config(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                      original_max_position_embeddings=32,
                      rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": short,
                                       "long_factor": long, "original_max_position_embeddings": 32},
                      **SMALL, **_tok())


def _olmo2_wide():
    from transformers import Olmo2Config

    # 8 heads over 2 key/value heads (q norm over 8 heads, k norm over 2), biases on the projections
    return Olmo2Config(num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, attention_bias=True,
                       **SMALL, **_tok())


def _olmo2_one_kv_head():
    from transformers import Olmo2Config

    # one key/value head: its norm over the whole projection is a norm over one head
    return Olmo2Config(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, **SMALL, **_tok())


def _olmo3():
    from transformers import Olmo3Config

    # OLMo 3: OLMo 2's block, three sliding-window layers then a global one, a rotary per layer type
    return Olmo3Config(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, sliding_window=4,
                       **SMALL, **_tok())


def _stablelm_sequential():
    from transformers import StableLmConfig

    # the StableLM 2 1.6B layout: sequential residual, q/k/v biases, no q/k norms; half of each head rotated
    return StableLmConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, use_qkv_bias=True,
                          qk_layernorm=False, use_parallel_residual=False, partial_rotary_factor=0.5,
                          **SMALL, **_tok())


def _stablelm_qk_norm_gqa():
    from transformers import StableLmConfig

    # per-head q/k LayerNorms with grouped keys (each key/value head its own norm), sequential residual
    return StableLmConfig(num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, qk_layernorm=True,
                          use_parallel_residual=False, partial_rotary_factor=0.25, **SMALL, **_tok())


def _granite_biases():
    from transformers import GraniteConfig

    return GraniteConfig(num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, attention_bias=True,
                         mlp_bias=True, embedding_multiplier=12.0, residual_multiplier=0.22,
                         attention_multiplier=0.015625, logits_scaling=8.0, tie_word_embeddings=False,
                         **SMALL, **_tok())


def _smollm3_windows():
    from transformers import SmolLM3Config

    # every second layer without rotary, sliding windows as the config derives them
    return SmolLM3Config(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1, no_rope_layer_interval=2,
                         use_sliding_window=True, sliding_window=4, **SMALL, **_tok())


def _llama_dynamic():
    from transformers import LlamaConfig

    # dynamic NTK changes its frequencies only beyond max_position_embeddings, which lenscope never runs
    return LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
                       **SMALL, **_tok())


def _qwen2_linear():
    from transformers import Qwen2Config

    return Qwen2Config(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}, **SMALL, **_tok())


VARIANTS = {"gemma2-mha": _gemma2_mha, "phi3-gqa": _phi3_gqa, "phi3-longrope": _phi3_longrope,
            "olmo2-wide": _olmo2_wide, "olmo2-one-kv-head": _olmo2_one_kv_head, "olmo3": _olmo3,
            "stablelm-sequential": _stablelm_sequential,
            "stablelm-qk-norm-gqa": _stablelm_qk_norm_gqa, "granite-biases": _granite_biases,
            "smollm3-windows": _smollm3_windows, "llama-dynamic": _llama_dynamic, "qwen2-linear": _qwen2_linear}
_built: dict = {}


def variant(name: str) -> LoadedModel:
    if name not in _built:
        _built[name] = build(VARIANTS[name]())
    return _built[name]


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variant_verifies_and_decomposes_exactly(name):
    lm = variant(name)
    rep = lenscope.verify(lm, TEXT)
    assert rep.ok, rep.to_frame()
    tr = lenscope.trace(lm, TEXT)
    dla = lenscope.direct_logit_attribution(lm, TEXT, " capital", " of", by_head=True, tr=tr)
    assert dla.completeness_error < 1e-4, dla
    for method in ("logit", "alti-logit"):
        e = lenscope.explain(lm, TEXT, " capital", " of", method=method, tr=tr)
        assert e.invariant_error < 1e-5, (method, e.info)
    for scope, maps in context_mixing(lm, tr=tr).items():
        if scope != "attention":
            assert maps.completeness_error <= 1e-4, scope
    # the per-head split (edge patching) with every head reading the block's normed input is the real model's heads
    from lenscope.models.runtime.engine import capture

    ids = torch.tensor([[3, 7, 1, 9, 4, 2, 8, 5]])
    L = lm.anatomy.n_layers - 1
    cap = capture(lm, ids, [("resid_pre", L), ("head", L)])
    layer = lm.anatomy.layers[L]
    x = layer.ln_attn(cap["resid_pre", L])
    per = x[:, :, None, :].expand(-1, -1, layer.attn.n_heads, -1)
    z = layer.attn.split(per, per, per, torch.arange(ids.shape[1]))
    real = cap["head", L].permute(0, 2, 1, 3)
    assert (z - real).abs().max() <= TOLERANCE * max(1.0, float(real.abs().max()))


def test_variants_read_what_their_configs_say():
    A = variant("gemma2-mha").anatomy
    assert [layer.attn.window for layer in A.layers] == [3, None, 3] and A.unembed.softcap is None
    assert all(layer.attn.softcap is None and layer.attn.n_kv_heads == 2 for layer in A.layers)
    A = variant("phi3-gqa").anatomy
    assert A.layers[0].attn.n_heads == 8 and A.layers[0].attn.n_kv_heads == 2 and A.layers[0].attn.rotary.dim == 6
    A = variant("olmo2-wide").anatomy
    at = A.layers[0].attn
    assert at.qk_norm_across_heads and at.q_norm.weight.shape == (64,) and at.k_norm.weight.shape == (16,)
    assert A.layers[0].ln_attn.kind == "identity" and A.layers[0].ln_mlp.kind == "identity" and at.b_Q is not None
    at = variant("olmo2-one-kv-head").anatomy.layers[0].attn
    assert at.qk_norm_across_heads and at.n_kv_heads == 1
    A = variant("olmo3").anatomy
    assert [layer.attn.window for layer in A.layers] == [4, 4, 4, None]
    assert A.family == "olmo2" and A.model_type == "olmo3"
    A = variant("stablelm-qk-norm-gqa").anatomy
    at = A.layers[0].attn
    assert at.q_norm.weight.shape == (8, 1, 8) and at.k_norm.weight.shape == (2, 1, 8) and A.placement == "pre"
    assert variant("stablelm-sequential").anatomy.layers[0].attn.q_norm is None
    A = variant("granite-biases").anatomy
    assert A.embed.scale == 12.0 and A.layers[0].residual_scale == pytest.approx(0.22)
    assert_same_computation(A.layers[0].attn.scale, 0.015625, why="the config's attention multiplier, copied")
    assert A.layers[0].mlp.b_in is not None
    W = variant("granite-biases").model.lm_head.weight.detach().T
    # logits / logits_scaling
    assert_same_computation((A.unembed.W_U, A.unembed.logit_scale), (W, 1 / 8.0), why="the head's weights, "
                            "copied; 1 / logits_scaling, a power of two")
    A = variant("smollm3-windows").anatomy
    assert [layer.attn.rotary is not None for layer in A.layers] == [True, False, True, False]
    assert any(layer.attn.window == 4 for layer in A.layers)


def test_longrope_runs_within_its_original_context():
    """LongRoPE switches every position to its long factors once an input is longer than the original context:
    lenscope's context is that length (its recomputation of a prefix could not know the switch), and a longer
    input is refused with a one-line error."""
    lm = variant("phi3-longrope")
    assert lm.anatomy.n_ctx == 32
    rot = lm.anatomy.layers[0].attn.rotary
    assert rot.attention_scaling > 1.0  # max_position_embeddings / original context = 2: scaled cos and sin
    ids = list(range(3, 35))
    assert lenscope.verify(lm, tr=lenscope.trace(lm, ids)).ok
    with pytest.raises(InputError, match="context of 32"):
        lenscope.trace(lm, list(range(3, 36)))


def test_switches_lenscope_does_not_model_are_refused():
    cfg = _gemma2_mha()
    cfg.use_bidirectional_attention = True
    with pytest.raises(UnsupportedModelError, match="use_bidirectional_attention"):
        build(cfg)
    from lenscope.models.families.gemma3 import _tiny_multimodal

    cfg = _tiny_multimodal(tiny_special_ids())
    cfg.text_config.use_bidirectional_attention = True
    with pytest.raises(UnsupportedModelError, match="use_bidirectional_attention"):
        build(cfg)
