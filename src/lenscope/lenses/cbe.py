"""Causal basis extraction (CBE) and causal fidelity of a lens (Belrose et al. 2023, section 4).

**Influence.** The influence ``sigma(v; f)`` of a unit direction ``v`` at state ``l`` on a readout ``f`` is the
expected KL divergence caused by mean-ablating the component of the state along ``v``
(:mod:`lenscope.lenses.influence`: its definition, the lens's fast factored objective and the model side).

**CBE** finds an orthonormal basis ``v_1 .. v_k`` one direction at a time, each maximising the lens's
``sigma`` subject to orthogonality to the earlier ones. The maximisation is L-BFGS (strong Wolfe line
search) on ``x`` with ``v = P x / |P x|``, ``P`` the projector onto the complement of the directions found so
far (so every iterate is a feasible unit vector: projected ascent by reparametrisation, as in the paper's
code). Each direction starts from the most promising of a pool of principal components after projection,
is first optimised on a subsample of the tokens (every ``N / 1024``-th) and then polished with a few
evaluations on all of them. The basis is finally sorted by ``sigma`` (a later direction may beat an
earlier one when the earlier search stopped at a local maximum); ``reordered`` says whether it had to.

**Causal fidelity** ablates each basis direction in the *model's* residual stream at the same state (every
position, mean ablation as above, through the engine, :func:`lenscope.models.runtime.engine.run`) and measures the KL of
the model's final output: ``model_sigma``. A lens whose features are causally faithful ranks the directions
the way the model does: ``fidelity_spearman`` is the Spearman correlation of ``sigma`` and ``model_sigma``.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..errors import InputError
from ..models.loading.load import LoadedModel
from ..results import Result, axis_size
from ..stats import spearman_or_none
from .influence import InfluenceObjective, influence_objective, layer_states, lens_influence, model_influence
from .lenses import Lens

__all__ = [
    "CausalBasis",
    "InfluenceObjective",
    "causal_bases",
    "causal_basis",
    "extract_causal_basis",
    "fidelity_spearman",
    "influence_objective",
    "layer_states",
    "lens_influence",
    "model_influence",
]


# ------------------------------------------------------------------------------------------- CBE


def _pca(Hc: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Top-``k`` principal directions ``(k, d)`` of centred states and their variances ``(k,)``."""
    C = (Hc.double().T @ Hc.double()) / Hc.shape[0]
    evals, evecs = torch.linalg.eigh(C)
    idx = evals.argsort(descending=True)[:k]
    vecs = evecs[:, idx].T.float()
    # a deterministic sign: the largest-magnitude entry positive
    sign = torch.sign(vecs.gather(1, vecs.abs().argmax(1, keepdim=True)))
    return vecs * sign, evals[idx].float()


class _Converged(Exception):
    pass


def _ascend(obj: InfluenceObjective, x0: Tensor, B: Tensor, max_evals: int, rtol: float) -> tuple[float, Tensor]:
    """Maximise ``sigma(unit(P x))`` from ``x0`` with L-BFGS (strong Wolfe); ``P`` projects out the rows of
    ``B``. Stops after ``max_evals`` evaluations, or when the best value gained less than ``rtol`` (relative)
    over the last three evaluations. Returns the best value and its unit vector."""
    x = torch.nn.Parameter(x0.clone())
    best = {"val": -math.inf, "v": None, "hist": []}

    def unit(y):
        if B.shape[0]:
            y = y - (y @ B.T) @ B
        return y / (y.norm() + 1e-12)

    def closure():
        opt.zero_grad()
        with torch.enable_grad():
            v = unit(x)
            val, g = obj.value_and_grad(v)
            if val > best["val"]:
                best["val"], best["v"] = val, v.detach().clone()
            hist = best["hist"]
            hist.append(best["val"])
            if len(hist) > 3 and hist[-1] - hist[-4] <= rtol * abs(hist[-1]):
                raise _Converged
            dot = (v * g).sum()
            loss = -dot + (dot.detach() - val)  # value -sigma, gradient -J^T dsigma/dv
            loss.backward()
        return loss

    opt = torch.optim.LBFGS([x], lr=1.0, max_iter=max_evals, max_eval=max_evals, tolerance_grad=1e-12,
                            tolerance_change=1e-12, history_size=20, line_search_fn="strong_wolfe")
    try:
        opt.step(closure)
    except _Converged:
        pass
    return best["val"], best["v"]


