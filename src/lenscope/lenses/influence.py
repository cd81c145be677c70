"""The influence of a residual-stream direction on a lens and on the model (Belrose et al. 2023, section 4).

**Influence.** The influence of a unit direction ``v`` at state ``l`` on a readout ``f`` (a lens's output
distribution, or the model's own final one) is

    sigma(v; f) = E_h[ KL( f(h) || f(h - ((h - E[h]) . v) v) ) ]

the expected KL divergence caused by *mean-ablating* the component of ``h`` along ``v`` (it is replaced by
its mean over the corpus), estimated over the tokens of a text. :class:`InfluenceObjective` is the lens's
``sigma`` (and its gradient, what causal basis extraction in :mod:`lenscope.lenses.cbe` maximises);
:func:`model_influence` is the model's, measured by editing its residual stream.

**Speed.** A lens is affine before the final norm, so mean-ablating ``v`` moves the (centred) pre-norm state
by a rank-one term ``x' = x - c w`` with ``c = (h - mu) . v`` and ``w = centre(v M)``. The logits become
``s' (Z - c u) + z_b`` with ``Z = (g * x) W_U`` computed once for all tokens, ``u = (g * w) W_U`` one vector
per direction and ``s'`` the new per-token norm scale; the KL's cross term ``p . z'`` folds into one
``(tokens, d_model)`` matrix ``p W_U^T``. One evaluation of ``sigma`` and its gradient is therefore a few
passes over a ``(tokens, vocab)`` array, chunked over tokens, with no ``d_model x vocab`` matmul: ``sigma``'s
gradient comes from a custom autograd function for the log-partition term (:func:`factored_base`,
:class:`AblatedLogPartition`, built on the readout's primitives). Lenses that are not affine-then-norm-then-linear
(encoders' masked-LM heads, soft-capped logits) use the plain chunked autograd path, which is also the tests'
reference.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import InputError, NotApplicableError
from ..models.loading.load import LoadedModel
from ..models.weights.readout import Readout
from .lenses import Lens, LogitLens, decode

__all__ = ["InfluenceObjective", "influence_objective", "layer_states", "lens_influence", "model_influence"]


# ---------------------------------------------------------------------------------------------- states


@torch.no_grad()
def layer_states(lm: LoadedModel, sequences: Tensor, layer: int, *, batch_size: int = 8,
                 skip_first: bool = True) -> Tensor:
    """Residual states ``(tokens, d_model)`` at state ``layer`` of every position of ``sequences (n_seq, pos)``
    (float32; without each sequence's first position when ``skip_first``)."""
    from ..models.runtime.engine import run
    from ..models.runtime.trace import residual_states

    L = lm.anatomy.n_layers
    if not 0 <= layer <= L:
        raise InputError(f"layer {layer} is outside 0..{L}")
    out = []
    for s in range(0, sequences.shape[0], batch_size):
        ids = sequences[s : s + batch_size]
        if layer < L:
            _, got = run(lm, ids, capture=[("resid_pre", layer)], stop_after=("resid_pre", layer), logits=False)
            h = got[("resid_pre", layer)]
        else:
            h = residual_states(lm, ids)["states"][-1]
        out.append((h[:, 1:] if skip_first else h).float().reshape(-1, h.shape[-1]).cpu())
    return torch.cat(out)


# ------------------------------------------------------------------------------------------ objective


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
        self.readout = Readout.from_anatomy(A)
        can_fast = self.readout.linear_head
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
        ro = self.readout
        d = self.d
        t0 = self.lens.transform(torch.zeros(1, d), self.layer)[0].float()
        M = self.lens.transform(torch.eye(d), self.layer).float() - t0  # the lens's linear part
        X = self.H @ M + t0
        if not torch.allclose(self.lens.transform(self.H[:4], self.layer).float(), X[:4], rtol=1e-4, atol=1e-4):
            raise InputError("this lens is not affine; use fast=False")
        self.M = M
        self.norm = ro.norm
        W = ro.W_U.float()  # (d, vocab)
        V = W.shape[1]
        self.W = W
        self.g = ro.gain(d)
        self.Xc = ro.center(X)
        self.zb = ro.bias_logits()
        self.rows = _rows_for(V, budget_bytes)
        self.var0 = ro.variance(self.Xc)  # (N,) float64, eps included
        s0 = torch.rsqrt(self.var0).float()
        # R: base logits without zb; lse0: base log-partition; lseb: what the ablated path gives for no ablation
        # (0 + rounding); praw: p . R; Pw: p W_U^T
        base = factored_base(ro, self.Xc, s0, W, self.zb, self.rows, _rows_for(V, 2.5e8))
        for name in ("R", "lse0", "lseb", "praw", "Pw"):
            setattr(self, name, base[name])

    def _sigma_fast(self, v: Tensor, need_grad: bool) -> Tensor:
        c = self.Hc @ v  # (N,)
        w = v @ self.M
        wc = self.readout.center(w)
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
        lse = AblatedLogPartition.apply(r, a, u, self.R, self.lse0, self.zb, self.rows, need_grad)
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
    from ..models.runtime.engine import Edit, run

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
        logits, got = run(lm, ids, capture=[("resid_pre", layer)])
        logp = torch.log_softmax(logits[:, first:].float(), -1)  # (B, P', V)
        h = got[("resid_pre", layer)].float()  # (B, P, d)
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
            edit = Edit("resid_pre", layer, rows=rows, pos=pos, values=delta, mode="add")
            out, _ = run(lm, rep, [edit])
            logq = torch.log_softmax(out[:, first:].float(), -1).reshape(G, B, P - first, -1)
            kl = (logp.exp()[None] * (logp[None] - logq)).sum(-1)  # (G, B, P')
            total[dirs] += kl.double().sum((1, 2))
    return (total / count).float()


# ------------------------------------------------- kernels: factored logits of a rank-one edit of the state


def factored_base(readout: Readout, xc: Tensor, s0: Tensor, W: Tensor, zb: Tensor, rows: int, big: int) -> dict:
    """The base quantities of :class:`AblatedLogPartition` for centred states ``xc (tokens, d_model)`` with
    final-norm scales ``s0 (tokens,)``: ``R (tokens, vocab)`` the logits without ``zb``, ``lse0`` their
    log-partition, ``lseb`` (float64) what :class:`AblatedLogPartition` gives for no edit (0 up to rounding),
    ``praw = p . R`` (float64) and ``Pw = p W_U^T (tokens, d_model)``, computed in blocks of ``big`` rows
    (and ``rows`` for the exact arithmetic of the ablated path)."""
    N, d = xc.shape
    V = W.shape[1]
    g = readout.gain(d)
    R = torch.empty(N, V)
    lse0 = torch.empty(N)
    lseb = torch.empty(N, dtype=torch.float64)
    praw = torch.empty(N, dtype=torch.float64)
    Pw = torch.empty(N, d)
    U3 = torch.stack([zb, torch.zeros(V), torch.ones(V)])
    for i in range(0, N, big):
        j = min(N, i + big)
        Rb = torch.mm(xc[i:j] * g, W, out=R[i:j]).mul_(s0[i:j, None])
        lse0[i:j] = torch.logsumexp(Rb + zb, -1)
        for i2 in range(i, j, rows):  # exactly the arithmetic of the ablated path at r = a = 0
            j2 = min(j, i2 + rows)
            zero = torch.zeros(j2 - i2)
            e = _shifted_exp(R[i2:j2], zero, zero, lse0[i2:j2], U3)
            S = e.sum(-1)
            lseb[i2:j2] = S.log().double()
            p = e.div_(S[:, None])
            praw[i2:j2] = (p * R[i2:j2]).sum(-1).double()
            Pw[i2:j2] = p @ W.T
    return {"R": R, "lse0": lse0, "lseb": lseb, "praw": praw, "Pw": Pw}


def _shifted_exp(R: Tensor, r: Tensor, a: Tensor, lse0: Tensor, U3: Tensor) -> Tensor:
    """``exp(z' - lse0)`` for a chunk of tokens, where ``z' = (1 + r) R + zb - a u`` are the edited logits
    (``U3 = [zb; u; 1]``, one rank-3 update after a row scaling: two passes over the chunk)."""
    C = torch.stack([torch.ones_like(a), -a, -lse0], 1)
    t = R.mul((1.0 + r)[:, None])
    return t.addmm_(C, U3).exp_()


class AblatedLogPartition(torch.autograd.Function):
    """``sum_n log sum_v exp(z'[n, v] - lse0_n)`` for the edited logits ``z' = (1 + r_n) R[n, v] + zb_v -
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
