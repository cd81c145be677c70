"""The metric gradients of attribution patching, one home for every AtP method (nodes :mod:`.atp`, AtP*
:mod:`.atp_star`, edges :mod:`.edges`, a dictionary's latents :mod:`lenscope.features.dictionaries.attribution`).

Each of them runs the prompts grouped by token length (no padding), the corrupted prompts without gradients
(:func:`corrupted_runs`, which also reads where the metric is), the clean ones through the engine with gradients
on, and takes the gradient of the summed per-row metric at the engine sites it reads (:func:`metric_grads`); a
node's first-order score is then ``(a_corrupted - a_clean) * d metric / d a`` (:func:`atp_product`), summed the
way the node is defined (:func:`atp_delta` the change alone, where the gradient is read elsewhere).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import Tensor

from ..models.loading.load import LoadedModel
from ..models.runtime.engine import Run, run
from ..models.runtime.request import Group, metric_of


def read_at(pos: int, P: int) -> tuple[bool, int]:
    """``(last_only, at)``: a metric read at the last position needs only the last logits."""
    return (True, -1) if pos == P - 1 else (False, pos)


def corrupted_runs(lm: LoadedModel, groups: Iterable[Group], capture=(), *, dictionaries=(),
                   logits: bool = True) -> Iterator[tuple[Group, bool, int, Run]]:
    """For each group of prompts of one token length: ``(group, last_only, at, run)`` with :func:`read_at`'s
    ``last_only``/``at`` and the engine's run of the corrupted prompts without gradients, the sites in ``capture``
    kept (``dictionaries``: those whose latents are among them; ``logits=False``: captures only)."""
    for g in groups:
        last_only, at = read_at(g.position, g.clean.shape[1])
        with torch.no_grad():
            r = run(lm, g.corrupted, capture=capture, last_only=last_only, logits=logits, dictionaries=dictionaries)
        yield g, last_only, at, r


def metric_grads(lm: LoadedModel, ids: Tensor | None, wrt: list, metric: str, target, foil, *, at,
                 capture=None, edits=(), last_only: bool = False, inputs_embeds: Tensor | None = None,
                 dictionaries=(), allow_unused: bool = False) -> tuple[Tensor, dict, dict]:
    """One engine run of ``ids`` (or ``inputs_embeds``) with gradients and ``edits``: ``(metric (row,), captured,
    grads)``, the per-row ``metric`` read at ``at`` (:func:`lenscope.models.runtime.request.metric_of`) and
    ``grads[site]`` the gradient of its sum at each site of ``wrt`` (None where ``allow_unused`` and the metric does
    not read it).
    ``capture``: the sites kept (default ``wrt``); the metric and captures keep their graph."""
    lg, cap = run(lm, ids, edits, capture=wrt if capture is None else capture, inputs_embeds=inputs_embeds,
                  grad=True, last_only=last_only, dictionaries=dictionaries)
    m = metric_of(lg, metric, target, foil, at=at)
    grads = torch.autograd.grad(m.sum(), [cap[s] for s in wrt], allow_unused=allow_unused)
    return m, cap, dict(zip(wrt, grads))


def atp_delta(corrupted: Tensor, clean: Tensor, dtype=torch.float32) -> Tensor:
    """``a_corrupted - a_clean`` in ``dtype`` (the clean activation detached)."""
    return corrupted.to(dtype) - clean.detach().to(dtype)


def atp_product(corrupted: Tensor, clean: Tensor, grad: Tensor, dtype=torch.float32) -> Tensor:
    """``(a_corrupted - a_clean) * d metric / d a`` elementwise in ``dtype``: what a node's AtP score sums."""
    return atp_delta(corrupted, clean, dtype) * grad.to(dtype)
