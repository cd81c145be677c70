"""Causal basis extraction (CBE) and causal fidelity of a lens (Belrose et al. 2023, section 4).

**Influence.** The influence of a unit direction ``v`` at state ``l`` on a readout ``f`` (a lens's output
distribution, or the model's own final one) is

    sigma(v; f) = E_h[ KL( f(h) || f(h - ((h - E[h]) . v) v) ) ]

the expected KL divergence caused by *mean-ablating* the component of ``h`` along ``v`` (it is replaced by
its mean over the corpus), estimated over the tokens of a text.

**CBE** finds an orthonormal basis ``v_1 .. v_k`` one direction at a time, each maximising the lens's
``sigma`` subject to orthogonality to the earlier ones. The maximisation is L-BFGS (strong Wolfe line
search) on ``x`` with ``v = P x / |P x|``, ``P`` the projector onto the complement of the directions found so
far (so every iterate is a feasible unit vector: projected ascent by reparametrisation, as in the paper's
code). Each direction starts from the most promising of a pool of principal components after projection,
is first optimised on a subsample of the tokens (every ``N / 1024``-th) and then polished with a few
evaluations on all of them. The basis is finally sorted by ``sigma`` (a later direction may beat an
earlier one when the earlier search stopped at a local maximum); ``reordered`` says whether it had to.

**Causal fidelity** ablates each basis direction in the *model's* residual stream at the same state (every
position, mean ablation as above, through :func:`lenscope.interventions.hooks.run`) and measures the KL of
the model's final output: ``model_sigma``. A lens whose features are causally faithful ranks the directions
the way the model does: ``fidelity_spearman`` is the Spearman correlation of ``sigma`` and ``model_sigma``.

**Speed.** A lens is affine before the final norm, so mean-ablating ``v`` moves the (centred) pre-norm state
by a rank-one term ``x' = x - c w`` with ``c = (h - mu) . v`` and ``w = centre(v M)``. The logits become
``s' (Z - c u) + z_b`` with ``Z = (g * x) W_U`` computed once for all tokens, ``u = (g * w) W_U`` one vector
per direction and ``s'`` the new per-token norm scale; the KL's cross term ``p . z'`` folds into one
``(tokens, d_model)`` matrix ``p W_U^T``. One evaluation of ``sigma`` and its gradient is therefore a few
passes over a ``(tokens, vocab)`` array, chunked over tokens, with no ``d_model x vocab`` matmul: ``sigma``'s
gradient comes from a custom autograd function for the log-partition term. Lenses that are not affine-then-
norm-then-linear (encoders' masked-LM heads, soft-capped logits) use the plain chunked autograd path, which
is also the tests' reference.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..errors import InputError, NotApplicableError
from ..models.load import LoadedModel
from ..results import Result
from .lenses import Lens, LogitLens, decode

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


# ---------------------------------------------------------------------------------------------- states


@torch.no_grad()
def layer_states(lm: LoadedModel, sequences: Tensor, layer: int, *, batch_size: int = 8,
                 skip_first: bool = True) -> Tensor:
    """Residual states ``(tokens, d_model)`` at state ``layer`` of every position of ``sequences (n_seq, pos)``
    (float32; without each sequence's first position when ``skip_first``)."""
    from ..interventions.hooks import run
    from ..models.trace import residual_states

    L = lm.anatomy.n_layers
    if not 0 <= layer <= L:
        raise InputError(f"layer {layer} is outside 0..{L}")
    out = []
    for s in range(0, sequences.shape[0], batch_size):
        ids = sequences[s : s + batch_size]
        if layer < L:
            _, got = run(lm, ids, capture=[("resid", layer)], stop_after=("resid", layer), logits=False)
            h = got[("resid", layer)]
        else:
            h = residual_states(lm, ids)["states"][-1]
        out.append((h[:, 1:] if skip_first else h).float().reshape(-1, h.shape[-1]).cpu())
    return torch.cat(out)


# ------------------------------------------------------------------------------------------ objective


def _shifted_exp(R: Tensor, r: Tensor, a: Tensor, lse0: Tensor, U3: Tensor) -> Tensor:
    """``exp(z' - lse0)`` for a chunk of tokens, where ``z' = (1 + r) R + zb - a u`` are the ablated logits
    (``U3 = [zb; u; 1]``, one rank-3 update after a row scaling: two passes over the chunk)."""
    C = torch.stack([torch.ones_like(a), -a, -lse0], 1)
    t = R.mul((1.0 + r)[:, None])
    return t.addmm_(C, U3).exp_()


class _LseSum(torch.autograd.Function):
    """``sum_n log sum_v exp(z'[n, v] - lse0_n)`` for the ablated logits ``z' = (1 + r_n) R[n, v] + zb_v -
    a_n u_v`` (``R``: the base logits without ``zb``, ``lse0``: their log-partition), and its gradient in
    ``r, a, u``.

    ``R (tokens, vocab)``, ``lse0 (tokens,)`` and ``zb (vocab,)`` are constants. Shifting by the base
    log-partition keeps the exponentials in range without a max pass (a chunk that overflows anyway is
    recomputed the safe way). The gradient is computed in the same pass as the value (every caller that asks
    for it needs both), chunked over tokens, so no other ``(tokens, vocab)`` tensor is kept.
    """

    @staticmethod
    def forward(ctx, r: Tensor, a: Tensor, u: Tensor, R: Tensor, lse0: Tensor, zb: Tensor, rows: int,
                need: bool):
        N = R.shape[0]
        total = torch.zeros((), dtype=torch.float64)
        dr = torch.empty_like(r) if need else None
        da = torch.empty_like(a) if need else None
        du = torch.zeros_like(u) if need else None
        U3 = torch.stack([zb, u, torch.ones_like(u)])
        for i in range(0, N, rows):
            j = min(N, i + rows)
            e = _shifted_exp(R[i:j], r[i:j], a[i:j], lse0[i:j], U3)
            S = e.sum(-1)
            if not bool(torch.isfinite(S).all() and (S > 0).all()):  # out of float32 range: stabilise
                t = R[i:j].mul((1.0 + r[i:j])[:, None]).add_(zb).addr_(a[i:j], u, alpha=-1.0)
                m = t.amax(-1)
                e = t.sub_(m[:, None]).exp_()
                S = e.sum(-1)
                logS = S.log() + (m - lse0[i:j])
            else:
                logS = S.log()
            total += logS.double().sum()
            if need:
                inv = 1.0 / S  # q = e / S
                du.addmv_(e.T, a[i:j] * inv, alpha=-1.0)
                da[i:j] = -(e @ u) * inv
                dr[i:j] = (e.mul_(R[i:j])).sum(-1) * inv
        if need:
            ctx.save_for_backward(dr, da, du)
        return total

    @staticmethod
    def backward(ctx, g):
        dr, da, du = ctx.saved_tensors
        g = float(g)
        return g * dr, g * da, g * du, None, None, None, None, None


def _rows_for(vocab: int, budget_bytes: float) -> int:
    return max(1, int(budget_bytes // (vocab * 4)))


class InfluenceObjective:
    """``sigma(v)`` of a lens at one state over fixed residual ``states (tokens, d_model)``.

    ``sigma(V)`` evaluates directions ``V (k, d_model)`` (no gradient); ``value_and_grad(v)`` returns the
    influence of one unit direction and its gradient in ``v``. ``mean`` is ``E[h]`` (default: the states'
    own mean). ``fast=None`` picks the factored path whenever the lens allows it.
    """

    def __init__(self, lm: LoadedModel, lens: Lens, layer: int, states: Tensor, *, mean: Tensor | None = None,
                 fast: bool | None = None, budget_bytes: float = 3.2e6, general_rows: int = 256):
        A = lm.anatomy
        if A.unembed is None:
            decode(A, torch.zeros(1, A.d_model))  # raises the NotApplicableError that says why
        if lens.mid:
            raise NotApplicableError("causal bases are defined on the regular residual states; this lens was trained "
                                     "on mid-layer states")
        if not 0 <= layer <= A.n_layers:
            raise InputError(f"layer {layer} is outside 0..{A.n_layers}")
        self.lm, self.lens, self.layer = lm, lens, layer
        self.H = states.float()
        self.N, self.d = self.H.shape
        if self.N < 2:
            raise InputError("mean ablation needs at least two token states")
        self.mu = self.H.mean(0) if mean is None else mean.float()
        self.Hc = self.H - self.mu
        self.general_rows = general_rows
        u = A.unembed
        can_fast = u.transform_W is None and u.softcap is None
        if fast and not can_fast:
            raise InputError("the factored path needs a lens decoded by norm + linear unembedding (no masked-LM "
                             "transform, no logit soft-capping)")
        self.fast = can_fast if fast is None else bool(fast)
        self.evals = 0
        if self.fast:
            self._prepare_fast(budget_bytes)
        else:
            self._prepare_general()

    # ---------------------------------------------------------------- fast (factored) path

    @torch.no_grad()
    def _prepare_fast(self, budget_bytes: float) -> None:
        A = self.lm.anatomy
        d = self.d
        t0 = self.lens.transform(torch.zeros(1, d), self.layer)[0].float()
        M = self.lens.transform(torch.eye(d), self.layer).float() - t0  # the lens's linear part
        X = self.H @ M + t0
        if not torch.allclose(self.lens.transform(self.H[:4], self.layer).float(), X[:4], rtol=1e-4, atol=1e-4):
            raise InputError("this lens is not affine; use fast=False")
        norm = A.final_norm
        self.M = M
        self.norm = norm
        W = A.unembed.W_U.float()  # (d, vocab)
        V = W.shape[1]
        self.W = W
        self.g = norm.weight.float() if norm is not None and norm.weight is not None else torch.ones(d)
        self.Xc = norm.center(X) if norm is not None else X
        zb = torch.zeros(V)
        if norm is not None and norm.bias is not None:
            zb += norm.bias.float() @ W
        if A.unembed.b_U is not None:
            zb += A.unembed.b_U.float()
        self.zb = zb
        self.rows = _rows_for(V, budget_bytes)
        self.var0 = self._var(self.Xc)  # (N,) float64, eps included
        s0 = torch.rsqrt(self.var0).float()
        self.R = torch.empty(self.N, V)  # base logits without zb
        self.lse0 = torch.empty(self.N)  # base log-partition
        self.lseb = torch.empty(self.N, dtype=torch.float64)  # what _LseSum gives for no ablation (0 + rounding)
        self.praw = torch.empty(self.N, dtype=torch.float64)  # p . R
        self.Pw = torch.empty(self.N, d)  # p W_U^T
        big = _rows_for(V, 2.5e8)
        U3 = torch.stack([zb, torch.zeros(V), torch.ones(V)])
        for i in range(0, self.N, big):
            j = min(self.N, i + big)
            R = torch.mm(self.Xc[i:j] * self.g, W, out=self.R[i:j]).mul_(s0[i:j, None])
            self.lse0[i:j] = torch.logsumexp(R + zb, -1)
            for i2 in range(i, j, self.rows):  # exactly the arithmetic of _LseSum at r = a = 0
                j2 = min(j, i2 + self.rows)
                zero = torch.zeros(j2 - i2)
                e = _shifted_exp(self.R[i2:j2], zero, zero, self.lse0[i2:j2], U3)
                S = e.sum(-1)
                self.lseb[i2:j2] = S.log().double()
                p = e.div_(S[:, None])
                self.praw[i2:j2] = (p * self.R[i2:j2]).sum(-1).double()
                self.Pw[i2:j2] = p @ W.T

    def _var(self, Xc: Tensor) -> Tensor:
        """Per-token variance seen by the final norm, eps included (float64; 1 without a norm)."""
        if self.norm is None:
            return torch.ones(Xc.shape[0], dtype=torch.float64)
        return Xc.double().pow(2).mean(-1) + self.norm.eps

    def _sigma_fast(self, v: Tensor, need_grad: bool) -> Tensor:
        c = self.Hc @ v  # (N,)
        w = v @ self.M
        wc = self.norm.center(w) if self.norm is not None else w
        if self.norm is not None:  # new scale s' = s0 (1 + r), the variance change taken exactly
            dvar = (-2.0 * c.double() * (self.Xc.double() @ wc.double()) + c.double().pow(2) * wc.double().pow(2).sum()
                    ) / self.d
            r = torch.expm1(-0.5 * torch.log1p(dvar / self.var0))
            s1 = (torch.rsqrt(self.var0) * (1.0 + r)).float()
            r = r.float()
        else:
            r, s1 = torch.zeros_like(c), torch.ones_like(c)
        gw = wc * self.g
        u = gw @ self.W  # (vocab,)
        a = s1 * c
        lse = _LseSum.apply(r, a, u, self.R, self.lse0, self.zb, self.rows, need_grad)
        pdelta = r.double() * self.praw - (a * (self.Pw @ gw)).double()  # p . (ablated - base logits)
        return (lse - self.lseb.sum() - pdelta.sum()) / self.N

    # ---------------------------------------------------------------- general path

    def _prepare_general(self) -> None:
        pass

    def _sigma_general(self, v: Tensor, need_grad: bool) -> tuple[float, Tensor | None]:
        A, lens, layer = self.lm.anatomy, self.lens, self.layer
        total = 0.0
        grad = torch.zeros_like(v) if need_grad else None
        for a in range(0, self.N, self.general_rows):
            b = min(self.N, a + self.general_rows)
            h = self.H[a:b]
            with torch.no_grad():
                logp = torch.log_softmax(decode(A, lens.transform(h, layer)).float(), -1)
            vv = v.detach().clone().requires_grad_(need_grad)
            with torch.set_grad_enabled(need_grad):
                c = self.Hc[a:b] @ vv
                logq = torch.log_softmax(decode(A, lens.transform(h - c[:, None] * vv, layer)).float(), -1)
                kl = (logp.exp() * (logp - logq)).sum()
            if need_grad:
                (g,) = torch.autograd.grad(kl, vv)
                grad += g
            total += float(kl.detach())
        return total / self.N, (grad / self.N if need_grad else None)

    # ---------------------------------------------------------------- public

    def subset(self, step: int) -> InfluenceObjective:
        """The same objective on every ``step``-th token (views, no copies; the mean stays the full one)."""
        import copy

        sub = copy.copy(self)
        sl = slice(None, None, step)
        for name in ("H", "Hc", "Xc", "var0", "R", "lse0", "lseb", "praw", "Pw"):
            if getattr(self, name, None) is not None:
                setattr(sub, name, getattr(self, name)[sl])
        sub.N = sub.H.shape[0]
        sub.evals = 0
        return sub

    def value_and_grad(self, v: Tensor) -> tuple[float, Tensor]:
        """``sigma(v)`` and its gradient in ``v (d_model,)`` (``v`` is used as given: pass a unit vector)."""
        self.evals += 1
        v = v.detach().float()
        if self.fast:
            vv = v.clone().requires_grad_(True)
            with torch.enable_grad():
                sig = self._sigma_fast(vv, True)
                (g,) = torch.autograd.grad(sig, vv)
            return float(sig.detach()), g
        val, g = self._sigma_general(v, True)
        return val, g

    @torch.no_grad()
    def sigma(self, V: Tensor) -> Tensor:
        """Influence of each unit direction ``V (k, d_model)`` -> ``(k,)`` (float32)."""
        V = V.detach().float().reshape(-1, self.d)
        out = torch.empty(V.shape[0])
        for i, v in enumerate(V):
            self.evals += 1
            out[i] = float(self._sigma_fast(v, False)) if self.fast else self._sigma_general(v, False)[0]
        return out


def influence_objective(lm: LoadedModel, lens: Lens, layer: int, states: Tensor, **kw) -> InfluenceObjective:
    """The :class:`InfluenceObjective` of ``lens`` at state ``layer`` over ``states (tokens, d_model)``."""
    return InfluenceObjective(lm, lens, layer, states, **kw)


def lens_influence(lm: LoadedModel, lens: Lens, layer: int, states: Tensor, directions: Tensor, *,
                   mean: Tensor | None = None, fast: bool | None = None) -> Tensor:
    """``sigma(v; lens)`` for each row of ``directions (k, d_model)`` (unit vectors) -> ``(k,)``."""
    return InfluenceObjective(lm, lens, layer, states, mean=mean, fast=fast).sigma(directions)


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


# ------------------------------------------------------------------------------------ model side


@torch.no_grad()
def model_influence(lm: LoadedModel, sequences: Tensor, layer: int, directions: Tensor, mean: Tensor, *,
                    skip_first: bool = True, budget_bytes: float = 1.0e9) -> Tensor:
    """``sigma(v; model)`` for each row of ``directions (k, d_model)``: mean-ablate ``v`` in the real model's
    residual stream entering block ``layer`` (at every position, or every position but each sequence's first
    when ``skip_first``), run the rest of the model, and average KL(final || ablated final) over the same
    positions. Directions are batched: one forward pass runs several (sequence, direction) rows.

    ``layer == n_layers`` (the last residual state, before the final norm) is the logit lens's influence there.
    """
    from ..interventions.hooks import Edit, run

    A = lm.anatomy
    L = A.n_layers
    directions = directions.float()
    k = directions.shape[0]
    if layer == L:
        states = layer_states(lm, sequences, L, skip_first=skip_first)
        return lens_influence(lm, LogitLens(A), L, states, directions, mean=mean)
    if not 0 <= layer < L:
        raise InputError(f"layer {layer} is outside 0..{L}")
    n_seq, P = sequences.shape
    first = 1 if skip_first else 0
    V = A.vocab_size
    rows_per_pass = max(1, int(budget_bytes // (P * V * 4 * 3)))
    total = torch.zeros(k, dtype=torch.float64)
    count = 0
    for s in range(0, n_seq, max(1, min(n_seq, rows_per_pass))):
        ids = sequences[s : s + rows_per_pass]
        B = ids.shape[0]
        logits, got = run(lm, ids, capture=[("resid", layer)])
        logp = torch.log_softmax(logits[:, first:].float(), -1)  # (B, P', V)
        h = got[("resid", layer)].float()  # (B, P, d)
        c = (h - mean) @ directions.T  # (B, P, k)
        if skip_first:
            c[:, 0] = 0.0
        count += B * (P - first)
        per = max(1, rows_per_pass // B)  # directions per forward pass
        for d0 in range(0, k, per):
            dirs = list(range(d0, min(k, d0 + per)))
            G = len(dirs)
            rep = ids.repeat(G, 1)  # row g * B + b: direction dirs[g], sequence b
            delta = torch.stack([-c[:, :, j, None] * directions[j] for j in dirs]).reshape(G * B * P, -1)
            rows = torch.arange(G * B).repeat_interleave(P)
            pos = torch.arange(P).repeat(G * B)
            edit = Edit("resid", layer, rows=rows, pos=pos, values=delta, mode="add")
            out, _ = run(lm, rep, [edit])
            logq = torch.log_softmax(out[:, first:].float(), -1).reshape(G, B, P - first, -1)
            kl = (logp.exp()[None] * (logp[None] - logq)).sum(-1)  # (G, B, P')
            total[dirs] += kl.double().sum((1, 2))
    return (total / count).float()


# ------------------------------------------------------------------------------------------ results


def _spearman(a: Tensor, b: Tensor) -> float | None:
    from ..mixing.analysis import spearman

    if a.numel() < 2:
        return None
    r = spearman(a.double().flatten(), b.double().flatten())
    return r if math.isfinite(r) else None


def fidelity_spearman(results: list[CausalBasis]) -> float | None:
    """Spearman correlation of lens and model influence, pooled over the directions of several results
    (e.g. one lens at several states)."""
    rs = [r for r in results if r.model_sigma is not None and r.model_sigma.numel()]
    if not rs:
        return None
    return _spearman(torch.cat([r.sigma for r in rs]), torch.cat([r.model_sigma for r in rs]))


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

    @property
    def k(self) -> int:
        return self.vectors.shape[0]

    @property
    def fidelity_spearman(self) -> float | None:
        if self.model_sigma is None or self.model_sigma.numel() == 0:
            return None
        return _spearman(self.sigma, self.model_sigma)

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


def _sequences(lm: LoadedModel, data, tokens: int, seq_len: int) -> Tensor:
    from ..data.text import token_sequences

    if isinstance(data, str):
        return token_sequences(lm, data, seq_len, max_tokens=tokens)
    seqs = torch.as_tensor(data, dtype=torch.long)
    if seqs.dim() == 1:
        seqs = seqs[None]
    return seqs


def causal_basis(lm: LoadedModel, lens: Lens, data, layer: int, k: int = 8, *, tokens: int = 4096,
                 seq_len: int = 256, model_tokens: int | None = 1024, max_evals: int = 40, skip_first: bool = True,
                 name: str | None = None, fast: bool | None = None, progress: bool = False) -> CausalBasis:
    """CBE of ``lens`` at state ``layer`` and the causal fidelity of its directions.

    ``data``: a text (cut into sequences of ``seq_len`` tokens, ``tokens`` in all) or token ids
    ``(n_seq, pos)``. The lens's influence is measured on every position (each sequence's first position,
    an outlier "attention sink" state in many models, is left out when ``skip_first``); the model's influence
    on the first ``model_tokens`` of them (``None``: all; ``0``: not measured).
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
    seqs = _sequences(lm, data, kw.pop("tokens", 4096), kw.pop("seq_len", 256))
    return {name: [causal_basis(lm, lens, seqs, layer, k, name=name, **kw) for layer in layers]
            for name, lens in lenses.items()}
