"""The result of :func:`lenscope.generate`: every generated token with its statistics and explanations."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from ..errors import InputError, NotApplicableError
from ..results import Result
from ..viz.notebook import ReportView


def _num(x: float) -> float | None:
    return x if math.isfinite(x) else None


@dataclass(repr=False)
class Generation(ReportView, Result):
    """A generated continuation of ``prompt`` and, for every generated token, why the model wrote it.

    ``text``: the generated tokens decoded together. Step ``i`` is the token at ``position = prompt_len + i``
    of the full sequence ``ids (pos,)``; its prediction is read at ``position - 1``. Per step (axis ``step``):

    - ``prob``, ``entropy`` (nats) of the model's next-token distribution there; ``runner_up (step,)``: the most
      likely token other than the generated one; ``depth (step,)``: the logit lens's prediction depth of that
      position (``-1``: never settles; :mod:`lenscope.lenses.depth`), ``tuned_depth`` the tuned lens's when one
      was given;
    - ``foil_ids (step,)``: the foil of the contrastive methods (the runner-up, or the given foil token; where
      the given foil is the generated token itself, that step's runner-up), None without a foil;
    - ``scores (method, step, src)``: each method's score of every token before the step's position (``src``
      runs over ``tokens[:-1]``; zeros from the step's position on), ``invariant_error (method, step)``
      (NaN for methods without such a check).

    An encoder-decoder model's generation (``source=``): ``prompt`` is the target prefix, ``ids`` / ``tokens`` the
    decoder's sequence (from its start token), ``source`` the source text, ``source_ids (src,)`` / ``source_tokens``
    its tokens, and ``src`` runs over the ``n_source`` source tokens first, then ``tokens[:-1]``
    (:attr:`context_tokens`; ``n_source`` is 0 for a decoder).

    ``seconds``: wall time per stage (``generate``: the decoding loop, ``trace``, then one entry per method).
    """

    VIEW = "generation"  # its view: drawn by viz/views/generation/generation.js (lenscope.viz.views)

    model: str
    prompt: str
    text: str
    ids: Tensor
    tokens: list[str]
    prompt_len: int
    methods: list[str]
    prob: Tensor
    entropy: Tensor
    runner_up: Tensor
    depth: Tensor
    scores: Tensor
    invariant_error: Tensor
    foil_ids: Tensor | None = None
    tuned_depth: Tensor | None = None
    token_names: dict = field(default_factory=dict)
    settings: dict = field(default_factory=dict)
    seconds: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    source: str | None = None
    source_ids: Tensor | None = None
    source_tokens: list = field(default_factory=list)
    n_source: int = 0

    # ------------------------------------------------------------------------------------------- views

    @property
    def n_steps(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def positions(self) -> list[int]:
        return list(range(self.prompt_len, len(self.tokens)))

    @property
    def context_tokens(self) -> list[str]:
        """The tokens the scores' ``src`` axis runs over (with a source: the source's, then the decoder's)."""
        return list(self.source_tokens) + list(self.tokens)

    def _name(self, tid: int) -> str:
        return self.token_names.get(str(int(tid)), f"#{int(tid)}")

    def _method(self, method: str) -> int:
        if method not in self.methods:
            raise InputError(f"{method!r} was not computed; this generation has {', '.join(self.methods)}")
        return self.methods.index(method)

    def matrix(self, method: str) -> Tensor:
        """``(step, src)`` scores of ``method`` (zeros from each step's position on; with a source, the first
        ``n_source`` columns are the source tokens')."""
        return self.scores[self._method(method)]

    def to_dict(self) -> dict:
        gen = []
        from ..attribution.methods import needs_target

        foil = self.foil_ids is not None and any(needs_target(m) for m in self.methods)
        S = self.n_source
        for i, p in enumerate(self.positions):
            tid = int(self.ids[p])
            step = {
                "position": p, "token": self.tokens[p], "id": tid, "prob": _num(float(self.prob[i])),
                "entropy": _num(float(self.entropy[i])),
                "runner_up": {"token": self._name(self.runner_up[i]), "id": int(self.runner_up[i])},
                "depth": None if int(self.depth[i]) < 0 else int(self.depth[i]),
            }
            if self.tuned_depth is not None:
                step["tuned_depth"] = None if int(self.tuned_depth[i]) < 0 else int(self.tuned_depth[i])
            step["foil"] = ({"token": self._name(self.foil_ids[i]), "id": int(self.foil_ids[i])} if foil else None)
            step["explanations"] = {
                m: {"scores": [_num(v) for v in self.scores[k, i, : S + p].double().tolist()],
                    "invariant_error": _num(float(self.invariant_error[k, i]))}
                for k, m in enumerate(self.methods)}
            gen.append(step)
        out = {"model": self.model, "prompt": self.prompt, "text": self.text, "tokens": list(self.tokens),
               "prompt_tokens": list(self.tokens[: self.prompt_len]), "methods": list(self.methods),
               "generated": gen, "seconds": round(sum(self.seconds.values()), 4),
               "timings": {k: round(v, 4) for k, v in self.seconds.items()}, "settings": dict(self.settings),
               "notes": list(self.notes)}
        if S:  # an encoder-decoder model's: each step's scores run over the source's tokens, then the decoder's
            out.update(source=self.source, source_tokens=list(self.source_tokens), n_source=S)
        return out

    def to_frame(self):
        """One row per (step, source, method): ``step, position, token, source, source_token, method, score``
        (``source``: the index into :attr:`context_tokens`); with a source, a ``part`` column says which side each
        scored token is on (``source`` / ``target``)."""
        import pandas as pd

        rows, S, ctx = [], self.n_source, self.context_tokens
        for k, m in enumerate(self.methods):
            for i, p in enumerate(self.positions):
                sc = self.scores[k, i, : S + p].double().tolist()
                rows += [(i, p, self.tokens[p], j, ctx[j], m, v) for j, v in enumerate(sc)]
        df = pd.DataFrame(rows, columns=["step", "position", "token", "source", "source_token", "method", "score"])
        if S:
            df.insert(4, "part", ["source" if j < S else "target" for j in df["source"]])
        return df

    def _no_source_view(self, what: str) -> None:
        if self.n_source:
            raise NotApplicableError(f"{what} of a generation with a source is not drawn yet; use to_frame(), "
                                     "to_dict() or matrix()")

    def plot(self, method: str | None = None):
        """The (generated token × source token) heat map of ``method`` (default: the first one)."""
        from ..viz.generation_plots import plot_generation

        self._no_source_view("the plot")
        return plot_generation(self, method or self.methods[0])

    def to_html(self, path: str | Path | None = None) -> str:
        """A self-contained page: the generated text coloured by probability or depth, each token's explanation
        on click, and the matrices (written to ``path`` when given)."""
        from ..viz.views.generation import generation_html

        self._no_source_view("the page")
        return generation_html(self.to_dict(), path)

    def _repr_html_(self) -> str:
        if self.n_source:  # the report's generation view draws a decoder's generation: the fields' table
            return Result._repr_html_(self)
        return super()._repr_html_()

    def __repr__(self) -> str:
        src = f"{self.n_source} source + " if self.n_source else ""
        return (f"Generation({self.model}, {src}{self.prompt_len} prompt + {self.n_steps} generated tokens, "
                f"methods={self.methods}, text={self.text!r})")


def stack_scores(per_method: list[Tensor], n_src: int) -> Tensor:
    """``[(step, >= n_src)]`` -> ``(method, step, n_src)`` float32."""
    return torch.stack([s[:, :n_src].float().cpu() for s in per_method]) if per_method else torch.zeros(0, 0, n_src)
