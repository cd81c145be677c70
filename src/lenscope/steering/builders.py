"""The table of steering-direction builders: the one place a way of building a direction is named.

A :class:`Builder` turns the ``(pair, d_model)`` float64 states of the positive and the negative texts at the
direction's site into a unit direction and its statistics; :func:`~lenscope.steering.directions.build_direction`
reads its needs (how many pairs, whether it reads the first pair only, the options it takes) and scales the unit
direction the same way for every builder. ``lenscope steer build``'s ``--method`` choices and help are
:func:`names` and each builder's ``help`` (read when the command line is built), so a new builder is one
:func:`register` call (``tests/steering/test_builders.py`` registers a dummy one and finds it in the CLI and the
Python API).

This module imports no torch at module level (the command line's ``--help`` reads it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..registry import Table

if TYPE_CHECKING:
    from torch import Tensor

DEFAULT = "mean-diff"  # lenscope.steering.build_direction's and `lenscope steer build`'s default


@dataclass(frozen=True)
class Builder:
    """One way to build a steering direction.

    - ``build(pos, neg, **options) -> (u (d_model,), stats)``: the unit direction from the ``(pair, d_model)``
      float64 states of the positive and the negative texts, and its own statistics (added to the direction's
      ``stats``, e.g. ``explained``).
    - ``help``: its words in ``lenscope steer build --help`` after its name (``"first pair"``), or none.
    - ``min_pairs``: the pairs it needs at least; ``one_pair``: it is built from the first pair only (the
      direction's notes say so when more are given).
    - ``options``: the keyword options it takes (``build_direction(..., **options)``); others are refused.
    """

    name: str
    build: Callable
    help: str = ""
    min_pairs: int = 1
    one_pair: bool = False
    options: tuple[str, ...] = ()


_TABLE: Table[Builder] = Table("a steering direction builder", "unknown method {name!r}; choose from {names}")
register, unregister, get = _TABLE.register, _TABLE.unregister, _TABLE.get
names = _TABLE.names  # the builder names in table order (``lenscope steer build``'s ``--method`` choices)
builders = _TABLE.entries


# ------------------------------------------------------------------------------------ the built-in builders


def _actadd(pos: Tensor, neg: Tensor) -> tuple[Tensor, dict]:
    d = pos[0] - neg[0]
    return d / d.norm(), {}


def _mean_diff(pos: Tensor, neg: Tensor) -> tuple[Tensor, dict]:
    d = (pos - neg).mean(0)
    return d / d.norm(), {}


def _pca(pos: Tensor, neg: Tensor) -> tuple[Tensor, dict]:
    import torch

    _, s, vh = torch.linalg.svd(pos - neg, full_matrices=False)
    return vh[0], {"explained": float(s[0] ** 2 / (s ** 2).sum())}


def _probe(pos: Tensor, neg: Tensor) -> tuple[Tensor, dict]:
    import torch
    from sklearn.linear_model import LogisticRegression

    X = torch.cat([pos, neg]).numpy()
    y = [1] * len(pos) + [0] * len(neg)
    clf = LogisticRegression(C=1.0, max_iter=5000).fit(X, y)
    w = torch.as_tensor(clf.coef_[0], dtype=torch.float64)
    return w / w.norm(), {"accuracy": float(clf.score(X, y))}


for _b in (
    Builder("actadd", _actadd, help="first pair", one_pair=True),
    Builder(DEFAULT, _mean_diff),
    Builder("pca", _pca, min_pairs=2),
    Builder("probe", _probe, min_pairs=2),
):
    register(_b)
del _b
