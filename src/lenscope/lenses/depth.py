"""Prediction depth: how many layers a token needs (Belrose et al. 2023, section 5, after Baldock et al. 2021).

The prediction depth of a token under a lens is the first state ``l`` from which the lens's top-1 prediction
equals the model's final top-1 and stays equal at every later state ``l .. n_layers - 1`` (states numbered as
in :mod:`lenscope.lenses.lenses`: state 0 = embeddings, state ``n_layers`` = the model's output, where every
lens is exact and which therefore does not count). A token whose prediction is wrong at the last translated
state never settles: its depth is ``None`` in JSON (``-1`` in tensors).

Over a corpus the depth is set beside the model's loss on that token (its cross-entropy against the next
token; the token itself for masked-LM encoders): ``spearman_with_loss`` ranks never-settled tokens after
every settled one (depth ``n_layers``), ``mean_depth`` averages the tokens that settle.

Speed: only top-1 tokens are needed, so the lens states are decoded with a bfloat16 unembedding matmul
(AMX/AVX-512) and made exact afterwards (:meth:`lenscope.models.weights.readout.Readout.top1`): the 16 best candidates
of each row are recomputed in float32, and a row is recomputed entirely in float32 unless its exact best beats every
other token's bfloat16 logit by more than a rounding-error bound (so the result equals the float32 argmax).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ..data.jsonl import jsonl_rows
from ..errors import InputError, NotApplicableError
from ..models.loading.load import LoadedModel, encode, require_decoder
from ..models.runtime.trace import residual_states
from ..models.weights.readout import Readout
from ..results import Result, axis_size
from ..stats import spearman_or_none
from .evaluate import prediction_depth
from .lenses import Lens, LogitLens

NEVER = -1


# ------------------------------------------------------------------------------------------- top-1


@torch.no_grad()
def lens_top1(lm: LoadedModel, lens: Lens, h: Tensor, layer: int, *, exact: bool = False, candidates: int = 16,
              rows: int = 1024) -> Tensor:
    """Top-1 token ``(n,)`` of ``lens`` at state ``layer`` for states ``h (n, d_model)``, equal to the argmax of
    the float32 logits (bfloat16 matmul plus exact check; ``exact=True``: float32 throughout)."""
    A = lm.anatomy
    require_decoder(lm, "prediction depth", instead="use a model with a language-model head")
    readout = Readout.from_anatomy(A)
    out = torch.empty(h.shape[0], dtype=torch.long)
    for i in range(0, h.shape[0], rows):
        y = readout.features(lens.transform(h[i : i + rows].float(), layer))
        out[i : i + rows] = readout.top1(y, exact=exact, candidates=candidates)
    return out


def depths_from_agreement(agree: Tensor) -> Tensor:
    """``agree (state, tokens)`` over the lens's states ``0..n_layers-1`` -> depth per token (``-1``: never)."""
    d = prediction_depth(agree.int())
    return torch.where(d == agree.shape[0], torch.full_like(d, NEVER), d)


@torch.no_grad()
def token_depths(lm: LoadedModel, lenses: dict[str, Lens], ids: Tensor, *, exact: bool = False
                 ) -> tuple[dict[str, Tensor], Tensor, Tensor]:
    """For token ``ids (batch, pos)``: per lens the depth ``(batch, pos)`` (``-1``: never settles), the model's
    loss ``(batch, pos)`` on each position's target (NaN where there is none: a decoder's last position), and
    the model's final top-1 ``(batch, pos)``."""
    A = lm.anatomy
    ids = torch.as_tensor(ids, dtype=torch.long)
    if ids.dim() == 1:
        ids = ids[None]
    cap = residual_states(lm, ids)
    if cap["logits"] is None:
        raise NotApplicableError("the model returned no logits, so there is no final prediction to compare with")
    B, P = ids.shape
    logits = cap["logits"].float()
    final_top = logits.argmax(-1)  # (B, P)
    logp = torch.log_softmax(logits, -1)
    loss = torch.full((B, P), float("nan"))
    if A.causal:
        loss[:, :-1] = -logp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    else:
        loss = -logp.gather(-1, ids[..., None])[..., 0]
    states = cap["states"][: A.n_layers].flatten(1, 2)  # (state, tokens, d)
    out = {}
    for name, lens in lenses.items():
        if lens.mid:
            raise NotApplicableError("prediction depth reads the regular residual states; this lens was trained on "
                                     "mid-layer states")
        agree = torch.stack([lens_top1(lm, lens, states[l], l, exact=exact) for l in range(A.n_layers)])
        out[name] = depths_from_agreement(agree == final_top.reshape(1, -1)).reshape(B, P)
    return out, loss, final_top


