"""The families of issue 31 (StarCoder2, Cohere, GPT-J, Falcon) under other shapes than their ``tiny:`` models (head
counts, key/value groups, rotary widths, windows, biases, block layouts), read from the config and the modules and
proven by ``verify`` and the engine's site checks; the config switches they refuse; interleaved and partial rotary by
hand; a shared norm's two sites; and the refusal of model types lenscope does not read."""

from __future__ import annotations

import math

import pytest
import torch

import lenscope
from lenscope.errors import UnsupportedModelError
from lenscope.models.families import randomize_, read_anatomy, tiny_tokens
from lenscope.models.loading.load import LoadedModel
from lenscope.models.loading.tokenizer import tiny_special_ids, tiny_tokenizer
from lenscope.models.runtime.engine import Edit, capture, run
from lenscope.models.runtime.verify import RESID_TOL
from lenscope.models.weights.anatomy import Rotary
from tests.conftest import get_model
from tests.models import test_engine as engine_checks
from tests.tolerances import assert_same_computation

TOK = tiny_tokens(tiny_special_ids())


def build(cfg) -> LoadedModel:
    """A random model of ``cfg`` as ``lenscope.load`` makes a tiny one (eager attention, randomised norms and
    biases), read by its family."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    randomize_(model, seed=1)
    model.eval()
    model.requires_grad_(False)
    _, anatomy = read_anatomy(model)
    return LoadedModel(model=model, tokenizer=tiny_tokenizer(), anatomy=anatomy, name=f"random {cfg.model_type}")


def starcoder2(**kw):
    from transformers import Starcoder2Config

    base = dict(num_hidden_layers=2, hidden_size=48, num_attention_heads=6, num_key_value_heads=2,
                intermediate_size=96, max_position_embeddings=128, tie_word_embeddings=False)
    return Starcoder2Config(**{**base, **kw}, **TOK)


def cohere(**kw):
    from transformers import CohereConfig

    base = dict(num_hidden_layers=2, hidden_size=48, num_attention_heads=6, num_key_value_heads=2,
                intermediate_size=96, max_position_embeddings=128)
    return CohereConfig(**{**base, **kw}, **TOK)


def gptj(**kw):
    from transformers import GPTJConfig

    base = dict(n_layer=2, n_embd=48, n_head=6, rotary_dim=4, n_inner=96, n_positions=128)
    return GPTJConfig(**{**base, **kw}, **TOK)


def falcon(**kw):
    from transformers import FalconConfig

    base = dict(num_hidden_layers=2, hidden_size=48, num_attention_heads=6, ffn_hidden_size=96,
                max_position_embeddings=128, alibi=False)
    return FalconConfig(**{**base, **kw}, **TOK)


VARIANTS = {
    "starcoder2-mqa-nobias-nowindow": lambda: starcoder2(num_key_value_heads=1, use_bias=False, sliding_window=None),
    "starcoder2-mha-window3": lambda: starcoder2(num_key_value_heads=6, sliding_window=3, hidden_act="gelu"),
    "starcoder2-theta": lambda: starcoder2(num_attention_heads=4, num_key_value_heads=2, sliding_window=7,
                                           rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
    "cohere-plain": lambda: cohere(use_qk_norm=False, attention_bias=False, num_key_value_heads=1,
                                   logit_scale=0.0625),
    "cohere-mha-qknorm": lambda: cohere(use_qk_norm=True, num_key_value_heads=6, logit_scale=3.0,
                                        tie_word_embeddings=False),
    "cohere-gqa3-bias-linear-rope": lambda: cohere(num_attention_heads=6, num_key_value_heads=3, use_qk_norm=True,
                                                   attention_bias=True, rope_parameters={
                                                       "rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}),
    "gptj-full-rotary": lambda: gptj(rotary_dim=8),
    "gptj-rotary2-relu": lambda: gptj(n_head=4, rotary_dim=2, activation_function="relu"),
    "gptj-two-heads": lambda: gptj(n_head=2, rotary_dim=6),
    "falcon-sequential": lambda: falcon(parallel_attn=False, multi_query=True, bias=True),
    "falcon-classic-mha": lambda: falcon(parallel_attn=True, multi_query=False, bias=True),
    "falcon-new-one-norm": lambda: falcon(new_decoder_architecture=True, num_kv_heads=3, num_ln_in_parallel_attn=1),
    "falcon-new-kv1": lambda: falcon(new_decoder_architecture=True, num_kv_heads=1, bias=False),
    "falcon-new-mha": lambda: falcon(new_decoder_architecture=True, num_kv_heads=6, bias=True),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_other_shapes_verify_and_their_sites(variant):
    lm = build(VARIANTS[variant]())
    rep = lenscope.verify(lm)
    assert rep.ok, rep.to_frame()
    assert rep.n_tokens > 8  # longer than every window above: the windowed masks are exercised
    assert rep.max_rel_resid_error <= RESID_TOL
    engine_checks.test_qkv_sites_are_the_projections(lm)  # Falcon's fused layouts split: the Anatomy's projections
    engine_checks.test_qkv_edits_reach_the_real_attention(lm)  # ... and edits there reach the real heads


def test_the_anatomy_reads_the_switches():
    A = build(VARIANTS["falcon-sequential"]()).anatomy
    assert A.placement == "pre" and A.layers[0].attn.n_kv_heads == 1
    assert A.layers[0].ln_mlp is not A.layers[0].ln_attn and A.layers[0].attn.b_Q is not None
    A = build(VARIANTS["falcon-new-one-norm"]()).anatomy
    assert A.placement == "parallel" and A.layers[0].ln_mlp is A.layers[0].ln_attn
    assert A.layers[0].attn.n_kv_heads == 3 and A.layers[0].attn.b_Q is None
    A = get_model("tiny:falcon-new").anatomy
    assert A.layers[0].ln_mlp is not A.layers[0].ln_attn and A.layers[0].attn.n_kv_heads == 2
    A = build(VARIANTS["gptj-rotary2-relu"]()).anatomy
    rot = A.layers[0].attn.rotary
    assert rot.dim == 2 and rot.interleaved and A.layers[0].mlp.act == "relu" and A.unembed.b_U is not None
    A = build(VARIANTS["cohere-mha-qknorm"]()).anatomy
    assert A.unembed.logit_scale == 3.0 and A.layers[0].attn.q_norm.weight.shape == (6, 1, 8)
    assert A.final_norm.bias is None and A.final_norm.kind == "layernorm"
    A = build(VARIANTS["starcoder2-mha-window3"]()).anatomy
    assert A.layers[1].attn.window == 3 and A.layers[0].attn.n_kv_heads == 6


def test_verify_fails_when_a_switch_is_read_wrong():
    """verify is what proves these readings: each of the new conventions, read the other way, fails it."""
    import dataclasses

    def fails(lm, change):
        for layer in lm.anatomy.layers:
            change(layer)
        assert not lenscope.verify(lm).ok

    lm = build(VARIANTS["gptj-full-rotary"]())
    fails(lm, lambda layer: setattr(layer.attn, "rotary", dataclasses.replace(layer.attn.rotary, interleaved=False)))
    lm = build(VARIANTS["cohere-mha-qknorm"]())
    fails(lm, lambda layer: setattr(layer.attn, "q_norm", dataclasses.replace(
        layer.attn.q_norm, weight=layer.attn.q_norm.weight.mean(0))))  # one weight for every head
    lm = build(VARIANTS["cohere-plain"]())
    lm.anatomy.unembed.logit_scale = 1.0
    rep = lenscope.verify(lm)
    assert not rep.ok and rep.max_abs_logit_error > 1e-2


@pytest.mark.parametrize("cfg,match", [
    (lambda: falcon(alibi=True), "alibi=True is not supported"),
    (lambda: falcon(new_decoder_architecture=True, num_kv_heads=2, parallel_attn=False), "parallel_attn=False"),
])
def test_switches_lenscope_does_not_model_are_refused(cfg, match):
    with pytest.raises(UnsupportedModelError, match=match) as e:
        build(cfg())
    assert len(str(e.value).splitlines()) == 1


def test_length_dependent_rope_runs_within_its_original_context():
    """LongRoPE (read by ``families.rotary``, its context capped by ``rope_context``, for every rotary family)."""
    lm = build(cohere(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 4,
                                       "long_factor": [2.0] * 4, "original_max_position_embeddings": 64}))
    assert lm.anatomy.n_ctx == 64
    assert lenscope.verify(lm, tr=lenscope.trace(lm, list(range(3, 67)))).ok


def test_a_module_that_is_not_there_is_named():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(VARIANTS["gptj-full-rotary"](), attn_implementation="eager")
    del model.transformer.h[1].mlp.fc_in
    with pytest.raises(UnsupportedModelError, match="gptj reader cannot read .*fc_in") as e:
        read_anatomy(model)
    assert len(str(e.value).splitlines()) == 1


def test_interleaved_and_partial_rotary_by_hand():
    """Frequency i rotates the adjacent pair (2i, 2i+1) by position * inv_freq[i]; features past ``dim`` pass."""
    inv = torch.tensor([0.5, 0.1])
    rot = Rotary(inv_freq=inv, dim=4, interleaved=True)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 6, generator=g)  # (head, pos, d_head): 4 rotated features, 2 passed through
    out = rot.apply(x, torch.arange(5))
    for p in range(5):
        for i in range(2):
            c, s = math.cos(p * float(inv[i])), math.sin(p * float(inv[i]))
            a, b = x[:, p, 2 * i], x[:, p, 2 * i + 1]
            torch.testing.assert_close(out[:, p, 2 * i], a * c - b * s)
            torch.testing.assert_close(out[:, p, 2 * i + 1], b * c + a * s)
    assert_same_computation(out[..., 4:], x[..., 4:], why="the dimensions past the rotary ones, copied")
    # the rotate-half convention pairs (i, i + dim/2) instead
    half = Rotary(inv_freq=inv, dim=4).apply(x, torch.arange(5))
    c, s = math.cos(3 * 0.1), math.sin(3 * 0.1)
    torch.testing.assert_close(half[:, 3, 1], x[:, 3, 1] * c - x[:, 3, 3] * s)


@pytest.mark.parametrize("name", ["gptj", "cohere", "falcon"])
def test_a_shared_norm_gives_each_branch_its_own_sites(name):
    """One norm feeds attention and the MLP; its ``ln_attn`` sites reach only attention and its ``ln_mlp`` sites only
    the MLP, as for two norms with the same weights (captures, edits and gradients)."""
    lm = get_model(f"tiny:{name}")
    L0 = lm.anatomy.layers[0]
    assert L0.placement == "parallel" and L0.ln_mlp is L0.ln_attn
    ids = torch.tensor([[5, 17, 3, 42, 9, 11, 7]])
    P = ids.shape[1]
    sites = [(s, 0) for s in ("ln_attn.in", "ln_attn.out", "ln_mlp.in", "ln_mlp.out", "ln_mlp.scale", "attn_out",
                              "mlp_out", "resid_pre")]
    base = capture(lm, ids, sites)
    assert_same_computation(base[("ln_mlp.in", 0)], base[("resid_pre", 0)], why="one norm input: the same tensor")
    assert_same_computation(base[("ln_mlp.out", 0)], base[("ln_attn.out", 0)], why="one norm: the same output")
    torch.testing.assert_close(base[("ln_mlp.scale", 0)], L0.ln_mlp.scale(base[("resid_pre", 0)]))
    rows, pos = torch.zeros(P, dtype=torch.long), torch.arange(P)
    delta = torch.randn(P, lm.anatomy.d_model, generator=torch.Generator().manual_seed(0))
    for slot, moved, kept in (("ln_mlp", "mlp_out", "attn_out"), ("ln_attn", "attn_out", "mlp_out")):
        for where in ("in", "out"):
            _, cap = run(lm, ids, [Edit(f"{slot}.{where}", 0, rows, pos, delta, mode="add")], capture=sites)
            assert_same_computation(cap[(kept, 0)], base[(kept, 0)], why=f"the edit reaches the other branch only: "
                                    f"the same operations here ({slot}.{where})")
            assert float((cap[(moved, 0)] - base[(moved, 0)]).abs().max()) > 1e-4, (slot, where)
    # the gradient at ln_mlp.out is the MLP's alone: the MLP's input gradient, brute force by autograd
    _, cap = run(lm, ids, capture=[("ln_mlp.out", 0), ("mlp_out", 0)], grad=True)
    w = torch.randn(cap[("mlp_out", 0)].shape, generator=torch.Generator().manual_seed(1))
    (g,) = torch.autograd.grad((cap[("mlp_out", 0)] * w).sum(), cap[("ln_mlp.out", 0)])
    x = base[("ln_mlp.out", 0)].clone().requires_grad_(True)
    with torch.enable_grad():
        (want,) = torch.autograd.grad((L0.mlp(x) * w).sum(), x)
    torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kind", ["prophetnet", "mamba"])
def test_a_model_type_lenscope_does_not_read_is_one_line(tmp_path, kind):
    """A real random model of an unsupported type, saved to a folder: load and the CLI say what lenscope reads."""
    from transformers import AutoModel, MambaConfig, ProphetNetConfig
    from typer.testing import CliRunner

    from lenscope.cli import app

    cfg = (ProphetNetConfig(hidden_size=16, num_encoder_layers=1, num_decoder_layers=1,
                            num_encoder_attention_heads=2, num_decoder_attention_heads=2, encoder_ffn_dim=32,
                            decoder_ffn_dim=32, vocab_size=64)
           if kind == "prophetnet" else MambaConfig(hidden_size=16, num_hidden_layers=1, vocab_size=64, state_size=4))
    AutoModel.from_config(cfg).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match=f"model type '{kind}'.* is not supported; supported model "
                                                     "types: .*bart.*falcon.*marian.*t5") as e:
        lenscope.load(str(tmp_path))
    assert len(str(e.value).splitlines()) == 1
    r = CliRunner().invoke(app, ["verify", "--model", str(tmp_path)])
    err = r.stderr.strip()
    assert r.exit_code == 2 and err.startswith("error: model type") and len(err.splitlines()) == 1, r.output
    assert "Traceback" not in r.output
