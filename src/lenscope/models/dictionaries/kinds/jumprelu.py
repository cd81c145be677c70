"""JumpReLU (Rajamanoharan et al. 2024): ``z = pre · H(pre - θ)`` with a learnt threshold per latent (the base
:class:`~lenscope.models.dictionaries.kinds.Kind`'s inference form, SAELens's ``jumprelu``). A ReLU dictionary read from
SAELens (``standard``, ``transcoder``, ``skip_transcoder``) is a JumpReLU with threshold 0, the same function.

Training: ``θ = exp(log θ)`` learnt (each latent's starting θ fires it on a fraction ``k / width`` of the first
block's tokens, at least 0.001), gradients to ``θ`` by the straight-through estimator with the rectangle kernel of
bandwidth 0.001; loss ``|y - ŷ|² + λ L0``. ``k`` is the *target* L0, λ the multiplier of the constraint ``L0 = k`` by
dual ascent: from 0, after every step ``λ ← λ + 0.05 · clip((L0 - k) / k, -1, 1)`` (``L0`` the batch's mean active
latents), so λ rises while the dictionary is denser than ``k`` and falls (below 0 if need be, pulling the thresholds
down) while sparser. Short runs of JumpReLU *transcoders* tend to switch latents off before their decoders learn (no
auxiliary loss revives them): prefer TopK for transcoders on CPU budgets. The encoder and decoder matmuls are dense
(``m.mm``).
"""

from __future__ import annotations

import math
from functools import cache

from . import Kind, register

BANDWIDTH = 0.001
JUMPRELU_THETA0 = 0.001
L0_RATE = 0.05
JUMPRELU_INIT_ROWS = 8192


@cache
def estimators():
    """The straight-through estimators ``(JumpReLUFn, StepFn)`` (``torch.autograd.Function`` classes, made on first
    use so that the kinds' table imports without torch)."""
    import torch

    class JumpReLUFn(torch.autograd.Function):
        """``pre · H(pre - θ)``; to ``θ``: ``-(θ/ε) K((pre - θ)/ε)`` (rectangle kernel ``K``, bandwidth ``ε``)."""

        @staticmethod
        def forward(ctx, pre, theta):
            ctx.save_for_backward(pre, theta)
            return pre * (pre > theta)

        @staticmethod
        def backward(ctx, g):
            pre, theta = ctx.saved_tensors
            rect = ((pre - theta).abs() < BANDWIDTH / 2).to(g.dtype)
            return g * (pre > theta), (-(theta / BANDWIDTH) * rect * g).sum(0)

    class StepFn(torch.autograd.Function):
        """``H(pre - θ)``; to ``θ``: ``-(1/ε) K((pre - θ)/ε)`` (no gradient to ``pre``, as in the paper)."""

        @staticmethod
        def forward(ctx, pre, theta):
            ctx.save_for_backward(pre, theta)
            return (pre > theta).to(pre.dtype)

        @staticmethod
        def backward(ctx, g):
            pre, theta = ctx.saved_tensors
            rect = ((pre - theta).abs() < BANDWIDTH / 2).to(g.dtype)
            return None, (-(1.0 / BANDWIDTH) * rect * g).sum(0)

    return JumpReLUFn, StepFn


class JumpReLU(Kind):
    name = "jumprelu"
    help = "a learnt threshold per latent"
    k_help = "the target L0"
    architecture = "jumprelu"
    trained_per_latent = 1  # its log threshold

    def reads(self, base, cfg, tensors):
        if base in ("", "standard"):  # ReLU: a JumpReLU at threshold 0
            import torch

            tensors.setdefault("threshold", torch.zeros_like(tensors["b_enc"]))
            return {"k": cfg.get("k")}
        return super().reads(base, cfg, tensors)

    def setup(self, m, D) -> None:
        import torch
        from torch import nn

        super().setup(m, D)
        m.log_threshold = nn.Parameter(torch.full((D.width,), math.log(JUMPRELU_THETA0)))

    def first_block(self, m, x, scale) -> None:
        """Each latent starts firing on a fraction ``k / width`` of the block."""
        x = x[:JUMPRELU_INIT_ROWS] * scale
        pre = m.centre(x) @ m.W_enc + m.b_enc
        q = max(1, min(len(x), round(len(x) * m.k / m.width)))
        theta = pre.topk(q, dim=0).values[-1]
        m.log_threshold.copy_(theta.clamp_min(JUMPRELU_THETA0).log())

    def train_forward(self, m, xc, n, dist, stats):
        jump, step = estimators()
        pre = m.mm(xc, m.W_enc) + m.b_enc
        theta = m.log_threshold.exp()
        z = jump.apply(pre, theta)
        yhat = m.mm(z, m.W_dec) + m.b_dec
        active = step.apply(pre, theta)
        l0 = active.sum(-1).mean()
        fired = (pre.detach() > theta.detach()).any(0)
        stats["l0"] = float(l0.detach())
        return pre, yhat, fired, l0

    def penalty(self, m, loss, xc, pre, dead, err, extra):
        return loss + m.l0_coef * extra

    def after_step(self, m, l0) -> None:
        m.l0_coef.add_(L0_RATE * max(-1.0, min(1.0, (l0 - m.k) / m.k)))

    def trained(self, m, tensors) -> None:
        tensors["threshold"] = m.log_threshold.detach().exp()


register(JumpReLU())

__all__ = ["BANDWIDTH", "JUMPRELU_INIT_ROWS", "JUMPRELU_THETA0", "L0_RATE", "JumpReLU", "estimators"]
