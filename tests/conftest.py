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
