"""BatchTopK (Bussmann et al. 2024): in training the ``k x n`` largest pre-activations of a batch of ``n`` tokens
(TopK's sparse training and auxiliary loss, :class:`~.topk.SparseTraining`); at inference a JumpReLU with the global
threshold learnt in training, as SAELens stores it (architecture ``jumprelu``): the exponential moving average
(rate 0.01, as SAELens's ``topk_threshold``) of the smallest kept activation, reduced over ranks under ``torchrun``.
"""

from __future__ import annotations

import math

from ....errors import InputError
from . import Kind, register
from .topk import SparseTraining

THRESHOLD_LR = 0.01


class BatchTopK(SparseTraining, Kind):
    name = "batchtopk"
    help = "the k x n largest of a batch of n tokens (a JumpReLU at inference)"
    k_help = "active latents per token, on average over a batch"
    architecture = "jumprelu"

    def check_file(self, tensors, where) -> None:
        if "threshold" not in tensors:
            raise InputError(f"{where}: a BatchTopK dictionary needs its threshold")

    def select(self, m, pre, n):
        vals, idx = pre.detach().reshape(-1).topk(m.k * n)
        return idx // m.width, idx % m.width, vals > 0

    def after_pick(self, m, v, dist) -> None:
        import torch

        with torch.no_grad():
            pos = v.detach()[v.detach() > 0]
            low = m.reduce(pos.min() if len(pos) else torch.tensor(float("inf")), dist, "min")
            if math.isfinite(float(low)):
                m.threshold.mul_(1 - THRESHOLD_LR).add_(THRESHOLD_LR * low)

    def trained(self, m, tensors) -> None:
        tensors["threshold"] = m.threshold.expand(m.width).clone()


register(BatchTopK())

__all__ = ["THRESHOLD_LR", "BatchTopK"]
