"""The synthetic benchmark: activations made of known sparse features, to measure how well a dictionary recovers
them (in the spirit of SynthSAEBench).

:func:`make_synthetic` draws ``n_features`` true feature directions, random unit vectors in a ``d``-dimensional
space (``d < n_features``: the features are in superposition), and ``n`` samples

    x = sum_i c_i f_i + noise          c_i = m_i  when feature i fires (else 0), noise ~ N(0, noise^2 I)

- firing frequencies follow a Zipf law, ``p_i ∝ (i + 1)^-zipf_exponent``, scaled so that the expected number of
  active features per sample (the true L0) is ``l0`` (a frequency is capped at 1);
- a fraction ``hierarchy`` of the features are children: a child fires only when its parent (a more frequent root
  feature) fires, with probability ``p_child / p_parent`` then, so its marginal frequency is still ``p_child``;
- magnitudes ``m_i = |1 + magnitude_std * N(0, 1)|``.

Recovery of the true features by a learned dictionary (:func:`recovery`):

- :func:`mean_max_cosine`: the mean over true features of the largest ``|cos|`` with any learned decoder row;
- :func:`mcc`: the mean correlation coefficient: Pearson correlations between the true codes and the learned
  latents over the samples, true features matched one-to-one to latents by
  ``scipy.optimize.linear_sum_assignment`` on ``|corr|``, averaged over the true features (one left without a
  latent, when there are fewer latents than features, counts 0).

:func:`save_activations` writes the activations as the ``activations`` tensor of a safetensors file, which
``lenscope dict train --activations`` reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ...errors import InputError
from ...results import axis_size


@dataclass(repr=False)
class SyntheticData:
    """Synthetic activations and their ground truth.

    - ``activations (n, d)``: the samples;
    - ``codes (n, n_features)``: each feature's coefficient in each sample (0 when it does not fire);
    - ``directions (n_features, d)``: the true features, unit norm;
    - ``frequencies (n_features,)``: each feature's firing probability (marginal);
    - ``parents (n_features,)``: a child's parent feature, -1 for a root;
    - ``l0``: the expected number of active features per sample (``frequencies.sum()``).
    """

    activations: Tensor
    codes: Tensor
    directions: Tensor
    frequencies: Tensor
    parents: Tensor
    noise: float
    seed: int

    @property
    def l0(self) -> float:
        return float(self.frequencies.sum())

    n_features = axis_size("directions", 0)
    d = axis_size("directions", 1)

    def __repr__(self) -> str:
        return (f"SyntheticData(n={self.activations.shape[0]}, d={self.d}, n_features={self.n_features}, "
                f"l0={self.l0:.2f}, children={int((self.parents >= 0).sum())}, noise={self.noise})")


def zipf_frequencies(n_features: int, l0: float, exponent: float = 1.0) -> Tensor:
    """Firing probabilities ``(n_features,)`` float64, ``∝ (i + 1)^-exponent``, summing to ``l0`` (each capped at
    1: the mass a capped feature cannot take is spread over the others)."""
    if not 0 < l0 < n_features:
        raise InputError(f"the true L0 must lie in (0, n_features={n_features}); got {l0}")
    w = torch.arange(1, n_features + 1, dtype=torch.float64).pow(-float(exponent))
    p = torch.zeros(n_features, dtype=torch.float64)
    free = torch.ones(n_features, dtype=torch.bool)
    for _ in range(n_features):  # water-filling: at most n_features rounds, usually one
        left = l0 - float(p[~free].sum())
        p[free] = w[free] * left / float(w[free].sum())
        over = free & (p > 1)
        if not over.any():
            break
        p[over] = 1.0
        free &= ~over
    return p


def make_synthetic(n: int, *, d: int = 64, n_features: int = 256, l0: float = 8.0, zipf_exponent: float = 1.0,
                   hierarchy: float = 0.25, magnitude_std: float = 0.2, noise: float = 0.05,
                   seed: int = 0) -> SyntheticData:
    """``n`` synthetic samples (see the module's docstring); float32 tensors, reproducible from ``seed``."""
    if n < 1 or d < 1:
        raise InputError(f"n and d must be at least 1; got n={n}, d={d}")
    if not d < n_features:
        raise InputError(f"the features are in superposition only with d < n_features; got d={d}, "
                         f"n_features={n_features}")
    if not 0 <= hierarchy < 1:
        raise InputError(f"hierarchy is the fraction of child features, in [0, 1); got {hierarchy}")
    if noise < 0 or magnitude_std < 0:
        raise InputError("noise and magnitude_std must be >= 0")
    g = torch.Generator().manual_seed(int(seed))
    dirs = torch.randn(n_features, d, generator=g, dtype=torch.float64)
    dirs = dirs / dirs.norm(dim=1, keepdim=True)
    p = zipf_frequencies(n_features, l0, zipf_exponent)
    # children: a random subset of the features after the first; each parent a root more frequent than its child
    n_child = int(round(hierarchy * n_features))
    child = torch.zeros(n_features, dtype=torch.bool)
    if n_child:
        child[1 + torch.randperm(n_features - 1, generator=g)[:n_child]] = True
    parents = torch.full((n_features,), -1, dtype=torch.long)
    for i in torch.nonzero(child).flatten().tolist():
        roots = torch.nonzero(~child[:i]).flatten()  # feature 0 is always a root
        parents[i] = roots[int(torch.randint(len(roots), (1,), generator=g))]
    is_child = parents >= 0
    cond = p.clone()
    cond[is_child] = p[is_child] / p[parents[is_child]]  # <= 1: a parent is at least as frequent
    u = torch.rand(n, n_features, generator=g, dtype=torch.float64)
    fires = u < cond
    fires[:, is_child] &= fires[:, parents[is_child]]
    mag = (1 + magnitude_std * torch.randn(n, n_features, generator=g, dtype=torch.float64)).abs()
    codes = torch.where(fires, mag, torch.zeros((), dtype=torch.float64))
    x = codes @ dirs + noise * torch.randn(n, d, generator=g, dtype=torch.float64)
    return SyntheticData(activations=x.float(), codes=codes.float(), directions=dirs.float(), frequencies=p.float(),
                         parents=parents, noise=float(noise), seed=int(seed))


def mean_max_cosine(true_directions: Tensor, learned: Tensor) -> float:
    """Mean over the true features ``(n_features, d)`` of the largest ``|cos|`` with any learned direction
    ``(width, d)`` (a dictionary's decoder rows ``W_dec``)."""
    if true_directions.shape[-1] != learned.shape[-1]:
        raise InputError(f"true directions have {true_directions.shape[-1]} dimensions, learned ones "
                         f"{learned.shape[-1]}")
    a = true_directions.double()
    b = learned.double()
    a = a / a.norm(dim=1, keepdim=True).clamp_min(1e-300)
    b = b / b.norm(dim=1, keepdim=True).clamp_min(1e-300)
    return float((a @ b.T).abs().max(dim=1).values.mean())


def correlations(a: Tensor, b: Tensor, chunk: int = 65536) -> Tensor:
    """Pearson correlations ``(m, w)`` between the columns of ``a (n, m)`` and ``b (n, w)`` (float64, summed over
    the samples in chunks); a constant column correlates 0 with everything."""
    if a.shape[0] != b.shape[0]:
        raise InputError(f"codes and latents must cover the same samples; got {a.shape[0]} and {b.shape[0]}")
    n = a.shape[0]
    ma, mb = a.double().mean(0), b.double().mean(0)
    cross = torch.zeros(a.shape[1], b.shape[1], dtype=torch.float64)
    va = torch.zeros(a.shape[1], dtype=torch.float64)
    vb = torch.zeros(b.shape[1], dtype=torch.float64)
    for s in range(0, n, chunk):
        ca, cb = a[s:s + chunk].double() - ma, b[s:s + chunk].double() - mb
        cross += ca.T @ cb
        va += ca.pow(2).sum(0)
        vb += cb.pow(2).sum(0)
    den = (va[:, None] * vb[None, :]).sqrt()
    return torch.where(den > 0, cross / den.clamp_min(1e-300), torch.zeros((), dtype=torch.float64))


def mcc(true_codes: Tensor, latents: Tensor) -> float:
    """The mean correlation coefficient: true codes ``(n, n_features)`` and learned latents ``(n, width)`` matched
    one-to-one by the assignment that maximises the summed ``|corr|``, averaged over the true features."""
    from scipy.optimize import linear_sum_assignment

    c = correlations(true_codes, latents).abs()
    rows, cols = linear_sum_assignment(c.numpy(), maximize=True)
    return float(c[torch.as_tensor(rows), torch.as_tensor(cols)].sum()) / c.shape[0]


def recovery(dictionary, data: SyntheticData) -> dict:
    """How well ``dictionary`` (an SAE over ``data.d`` dimensions) recovers ``data``'s features:
    ``{"mean_max_cosine", "mcc", "l0"}`` (``l0``: the dictionary's mean active latents per sample)."""
    if dictionary.d_in != data.d or dictionary.d_out != data.d:
        raise InputError(f"the dictionary reads {dictionary.d_in} and writes {dictionary.d_out} dimensions; the "
                         f"synthetic data has {data.d}")
    with torch.no_grad():
        z = dictionary.encode(data.activations)
    return {"mean_max_cosine": mean_max_cosine(data.directions, dictionary.W_dec), "mcc": mcc(data.codes, z),
            "l0": float((z != 0).sum(-1).double().mean())}


def save_activations(path: str | Path, x: Tensor, **extra: Tensor) -> Path:
    """Write ``x (n, d)`` (or ``(n, 2, d)`` input / output pairs) as the tensor ``activations`` of a safetensors
    file (what ``lenscope dict train --activations`` reads); ``extra`` tensors are stored beside it (e.g. the
    ground truth's ``directions`` and ``codes``)."""
    from safetensors.torch import save_file

    if x.dim() not in (2, 3) or (x.dim() == 3 and x.shape[1] != 2) or not x.is_floating_point():
        raise InputError(f"activations are float (n, d) or (n, 2, d); got {str(x.dtype)} {tuple(x.shape)}")
    if "activations" in extra:
        raise InputError("'activations' is the name of x itself")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {"activations": x.detach().float().contiguous().cpu()}
    tensors.update({k: v.detach().contiguous().cpu() for k, v in extra.items()})
    save_file(tensors, str(path))
    return path


__all__ = ["SyntheticData", "correlations", "make_synthetic", "mcc", "mean_max_cosine", "recovery",
           "save_activations", "zipf_frequencies"]
