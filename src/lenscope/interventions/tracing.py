"""Causal tracing (Meng et al. 2022, "Locating and Editing Factual Associations in GPT").

Corrupt the subject: add Gaussian noise ``ν·ε`` (``ε ~ N(0, I)``, one draw per sample) to the residual stream
entering block 0 (the input embeddings, with whatever the model adds before block 0) at the subject's tokens.
``ν = 3 × std`` of those input embeddings over the tokens of a corpus text (cached per model and corpus).
Then restore one clean state at a time and read the probability of the target at the last token:

- ``resid[l, p]``: the residual stream entering block ``l`` at token ``p``;
- ``mlp[l, p]``: the MLP outputs of the layers ``l - window//2 .. l + ceil(window/2) - 1`` (clipped) at ``p``;
- ``attn[l, p]``: the attention outputs of the same window of layers at ``p``.

``AIE = mean_s P_restored,s[o] - mean_s P_corrupted,s[o]``. Every (sample, restoration) pair is one batch row.
For causal models, tokens before the first subject token never see the noise: restoring them changes nothing,
so their rows are not run and their AIE is exactly 0.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from ..errors import InputError
from ..models.loading.load import LoadedModel, encode, require_decoder, token_str
from ..models.loading.tokenizer import TINY_CORPUS
from ..models.runtime.engine import Edit, batches, run
from ..models.runtime.request import Request, token_texts
from ..models.runtime.sites import PART_SITES
from ..results import Result
from .patching import patch_edits

KINDS = ("resid", "mlp", "attn")
DEFAULT_CORPUS = TINY_CORPUS
_STD_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {(corpus, ...): std}


@dataclass(repr=False)
class CausalTrace(Result):
    """A causal trace of one prompt.

    - ``resid, mlp, attn (layer, pos)``: the average indirect effect of restoring that clean state
    - ``p_clean``, ``p_corrupted``: the target's probability on the clean prompt, and averaged over the noise
    - ``subject_positions``: the corrupted tokens; ``noise_scale``: ν
    """

    resid: Tensor
    mlp: Tensor
    attn: Tensor
    tokens: list[str]
    subject: str
    subject_positions: list[int]
    target: str
    target_id: int
    p_clean: float
    p_corrupted: float
    noise_scale: float
    samples: int
    window: int
    seed: int
    model: str = ""
    info: dict = field(default_factory=dict)

    def to_frame(self):
        import pandas as pd

        L, P = self.resid.shape
        rows = []
        for kind in KINDS:
            vals = getattr(self, kind)
            for layer in range(L):
                for p in range(P):
                    rows.append({"kind": kind, "layer": layer, "pos": p, "token": self.tokens[p],
                                 "subject": p in self.subject_positions, "aie": float(vals[layer, p])})
        return pd.DataFrame(rows)

    def to_dict(self) -> dict:
        return {
            "model": self.model, "tokens": self.tokens, "subject": self.subject,
            "subject_positions": self.subject_positions, "target": self.target, "target_id": self.target_id,
            "p_clean": self.p_clean, "p_corrupted": self.p_corrupted, "noise_scale": self.noise_scale,
            "samples": self.samples, "window": self.window, "seed": self.seed, "axes": ["layer", "pos"],
            "resid": self.resid.tolist(), "mlp": self.mlp.tolist(), "attn": self.attn.tolist(),
        }

    def plot(self):
        from ..viz.intervention_plots import heatmaps

        cols = [t + ("*" if i in self.subject_positions else "") for i, t in enumerate(self.tokens)]
        panels = [("residual stream", self.resid), (f"MLP (window {self.window})", self.mlp),
                  (f"attention (window {self.window})", self.attn)]
        title = (f"Causal trace of {self.target!r}: p_clean {self.p_clean:.3f}, p_corrupted {self.p_corrupted:.3f} "
                 f"(* = subject)")
        return heatmaps(panels, cols, title, "AIE")

    def __repr__(self) -> str:
        return (f"CausalTrace(target={self.target!r}, subject_positions={self.subject_positions}, "
                f"p_clean={self.p_clean:.4f}, p_corrupted={self.p_corrupted:.4f}, layers={self.resid.shape[0]})")


def subject_positions(lm: LoadedModel, prompt: str, subject: str) -> list[int]:
    """The tokens of ``prompt`` (as :func:`encode` gives them) that overlap the first occurrence of ``subject``,
    found with the tokenizer's character offsets."""
    if not subject or not subject.strip():
        raise InputError("the subject is empty; give the words of the prompt to corrupt")
    start = prompt.find(subject)
    if start < 0:
        raise InputError(f"the subject {subject!r} does not occur in the prompt {prompt!r}")
    end = start + len(subject)
    try:
        enc = lm.tokenizer(prompt, return_offsets_mapping=True)
    except NotImplementedError:
        raise InputError("this tokenizer gives no character offsets (a fast tokenizer is needed)") from None
    offs = enc["offset_mapping"]
    ids = enc["input_ids"]
    if list(ids) != encode(lm, prompt).tolist():
        raise InputError("the tokenizer's offsets do not match the prompt's tokens")
    pos = [i for i, (a, b) in enumerate(offs) if b > a and a < end and b > start]
    if not pos:
        raise InputError(f"no token of the prompt covers the subject {subject!r}")
    return pos


