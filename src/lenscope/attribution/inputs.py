"""The input embeddings that the attribution baselines (:mod:`lenscope.attribution.baselines`) differentiate and
perturb, and integrated gradients' baselines.

A decoder (or encoder): ``e_j (d_model,)`` is token ``j``'s embedding exactly as the model's own input-embedding
module returns it (``lm.model.get_input_embeddings()(ids)``; for Gemma this already holds the sqrt(d_model)
scale), given to the model as ``inputs_embeds``.

An encoder-decoder model (its ``source`` given): the source tokens' embeddings first, then the target prefix's,
each as its stack computes it from ids before adding positions: ``W_E[id] * scale`` with the stack's
:class:`~lenscope.models.weights.anatomy.Embedding` (``lm.anatomy.encoder.embed``, ``lm.anatomy.embed``; BART, mBART and
M2M-100 scale in their embedding module, Marian and Pegasus in the stack, T5 not at all: the family's reader
knows). The model is given them as the encoder's ``inputs_embeds`` and the ``decoder_inputs_embeds``; a stack that
multiplies given embeddings by a factor ``k`` itself (transformers' Marian and Pegasus decoders:
``Anatomy.extras["inputs_embeds_scale"]``, set by the reader) is given ``W_E[id] * (scale / k)``, so that the
model computes bit for bit what it computes from the ids. :class:`Inputs` holds what the model is given
(``fed``) and turns gradients with respect to it into gradients with respect to the embeddings ``x = fed * k``.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import InputError
from ..models.loading.load import LoadedModel, token_str

IG_BASELINES = ("zero", "pad", "mean")


@contextmanager
def eval_mode(model):
    """Run with dropout off; restore every module's training flag afterwards."""
    was = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, flag in was:
            m.training = flag


def _stack_scale(stack) -> float:
    """The factor a stack multiplies given ``inputs_embeds`` by (1 for most; the reader says otherwise)."""
    return float(stack.extras.get("inputs_embeds_scale", 1.0))


def _embedder(lm: LoadedModel, stack=None, fed: bool = False):
    """``ids -> embeddings``: the model's input-embedding module (``stack`` None), or an encoder-decoder stack's
    token embedding before positions, ``W_E[ids] * scale``, in the model's dtype on its device (``fed``: what the
    stack is given for it, ``W_E[ids] * (scale / k)``)."""
    from ..models.loading.devices import main_device

    if stack is None:
        return lm.model.get_input_embeddings()
    device, dtype = main_device(lm.model), lm.model.dtype
    emb = stack.embed
    scale = emb.scale / _stack_scale(stack) if fed else emb.scale

    def embed(ids: Tensor) -> Tensor:
        return emb.W_E[ids.to(emb.W_E.device)].to(device=device, dtype=dtype) * scale

    return embed


@dataclass
class Inputs:
    """What the model is given for a batch: ``fed (batch, src + pos, d_model)`` (an encoder-decoder model's
    ``n_source`` source positions first), and ``k_source`` / ``k`` the factors the encoder / decoder multiply what
    they are given by (the embeddings are ``fed * k``)."""

    fed: Tensor
    n_source: int = 0
    k_source: float = 1.0
    k: float = 1.0

    @classmethod
    def of(cls, lm: LoadedModel, ids: Tensor, source: Tensor | None = None) -> Inputs:
        """The inputs of ``ids (batch, pos)`` (and of ``source (batch, src)`` ids for an encoder-decoder model)."""
        A = lm.anatomy
        with torch.no_grad():
            if source is None:
                return cls(_embedder(lm)(ids).detach())
            fed = [_embedder(lm, stack, fed=True)(x) for stack, x in ((A.encoder, source), (A, ids))]
        return cls(torch.cat(fed, 1).detach(), source.shape[1], _stack_scale(A.encoder), _stack_scale(A))

    def factors(self) -> Tensor | None:
        """``(src + pos, 1)``: each position's factor (None where every one is 1)."""
        if self.k_source == 1.0 and self.k == 1.0:
            return None
        n = self.fed.shape[1]
        out = torch.full((n, 1), self.k, dtype=torch.float64, device=self.fed.device)
        out[: self.n_source] = self.k_source
        return out

    def kwargs(self, x: Tensor) -> dict:
        """``baselines.model_logits``' keyword arguments for a tensor shaped like ``fed`` (rows and positions)."""
        if self.n_source == 0:
            return {"inputs_embeds": x}
        return {"source_embeds": x[:, : self.n_source], "inputs_embeds": x[:, self.n_source:]}

    def embeddings_and_gradient(self, g: Tensor) -> tuple[Tensor, Tensor]:
        """``(x, df/dx)`` in float32 from the gradient ``g`` with respect to ``fed``: ``x = fed * k``, ``g / k``."""
        k = self.factors()
        if k is None:
            return self.fed.float(), g.float()
        return (self.fed.double() * k).float(), (g.double() / k).float()

    def baseline(self, lm: LoadedModel, baseline: str | Tensor) -> tuple[Tensor | None, dict]:
        """Integrated gradients' baseline in what the model is given: None (zero), a ``(d_model,)`` vector for a
        decoder (:func:`ig_baseline`), or ``(src + pos, d_model)`` for an encoder-decoder model (each stack's
        baseline embedding over its positions, divided by its factor)."""
        if self.n_source == 0:
            return ig_baseline(lm, baseline)
        A = lm.anatomy
        (b_src, _), (b, info) = ig_baseline(lm, baseline, A.encoder), ig_baseline(lm, baseline, A)
        if b is None:
            return None, info
        n = self.fed.shape[1]
        return torch.cat([b_src.expand(self.n_source, -1) / self.k_source,
                          b.expand(n - self.n_source, -1) / self.k]), info