def trajectory_depth(traj) -> list[int | None]:
    """Prediction depth per position read off a :class:`PredictionTrajectory` (its regular states)."""
    keep = [i for i, s in enumerate(traj.state_labels) if not s.endswith(".mid")]
    top = traj.top_ids[keep]  # (state 0..n_layers, pos)
    d = depths_from_agreement(top[:-1] == top[-1:])
    return [None if x == NEVER else int(x) for x in d.tolist()]


# ------------------------------------------------------------------------------------------ results


@dataclass(repr=False)
class TokenDepths(Result):
    """Prediction depth of every position of one text (named axis ``pos``).

    - ``depth (pos,)``: first state from which the lens's top-1 equals the model's and stays so (``-1``: never)
    - ``loss (pos,)``: the model's cross-entropy on the position's target (NaN where there is none)
    - ``tokens``: the input tokens; ``predictions``: the model's final top-1 token at each position
    """

    model: str
    lens: str
    n_layers: int
    tokens: list[str]
    predictions: list[str]
    depth: Tensor
    loss: Tensor

    def to_dict(self) -> dict:
        return {
            "model": self.model, "lens": self.lens, "n_layers": self.n_layers, "tokens": list(self.tokens),
            "predictions": list(self.predictions),
            "depth": [None if d == NEVER else int(d) for d in self.depth.tolist()],
            "loss": [None if not math.isfinite(x) else x for x in self.loss.tolist()],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def to_frame(self):
        import pandas as pd

        d = self.to_dict()
        return pd.DataFrame({"token": d["tokens"], "prediction": d["predictions"], "depth": d["depth"],
                             "loss": d["loss"]})

    def plot(self, ax=None):
        from ..viz.lens_analysis_plots import plot_token_depths

        return plot_token_depths(self, ax=ax)

    def __repr__(self) -> str:
        return f"TokenDepths({self.lens!r} lens on {self.model!r}, {len(self.tokens)} tokens)"


@dataclass(repr=False)
class DepthStats(Result):
    """Prediction depths over a corpus (named axis ``token``): ``depth (token,)`` (``-1``: never settles) and
    the model's ``loss (token,)`` on the same tokens (only tokens that have a target are kept)."""

    model: str
    lens: str
    data: str
    n_layers: int
    depth: Tensor
    loss: Tensor

    n_tokens = axis_size("depth", 0)

    @property
    def settled(self) -> Tensor:
        return self.depth != NEVER

    @property
    def mean_depth(self) -> float | None:
        """Mean depth of the tokens that settle."""
        s = self.settled
        return float(self.depth[s].double().mean()) if s.any() else None

    @property
    def never_settled(self) -> float:
        """Fraction of tokens whose lens prediction is still wrong at the last translated state."""
        return float((~self.settled).double().mean()) if self.n_tokens else float("nan")

    def ranked_depth(self) -> Tensor:
        """Depth with never-settled tokens at ``n_layers`` (after every settled one), for rank statistics."""
        return torch.where(self.settled, self.depth, torch.full_like(self.depth, self.n_layers))

    @property
    def spearman_with_loss(self) -> float | None:
        return spearman_or_none(self.ranked_depth(), self.loss)

    def histogram(self) -> list[int]:
        """Token counts at depth ``0 .. n_layers - 1``, then the never-settled count."""
        return torch.bincount(self.ranked_depth(), minlength=self.n_layers + 1).tolist()

    def mean_loss_by_depth(self) -> list[float | None]:
        r = self.ranked_depth()
        return [float(self.loss[r == d].double().mean()) if (r == d).any() else None
                for d in range(self.n_layers + 1)]

    def to_dict(self) -> dict:
        return {
            "model": self.model, "lens": self.lens, "data": self.data, "n_layers": self.n_layers,
            "n_tokens": self.n_tokens, "mean_depth": self.mean_depth, "never_settled": self.never_settled,
            "spearman_with_loss": self.spearman_with_loss, "mean_loss": float(self.loss.double().mean()),
            "histogram": self.histogram(), "mean_loss_by_depth": self.mean_loss_by_depth(),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def to_frame(self):
        import pandas as pd

        return pd.DataFrame({"depth": self.depth.numpy(), "loss": self.loss.numpy()})

    def plot(self, others: list[DepthStats] | tuple = (), ax=None):
        from ..viz.lens_analysis_plots import plot_depth_stats

        return plot_depth_stats([self, *others], ax=ax)

    def __repr__(self) -> str:
        md, rho = self.mean_depth, self.spearman_with_loss
        return (f"DepthStats({self.lens!r} lens on {self.model!r}, {self.data!r}, {self.n_tokens} tokens, "
                f"mean_depth={'n/a' if md is None else f'{md:.2f}'}, never={self.never_settled:.1%}, "
                f"spearman_with_loss={'n/a' if rho is None else f'{rho:.3f}'})")


# ------------------------------------------------------------------------------------------ entry points


def text_depths(lm: LoadedModel, text: str, lenses: dict[str, Lens] | Lens | None = None, *, exact: bool = False
                ) -> dict[str, TokenDepths]:
    """Prediction depth of every token of ``text`` under each lens (default: the logit lens)."""
    lenses = _lens_dict(lm, lenses)
    ids = encode(lm, text)
    depths, loss, top = token_depths(lm, lenses, ids[None], exact=exact)
    tok = lm.tokenizer
    tokens = tok.batch_decode([[int(i)] for i in ids])
    preds = tok.batch_decode([[int(i)] for i in top[0]])
    return {name: TokenDepths(model=lm.name, lens=name, n_layers=lm.anatomy.n_layers, tokens=tokens,
                              predictions=preds, depth=d[0], loss=loss[0]) for name, d in depths.items()}


def _lens_dict(lm: LoadedModel, lenses) -> dict[str, Lens]:
    if lenses is None:
        return {"logit": LogitLens(lm.anatomy, model_name=lm.name)}
    if isinstance(lenses, Lens):
        return {lenses.kind: lenses}
    return dict(lenses)


@torch.no_grad()
def corpus_depths(lm: LoadedModel, data, lenses: dict[str, Lens] | Lens | None = None, *, name: str = "",
                  batch_size: int = 4, exact: bool = False, progress: bool = False) -> dict[str, DepthStats]:
    """Prediction depth and loss of every token that has a target, over ``data``: token sequences
    ``(n_seq, pos)`` (all the same length) or a list of texts (each run on its own, batched by length)."""
    from tqdm.auto import tqdm

    lenses = _lens_dict(lm, lenses)
    if isinstance(data, (list, tuple)):
        if not data:
            raise InputError("no texts to measure")
        groups: dict[int, list[Tensor]] = {}
        for t in data:
            ids = encode(lm, t)
            groups.setdefault(ids.numel(), []).append(ids)
        batches = [torch.stack(g[i : i + batch_size * 8]) for g in groups.values()
                   for i in range(0, len(g), batch_size * 8)]
    else:
        seqs = torch.as_tensor(data, dtype=torch.long)
        batches = [seqs[i : i + batch_size] for i in range(0, seqs.shape[0], batch_size)]
    acc = {n: [] for n in lenses}
    losses = []
    for ids in tqdm(batches, desc="prediction depth", disable=not progress, unit="batch"):
        depths, loss, _ = token_depths(lm, lenses, ids, exact=exact)
        keep = torch.isfinite(loss)
        losses.append(loss[keep])
        for n, d in depths.items():
            acc[n].append(d[keep])
    loss = torch.cat(losses)
    return {n: DepthStats(model=lm.name, lens=n, data=name, n_layers=lm.anatomy.n_layers, depth=torch.cat(ds),
                          loss=loss) for n, ds in acc.items()}


def read_texts(path: str | Path, limit: int | None = None) -> list[str]:
    """Texts of a ``.jsonl`` file, one per line: the ``sentence_good`` field (BLiMP) or ``text``."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"data file not found: {path}")
    texts = []
    for n, row in jsonl_rows(path):
        t = row.get("sentence_good", row.get("text")) if isinstance(row, dict) else None
        if not isinstance(t, str):
            raise InputError(f"{path}, line {n}: no 'sentence_good' or 'text' field")
        texts.append(t)
        if limit is not None and len(texts) >= limit:
            break
    if not texts:
        raise InputError(f"{path} holds no texts")
    return texts
