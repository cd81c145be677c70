"""The baselines a dictionary is evaluated beside (:mod:`lenscope.features.dictionaries.evaluate`), fitted from running
sums:

- :class:`PCA`: the mean and principal directions of a site (an SAE's baseline: the mean plus the projection on as
  many components as the dictionary's L0);
- :class:`Linear`: the least-squares affine map from an MLP's input to its output (a transcoder's baseline).

:class:`Moments` accumulates ``[x, 1]ᵀ[x, 1]`` (and ``[x, 1]ᵀ y``) in float64 over a stream of tokens;
:func:`fit_pca` / :func:`fit_linear` fit one tensor at once the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class PCA:
    """The site's mean ``(d,)`` and principal directions ``(d, d)`` (columns, variance descending)."""

    mean: Tensor
    components: Tensor
    variances: Tensor

    def reconstruct(self, y: Tensor, k: int) -> Tensor:
        U = self.components[:, :k].to(y.dtype)
        m = self.mean.to(y.dtype)
        return m + ((y - m) @ U) @ U.T


@dataclass
class Linear:
    """``y ≈ x @ W + b`` (``W (d_in, d_out)``), the least-squares fit."""

    W: Tensor
    b: Tensor

    def __call__(self, x: Tensor) -> Tensor:
        return x @ self.W.to(x.dtype) + self.b.to(x.dtype)


class Moments:
    """Running float64 sums of ``[x, 1]ᵀ[x, 1]`` and ``[x, 1]ᵀ y``."""

    def __init__(self, d_in: int, d_out: int | None):
        self.G = torch.zeros(d_in + 1, d_in + 1, dtype=torch.float64)
        self.C = None if d_out is None else torch.zeros(d_in + 1, d_out, dtype=torch.float64)

    def add(self, x: Tensor, y: Tensor | None = None) -> None:
        X = torch.cat([x.double(), x.new_ones(x.shape[0], 1, dtype=torch.float64)], 1)
        self.G += X.T @ X
        if self.C is not None:
            self.C += X.T @ y.double()

    def pca(self) -> PCA:
        n = self.G[-1, -1]
        s = self.G[:-1, -1]
        mean = s / n
        cov = (self.G[:-1, :-1] - torch.outer(s, mean)) / n
        evals, evecs = torch.linalg.eigh(cov)
        order = evals.argsort(descending=True)
        return PCA(mean=mean, components=evecs[:, order], variances=evals[order])

    def linear(self) -> Linear:
        # the minimum-norm least-squares solution (the Gram matrix may be singular: a LayerNorm's output lies in a
        # hyperplane, so [x, 1] has rank d); the fitted map is unique on the data either way
        B = torch.linalg.lstsq(self.G, self.C, rcond=1e-12, driver="gelsd").solution
        return Linear(W=B[:-1], b=B[-1])


def fit_pca(x: Tensor) -> PCA:
    """The PCA of the rows of ``x (n, d)`` (float64), as the streamed fit computes it."""
    m = Moments(x.shape[1], None)
    m.add(x)
    return m.pca()


def fit_linear(x: Tensor, y: Tensor) -> Linear:
    """The least-squares affine map ``x (n, d_in) -> y (n, d_out)`` (float64), as the streamed fit computes it."""
    m = Moments(x.shape[1], y.shape[1])
    m.add(x, y)
    return m.linear()


__all__ = ["Linear", "Moments", "PCA", "fit_linear", "fit_pca"]