def ig_baseline(lm: LoadedModel, baseline: str | Tensor = "zero", stack=None) -> tuple[Tensor | None, dict]:
    """The baseline embedding ``(d_model,)`` that integrated gradients starts from, and what it is.

    - ``"zero"``: the zero vector (returned as None: the path is ``alpha * e``, exactly as before baselines
      were selectable);
    - ``"pad"``: the input embedding of the tokenizer's pad token, or of its unk token where there is no pad
      token (an :class:`InputError` where it has neither);
    - ``"mean"``: the mean input embedding over every row of the input-embedding matrix (the model's whole
      vocabulary, including any rows the tokenizer never produces);
    - a tensor ``(d_model,)``: that vector.

    Embeddings are read as ``e`` is (:class:`Inputs`: the model's own input-embedding module, Gemma's scale
    included, or ``stack``'s embedding of an encoder-decoder model), and the same vector is used at every
    position. The second value is ``info`` for the explanation: ``{"baseline": name}`` plus
    ``baseline_token``/``baseline_token_id`` for ``"pad"``.
    """
    from ..models.loading.devices import main_device

    if isinstance(baseline, Tensor):
        if baseline.dim() != 1:
            raise InputError(f"a baseline tensor must be one embedding vector (d_model,), got shape "
                             f"{tuple(baseline.shape)}")
        return baseline.detach().float().to(main_device(lm.model)), {"baseline": "custom"}
    if baseline not in IG_BASELINES:
        raise InputError(f"unknown integrated-gradients baseline {baseline!r}; choose from {', '.join(IG_BASELINES)}")
    if baseline == "zero":
        return None, {"baseline": "zero"}
    emb = _embedder(lm, stack)
    device = main_device(lm.model)
    if baseline == "pad":
        tok = lm.tokenizer
        for kind in ("pad", "unk"):
            tid = getattr(tok, f"{kind}_token_id", None)
            if tid is not None:
                break
        else:
            raise InputError(f"{lm.name}'s tokenizer has neither a pad nor an unk token, so there is no pad "
                             "baseline; use baseline 'zero' or 'mean' (or give an embedding vector)")
        with torch.no_grad():
            vec = emb(torch.tensor([int(tid)], device=device))[0].detach().float()
        return vec, {"baseline": "pad", "baseline_token": token_str(lm, int(tid)), "baseline_token_id": int(tid),
                     "baseline_token_kind": kind}
    V = lm.model.get_input_embeddings().weight.shape[0] if stack is None else stack.embed.W_E.shape[0]
    total = None
    with torch.no_grad():
        for s in range(0, V, 8192):  # chunks: a 262k x d_model float copy at once is too much
            part = emb(torch.arange(s, min(s + 8192, V), device=device)).double().sum(0)
            total = part if total is None else total + part
    return (total / V).float(), {"baseline": "mean"}
