"""What the steering tests share: contrast pairs and held-out inputs that every tiny model's tokenizer reads (single
token answers), a direction per model, and a plain PyTorch hook that adds a vector to a block's input."""

from __future__ import annotations

import torch

from lenscope.steering import build_direction

PAIRS = [("the cat is happy", "the cat is sad"), ("a dog was good", "a dog was bad"),
         ("the man sat down", "the man ran off"), ("she is glad", "she is angry")]
INPUTS = [("the cat sat on the", " the", " a"), ("a dog is", " the", " a"), ("the man and the woman", " a", " the"),
          ("it was a", " the", " a"), ("the dog sat", " the", " cat"), ("she said that the", " cat", " dog")]
PROMPT = "the cat sat on the"


def direction(lm, layer: int = 1, method: str = "mean-diff"):
    return build_direction(lm, PAIRS, method, layer)


def blocks(model, n_layers: int):
    """The model's blocks found without lenscope: the first ``nn.ModuleList`` of ``n_layers`` modules."""
    return next(m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == n_layers)


def add_hook(block, vec: torch.Tensor, lo: int = 0, hi: int | None = None):
    """A forward pre-hook adding ``vec`` to the block's input at positions ``lo:hi`` (absolute: the hook counts the
    positions the block sees, so it is meant for runs without a cache). Returns the handle."""

    def f(mod, args, kwargs):
        x = args[0] if args else kwargs["hidden_states"]
        x = x.clone()
        x[:, lo:hi] = x[:, lo:hi] + vec
        if args:
            return (x,) + tuple(args[1:]), kwargs
        kwargs = dict(kwargs)
        kwargs["hidden_states"] = x
        return args, kwargs

    return block.register_forward_pre_hook(f, with_kwargs=True)
