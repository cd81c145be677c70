"""The result of every context-attribution method: one score per input token, plus breakdowns.

All methods (Logit, ALTI-Logit, ALTI, the gradient and erasure baselines, value zeroing) return an
:class:`Explanation`, so tables, plots, pages and files work the same way for each of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..models.runtime.sites import display_name
from ..results import Result


def __getattr__(name: str):
    """``METHODS`` (every method's name), ``LOGIT_METHODS`` (those needing a target) and ``ROLLOUT_METHODS``
    (those needing none), read from the method table (:mod:`lenscope.attribution.methods`) when asked for."""
    from . import methods as table

    if name == "METHODS":
        return table.names()
    if name == "LOGIT_METHODS":
        return tuple(m for m in table.names() if table.needs_target(m))
    if name == "ROLLOUT_METHODS":
        return table.without_target()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _floats(t: Tensor | None):
    if t is None:
        return None
    return [None if not math.isfinite(v) else v for v in t.double().flatten().tolist()] if t.dim() == 1 else [
        _floats(r) for r in t]


@dataclass(repr=False)
class Explanation(Result):
    """Scores of the input tokens for one prediction.

    - ``scores (src,)``: one score per input token, in input order (sources after ``position`` are 0 in
      causal models).
    - ``layer_scores (layer, src)``: the per-layer scores where the method has them (Logit: each layer's
      attention logit update from each source; ALTI-Logit: that update carried back to the input tokens;
      ALTI / value zeroing: the rollout row after each layer); else None.
    - ``head_scores (layer, head, src)``: per head (Logit), else None.
    - ``attention_update (layer,)``: each layer's attention logit update computed directly from the trace;
      ``mlp_update (layer,)``: each MLP's logit update; ``remainder (layer,)``: the part of each attention
      update that goes to no token (the output-projection bias, through the norms). Logit methods only.
    - ``invariant_error``: the largest relative gap between ``layer_scores.sum(src) + remainder`` and
      ``attention_update`` (Logit, ALTI-Logit), or the largest deviation of a row sum from 1 (ALTI, value
      zeroing); None where no such check exists.
    - ``info``: method-specific numbers (e.g. integrated gradients' completeness, the logit difference).
    - ``n_source``: an encoder-decoder model's explanation: its first ``n_source`` tokens are the source's, the
      rest the target prefix's (``position`` indexes ``tokens``); 0 otherwise.
    """

    VIEW = "attribution"  # its view: drawn by viz/views/attribution/attribution.js (lenscope.viz.views)

    model: str
    method: str
    tokens: list[str]
    position: int
    target: str | None
    target_id: int | None
    foil: str | None
    foil_id: int | None
    scores: Tensor
    layer_scores: Tensor | None = None
    head_scores: Tensor | None = None
    attention_update: Tensor | None = None
    mlp_update: Tensor | None = None
    remainder: Tensor | None = None
    invariant_error: float | None = None
    info: dict = field(default_factory=dict)
    n_source: int = 0

    @property
    def source_scores(self) -> Tensor:
        """The source tokens' scores (an encoder-decoder model's explanation; empty otherwise)."""
        return self.scores[: self.n_source]

    @property
    def target_scores(self) -> Tensor:
        """The (target-prefix) context tokens' scores: every score but the source's."""
        return self.scores[self.n_source:]

    @property
    def contrastive(self) -> bool:
        return self.foil_id is not None

    @property
    def reports_completeness(self) -> bool:
        """Whether its method reports ``info["completeness_error"]`` (the method table's ``completeness``; a method
        not in the table, e.g. from an old file, reports none)."""
        from .methods import lookup

        m = lookup(self.method)
        return m is not None and m.completeness is not None

    def what(self) -> str:
        if self.target is None:
            return f"position {self.position} ({self.tokens[self.position]!r})"
        return repr(self.target) + (f" vs {self.foil!r}" if self.foil is not None else "")

    def to_dict(self) -> dict:
        d = {
            "model": self.model, "method": self.method, "tokens": self.tokens, "position": self.position,
            "target": self.target, "target_id": self.target_id, "foil": self.foil, "foil_id": self.foil_id,
            "scores": _floats(self.scores), "invariant_error": self.invariant_error,
        }
        if self.layer_scores is not None:
            d["layers"] = _floats(self.layer_scores)
        if self.head_scores is not None:
            d["heads"] = _floats(self.head_scores)
        for k in ("attention_update", "mlp_update", "remainder"):
            v = getattr(self, k)
            if v is not None:
                d[k] = _floats(v)
        d["info"] = self.info
        if self.n_source:
            d["n_source"] = self.n_source
        return d

    def to_frame(self):
        """One row per input token: ``position, token, score`` (+ one column per layer when available; ``part``:
        source or target, for an encoder-decoder model)."""
        import pandas as pd

        df = pd.DataFrame({"position": range(len(self.tokens)), "token": self.tokens,
                           "score": self.scores.double().numpy()})
        if self.n_source:  # an encoder-decoder model's: which side each token is on
            df.insert(2, "part", ["source"] * self.n_source + ["target"] * (len(self.tokens) - self.n_source))
        if self.layer_scores is not None:
            for i, row in enumerate(self.layer_scores.double().numpy()):
                df[display_name("layer", i)] = row
        return df

    def top(self, k: int = 5) -> list[tuple[int, str, float]]:
        """The ``k`` tokens with the largest scores: (position, token, score)."""
        order = torch.argsort(self.scores, descending=True)[:k]
        return [(int(i), self.tokens[int(i)], float(self.scores[i])) for i in order]

    def plot(self, ax=None):
        """A layer × token heat map where per-layer scores exist, else bars per token."""
        from ..viz.explain_plots import plot_explanation

        return plot_explanation(self, ax=ax)

    def to_html(self, path=None) -> str:
        """The self-contained page of this explanation: the report page with its attribution view (written to
        ``path`` when given; :func:`lenscope.viz.html.explanation_html`)."""
        from ..viz.html import explanation_html

        return explanation_html([self], path)

    def _repr_html_(self) -> str:
        """In a notebook: the report's context attribution view of this result, drawn by the report's own
        script (:func:`lenscope.viz.notebook.view`; ``lenscope.show(result)`` opens it in a browser)."""
        from ..viz.notebook import view

        return str(view(self))

    def __repr__(self) -> str:
        inv = "" if self.invariant_error is None else f", invariant_error={self.invariant_error:.1e}"
        return (f"Explanation({self.method}, {self.what()} at position {self.position}, "
                f"{len(self.tokens)} tokens{inv})")
