"""The memory :func:`lenscope.features.dictionaries.train.train_dictionaries` will take, estimated before it allocates
anything
(``lenscope dict train --max-memory``), and its one-line refusal."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...errors import InputError
from ...memory import budget, format_bytes
from ...models.dictionaries.kinds import get

if TYPE_CHECKING:
    from .train import DictSettings


def train_memory(s: DictSettings, *, d: int, sites: int, roles: list[str]) -> dict[str, int]:
    """The estimated peak memory of :func:`~lenscope.features.dictionaries.train.train_dictionaries` in bytes, by term
    (float32:
    4 bytes a number; ``d`` the activations' width, ``sites`` the sites a row holds, one dictionary per entry of
    ``roles``):

    - ``buffer``: the shuffle buffer, ``4 buffer sites d``, three times while the next block is read (the block in
      use, the new block's parts and their concatenation);
    - ``weights``: each dictionary's parameters (encoder and decoder ``2 d width``, biases, a skip transcoder's
      ``d^2``, the kind's own per latent, ``Kind.trained_per_latent``: JumpReLU's thresholds) five times: the
      parameters, their gradients, Adam's two moments and the dictionary returned at the end, ``4 * 5 *
      parameters``;
    - ``latents``: one dictionary's step on a batch, ``4 batch_size (6 width + 8 d)``: the pre-activations,
      activations and their gradients (with the auxiliary loss's copies), the batch's inputs, targets, outputs and
      errors.

    ``total``: their sum."""
    extra = get(s.kind).trained_per_latent * s.width
    per = [2 * d * s.width + s.width + d + (d * d if r == "skip" else 0) + extra for r in roles]
    out = {"buffer": 3 * 4 * s.buffer * sites * d, "weights": 4 * 5 * sum(per),
           "latents": 4 * s.batch_size * (6 * s.width + 8 * d)}
    out["total"] = sum(out.values())
    return out


def check_train_memory(s: DictSettings, max_memory, *, d: int, sites: int, roles: list[str]) -> None:
    """An :class:`~lenscope.errors.InputError` in one line when :func:`train_memory` exceeds the budget
    (:func:`lenscope.memory.budget`), naming the option that lowers each term."""
    limit = budget(max_memory)
    m = train_memory(s, d=d, sites=sites, roles=roles)
    if m["total"] > limit:
        raise InputError(f"dict train: needs about {format_bytes(m['total'])} (shuffle buffer "
                         f"{format_bytes(m['buffer'])}: --buffer; {len(roles)} dictionar"
                         f"{'y' if len(roles) == 1 else 'ies'} with Adam's states {format_bytes(m['weights'])}: "
                         f"--width; a batch's latents {format_bytes(m['latents'])}: --batch-size), more than the "
                         f"memory budget of {format_bytes(limit)}; lower those or raise --max-memory")


__all__ = ["check_train_memory", "train_memory"]