@torch.no_grad()
def embedding_std(lm: LoadedModel, corpus: str | Path | None = None, *, max_tokens: int = 4096,
                  seq_len: int = 128) -> float:
    """The standard deviation (over tokens and dimensions) of the residual stream entering block 0 on the
    tokens of a corpus text (default: the package's tiny corpus). Cached per model and corpus."""
    path = Path(corpus) if corpus is not None else DEFAULT_CORPUS
    key = (str(path.resolve()), max_tokens, seq_len)
    cache = _STD_CACHE.setdefault(lm.model, {})  # weak: a freed model's id can be reused by another one
    if key in cache:
        return cache[key]
    if not path.exists():
        raise InputError(f"no such corpus file: {path}")
    text = path.read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        raise InputError(f"the corpus {path} is empty")
    ids = lm.tokenizer(text[: 20 * max_tokens], add_special_tokens=False)["input_ids"][:max_tokens]
    if not ids:
        raise InputError(f"the corpus {path} gives no tokens")
    seq_len = min(seq_len, lm.anatomy.n_ctx)
    chunks = [torch.tensor(ids[s:e]) for s, e in batches(len(ids), seq_len)]
    states = []
    for c in chunks:
        _, got = run(lm, c[None], capture=[("resid_pre", 0)], stop_after=("resid_pre", 0))
        states.append(got[("resid_pre", 0)].reshape(-1).float())
    std = float(torch.cat(states).std())
    cache[key] = std
    return std


def window_layers(layer: int, window: int, n_layers: int) -> list[int]:
    """The layers restored together around ``layer`` (as in ROME: ``layer - window//2`` up to
    ``layer + ceil(window/2) - 1``, clipped to the model)."""
    return list(range(max(0, layer - window // 2), min(n_layers, layer - (-window // 2))))


@torch.no_grad()
def causal_trace(lm: LoadedModel, prompt: str, subject: str, target=None, *, samples: int = 10, window: int = 10,
                 noise: float | None = None, corpus: str | Path | None = None, seed: int = 0, batch_size: int = 64,
                 kinds=KINDS) -> CausalTrace:
    """Causal tracing of ``target`` (default: the model's top prediction) after ``prompt``, corrupting the
    tokens of ``subject``. Returns a :class:`CausalTrace` with ``resid, mlp, attn (layer, pos)`` AIEs (kinds
    left out of ``kinds`` are zeros and not run)."""
    require_decoder(lm, "causal tracing", instead="use a model with a language-model head")
    if samples < 1 or window < 1 or batch_size < 1:
        raise InputError("samples, window and batch_size must be at least 1")
    ids = encode(lm, prompt)
    P = ids.numel()
    L = lm.anatomy.n_layers
    subj = subject_positions(lm, prompt, subject)
    nu = 3.0 * embedding_std(lm, corpus) if noise is None else float(noise)
    keys = [(PART_SITES[s], layer) for s in ("resid", "attn", "mlp") for layer in range(L)]
    logits, clean = run(lm, ids[None], capture=keys)
    probs = logits[0, -1].float().softmax(-1)
    tid = Request.of(lm, target).or_top(probs).target
    p_clean = float(probs[tid])
    clean = {k: v[0] for k, v in clean.items()}  # (pos, d_model)

    g = torch.Generator().manual_seed(seed)
    d = clean[("resid_pre", 0)].shape[-1]
    eps = torch.randn(samples, len(subj), d, generator=g) * nu  # (sample, subject token, d_model)
    eps = eps.to(clean[("resid_pre", 0)].device, clean[("resid_pre", 0)].dtype)
    subj_t = torch.tensor(subj)

    # restorations: (kind index, layer, pos); -1 = none (the corrupted run)
    first = min(subj) if lm.anatomy.causal else 0
    rest = [(-1, 0, 0)] + [(k, layer, p) for k, kind in enumerate(KINDS) if kind in kinds
                           for layer in range(L) for p in range(first, P)]
    R = len(rest)
    spec = torch.tensor(rest, dtype=torch.long)  # (restoration, 3)
    rows_all = torch.arange(R * samples)  # row = restoration * samples + sample
    out = torch.empty(R * samples)
    for s, e in batches(R * samples, batch_size):
        n = e - s
        r_idx = rows_all[s:e] // samples
        s_idx = rows_all[s:e] % samples
        local = torch.arange(n)
        # the noise first, then any restoration at the same site overrides it
        edits = [Edit("resid_pre", 0, local.repeat_interleave(len(subj)), subj_t.repeat(n),
                      eps[s_idx].reshape(-1, d), mode="add")]
        restore = []  # (row, node, clean value): the restorations, patched from the clean run
        for row, (k, layer, p) in enumerate(spec[r_idx].tolist()):
            if k < 0:
                continue
            site = PART_SITES[KINDS[k]]
            for lw in [layer] if KINDS[k] == "resid" else window_layers(layer, window, L):
                restore.append((row, (site, lw, p, None), clean[(site, lw)]))
        edits += patch_edits(restore, P)
        lg, _ = run(lm, ids[None].expand(n, P), edits)
        out[s:e] = lg[:, -1].float().softmax(-1)[:, tid].cpu()
    per = out.reshape(R, samples).mean(1)
    p_corr = float(per[0])
    maps = {kind: torch.zeros(L, P) for kind in KINDS}
    for k, kind in enumerate(KINDS):
        sel = (spec[:, 0] == k).nonzero()[:, 0]
        if sel.numel():
            maps[kind][spec[sel, 1], spec[sel, 2]] = per[sel] - p_corr
    return CausalTrace(
        resid=maps["resid"], mlp=maps["mlp"], attn=maps["attn"], tokens=token_texts(lm, ids), subject=subject,
        subject_positions=subj, target=token_str(lm, tid), target_id=tid, p_clean=p_clean, p_corrupted=p_corr,
        noise_scale=nu, samples=samples, window=window, seed=seed, model=lm.name,
    )
