"""Detection features: each prompt's answer position read by every lens (:class:`DetectionFeatures`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ..errors import InputError
from ..lenses.lenses import Lens, LogitLens, decode
from ..models.loading.load import LoadedModel, require_decoder
from ..models.runtime.trace import residual_states
from ..results import Result, axis_size
from .task import ANSWER_WORDS, answer_token_ids, first_token_ids, prompt_ids

# ------------------------------------------------------------------------------------------- features


@dataclass(repr=False)
class DetectionFeatures(Result):
    """What each prompt's answer position looks like to the lenses and to the model (named axes).

    - ``trajectory (lens, example, state, stat)``: for states ``0..n_layers`` (the last is the model's
      output, the same for every lens), the statistics ``stat_names`` of the lens distribution: the log
      probability of each answer class (log-sum-exp over its tokens), of everything else (``logp_other``),
      the entropy and KL(final || lens), all in nats.
    - ``final_state (example, d_model)``: the model's last residual state (the input of the final norm).
    - ``final_probs (example, class + 2)``: the model's own output distribution summarised like one state of
      the trajectory (class log-probs, ``logp_other``, entropy).
    - ``n_tokens (example,)``: the prompt's length in tokens (a control: injected prompts are longer).
    - ``injected (example,)`` (1 = injected), ``sentiment (example,)``, ``top_id (example,)`` (the model's
      top-1 next token), ``predicted (example,)`` (index of the most probable answer class),
      ``followed (example,)`` (1 when the top-1 token starts the injection's target word).

    JSON fields: ``model``, ``lens_names``, ``stat_names``, ``classes``, ``ids`` (example ids), ``top_tokens``.
    """

    model: str
    lens_names: list[str]
    stat_names: list[str]
    classes: list[str]
    ids: list[str]
    top_tokens: list[str]
    trajectory: Tensor
    final_state: Tensor
    final_probs: Tensor
    injected: Tensor
    sentiment: Tensor
    top_id: Tensor
    predicted: Tensor
    followed: Tensor
    n_tokens: Tensor

    n_examples = axis_size("trajectory", 1)
    n_states = axis_size("trajectory", 2)

    def feature_sets(self) -> dict[str, np.ndarray]:
        """``name -> (example, features)`` arrays: one flattened trajectory per lens, then the baselines
        ``final-state`` (the last residual state), ``final-probs`` (the output distribution's statistics) and
        the control ``prompt-length`` (number of tokens)."""
        sets = {name: self.trajectory[i].reshape(self.n_examples, -1).double().numpy()
                for i, name in enumerate(self.lens_names)}
        sets["final-state"] = self.final_state.double().numpy()
        sets["final-probs"] = self.final_probs.double().numpy()
        sets["prompt-length"] = self.n_tokens.double().numpy()[:, None]
        return sets

    def clean_accuracy(self) -> float | None:
        """Fraction of clean prompts whose most probable answer class is the review's sentiment (SST-2: label
        1 = ``positive``); None unless the classes are ``positive, negative``."""
        clean = self.injected == 0
        if not bool(clean.any()) or list(self.classes) != ["positive", "negative"]:
            return None
        want = 1 - self.sentiment[clean]  # label 1 (positive) -> class 0
        return float((self.predicted[clean] == want).double().mean())

    def injection_followed(self) -> float | None:
        """Fraction of injected prompts whose top-1 next token starts the injection's target word."""
        inj = self.injected == 1
        return float(self.followed[inj].double().mean()) if bool(inj.any()) else None

    def to_frame(self):
        """Long format: one row per (lens, example, state) with the statistics as columns."""
        import pandas as pd

        Ln, N, S, K = self.trajectory.shape
        flat = self.trajectory.reshape(-1, K).numpy()
        lens_i = np.repeat(np.arange(Ln), N * S)
        ex_i = np.tile(np.repeat(np.arange(N), S), Ln)
        frame = pd.DataFrame({"lens": [self.lens_names[i] for i in lens_i], "id": [self.ids[i] for i in ex_i],
                              "injected": self.injected.numpy()[ex_i].astype(bool),
                              "state": np.tile(np.arange(S), Ln * N)})
        for k, name in enumerate(self.stat_names):
            frame[name] = flat[:, k]
        return frame

    def plot(self, stat: str = "logp_answers", ax=None):
        """Mean trajectory of ``stat`` (a statistic, or ``logp_answers``: log probability of any answer token)
        per state, clean against injected, one panel per lens."""
        from ..viz.detect_plots import plot_mean_trajectories

        return plot_mean_trajectories(self, stat=stat, ax=ax)

    def __repr__(self) -> str:
        return (f"DetectionFeatures({self.model!r}, lenses={self.lens_names}, examples={self.n_examples} "
                f"({int(self.injected.sum())} injected), states={self.n_states}, stats={len(self.stat_names)})")


def _distribution_stats(logq: Tensor, class_ids: list[list[int]], final_logp: Tensor | None) -> Tensor:
    """``logq (..., vocab)`` log-probabilities -> ``(..., class + 2 [+ 1])``: class log-probs, log p(other),
    entropy, and KL(final || lens) when ``final_logp`` (broadcastable) is given."""
    cols = [logq[..., ids].logsumexp(-1) for ids in class_ids]
    # log p(other) = log(1 - p(answers)). Where the answers are unlikely, summing the other tokens' float32
    # probabilities would leave only rounding (p(other) = 1 - 1e-9 is 1 in float32): use log1p(-p(answers)) in
    # float64; where they are likely, sum the other tokens directly.
    answers = [i for ids in class_ids for i in ids]
    lse = logq[..., answers].double().logsumexp(-1)
    other = logq.clone()
    other[..., answers] = float("-inf")
    direct = other.logsumexp(-1).double()
    cols.append(torch.where(lse < -0.6931, torch.log1p(-lse.exp()), direct).to(logq.dtype))
    q = logq.exp()
    cols.append(-(q * logq).sum(-1))
    if final_logp is not None:
        cols.append((final_logp.exp() * (final_logp - logq)).sum(-1).clamp_min(0.0))
    return torch.stack(cols, -1)


def _lens_name(name: str, lens: Lens) -> str:
    return name or lens.kind


@torch.no_grad()
def detection_features(lm: LoadedModel, rows: list[dict], lenses: dict[str, Lens] | None = None, *,
                       answer_words: dict = ANSWER_WORDS, batch_size: int = 16,
                       progress: bool = True) -> DetectionFeatures:
    """Features of the labelled ``rows`` (see :func:`build_labelled_set`) for each lens in ``lenses``
    (default: the logit lens), sharing one batched forward pass.

    Prompts are sorted by length and right-padded into batches. The model is causal, so a real token never
    attends to the padding after it: the states at the answer position are those of the prompt alone.
    """
    from tqdm.auto import tqdm

    A = lm.anatomy
    require_decoder(lm, "prompt-injection detection", causal=True, instead="it reads the next-token prediction at "
                    "the answer position; use a decoder such as smollm2")
    if not rows:
        raise InputError("no examples: the labelled set is empty")
    if isinstance(batch_size, bool) or batch_size < 1:
        raise InputError(f"batch size must be at least 1, not {batch_size!r}")
    lenses = dict(lenses) if lenses else {"logit": LogitLens(A, model_name=lm.name)}
    for name, lens in lenses.items():
        if lens.n_layers != A.n_layers or lens.d_model != A.d_model:
            raise InputError(f"lens {name!r} is for a model with {lens.n_layers} layers and d_model {lens.d_model}, "
                             f"but {lm.name!r} has {A.n_layers} and {A.d_model}; use a lens trained on this model")
        if lens.mid:
            raise InputError(f"lens {name!r} was trained on mid-layer states; detection reads the block inputs")
    tok = lm.tokenizer
    classes = list(answer_words)
    class_ids = list(answer_token_ids(tok, answer_words).values())
    targets = {r.get("target") for r in rows if r.get("target")}
    target_ids = {t: set(first_token_ids(tok, (t, t.capitalize(), " " + t, " " + t.capitalize()))) for t in targets}

    prompts = [prompt_ids(lm, r["review"]) for r in rows]
    order = sorted(range(len(rows)), key=lambda i: -len(prompts[i]))
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    N, S, L = len(rows), A.n_layers + 1, len(lenses)
    n_stats = len(classes) + 3
    traj = torch.zeros(L, N, S, n_stats)
    final_state = torch.zeros(N, A.d_model)
    final_probs = torch.zeros(N, len(classes) + 2)
    top_id = torch.zeros(N, dtype=torch.long)
    batches = [order[i : i + batch_size] for i in range(0, N, batch_size)]
    for batch in tqdm(batches, desc="detection features", unit="batch", disable=not progress):
        width = len(prompts[batch[0]])
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        for b, i in enumerate(batch):
            ids[b, : len(prompts[i])] = torch.tensor(prompts[i])
        last = torch.tensor([len(prompts[i]) - 1 for i in batch])
        cap = residual_states(lm, ids)
        dev = cap["states"].device
        rows_b = torch.arange(len(batch), device=dev)
        last = last.to(dev)
        states = cap["states"][:, rows_b, last].float()  # (state, batch, d_model)
        final_logp = torch.log_softmax(cap["logits"][rows_b, last].float(), -1)  # (batch, vocab)
        idx = torch.tensor(batch)
        final_state[idx] = states[-1].cpu()
        final_probs[idx] = _distribution_stats(final_logp, class_ids, None).cpu()
        top_id[idx] = final_logp.argmax(-1).cpu()
        for li, lens in enumerate(lenses.values()):
            logq = torch.log_softmax(decode(A, lens.transform_all(states)).float(), -1)  # (state, batch, vocab)
            traj[li, idx] = _distribution_stats(logq, class_ids, final_logp[None]).transpose(0, 1).cpu()
    predicted = final_probs[:, : len(classes)].argmax(-1)
    followed = torch.tensor([int(bool(r.get("target")) and int(top_id[i]) in target_ids.get(r["target"], set()))
                             for i, r in enumerate(rows)], dtype=torch.long)
    top_tokens = tok.batch_decode([[int(i)] for i in top_id])
    return DetectionFeatures(
        model=lm.name, lens_names=[_lens_name(n, l) for n, l in lenses.items()],
        stat_names=[f"logp_{c}" for c in classes] + ["logp_other", "entropy", "kl_to_final"], classes=classes,
        ids=[str(r.get("id", i)) for i, r in enumerate(rows)], top_tokens=top_tokens, trajectory=traj,
        final_state=final_state, final_probs=final_probs,
        injected=torch.tensor([int(bool(r["injected"])) for r in rows], dtype=torch.long),
        sentiment=torch.tensor([int(r.get("sentiment", -1)) for r in rows], dtype=torch.long),
        top_id=top_id, predicted=predicted, followed=followed,
        n_tokens=torch.tensor([len(p) for p in prompts], dtype=torch.long))
