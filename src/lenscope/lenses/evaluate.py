"""Per-layer evaluation of a lens on held-out text, and prediction depth."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..models.loading.load import LoadedModel
from ..models.runtime.trace import residual_states
from ..results import Result
from .lenses import Lens, decode


def _finite(x: float) -> float | None:
    """JSON has no infinity: a perplexity that overflows float32 (CE above ~88 nats) is reported as None."""
    return x if math.isfinite(x) else None


def _state_records(kl: Tensor, ce: Tensor, entropy: Tensor, top1: Tensor) -> list[dict]:
    """One record per state of the four per-state metrics (the output states' and the mid-layer states' alike)."""
    return [
        {"layer": i, "kl": float(kl[i]), "ce": float(ce[i]), "perplexity": _finite(float(ce[i].exp())),
         "entropy": float(entropy[i]), "top1_agreement": float(top1[i]), "precision_at_1": float(top1[i])}
        for i in range(kl.shape[0])
    ]


@dataclass(repr=False)
class LensEvaluation(Result):
    """Per-state metrics, each ``(state,)`` for states ``0..n_layers`` (the last is the model's output):

    - ``kl``: KL(final || lens) in nats, mean over tokens
    - ``ce``: cross-entropy of the lens against the next token (encoders: the token itself), nats
    - ``entropy``: entropy of the lens distribution, nats
    - ``top1``: fraction of tokens whose lens top-1 equals the final top-1 (precision@1 against the model's own
      prediction; ``layers()`` gives it as ``top1_agreement`` and ``precision_at_1``)
    - ``depth_hist``: how many tokens have prediction depth 0..n_layers (the first state from which the
      lens's top-1 equals the final top-1 and stays equal)

    With ``evaluate_lenses(..., mid=True)`` also ``mid_kl, mid_ce, mid_entropy, mid_top1 (layer,)``: the same
    metrics for the residual after each block's attention (None otherwise).
    """

    model: str
    lens: str
    n_tokens: int
    kl: Tensor
    ce: Tensor
    entropy: Tensor
    top1: Tensor
    depth_hist: Tensor
    mid_kl: Tensor | None = None
    mid_ce: Tensor | None = None
    mid_entropy: Tensor | None = None
    mid_top1: Tensor | None = None

    @property
    def n_layers(self) -> int:
        return self.kl.shape[0] - 1

    @property
    def mean_kl(self) -> float:
        """Mean KL over the states a lens translates (all but the output state)."""
        return float(self.kl[:-1].mean())

    @property
    def perplexity(self) -> Tensor:
        return self.ce.exp()

    @property
    def mean_depth(self) -> float:
        d = torch.arange(self.depth_hist.shape[0], dtype=torch.float64)
        return float((d * self.depth_hist).sum() / self.depth_hist.sum())

    def layers(self) -> list[dict]:
        return _state_records(self.kl, self.ce, self.entropy, self.top1)

    @property
    def mean_mid_kl(self) -> float | None:
        """Mean KL over the mid-layer states (None when they were not evaluated)."""
        return None if self.mid_kl is None else float(self.mid_kl.mean())

    def mid_layers(self) -> list[dict]:
        if self.mid_kl is None:
            return []
        return _state_records(self.mid_kl, self.mid_ce, self.mid_entropy, self.mid_top1)

    def to_dict(self) -> dict:
        d = {"model": self.model, "lens": self.lens, "n_tokens": self.n_tokens, "mean_kl": self.mean_kl,
             "mean_prediction_depth": self.mean_depth, "layers": self.layers()}
        if self.mid_kl is not None:
            d.update({"mean_mid_kl": self.mean_mid_kl, "mid_layers": self.mid_layers()})
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def to_frame(self):
        import pandas as pd

        return pd.DataFrame(self.layers()).set_index("layer")

    def plot(self, other: LensEvaluation | None = None, ax=None):
        from ..viz.lens_plots import plot_lens_evaluation

        return plot_lens_evaluation(self, other, ax=ax)

    def __repr__(self) -> str:
        return (f"LensEvaluation({self.lens!r} on {self.model!r}, {self.n_tokens} tokens, "
                f"mean_kl={self.mean_kl:.3f}, mean_depth={self.mean_depth:.2f})")


def lens_metrics(lm: LoadedModel, lens: Lens, states: Tensor, final_logits: Tensor, targets: Tensor | None,
                 mid: bool = False):
    """Metrics for ``states (state, tokens, d_model)`` against ``final_logits (tokens, vocab)``, in float32.

    Returns per-state sums over tokens of kl, ce, entropy (each (state,)), and ``agree (state, tokens)``.
    ``mid=True``: the states are the mid-layer ones (``lens.transform_mid``); otherwise each chunk of tokens goes
    through ``lens.transform_all`` at once (every state of a chunk in one batch: the Patchscope lens runs them as
    rows of one batch).

    Exact full-vocabulary values, computed with few passes over the ``(tokens, vocab)`` logits ``z``:
    ``KL = sum p log p - p . z + lse(z)``, entropy ``= lse(z) - q . z`` with ``q = exp(z - lse)``.
    """
    n, N = states.shape[:2]
    V = final_logits.shape[-1]
    kl, ce, ent = (torch.zeros(n, dtype=torch.float64) for _ in range(3))
    agree = torch.zeros(n, N, dtype=torch.bool)
    step = max(1, int(2.5e8 // (V * 4)))  # tokens per chunk: ~250 MB per (tokens, vocab) tensor
    with torch.no_grad():
        for t0 in range(0, N, step):
            ts = slice(t0, min(N, t0 + step))
            logp = torch.log_softmax(final_logits[ts].float(), -1)
            p = logp.exp()
            neg_ent_p = (p * logp).sum(-1)
            final_top = logp.argmax(-1)
            del logp
            x = None if mid else lens.transform_all(states[:, ts])
            for i in range(n):
                z = decode(lm.anatomy, lens.transform_mid(states[i, ts], i) if mid else x[i]).float()
                lse = torch.logsumexp(z, -1)
                kl[i] += (neg_ent_p - (p * z).sum(-1) + lse).clamp_min(0.0).double().sum()  # >= 0 up to rounding
                q = torch.exp(z - lse[:, None])
                ent[i] += (lse - (q * z).sum(-1)).double().sum()
                if targets is not None:
                    ce[i] += (lse - z.gather(-1, targets[ts, None]).squeeze(-1)).double().sum()
                agree[i, ts] = z.argmax(-1) == final_top
    return kl, ce, ent, agree


def prediction_depth(agree: Tensor) -> Tensor:
    """``agree (state, tokens)`` -> depth per token: the first state from which all later states agree."""
    stays = agree.flip(0).cumprod(0).flip(0)  # 1 where this and every later state agree
    return agree.shape[0] - stays.sum(0)


@torch.no_grad()
def evaluate_lens(lm: LoadedModel, lens: Lens, sequences: Tensor, *, batch_size: int = 4, progress: bool = True,
                  name: str | None = None, mid: bool = False) -> LensEvaluation:
    """Evaluate ``lens`` on token ``sequences (n_seq, seq_len)``: per-state KL, CE, entropy, top-1 agreement
    (``mid=True``: the mid-layer states too)."""
    return evaluate_lenses(lm, {name or lens.kind: lens}, sequences, batch_size=batch_size, progress=progress,
                           mid=mid)[name or lens.kind]


@torch.no_grad()
def evaluate_lenses(lm: LoadedModel, lenses: dict[str, Lens], sequences: Tensor, *, batch_size: int = 4,
                    progress: bool = True, mid: bool = False) -> dict[str, LensEvaluation]:
    """Evaluate several lenses on the same sequences, sharing each batch's forward pass.

    ``mid=True`` also evaluates the residual after each block's attention, through each lens's mid-layer
    translators (the identity for lenses without them), into the ``mid_*`` fields.
    """
    from tqdm.auto import tqdm

    A = lm.anatomy
    n = A.n_layers + 1
    sequences = torch.as_tensor(sequences, dtype=torch.long)
    keys = ("kl", "ce", "entropy", "top1")
    tot = {name: {k: torch.zeros(n, dtype=torch.float64) for k in keys} for name in lenses}
    tot_mid = {name: {k: torch.zeros(n - 1, dtype=torch.float64) for k in keys} for name in lenses}
    hist = {name: torch.zeros(n + 1, dtype=torch.float64) for name in lenses}
    count = ce_count = 0
    batches = range(0, sequences.shape[0], batch_size)
    for start in tqdm(batches, desc="evaluating " + ", ".join(lenses), unit="batch", disable=not progress):
        batch = sequences[start : start + batch_size]
        cap = residual_states(lm, batch, mid=mid)
        states = cap["states"]
        mids = cap.get("mid")
        if A.causal:  # predict the next token: drop the last position
            states, final = states[:, :, :-1], cap["logits"][:, :-1]
            mids = None if mids is None else mids[:, :, :-1]
            targets = batch[:, 1:]
        else:
            final, targets = cap["logits"], batch
        states = states.flatten(1, 2)
        for name, lens in lenses.items():
            kl, ce, ent, agree = lens_metrics(lm, lens, states, final.flatten(0, 1), targets.flatten())
            t = tot[name]
            t["kl"] += kl
            t["ce"] += ce
            t["entropy"] += ent
            t["top1"] += agree.double().sum(1)
            hist[name] += torch.bincount(prediction_depth(agree.int()), minlength=n + 1).double()
            if mid:
                kl, ce, ent, agree = lens_metrics(lm, lens, mids.flatten(1, 2), final.flatten(0, 1), targets.flatten(),
                                                  mid=True)
                t = tot_mid[name]
                t["kl"] += kl
                t["ce"] += ce
                t["entropy"] += ent
                t["top1"] += agree.double().sum(1)
        count += states.shape[1]
        ce_count += targets.numel()

    def mid_fields(name):
        if not mid:
            return {}
        t = tot_mid[name]
        return {"mid_kl": (t["kl"] / count).float(), "mid_ce": (t["ce"] / ce_count).float(),
                "mid_entropy": (t["entropy"] / count).float(), "mid_top1": (t["top1"] / count).float()}

    return {
        name: LensEvaluation(
            model=lm.name, lens=name, n_tokens=count, kl=(t["kl"] / count).float(), ce=(t["ce"] / ce_count).float(),
            entropy=(t["entropy"] / count).float(), top1=(t["top1"] / count).float(), depth_hist=hist[name].float(),
            **mid_fields(name))
        for name, t in tot.items()
    }
