"""Training a cross-layer transcoder (:class:`~lenscope.models.dictionaries.clt.CrossLayerTranscoder`) from one
streaming pass over every block: the inputs ``ln_mlp.out.l`` and the targets ``mlp_out.l`` of all blocks are read
together (one forward pass, :class:`~lenscope.features.dictionaries.sources.StreamSource`) and fed to the trainer of
per-layer dictionaries (:func:`~lenscope.features.dictionaries.train.train_dictionaries`: the same shuffle blocks,
plan, learning-rate schedule, checkpoints and resumption, ``torchrun``), with the CLT as one trainable.

Block ``l`` trains as a per-layer transcoder (:class:`~lenscope.features.dictionaries.train.Trainable`, so each kind's
objective is the one in its file) whose decoder is the concatenation of its decoders to blocks ``l .. L-1``: a
``(width, (L - l) d)`` matrix. Then:

- TopK and BatchTopK decode sparsely: only the active latents' rows are gathered (``embedding_bag``), into every
  later block at once, ``n k (L - l) d`` work (no dense ``(tokens, width)`` latents); JumpReLU decodes densely, as
  its per-layer form does;
- the decoder rows are kept at unit norm over all the blocks a latent writes (the concatenated row);
- ``b_dec`` is one per output block, shared by every source block (started at the mean of its target);
- the loss is the sum over output blocks of the reconstruction error of ``mlp_out.l'`` (squared, summed over
  dimensions, averaged over tokens, on activations normalised per block by the fixed factors the per-layer
  transcoders use), plus each block's kind terms: AuxK, whose dead latents reconstruct the error of every block
  they write, or JumpReLU's L0 constraint with one multiplier per block.

The scales are folded into the weights at the end (:meth:`CrossLayerTranscoder.folded`).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from ...distributed import ddp
from ...errors import InputError
from ...models.dictionaries.clt import CrossLayerTranscoder
from ...models.dictionaries.dictionary import Dictionary
from .sources import Target
from .train import CHECKPOINT, DictSettings, Trainable, _scale, train_dictionaries


class CLTTrainable(nn.Module):
    """A CLT as parameters: one :class:`Trainable` per block (its decoder the concatenation of its decoders to every
    later block, its own ``b_dec`` a zero buffer) and the shared ``b_dec (L, d)``."""

    def __init__(self, n_layers: int, d: int, s: DictSettings, seed: int):
        super().__init__()
        self.L, self.d, self.s = n_layers, d, s
        C = CrossLayerTranscoder.init(n_layers, d, s.width, kind=s.kind, k=s.k, seed=seed)
        blocks = []
        for i in range(n_layers):
            D = Dictionary(W_enc=C.W_enc[i], b_enc=C.b_enc[i], W_dec=C.W_dec[i].reshape(s.width, -1),
                           b_dec=torch.zeros((n_layers - i) * d), kind=s.kind, role="transcoder", k=s.k,
                           threshold=None if C.threshold is None else C.threshold[i])
            m = Trainable(D, s)
            del m.b_dec
            m.register_buffer("b_dec", torch.zeros((n_layers - i) * d), persistent=False)
            blocks.append(m)
        self.blocks = nn.ModuleList(blocks)
        self.b_dec = nn.Parameter(torch.zeros(n_layers, d))
        self.l0s: list[float] = []

    @property
    def mm_dtype(self):
        return self.blocks[0].mm_dtype

    @mm_dtype.setter
    def mm_dtype(self, v) -> None:
        for m in self.blocks:
            m.mm_dtype = v

    def forward(self, x: Tensor, y: Tensor, n_global: int | None = None,
                dist: ddp.Dist = ddp.SINGLE) -> tuple[Tensor, dict]:
        """The loss of a batch ``x, y (n, L, d)`` (normalised MLP inputs and outputs of every block)."""
        n, L, d = x.shape
        n_global = n if n_global is None else n_global
        # every block's decoding added into the reconstruction as it comes, source block by source block (each
        # output block's sum in the order b_dec, block 0, block 1, ...): one (n, L, d) tensor, not every block's
        # (n, (L - i) d) decoding kept at once (n d L (L + 1) / 2 numbers); an addition keeps nothing for the backward
        yhat = self.b_dec.expand(n, L, d).clone()
        kept = []
        for i, m in enumerate(self.blocks):
            st: dict = {}
            xc = m.centre(x[:, i])
            pre, out, fired, extra = m.spec.train_forward(m, xc, n, dist, st)
            yhat[:, i:] += out.reshape(n, L - i, d)
            del out
            kept.append((xc, pre, fired, extra, st))
        err = y - yhat
        mse = err.pow(2).sum(-1).mean(0)  # (L,): each output block's error, as a per-layer transcoder's
        loss = mse.sum()
        dead_frac = []
        for i, (m, (xc, pre, fired, extra, st)) in enumerate(zip(self.blocks, kept)):
            dead = m.track(fired, st, n, n_global, dist)
            loss = m.spec.penalty(m, loss, xc, pre, dead, err[:, i:].reshape(n, -1), extra)
            dead_frac.append(float(dead.float().mean()))
        self.l0s = [st["l0"] for *_, st in kept]
        with torch.no_grad():
            var = (y - y.mean(0)).pow(2).sum((0, 2))
            ev = 1 - err.pow(2).sum((0, 2)) / var
        stats = {"mse": float(mse.detach().sum()) / (L * d), "explained_variance": float(ev.mean()),
                 "l0": sum(self.l0s) / L, "dead_fraction": sum(dead_frac) / L, "loss": float(loss.detach())}
        stats.update({f"explained_variance.{i}": float(v) for i, v in enumerate(ev)})
        stats.update({f"l0.{i}": v for i, v in enumerate(self.l0s)})
        return loss, stats

    def after_backward(self) -> None:
        for m in self.blocks:
            m.after_backward()

    @torch.no_grad()
    def after_step(self, l0: float) -> None:
        """Each block's step (its own L0: JumpReLU's multiplier per block)."""
        for m, v in zip(self.blocks, self.l0s):
            m.after_step(v)

    def start(self, x: Tensor, y: Tensor) -> list:
        """Scales per block from the first block of rows ``x, y (n, L, d)``, ``b_dec`` at the targets' means."""
        sin = [_scale(x[:, i]) for i in range(self.L)]
        sout = [_scale(y[:, i]) for i in range(self.L)]
        with torch.no_grad():
            self.b_dec.copy_(torch.stack([y[:, i].double().mean(0) * sout[i] for i in range(self.L)]).float())
            for i, m in enumerate(self.blocks):
                m.spec.first_block(m, x[:, i], sin[i])
        return [sin, sout]

    def result(self, like: CrossLayerTranscoder, scale_in: list, scale_out: list) -> CrossLayerTranscoder:
        """The trained CLT, its normalisation folded in."""
        ts = []
        for m in self.blocks:
            t = {n: getattr(m, n).detach().clone() for n in ("W_enc", "b_enc", "W_dec")}
            m.spec.trained(m, t)
            ts.append(t)
        C = CrossLayerTranscoder(
            W_enc=torch.stack([t["W_enc"] for t in ts]), b_enc=torch.stack([t["b_enc"] for t in ts]),
            W_dec=[t["W_dec"].reshape(self.s.width, self.L - i, self.d) for i, t in enumerate(ts)],
            b_dec=self.b_dec.detach().clone(), kind=self.s.kind, k=self.s.k,
            threshold=torch.stack([t["threshold"] for t in ts]) if "threshold" in ts[0] else None,
            model=like.model, fingerprint=like.fingerprint, info=dict(like.info))
        return C.folded(scale_in, scale_out)


