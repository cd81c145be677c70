"""Fixtures: tiny random models of every family (cached per session) and the embedded real models."""

from __future__ import annotations

import pytest

import lenscope
from lenscope.models.families import tiny_names

TINY = sorted(tiny_names())
DECODERS = [n for n in TINY if not tiny_names()[n].encoder]
ENCODERS = [n for n in TINY if tiny_names()[n].encoder]
REAL = ["smollm2", "gemma3-270m", "minilm"]

_cache: dict = {}


def get_model(name: str):
    if name not in _cache:
        _cache[name] = lenscope.load(name)
    return _cache[name]


@pytest.fixture(params=TINY)
def tiny(request):
    return get_model(f"tiny:{request.param}")


@pytest.fixture(params=DECODERS)
def tiny_decoder(request):
    return get_model(f"tiny:{request.param}")


@pytest.fixture(params=ENCODERS)
def tiny_encoder(request):
    return get_model(f"tiny:{request.param}")


@pytest.fixture(scope="session")
def smollm2():
    return get_model("smollm2")


@pytest.fixture(scope="session")
def gemma3():
    return get_model("gemma3-270m")


@pytest.fixture(scope="session")
def minilm():
    return get_model("minilm")


def tiny_with_layers(family: str, n_layers: int):
    """A ``tiny:<family>`` model with ``n_layers`` blocks (same seed and recipe as ``lenscope.load``)."""
    key = (family, n_layers)
    if key not in _cache:
        import torch
        from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

        from lenscope.models.families import randomize_
        from lenscope.models.load import LoadedModel
        from lenscope.models.tokenizer import tiny_special_ids, tiny_tokenizer

        fam = tiny_names()[family]
        cfg = fam.tiny[family](tiny_special_ids())
        cfg.num_hidden_layers = n_layers
        if getattr(cfg, "layer_types", None) is not None:
            cfg.layer_types = cfg.layer_types[:n_layers]
        torch.manual_seed(0)
        auto = AutoModelForMaskedLM if fam.encoder else AutoModelForCausalLM
        model = auto.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
        randomize_(model, seed=0)
        model.eval()
        model.requires_grad_(False)
        _cache[key] = LoadedModel(model=model, tokenizer=tiny_tokenizer(encoder=fam.encoder),
                                  anatomy=fam.read(model), name=f"tiny:{family}")
    return _cache[key]