def extract_causal_basis(obj: InfluenceObjective, k: int, *, max_evals: int = 40, polish_evals: int = 8,
                         coarse_tokens: int = 1024, rtol: float = 1e-4, pool: int | None = None,
                         progress: bool = False) -> dict:
    """Greedy CBE on an :class:`InfluenceObjective`: ``k`` orthonormal directions, each maximising ``sigma``
    among the unit vectors orthogonal to the earlier ones, then sorted by ``sigma``.

    Each direction: L-BFGS (strong Wolfe) on every ``N // coarse_tokens``-th token (a subsample of about
    ``coarse_tokens``, at most ``max_evals`` evaluations), then at most ``polish_evals`` evaluations on all
    tokens from there (when there are at most ``coarse_tokens`` tokens, all ``max_evals`` run on all tokens).
    A stage stops early when the best value gained less than ``rtol`` (relative) over three evaluations. The
    start is the principal direction (of a pool of ``2 k``) whose part orthogonal to the earlier directions
    promises the most influence (its own ``sigma`` times its squared projected norm).

    Returns ``vectors (k, d)``, ``sigma (k,)`` (non-increasing, every value evaluated on all tokens),
    ``evals`` (evaluations per direction, coarse and full), ``reordered`` (whether sorting changed the greedy
    order), ``pca_vectors``, ``pca_sigma``, ``pca_variance`` (the top-``k`` principal components of the same
    states, their influence and variance), ``seconds``.
    """
    from tqdm.auto import tqdm

    d = obj.d
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= d:
        raise InputError(f"k must be an integer in 1..{d} (d_model), not {k!r}")
    t_start = time.perf_counter()
    step = obj.N // coarse_tokens if coarse_tokens else 0
    coarse = obj.subset(step) if step >= 2 else None
    n_pool = min(d, max(k, pool if pool is not None else 2 * k))
    pcs, var = _pca(obj.Hc, n_pool)
    pca_sigma = obj.sigma(pcs[:k])
    pool_sigma = torch.cat([pca_sigma, (coarse or obj).sigma(pcs[k:])]) if n_pool > k else pca_sigma
    B = torch.zeros(0, d)
    evals: list[list[int]] = []
    for _ in tqdm(range(k), desc=f"CBE state {obj.layer}", disable=not progress, unit="dir"):
        proj = pcs - (pcs @ B.T) @ B
        x0 = proj[int((pool_sigma * proj.pow(2).sum(1)).argmax())]
        x0 = x0 / x0.norm()
        n_coarse = 0
        if coarse is not None:
            e0 = coarse.evals
            _, x0 = _ascend(coarse, x0, B, max_evals, rtol)
            n_coarse = coarse.evals - e0
        e0 = obj.evals
        _, v = _ascend(obj, x0, B, polish_evals if coarse is not None else max_evals, rtol)
        if B.shape[0]:
            v = v - (v @ B.T) @ B  # exact orthogonality (Gram-Schmidt once more)
        B = torch.cat([B, (v / v.norm())[None]])
        evals.append([n_coarse, obj.evals - e0])
    sigma = obj.sigma(B)  # final values on all tokens, of the orthonormalised vectors
    order = sigma.argsort(descending=True, stable=True)
    return {
        "vectors": B[order], "sigma": sigma[order], "evals": [evals[i] for i in order.tolist()],
        "reordered": bool((order != torch.arange(k)).any()), "pca_vectors": pcs[:k], "pca_sigma": pca_sigma,
        "pca_variance": var[:k], "seconds": time.perf_counter() - t_start,
    }



# ------------------------------------------------------------------------------------------ results


def fidelity_spearman(results: list[CausalBasis]) -> float | None:
    """Spearman correlation of lens and model influence, pooled over the directions of several results
    (e.g. one lens at several states)."""
    rs = [r for r in results if r.model_sigma is not None and r.model_sigma.numel()]
    if not rs:
        return None
    return spearman_or_none(torch.cat([r.sigma for r in rs]), torch.cat([r.model_sigma for r in rs]))


