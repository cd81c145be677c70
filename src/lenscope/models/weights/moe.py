"""Mixture-of-experts blocks in the Anatomy: :class:`MoE`, the router and its experts (a kind of MLP).

Kept beside :mod:`lenscope.models.weights.anatomy` (which defines the dense
:class:`~lenscope.models.weights.anatomy.MLP` every
expert is); ``anatomy`` re-exports it. With the routing weights fixed (read from the trace), the block is a weighted
sum of MLPs: every decomposition of an MLP applies per expert and is summed with the weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ...results import axis_size
from .anatomy import MLP, _mix, _on

MOE_SITES = ("mlp_pre", "mlp_up", "mlp_hidden", "expert_out")  # what MoE.run passes to its visitor


def _of_experts(name: str, doc: str) -> property:
    """A read-only property: the experts' attribute ``name`` (the block reads as one MLP where it is one)."""
    return property(lambda self: getattr(self.experts, name), doc=doc)


@dataclass(repr=False)
class MoE:
    """A sparse mixture-of-experts block: a router chooses ``top_k`` experts per token; the block's output is the
    sum of the chosen experts' outputs, each times its routing weight.

    - router logits ``r = x W_router + b_router``, ``W_router (d_model, expert)``, ``b_router (expert,)``;
    - routing weights (:meth:`routing`): ``softmax_first`` (Mixtral, Qwen3-MoE, OLMoE): a softmax over every expert,
      then the ``top_k`` largest probabilities, divided by their sum when ``renormalize``; else (GPT-OSS) the
      ``top_k`` largest logits, then a softmax over those;
    - ``experts``: an :class:`MLP` whose every tensor has a leading expert axis (``W_in, W_gate (expert, d_model,
      d_mlp)``, ``W_out (expert, d_mlp, d_model)``, ``b_in, b_gate (expert, d_mlp)``, ``b_out (expert, d_model)``);
      :meth:`expert` is one of them as a plain MLP (views). An expert's output bias is weighted with the rest of it.

    With the routing weights fixed (read from the trace, as attention patterns are), the block is a weighted sum of
    MLPs: every decomposition of an MLP applies per expert and is summed with the weights. Routing weights are kept
    dense, ``(..., expert)``, zero for the experts a token does not use.
    """

    W_router: Tensor
    b_router: Tensor | None
    experts: MLP
    top_k: int
    softmax_first: bool = True
    renormalize: bool = True

    n_experts = axis_size("W_router", 1)
    d_mlp = axis_size("W_in", -1, "One expert's hidden width.")
    gated = _of_experts("gated", "Whether the experts are gated MLPs.")
    act = _of_experts("act", "The experts' activation.")
    W_in = _of_experts("W_in", "The experts' stacked input weights (expert, d_model, d_mlp) (where the block's "
                       "weights sit).")
    W_out = _of_experts("W_out", "The experts' stacked output weights (expert, d_mlp, d_model).")

    def expert(self, e: int) -> MLP:
        """Expert ``e`` as an :class:`MLP` (views of the stacked weights)."""
        import dataclasses

        ex = self.experts
        names = ("W_in", "b_in", "W_out", "b_out", "W_gate", "b_gate")
        return dataclasses.replace(ex, **{n: None if getattr(ex, n) is None else getattr(ex, n)[e] for n in names})

    def router_logits(self, x: Tensor) -> Tensor:
        """``x (..., d_model)`` -> router logits ``(..., expert)``."""
        x = _on(x, self.W_router)
        r = torch.matmul(*_mix(x, self.W_router))
        return r + self.b_router if self.b_router is not None else r

    def routing(self, logits: Tensor) -> Tensor:
        """Dense routing weights ``(..., expert)`` from router logits (float32, or float64 for float64 logits):
        the weights of each token's ``top_k`` experts, zero elsewhere."""
        logits = logits if logits.dtype == torch.float64 else logits.float()
        if self.softmax_first:
            top, idx = torch.softmax(logits, -1).topk(self.top_k, dim=-1)
            if self.renormalize:
                top = top / top.sum(-1, keepdim=True)
        else:
            top, idx = logits.topk(self.top_k, dim=-1)
            top = torch.softmax(top, -1)
        return torch.zeros_like(logits).scatter(-1, idx, top)

    def _flat(self, x: Tensor, weights: Tensor | None) -> tuple[Tensor, Tensor]:
        x = _on(x, self.W_in)
        if weights is None:
            weights = self.routing(self.router_logits(x))
        return x.reshape(-1, x.shape[-1]), _on(weights, self.W_in).reshape(-1, self.n_experts)

    def _routed(self, w: Tensor):
        """``(expert, token rows)`` for every expert that some row uses (a loop over experts, as the model's own)."""
        if w.device.type == "meta":  # shapes only (no values to choose by): every expert for every row
            for e in range(self.n_experts):
                yield e, torch.arange(w.shape[0], device=w.device)
            return
        used = w.ne(0)
        for e in used.any(0).nonzero()[:, 0].tolist():
            yield e, used[:, e].nonzero()[:, 0]

    def expert_outputs(self, x: Tensor, weights: Tensor | None = None) -> Tensor:
        """Each expert's weighted output ``(..., expert, d_model)`` for inputs ``x (..., d_model)`` (zero where a
        token does not use the expert); ``weights (..., expert)``: the routing (default: this router's own)."""
        xf, w = self._flat(x, weights)
        out = None
        for e, t in self._routed(w):
            y = self.expert(e)(xf[t]) * w[t, e, None].to(xf.dtype)
            if out is None:
                out = y.new_zeros(xf.shape[0], self.n_experts, y.shape[-1])
            out[t, e] = y
        if out is None:
            out = xf.new_zeros(xf.shape[0], self.n_experts, xf.shape[-1])
        return out.reshape(*x.shape[:-1], self.n_experts, out.shape[-1])

    def __call__(self, x: Tensor, weights: Tensor | None = None) -> Tensor:
        """The block's output ``(..., d_model)``; ``weights (..., expert)``: the routing (default: the router's
        own, from ``x``, as the model computes it)."""
        xf, w = self._flat(x, weights)
        out = None
        for e, t in self._routed(w):
            y = self.expert(e)(xf[t]) * w[t, e, None].to(xf.dtype)
            out = y.new_zeros(xf.shape[0], y.shape[-1]) if out is None else out
            out = out.index_add(0, t, y)
        if out is None:
            out = xf.new_zeros(xf.shape)
        return out.reshape(x.shape[:-1] + out.shape[-1:])

    def run(self, x: Tensor, weights: Tensor, visit: Callable[[str, Tensor], Tensor]) -> Tensor:
        """The block's output ``(token, d_model)`` from ``x (token, d_model)`` and routing ``weights (token,
        expert)``, every intermediate passed through ``visit(name, tensor)``, which may return it changed (the
        engine's MoE sites, :data:`MOE_SITES`): ``mlp_pre``, ``mlp_up``, ``mlp_hidden`` ``(token, expert * d_mlp)``
        (the experts' units side by side; zero for the experts a token does not use) and ``expert_out`` ``(token,
        expert, d_model)`` (weighted outputs, which add up to the block's output)."""
        xf, w = self._flat(x, weights)
        N, E, m = xf.shape[0], self.n_experts, self.d_mlp
        ex = self.experts
        G = U = None
        for e, t in self._routed(w):
            g, u = self.expert(e).pre(xf[t])
            if G is None:
                G = g.new_zeros(N, E, m)
                U = g.new_zeros(N, E, m) if u is not None else None
            G = G.index_put((t, torch.full_like(t, e)), g)
            if u is not None:
                U = U.index_put((t, torch.full_like(t, e)), u)
        if G is None:
            G = xf.new_zeros(N, E, m)
            U = xf.new_zeros(N, E, m) if ex.gated else None
        G = visit("mlp_pre", G.reshape(N, E * m)).reshape(N, E, m)
        if U is not None:
            U = visit("mlp_up", U.reshape(N, E * m)).reshape(N, E, m)
        H = ex.act_fn(G)
        if U is not None:
            H = H * ex.up_fn(U)
        H = visit("mlp_hidden", H.reshape(N, E * m)).reshape(N, E, m)
        Y = None
        for e, t in self._routed(w):  # only the experts a token uses (the others have weight 0)
            y = torch.matmul(*_mix(H[t, e], ex.W_out[e]))
            if ex.b_out is not None:
                y = y + ex.b_out[e]
            y = y * w[t, e, None].to(y.dtype)
            Y = y.new_zeros(N, E, y.shape[-1]) if Y is None else Y
            Y = Y.index_put((t, torch.full_like(t, e)), y)
        if Y is None:
            Y = H.new_zeros(N, E, xf.shape[-1])
        return visit("expert_out", Y).sum(1)

    def __repr__(self) -> str:
        order = "softmax, top-k" + (", renormalised" if self.renormalize else "") if self.softmax_first else \
            "top-k, softmax"
        return (f"MoE(experts={self.n_experts}, top_k={self.top_k}, {order}, router_bias={self.b_router is not None}, "
                f"expert={self.expert(0)!r})")


def is_moe(A) -> bool:
    """Whether an Anatomy's blocks are mixtures of experts (their MLP a :class:`MoE`)."""
    return isinstance(A.layers[0].mlp, MoE)
