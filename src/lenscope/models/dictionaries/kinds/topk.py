"""TopK (Gao et al. 2024): the ``k`` largest pre-activations of each token, ReLU'd, 0 elsewhere.

Training (:class:`SparseTraining`, which BatchTopK shares): the picked latents are found without autograd, the
gradients reach the encoder and its input through the picked pre-activations only (``m.pick``) and the decoding is
a weighted sum of the picked decoder rows (``m.decode_rows``): ``n·k·d`` work where dense latents cost
``n·width·d``. Loss ``|y - ŷ|²`` plus the auxiliary loss ``|e - ê|² / 32`` (AuxK): ``e = y - ŷ`` (detached),
``ê`` the decoding (no bias) of the top ``k_aux`` pre-activations among the *dead* latents, scaled by
``min(1, dead / k_aux)``.

Files: SAELens's ``topk`` (with ``k``; ``rescale_acts_by_decoder_norm`` folded on reading), and SAELens before 6.0's
``standard`` with ``activation_fn: topk``. circuit-tracer (0.5) has no TopK: refused there.
"""

from __future__ import annotations

from ....errors import InputError
from . import Kind, circuit_tracer_kinds, register

AUX_COEF = 1 / 32


class SparseTraining:
    """The training of a kind that picks its latents (:meth:`select`): sparse forward and backward, AuxK."""

    def select(self, m, pre, n: int):
        """``rows, cols, keep``: the picked entries of ``pre (n, width)`` and which of them are positive."""
        raise NotImplementedError

    def after_pick(self, m, v, dist) -> None:
        """After the picked latents ``v`` (ReLU'd) are known."""

    def train_forward(self, m, xc, n: int, dist, stats: dict):
        import torch

        with torch.no_grad():
            pre = m.mm(xc, m.W_enc) + m.b_enc
            rows, cols, keep = self.select(m, pre, n)
            rows, cols = rows[keep], cols[keep]
        v = m.pick(xc, pre, rows, cols).relu()
        yhat = m.decode_rows(rows, cols, v, n) + m.b_dec
        fired = torch.zeros(m.width, dtype=torch.bool)
        fired[cols] = True
        stats["l0"] = len(rows) / n
        self.after_pick(m, v, dist)
        return pre, yhat, fired, None

    def penalty(self, m, loss, xc, pre, dead, err, extra):
        if dead.any():
            loss = loss + AUX_COEF * self.aux(m, xc, pre, dead, err.detach())
        return loss

    def aux(self, m, xc, pre, dead, e):
        """AuxK: the top ``k_aux`` pre-activations of dead latents of each token reconstruct the error ``e``."""
        import torch

        n_dead = int(dead.sum())
        ka = min(m.k_aux, n_dead)
        n = len(pre)
        with torch.no_grad():
            cols = pre.detach().masked_fill(~dead, float("-inf")).topk(ka, dim=-1).indices.reshape(-1)
            rows = torch.arange(n).repeat_interleave(ka)
        # the pre-activations themselves, negative ones included (as SAELens): a dead latent gets a gradient even
        # while its pre-activation is below 0
        ehat = m.decode_rows(rows, cols, m.pick(xc, pre, rows, cols), n)
        return min(1.0, n_dead / m.k_aux) * (e - ehat).pow(2).sum(-1).mean()


class TopK(SparseTraining, Kind):
    name = "topk"
    help = "the k largest pre-activations of each token"
    k_help = "active latents per token"
    architecture = "topk"
    threshold = False

    def check(self, D) -> None:
        if D.k is None or not 0 < int(D.k) < D.width:
            raise InputError(f"a TopK dictionary needs 0 < k < width ({D.width}); got k={D.k}")
        D.k = int(D.k)

    def activate(self, D, pre):
        import torch

        vals, idx = pre.topk(D.k, dim=-1, sorted=False)
        return torch.zeros_like(pre).scatter(-1, idx, vals.relu())

    def describe(self, D) -> str:
        return f", k={D.k}"

    def config(self, D) -> dict:
        return {"k": D.k, "rescale_acts_by_decoder_norm": False}

    def reads(self, base, cfg, tensors):
        if base == "standard" and cfg.get("activation_fn") == "topk":  # SAELens before 6.0
            return {"k": (cfg.get("activation_fn_kwargs") or {}).get("k")}
        return super().reads(base, cfg, tensors)

    def rescale(self, cfg) -> bool:
        return bool(cfg.get("rescale_acts_by_decoder_norm"))

    def check_circuit_tracer(self, D) -> None:
        raise InputError(f"the transcoder for {D.site} is TopK, which circuit-tracer (0.5) cannot read: its files "
                         "hold a JumpReLU threshold or nothing (a ReLU), so it would run this one as a ReLU; train "
                         f"--kind {circuit_tracer_kinds()} for circuit-tracer, or keep lenscope's layout "
                         "(save_dictionaries)")

    def select(self, m, pre, n):
        import torch

        vals, cols = pre.detach().topk(m.k, dim=-1)
        rows = torch.arange(n).repeat_interleave(m.k)
        return rows, cols.reshape(-1), vals.reshape(-1) > 0


register(TopK())

__all__ = ["AUX_COEF", "SparseTraining", "TopK"]