@dataclass
class CLTTarget(Target):
    """The CLT among the source's sites: inputs ``i_in`` and targets ``i_out``, one per block."""

    i_in: list
    i_out: list

    def indices(self) -> list[int]:
        return list(self.i_in) + list(self.i_out)

    def trainable(self, d: int, s: DictSettings, seed: int) -> CLTTrainable:
        return CLTTrainable(len(self.i_in), d, s, seed)

    def shape(self, d: int, s: DictSettings) -> tuple[int, int]:
        """Its parameters (and the kind's per latent of every block); per batch row every block's latents ``6
        width``, the rows, the reconstruction, the error and their gradients ``8 L d``, one block's decoding and its
        gradient at a time ``2 L d``, and, for the kinds with an auxiliary loss (TopK, BatchTopK: AuxK, whose
        dead latents reconstruct every block they write), each block's auxiliary decoding kept for the backward,
        ``d L (L + 1) / 2``, twice."""
        from ...models.dictionaries import kinds

        L = len(self.i_in)
        spec = kinds.get(s.kind)
        extra = spec.trained_per_latent * s.width * L
        aux = 2 * d * L * (L + 1) // 2 if hasattr(spec, "aux") else 0
        return (CrossLayerTranscoder.parameters_count(L, d, s.width) + extra, L * 6 * s.width + 10 * d * L + aux)


def clt_sites(n_layers: int) -> list[str]:
    """The sites a CLT of ``n_layers`` blocks trains on, inputs then targets."""
    return [f"ln_mlp.out.{i}" for i in range(n_layers)] + [f"mlp_out.{i}" for i in range(n_layers)]


def train_clt(s: DictSettings, *, lm, data: str | Path, n_layers: int | None = None, part: str = "train",
              seq_len: int | None = None, forward_batch: int = 8, out: str | Path | None = None,
              resume: bool = False, progress: bool = True, max_steps: int | None = None,
              dist: ddp.Dist = ddp.SINGLE, max_memory=None) -> CrossLayerTranscoder | None:
    """Train a CLT over blocks ``0 .. n_layers - 1`` (default: all) of ``lm`` on the ``part`` of the text ``data``
    (see the module's docstring); saved into ``out`` when given (lenscope's layout: :meth:`CrossLayerTranscoder.save`;
    the checkpoint removed). None when stopped by ``max_steps`` (a checkpoint is then in ``out``)."""
    from ...models.loading.summary import fingerprint
    from .sources import StreamSource

    s.check()
    if s.role != "transcoder":
        raise InputError(f"a cross-layer transcoder is a transcoder: its role is 'transcoder', not {s.role!r}")
    A = lm.anatomy
    L = A.n_layers if n_layers is None else int(n_layers)
    if not 1 <= L <= A.n_layers:
        raise InputError(f"a CLT covers 1 to {A.n_layers} blocks of {lm.name!r}; got {L}")
    like = CrossLayerTranscoder.init(L, A.d_model, 2, kind="topk", k=1, model=lm.name, fingerprint=fingerprint(A))
    like.check(lm)
    source = StreamSource(lm, clt_sites(L), data, seq_len=seq_len, forward_batch=forward_batch, part=part, dist=dist)
    target = CLTTarget(like, list(range(L)), list(range(L, 2 * L)))
    got = train_dictionaries(source, [target], s, out=out, resume=resume, progress=progress, max_steps=max_steps,
                             dist=dist, max_memory=max_memory)
    if got is None:
        return None
    (C,) = got
    C.info["training"]["forward_passes"] = source.forwards
    if out is not None and dist.main:
        C.save(out)
        shutil.rmtree(Path(out) / CHECKPOINT, ignore_errors=True)
    return C


__all__ = ["CLTTarget", "CLTTrainable", "clt_sites", "train_clt"]
