"""Per-state model selection for tuned-lens training (``TrainSettings.keep_best``).

:class:`BestPerState` judges every state's translator on a few sequences held out of the training text,
keeps each state's best one and shrinks the step size of a state that got worse. Input: the model, the lens
being trained, the held-out token ids; it reads the KL through :mod:`lenscope.lenses.training.objective`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ...models.loading.load import LoadedModel
from ...models.runtime.trace import residual_states
from ..lenses import TunedLens
from .objective import (
    _groups,
    _training_states,
    _unembed_weight,
    chunks,
    kl_to_final_terms,
    lens_kl,
    stacked_translators,
    write_translators,
)


def split_validation(sequences: Tensor, validation_tokens: int) -> tuple[Tensor, Tensor | None]:
    """``sequences (n_seq, seq_len)`` split into training and held-out sequences: the last ones, at least
    ``validation_tokens`` tokens of them but never more than a fifth of the text; ``None`` when none are held
    out."""
    n_seq, S = sequences.shape
    if validation_tokens <= 0:
        return sequences, None
    n_val = min(math.ceil(validation_tokens / S), n_seq // 5)  # never more than a fifth of the text
    if n_val <= 0:
        return sequences, None
    return sequences[:-n_val], sequences[-n_val:]


class BestPerState:
    """Per-state model selection with step-size back-off, on sequences held out of the training text.

    The objective is a sum of independent per-state terms, so each state can be judged on its own. At every
    validation point a state whose KL improved keeps its new translator; a state that got worse goes back
    to its best translator (the identity, at step 0, counts), its momentum is cleared and, after
    ``patience`` failed checks in a row, its step size is multiplied by ``backoff``. Near-identity late
    translators, which one learning rate for all layers makes worse on some models (gemma3-270m), so find
    their own smaller step instead of ending wherever the last step left them; the early layers keep the
    full rate. States are numbered like
    :func:`~lenscope.lenses.training.objective.lens_kl`'s (mid-layer states after the regular ones).
    """

    def __init__(self, lm: LoadedModel, lens: TunedLens, val: Tensor, bf16: bool, backoff: float, patience: int = 1):
        A = lm.anatomy
        self.lm, self.W, self.backoff, self.patience = lm, _unembed_weight(lm, bf16), backoff, patience
        self.mid = lens.has_mid_translators
        n = A.n_layers * (2 if self.mid else 1)
        self.fails = torch.zeros(n, dtype=torch.long)
        cap = residual_states(lm, val, mid=self.mid)
        self.states = _training_states(cap, A.n_layers, self.mid)
        self.c, self.pbar = kl_to_final_terms(lm, cap["logits"].flatten(0, 1))
        self.A, self.b = stacked_translators(lens)
        self.kl = torch.full((n,), float("inf"))
        self.step = torch.zeros(n, dtype=torch.long)
        self.identity_kl = torch.full((n,), float("nan"))
        self.start_kl = torch.full((n,), float("nan"))  # the least-squares start's (nan: no such start)
        self.lr_scale = torch.ones(n)

    def state_kl(self, lens) -> Tensor:
        n_states, n_tokens = self.states.shape[:2]
        kl = torch.zeros(n_states)
        with torch.no_grad():
            for ss, ts in chunks(n_states, n_tokens, self.lm.anatomy.vocab_size, split_at=self.lm.anatomy.n_layers):
                kl[ss] += lens_kl(self.lm, lens, self.states[ss, ts], self.c[ts], self.pbar[ts], self.W,
                                  first_state=ss.start).sum(1)
        return kl / n_tokens

    def _keep_better(self, lens: TunedLens, kl: Tensor) -> Tensor:
        """Record ``lens``'s translators and validation ``kl`` for the states where it beats the best so far;
        returns that mask."""
        better = kl < self.kl
        self.kl = torch.where(better, kl, self.kl)
        now_A, now_b = stacked_translators(lens)
        self.A[better] = now_A[better]
        self.b[better] = now_b[better]
        return better

    def update(self, lens: TunedLens, opt, step: int) -> None:
        kl = self.state_kl(lens)
        if step == 0:
            self.identity_kl = kl.clone()
        better = self._keep_better(lens, kl)
        self.step[better] = step
        self.fails[better] = 0
        with torch.no_grad():
            worse = ~better
            if step > 0 and bool(worse.any()):
                write_translators(lens, self.A, self.b, worse)
                self.fails[worse] += 1
                shrink = worse & (self.fails >= self.patience)
                self.lr_scale[shrink] *= self.backoff
                self.fails[shrink] = 0
                L = lens.n_layers
                for gi, pair in enumerate(_groups(lens)):
                    w = worse[gi * L : (gi + 1) * L]
                    for p in pair:
                        for key in ("exp_avg", "momentum_buffer"):
                            buf = opt.state.get(p, {}).get(key)
                            if buf is not None:
                                buf[w] = 0.0

    def adopt(self, lens: TunedLens) -> None:
        """After :meth:`update` at step 0 (the identity) and a closed-form start of ``lens``'s translators: each
        state keeps the start where its validation KL is lower, and goes back to the identity where it is not."""
        self.start_kl = self.state_kl(lens)
        better = self._keep_better(lens, self.start_kl)
        write_translators(lens, self.A, self.b, ~better)

    def step_scaled(self, opt, lens: TunedLens) -> None:
        """``opt.step()`` with each state's change multiplied by its step-size factor."""
        if bool((self.lr_scale == 1.0).all()):
            opt.step()
            return
        groups = _groups(lens)
        before = [(a.detach().clone(), b.detach().clone()) for a, b in groups]
        opt.step()
        L = lens.n_layers
        with torch.no_grad():
            for gi, ((pA, pb), (A0, b0)) in enumerate(zip(groups, before)):
                f = self.lr_scale[gi * L : (gi + 1) * L]
                pA.sub_(A0).mul_(f[:, None, None]).add_(A0)
                pb.sub_(b0).mul_(f[:, None]).add_(b0)

    def finish(self, lens: TunedLens, every: int) -> dict:
        """Give every state its best translator; returns the ``selection`` record of the training info
        (``every``: the steps between validations)."""
        write_translators(lens, self.A, self.b)
        L = lens.n_layers
        sel = lambda t: [round(float(x), 6) for x in t]
        selection = {"validation_tokens": int(self.states.shape[1]), "validate_every": every,
                     "selected_step": self.step[:L].tolist(),
                     "validation_kl": [round(x, 4) for x in self.kl[:L].tolist()],
                     "validation_kl_identity": [round(x, 4) for x in self.identity_kl[:L].tolist()],
                     "step_size_factor": sel(self.lr_scale[:L])}
        if not bool(self.start_kl.isnan().all()):
            selection["validation_kl_start"] = [round(x, 4) for x in self.start_kl[:L].tolist()]
        if lens.has_mid_translators:
            selection["mid"] = {"selected_step": self.step[L:].tolist(),
                                "validation_kl": [round(x, 4) for x in self.kl[L:].tolist()],
                                "validation_kl_identity": [round(x, 4) for x in self.identity_kl[L:].tolist()],
                                "step_size_factor": sel(self.lr_scale[L:])}
            if "validation_kl_start" in selection:
                selection["mid"]["validation_kl_start"] = [round(x, 4) for x in self.start_kl[L:].tolist()]
        return selection

    def tensors(self) -> dict:
        return {"best.A": self.A, "best.b": self.b, "best.kl": self.kl, "best.step": self.step,
                "best.identity_kl": self.identity_kl,
                "best.start_kl": self.start_kl, "best.lr_scale": self.lr_scale, "best.fails": self.fails}

    def load(self, t: dict) -> None:
        self.A, self.b, self.kl, self.step = t["best.A"], t["best.b"], t["best.kl"], t["best.step"]
        self.identity_kl, self.lr_scale, self.fails = t["best.identity_kl"], t["best.lr_scale"], t["best.fails"]
        self.start_kl = t.get("best.start_kl", torch.full_like(self.identity_kl, float("nan")))


__all__ = ["BestPerState", "split_validation"]
