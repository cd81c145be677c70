"""Prediction trajectories: what a lens reads from every residual state at every position of one text.

For each state (embeddings at the bottom, the model's output at the top) and each position, the lens's
distribution over the vocabulary is summarised by its top-1 token and probability, its top-k tokens, its
entropy, and its KL divergence from the model's final distribution. This is the "logit lens picture" of
nostalgebraist (2020) and the trajectory plots of Belrose et al. (2023), as a result object.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ..errors import InputError, NotApplicableError
from ..models.loading.load import LoadedModel, encode, require_decoder
from ..models.runtime.trace import Trace, residual_states
from ..results import Result, axis_size
from ..viz.notebook import ReportView
from .lenses import Lens, LogitLens, decode

VALUES = ("entropy", "kl", "prob")


@dataclass(repr=False)
class PredictionTrajectory(ReportView, Result):
    """A lens's reading of every state at every position of one text (shapes use named axes).

    Tensors, ``state`` running bottom-up from the embeddings (state 0) to the model's output:

    - ``top_ids (state, pos)``: the lens's most likely token; ``top_prob (state, pos)`` its probability
    - ``entropy (state, pos)``: entropy of the lens distribution, nats
    - ``kl (state, pos)``: KL(final || lens) in nats, final = the model's own output distribution
    - ``topk_ids, topk_prob (state, pos, k)``: the ``k`` most likely tokens, most likely first

    JSON fields: ``model`` and ``lens`` names, the input ``tokens`` (``pos`` strings), ``state_labels``
    (``"0"`` ... ``"n_layers"``, with ``"l.mid"`` after ``"l"`` when mid-layer states are included),
    ``top_tokens (state, pos)`` and ``topk_tokens (state, pos, k)`` as strings, and ``causal`` (whether a
    position predicts the next token (decoders) or its own token (masked-LM encoders)).
    """

    VIEW = "trajectory"  # its view: drawn by viz/views/trajectory/trajectory.js (lenscope.viz.views)

    model: str
    lens: str
    tokens: list[str]
    state_labels: list[str]
    top_tokens: list[list[str]]
    topk_tokens: list[list[list[str]]]
    top_ids: Tensor
    top_prob: Tensor
    entropy: Tensor
    kl: Tensor
    topk_ids: Tensor
    topk_prob: Tensor
    causal: bool = True

    # ------------------------------------------------------------------ shape

    n_states = axis_size("top_ids", 0)
    n_pos = axis_size("top_ids", 1)
    k = axis_size("topk_ids", -1)

    @property
    def has_mid(self) -> bool:
        return any(s.endswith(".mid") for s in self.state_labels)

    @property
    def n_layers(self) -> int:
        return sum(not s.endswith(".mid") for s in self.state_labels) - 1

    def values(self, value: str = "entropy") -> Tensor:
        """The ``(state, pos)`` tensor named ``value``: ``"entropy"``, ``"kl"`` or ``"prob"`` (top-1 probability)."""
        if value not in VALUES:
            raise InputError(f"value must be one of {', '.join(VALUES)}, not {value!r}")
        return {"entropy": self.entropy, "kl": self.kl, "prob": self.top_prob}[value]

    def targets(self) -> list[str | None]:
        """Per position, the token the model is trained to predict there (the next one for decoders)."""
        if self.causal:
            return list(self.tokens[1:]) + [None]
        return list(self.tokens)

    # ------------------------------------------------------------------ views

    def to_frame(self):
        """Long format: one row per (state, position) with the top-1 token, its probability, entropy and KL."""
        import pandas as pd

        S, P = self.n_states, self.n_pos
        state_idx = torch.arange(S).repeat_interleave(P)
        pos = torch.arange(P).repeat(S)
        return pd.DataFrame({
            "state_index": state_idx.numpy(),
            "state": [self.state_labels[i] for i in state_idx.tolist()],
            "pos": pos.numpy(),
            "token": [self.tokens[p] for p in pos.tolist()],
            "top_id": self.top_ids.reshape(-1).numpy(),
            "top_token": [t for row in self.top_tokens for t in row],
            "top_prob": self.top_prob.reshape(-1).numpy(),
            "entropy": self.entropy.reshape(-1).numpy(),
            "kl": self.kl.reshape(-1).numpy(),
        })

    def to_dict(self, digits: int | None = None) -> dict:
        """A JSON-able dict with every field; nested lists are indexed ``[state][pos]`` (``[state][pos][k]``).

        ``digits`` rounds the floats (to keep an embedded copy small); None keeps them as they are.
        """

        def floats(t: Tensor):
            if digits is None:
                return t.tolist()
            return torch.round(t.double(), decimals=digits).tolist()

        return {
            "model": self.model, "lens": self.lens, "causal": self.causal, "tokens": list(self.tokens),
            "state_labels": list(self.state_labels), "k": self.k,
            "top_ids": self.top_ids.tolist(), "top_tokens": self.top_tokens, "top_prob": floats(self.top_prob),
            "entropy": floats(self.entropy), "kl": floats(self.kl),
            "topk_ids": self.topk_ids.tolist(), "topk_tokens": self.topk_tokens, "topk_prob": floats(self.topk_prob),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def plot(self, ax=None, value: str = "entropy"):
        """Annotated heat map (states bottom-up, input tokens across), coloured by ``value``; returns the Figure."""
        from ..viz.lens_plots import plot_trajectory

        return plot_trajectory(self, ax=ax, value=value)

    def to_html(self, path: str | Path, others: tuple[PredictionTrajectory, ...] | list = (),
                title: str | None = None) -> Path:
        """One self-contained interactive HTML page with this trajectory and ``others`` side by side."""
        from ..viz.html import trajectory_html

        return trajectory_html([self, *others], path, title=title)

    def __repr__(self) -> str:
        return (f"PredictionTrajectory({self.lens!r} lens on {self.model!r}, states={self.n_states}, "
                f"pos={self.n_pos}, k={self.k}, output top-1={self.top_tokens[-1][-1]!r})")


CHUNK_BYTES = 256 * 2**20  # logits decoded at once (float32): bounds the memory of long texts


def _token_strings(tokenizer, ids: Tensor) -> list:
    """Nested lists of token strings for an integer tensor, decoding each distinct id once."""
    uniq = torch.unique(ids).tolist()
    text = dict(zip(uniq, tokenizer.batch_decode([[i] for i in uniq])))

    def walk(x):
        return [walk(v) for v in x] if isinstance(x, list) else text[x]

    return walk(ids.tolist())


@torch.no_grad()
def prediction_trajectory(lm: LoadedModel, text: str | None = None, lens: Lens | None = None, k: int = 5,
                          mid: bool = False, *, name: str | None = None, tr: Trace | None = None
                          ) -> PredictionTrajectory:
    """Decode every residual state of ``text`` at every position with ``lens`` (default: the logit lens).

    States are ``0..n_layers`` (state ``l < n_layers`` enters block ``l``, state 0 = embeddings, state
    ``n_layers`` = the model's last residual). With ``mid=True`` the residual after each block's attention
    is interleaved as ``"l.mid"`` between ``"l"`` and ``"l+1"`` (``2 * n_layers + 1`` states in all).
    Translators exist only for the states a lens was trained on: the regular states go through
    ``lens.transform``; mid-layer states go through the lens's mid-layer translators when it has them
    (``TrainSettings(mid=True)``) and are decoded with the logit lens (the identity) otherwise — except for
    a lens trained on mid-layer states only (``lens.mid``), whose translators apply to the mid states and
    the regular states are read with the identity.

    Each cell records the top-1 token and probability, the top-``k`` tokens, the entropy (nats) and
    KL(final || lens) (nats), final being the model's own output distribution. Computed in float32.
    ``name`` labels the lens in plots (default: its kind, ``"logit"`` or ``"tuned"``). ``tr``: a trace of the
    text (``lenscope.trace``) to read the states and logits from instead of running the model again.
    """
    A = lm.anatomy
    if lens is None:
        lens = LogitLens(A, model_name=lm.name)
    if lens.n_layers != A.n_layers or lens.d_model != A.d_model:
        raise InputError(
            f"the lens is for a model with {lens.n_layers} layers and d_model {lens.d_model}, but {lm.name!r} has "
            f"{A.n_layers} layers and d_model {A.d_model}; use a lens trained on this model"
        )
    if lens.mid and not mid:
        raise InputError("this lens was trained on mid-layer states; call prediction_trajectory with mid=True")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise InputError(f"k must be a positive integer, not {k!r}")
    require_decoder(lm, "the prediction trajectory", instead="use a model with a language-model head")

    if tr is not None:
        ids = tr.input_ids
        cap = {"states": torch.cat([tr.resid_pre, tr.final_resid[None]])[:, None],
               "mid": tr.resid_mid[:, None] if mid else None,
               "logits": None if tr.logits is None else tr.logits[None]}
    elif text is None:
        raise InputError("give a text (or a trace of one)")
    else:
        ids = encode(lm, text)
        cap = residual_states(lm, ids[None], mid=mid)
    regular = cap["states"][:, 0]  # (layer + 1, pos, d_model)
    if cap["logits"] is None:
        raise NotApplicableError("the model returned no logits, so there is no final distribution to compare with")
    final_logp = torch.log_softmax(cap["logits"][0].float(), -1)  # (pos, vocab)
    final_p = final_logp.exp()
    k = min(k, final_logp.shape[-1])

    # (label, state tensor (pos, d_model), translator (a function of the state) or None for the identity)
    plan: list[tuple[str, Tensor, object]] = []
    L = A.n_layers
    for layer in range(L + 1):
        plan.append((str(layer), regular[layer], None if lens.mid else (lambda h, i=layer: lens.transform(h, i))))
        if mid and layer < L:
            plan.append((f"{layer}.mid", cap["mid"][layer, 0], lambda h, i=layer: lens.transform_mid(h, i)))

    # every (state, position) row decoded in chunks of many rows: one large unembedding matmul per chunk instead
    # of one per state (a matmul of a few rows runs far below the CPU's peak)
    X = torch.stack([h.float() if translate is None else translate(h.float()) for _, h, translate in plan])
    S, n = X.shape[:2]
    X = X.reshape(S * n, -1)
    final_plogp = (final_p * final_logp).sum(-1)  # (pos,)
    chunk = max(n, (CHUNK_BYTES // (4 * final_logp.shape[-1])) // n * n)  # whole states per chunk
    rows = {key: [] for key in ("topk_ids", "topk_prob", "entropy", "kl")}
    def dot(a: Tensor, b: Tensor) -> Tensor:  # row-wise a . b over the vocabulary without an (row, V) temporary
        return torch.matmul(a.unsqueeze(-2), b.unsqueeze(-1))[..., 0, 0]

    for a in range(0, S * n, chunk):
        x = decode(A, X[a: a + chunk]).float().unflatten(0, (-1, n))  # logits (state, pos, V)
        top_x, top_i = x.topk(k, dim=-1)
        m = top_x[..., :1]
        e = torch.sub(x, m).exp_()  # q * Z with Z = sum(e): log q = x - lse, lse = m + log Z
        Z = e.sum(-1)
        lse = m[..., 0] + Z.log()
        rows["topk_prob"].append((top_x - lse[..., None]).exp())
        rows["topk_ids"].append(top_i)
        rows["entropy"].append(lse - dot(e, x) / Z)  # H(q) = lse - q . x
        px = torch.matmul(x.transpose(0, 1), final_p[:, :, None])[..., 0].T  # final_p . x: (state, pos)
        rows["kl"].append((final_plogp - px + lse).clamp_min(0.0))  # sum p (log p - log q), sum p = 1
        del x, e
    t = {key: torch.cat(v).cpu() for key, v in rows.items()}
    t["top_prob"], t["top_ids"] = t["topk_prob"][..., 0], t["topk_ids"][..., 0]

    tok = lm.tokenizer
    return PredictionTrajectory(
        model=lm.name,
        lens=name or lens.kind,
        tokens=tok.batch_decode([[int(i)] for i in ids]),
        state_labels=[label for label, _, _ in plan],
        top_tokens=_token_strings(tok, t["top_ids"]),
        topk_tokens=_token_strings(tok, t["topk_ids"]),
        top_ids=t["top_ids"],
        top_prob=t["top_prob"],
        entropy=t["entropy"],
        kl=t["kl"],
        topk_ids=t["topk_ids"],
        topk_prob=t["topk_prob"],
        causal=bool(A.causal),
    )
