"""The activation functions of feed-forward blocks, by lenscope's canonical names, and transformers' names for
them (re-exported by :mod:`lenscope.models.weights.anatomy`)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from ...errors import UnsupportedModelError


def _gelu_tanh(x: Tensor) -> Tensor:
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "gelu": lambda x: torch.nn.functional.gelu(x),
    "gelu_tanh": _gelu_tanh,
    "relu": torch.relu,
    "silu": torch.nn.functional.silu,
}

# transformers' names for the same functions
ACTIVATION_ALIASES = {
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_tanh": "gelu_tanh",
    "bloom_gelu": "gelu_tanh",
    "relu": "relu",
    "silu": "silu",
    "swish": "silu",
}


def activation_name(hf_name: str) -> str:
    """Canonical activation name for a transformers ``hidden_act`` string."""
    try:
        return ACTIVATION_ALIASES[hf_name]
    except KeyError:
        raise UnsupportedModelError(
            f"activation {hf_name!r} is not supported; supported: {sorted(ACTIVATION_ALIASES)}"
        ) from None
