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


def dictionary_shape(s: DictSettings, d: int, role: str) -> tuple[int, int]:
    """A per-layer dictionary's ``(parameters, numbers per batch row of its step)``: encoder and decoder ``2 d
    width``, biases, a skip transcoder's ``d^2``, the kind's own per latent (``Kind.trained_per_latent``: JumpReLU's
    thresholds); per row the pre-activations, activations and their gradients (with the auxiliary loss's copies)
    ``6 width`` and the row's inputs, targets, outputs and errors ``8 d``."""
    extra = get(s.kind).trained_per_latent * s.width
    return 2 * d * s.width + s.width + d + (d * d if role == "skip" else 0) + extra, 6 * s.width + 8 * d


def train_memory(s: DictSettings, *, d: int, sites: int, roles: list[str] = (),
                 shapes: list[tuple[int, int]] = ()) -> dict[str, int]:
    """The estimated peak memory of :func:`~lenscope.features.dictionaries.train.train_dictionaries` in bytes, by term
    (float32: 4 bytes a number; ``d`` the activations' width, ``sites`` the sites a row holds, one per-layer
    dictionary per entry of ``roles`` (:func:`dictionary_shape`), and ``shapes``: ``(parameters, numbers per batch
    row)`` of dictionaries of other forms, a cross-layer transcoder's):

    - ``buffer``: the shuffle buffer, ``4 buffer sites d``, three times while the next block is read (the block in
      use, the new block's parts and their concatenation);
    - ``weights``: each dictionary's parameters five times: the parameters, their gradients, Adam's two moments and
      the dictionary returned at the end, ``4 * 5 * parameters``;
    - ``latents``: the largest dictionary's step on a batch, ``4 batch_size`` times its numbers per row.

    ``total``: their sum."""
    shapes = [dictionary_shape(s, d, r) for r in roles] + list(shapes)
    out = {"buffer": 3 * 4 * s.buffer * sites * d, "weights": 4 * 5 * sum(p for p, _ in shapes),
           "latents": 4 * s.batch_size * max(r for _, r in shapes)}
    out["total"] = sum(out.values())
    return out


def check_train_memory(s: DictSettings, max_memory, *, d: int, sites: int, roles: list[str] = (),
                       shapes: list[tuple[int, int]] = ()) -> None:
    """An :class:`~lenscope.errors.InputError` in one line when :func:`train_memory` exceeds the budget
    (:func:`lenscope.memory.budget`), naming the option that lowers each term."""
    limit = budget(max_memory)
    m = train_memory(s, d=d, sites=sites, roles=roles, shapes=shapes)
    n = len(roles) + len(shapes)
    if m["total"] > limit:
        raise InputError(f"dict train: needs about {format_bytes(m['total'])} (shuffle buffer "
                         f"{format_bytes(m['buffer'])}: --buffer; {n} dictionar"
                         f"{'y' if n == 1 else 'ies'} with Adam's states {format_bytes(m['weights'])}: "
                         f"--width; a batch's latents {format_bytes(m['latents'])}: --batch-size), more than the "
                         f"memory budget of {format_bytes(limit)}; lower those or raise --max-memory")


__all__ = ["check_train_memory", "dictionary_shape", "train_memory"]
