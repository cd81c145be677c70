"""One request: what a method explains or patches, resolved and checked once.

- :class:`Request`: a target token with an optional foil (the metric is then ``logit(target) - logit(foil)``) read
  at a position. :meth:`Request.of` turns the user's forms (a token's text ``" Paris"``, ``"#ID"``, an int id) into
  ids and holds the checks every method shares (a foil needs a target; a contrast needs two tokens; the position
  lies within the text); :meth:`Request.or_top` is the model's own top prediction where no target was given.
- :class:`Contrast`: a clean and a corrupted prompt of equal token length with a :class:`Request` and a metric
  (activation and path patching, the node and edge methods of ``circuits``); :func:`contrasts` turns the calling
  forms (one pair, lists, ``ContrastPair``s) into them, :func:`by_length` groups them into batches of one length.
- :func:`metric_of`: the one per-row metric of patching, attribution patching, the circuits and the attribution
  baselines.

Every method takes these; plain strings are turned into them at the method's entry.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from ...errors import InputError
from ..loading.load import require_decoder, resolve_token, token_ids, token_str

if TYPE_CHECKING:
    from ..loading.load import LoadedModel

METRICS = ("logit_diff", "prob")


def position_in(position, n: int) -> int:
    """``position`` (negative counts from the end) as an index ``0..n-1`` of a text of ``n`` tokens; the one
    position check of every method."""
    if not isinstance(position, (int, np.integer)) or isinstance(position, bool):
        raise InputError(f"position must be an integer, got {position!r}")
    if not -n <= position < n:
        raise InputError(f"position {position} is outside the text's {n} tokens (use -{n}..{n - 1})")
    return int(position) % n


@dataclass(frozen=True)
class Request:
    """A prediction to explain: ``target`` and ``foil`` token ids (``None``: none given) and the ``position``
    read (an index into the text, or as given when the text is not known yet)."""

    target: int | None = None
    foil: int | None = None
    position: int = -1

    @classmethod
    def of(cls, lm: LoadedModel, target=None, foil=None, position: int = -1, *, n: int | None = None,
           distinct: bool = False, need: str | None = None, top: Tensor | None = None,
           generated: bool = False) -> Request:
        """Resolve and check a request: token texts, ``"#ID"`` or ints; a foil needs a target; ``distinct``: the
        foil must differ from the target; ``n``: the text's token count, which the position must lie within;
        ``need``: the method that needs a target (refused without one); ``top``: logits ``(vocab,)`` whose argmax
        (the model's own top prediction) is the target where none is given; ``generated``: the targets are the
        tokens a generation will choose (a foil alone is then complete)."""
        if need is not None and target is None:
            raise InputError(f"{need} needs a target token (--target)")
        t = None if target is None else resolve_token(lm, target)
        if t is None and top is not None:
            t = Request._top(top)
        f = None if foil is None else resolve_token(lm, foil)
        if f is not None and t is None and not generated:
            raise InputError("a foil needs a target; give --target too")
        if distinct and f is not None and f == t:
            raise InputError(f"the foil is the same token as the target ({token_str(lm, t)!r}, #{t}); a contrastive "
                             "explanation needs two different tokens (or leave the foil out)")
        return cls(t, f, position if n is None else position_in(position, n))

    def or_top(self, logits: Tensor) -> Request:
        """This request, with the model's own top prediction (the argmax of ``logits (vocab,)``) as the target
        where none was given."""
        return self if self.target is not None else replace(self, target=Request._top(logits))

    @staticmethod
    def _top(logits: Tensor) -> int:
        return int(logits.float().argmax())

    def names(self, lm: LoadedModel) -> tuple[str | None, str | None]:
        """The target's and the foil's text."""
        return (None if self.target is None else token_str(lm, self.target),
                None if self.foil is None else token_str(lm, self.foil))


@dataclass(frozen=True)
class Contrast:
    """A clean/corrupted prompt pair, checked: ``clean``/``corrupted (pos,)`` token ids of equal length, the
    ``target`` and ``foil`` ids (a foil whenever ``metric="logit_diff"``), the metric's ``position`` (an index)."""

    clean: Tensor
    corrupted: Tensor
    target: int
    foil: int | None
    position: int
    metric: str = "logit_diff"

    @property
    def length(self) -> int:
        return self.clean.numel()


def check_metric(metric: str) -> None:
    if metric not in METRICS:
        raise InputError(f"unknown metric={metric!r}; choose one of {', '.join(METRICS)}")


def token_texts(lm: LoadedModel, ids) -> list[str]:
    """Each token id's text."""
    return lm.tokenizer.batch_decode([[int(i)] for i in ids])


def contrast(lm: LoadedModel, clean, corrupted, target, foil, metric: str = "logit_diff",
             position: int = -1) -> Contrast:
    """One clean/corrupted request checked for every patching method: equal token lengths, a target, a foil when
    ``metric="logit_diff"``, the position in range."""
    check_metric(metric)
    c_ids, x_ids = token_ids(lm, clean), token_ids(lm, corrupted)
    if c_ids.numel() != x_ids.numel():
        raise InputError(
            f"the clean and corrupted prompts must have the same number of tokens; they have {c_ids.numel()} "
            f"{token_texts(lm, c_ids)} and {x_ids.numel()} {token_texts(lm, x_ids)}: reword one of them"
        )
    if metric == "logit_diff" and foil is None:
        raise InputError("metric='logit_diff' needs a foil token (--foil); or use metric='prob'")
    r = Request.of(lm, target, foil, position, n=c_ids.numel(), need="patching")
    return Contrast(c_ids, x_ids, r.target, r.foil, r.position, metric)


def _many(x) -> bool:
    if isinstance(x, Tensor):
        return x.dim() == 2
    return isinstance(x, (list, tuple)) and len(x) > 0 and not isinstance(x[0], numbers.Integral) and not (
        isinstance(x[0], Tensor) and x[0].dim() == 0)


def _each(x, n: int, what: str) -> list:
    if isinstance(x, (list, tuple)):
        if len(x) != n:
            raise InputError(f"{what} has {len(x)} entries for {n} prompts: give one per prompt, or one for all")
        return list(x)
    return [x] * n


def contrasts(lm: LoadedModel, clean, corrupted, target, foil, metric: str, position: int, pairs=None,
              what: str = "attribution patching") -> list[Contrast]:
    """The checked prompts of a method over many contrasts (a causal decoder's): ``clean``/``corrupted`` a text or
    ids, or lists of them (``target``/``foil`` then one per prompt or one for all); or ``pairs``: objects with
    ``clean, corrupted, target, foil`` (``lenscope.data.contrast.ContrastPair``)."""
    check_metric(metric)
    require_decoder(lm, what, instead="use a causal decoder (GPT-2, Llama, ...)", causal=True)
    if pairs is not None:
        if clean is not None or corrupted is not None:
            raise InputError("give either pairs or clean/corrupted prompts, not both")
        pairs = list(pairs)
        if not pairs:
            raise InputError("pairs is empty: give at least one clean/corrupted pair")
        return [contrast(lm, p.clean, p.corrupted, p.target, getattr(p, "foil", None), metric, position)
                for p in pairs]
    if clean is None or corrupted is None or target is None:
        raise InputError("give clean and corrupted prompts and a target (or pairs=[ContrastPair, ...])")
    if not _many(clean):
        return [contrast(lm, clean, corrupted, target, foil, metric, position)]
    n = len(clean)
    cs, xs = list(clean), _each(corrupted if _many(corrupted) else [corrupted], n, "corrupted")
    ts, fs = _each(target, n, "target"), _each(foil, n, "foil")
    return [contrast(lm, c, x, t, f, metric, position) for c, x, t, f in zip(cs, xs, ts, fs)]


@dataclass
class Group:
    """Contrasts of one token length as one batch: ``clean``/``corrupted (b, pos)`` ids, ``target``/``foil (b,)``
    ids (``foil`` None for ``metric="prob"``), the metric's ``position``, the prompts' places in the caller's
    list (``index``)."""

    clean: Tensor
    corrupted: Tensor
    target: Tensor
    foil: Tensor | None
    position: int
    index: list[int]
    metric: str = "logit_diff"

    @property
    def size(self) -> int:
        return self.clean.shape[0]


def by_length(cs: list[Contrast]) -> list[Group]:
    """The contrasts grouped by token length (no padding), in order of first appearance."""
    by: dict[int, list[int]] = {}
    for i, c in enumerate(cs):
        by.setdefault(c.length, []).append(i)
    out = []
    for idx in by.values():
        sel = [cs[i] for i in idx]
        fid = None if sel[0].foil is None else torch.tensor([c.foil for c in sel])
        out.append(Group(torch.stack([c.clean for c in sel]), torch.stack([c.corrupted for c in sel]),
                         torch.tensor([c.target for c in sel]), fid, sel[0].position, idx, sel[0].metric))
    return out


def metric_of(logits: Tensor, metric: str, target_id, foil_id=None, *, at: Tensor | int | None = None) -> Tensor:
    """``logits (rows, vocab)`` -> ``(rows,)``: the logit difference ``logit[target] - logit[foil]`` (``foil_id``
    None: the target's logit alone) or, for ``metric="prob"``, the target's probability.

    ``target_id`` / ``foil_id``: one token id for every row, or ``(rows,)`` ids, one per row. ``at``: read
    ``logits (rows, pos, vocab)`` at that position (an int, or ``(rows,)`` one per row). bfloat16 / float16 logits
    are read in float32; the one per-row metric of patching, attribution patching and the attribution baselines."""
    rows = torch.arange(logits.shape[0], device=logits.device)
    if at is not None:
        logits = logits[rows, _on(at, rows)] if isinstance(at, Tensor) else logits[:, at]
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    if metric == "prob":
        logits = logits.softmax(-1)
    t = _on(target_id, rows) if isinstance(target_id, Tensor) else target_id
    out = logits[rows, t]
    if metric == "logit_diff" and foil_id is not None:
        out = out - logits[rows, _on(foil_id, rows) if isinstance(foil_id, Tensor) else foil_id]
    return out


def _on(x: Tensor, like: Tensor) -> Tensor:
    return x.to(like.device)