@dataclass(repr=False)
class CausalBasis(Result):
    """A lens's causal basis at one state (named axes: ``dir`` = basis direction, ``d_model``).

    - ``vectors (dir, d_model)``: orthonormal, most influential first; ``sigma (dir,)``: the lens's influence
      ``E KL(lens || lens with v mean-ablated)`` in nats, non-increasing
    - ``model_sigma (dir,)``: the model's influence of the same directions (KL of its final output when ``v``
      is mean-ablated in its residual stream); empty when not measured
    - ``pca_vectors (dir, d_model)``, ``pca_sigma (dir,)``, ``pca_variance (dir,)``: the top principal
      components of the same states, their influence on the lens, and their variance
    - ``mean (d_model,)``: ``E[h]`` used by the mean ablations
    """

    model: str
    lens: str
    layer: int
    n_tokens: int
    n_model_tokens: int
    vectors: Tensor
    sigma: Tensor
    model_sigma: Tensor
    pca_vectors: Tensor
    pca_sigma: Tensor
    pca_variance: Tensor
    mean: Tensor
    evals: list = field(default_factory=list)
    reordered: bool = False
    method: str = "lbfgs"
    seconds: float = 0.0
    model_seconds: float = 0.0
    fast: bool = True

    k = axis_size("vectors", 0)

    @property
    def fidelity_spearman(self) -> float | None:
        if self.model_sigma is None or self.model_sigma.numel() == 0:
            return None
        return spearman_or_none(self.sigma, self.model_sigma)

    def to_dict(self) -> dict:
        has_model = self.model_sigma is not None and self.model_sigma.numel() > 0
        return {
            "model": self.model, "lens": self.lens, "layer": self.layer, "k": self.k, "n_tokens": self.n_tokens,
            "n_model_tokens": self.n_model_tokens if has_model else 0,
            "sigma": self.sigma.tolist(), "model_sigma": self.model_sigma.tolist() if has_model else None,
            "pca_sigma": self.pca_sigma.tolist(), "pca_variance": self.pca_variance.tolist(),
            "fidelity_spearman": self.fidelity_spearman, "method": self.method, "evals": list(self.evals),
            "reordered": self.reordered, "seconds": self.seconds, "model_seconds": self.model_seconds,
            "fast": self.fast,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def to_frame(self):
        """One row per direction: ``sigma``, ``model_sigma``, and the principal component of the same rank."""
        import pandas as pd

        has_model = self.model_sigma is not None and self.model_sigma.numel() > 0
        return pd.DataFrame({
            "direction": range(self.k), "sigma": self.sigma.numpy(),
            "model_sigma": self.model_sigma.numpy() if has_model else [float("nan")] * self.k,
            "pca_sigma": self.pca_sigma.numpy(), "pca_variance": self.pca_variance.numpy(),
        }).set_index("direction")

    def plot(self, others: list[CausalBasis] | tuple = (), ax=None):
        """sigma per direction (this lens, ``others``, and the principal components); returns the Figure."""
        from ..viz.lens_analysis_plots import plot_sigma

        return plot_sigma([self, *others], ax=ax)

    def __repr__(self) -> str:
        f = self.fidelity_spearman
        return (f"CausalBasis({self.lens!r} lens on {self.model!r}, state {self.layer}, k={self.k}, "
                f"{self.n_tokens} tokens, sigma[0]={float(self.sigma[0]):.4g}, "
                f"fidelity_spearman={'n/a' if f is None else f'{f:.3f}'})")


def _sequences(lm: LoadedModel, data, tokens: int, seq_len: int | None) -> Tensor:
    from ..data.text import token_sequences

    if isinstance(data, str):
        return token_sequences(lm, data, seq_len, max_tokens=tokens)
    seqs = torch.as_tensor(data, dtype=torch.long)
    if seqs.dim() == 1:
        seqs = seqs[None]
    return seqs


def causal_basis(lm: LoadedModel, lens: Lens, data, layer: int, k: int = 8, *, tokens: int = 4096,
                 seq_len: int | None = None, model_tokens: int | None = 1024, max_evals: int = 40,
                 skip_first: bool = True, name: str | None = None, fast: bool | None = None,
                 progress: bool = False) -> CausalBasis:
    """CBE of ``lens`` at state ``layer`` and the causal fidelity of its directions.

    ``data``: a text (cut into sequences of ``seq_len`` tokens, default :func:`~lenscope.data.text.fit_seq_len`,
    ``tokens`` in all) or token ids ``(n_seq, pos)``. The lens's influence is measured on every position (each
    sequence's first position, an outlier "attention sink" state in many models, is left out when ``skip_first``);
    the model's influence on the first ``model_tokens`` of them (``None``: all; ``0``: not measured).
    """
    seqs = _sequences(lm, data, tokens, seq_len)
    states = layer_states(lm, seqs, layer, skip_first=skip_first)
    obj = InfluenceObjective(lm, lens, layer, states, fast=fast)
    res = extract_causal_basis(obj, k, max_evals=max_evals, progress=progress)
    model_sigma = torch.zeros(0)
    n_model = 0
    t0 = time.perf_counter()
    if model_tokens != 0:
        per_seq = seqs.shape[1] - (1 if skip_first else 0)
        n_seq = seqs.shape[0] if model_tokens is None else max(1, round(model_tokens / max(1, per_seq)))
        sub = seqs[:n_seq]
        model_sigma = model_influence(lm, sub, layer, res["vectors"], obj.mu, skip_first=skip_first)
        n_model = sub.shape[0] * per_seq
    return CausalBasis(
        model=lm.name, lens=name or lens.kind, layer=layer, n_tokens=obj.N, n_model_tokens=n_model,
        vectors=res["vectors"], sigma=res["sigma"], model_sigma=model_sigma, pca_vectors=res["pca_vectors"],
        pca_sigma=res["pca_sigma"], pca_variance=res["pca_variance"], mean=obj.mu, evals=res["evals"],
        reordered=res["reordered"], seconds=res["seconds"], model_seconds=time.perf_counter() - t0, fast=obj.fast,
    )


def causal_bases(lm: LoadedModel, lenses: dict[str, Lens], data, layers: list[int], k: int = 8, **kw
                 ) -> dict[str, list[CausalBasis]]:
    """:func:`causal_basis` for several lenses (by name) and states, on the same token sequences."""
    seqs = _sequences(lm, data, kw.pop("tokens", 4096), kw.pop("seq_len", None))
    return {name: [causal_basis(lm, lens, seqs, layer, k, name=name, **kw) for layer in layers]
            for name, lens in lenses.items()}
