"""Plain text files -> token sequences for lens training and evaluation; :func:`fit_seq_len`, the one place a
sequence length meets the model's context."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from ..errors import InputError
from ..models.loading.load import LoadedModel


def read_text(path: str | Path) -> str:
    path = Path(path)
    if not path.is_file():
        raise InputError(f"data file not found: {path}")
    text = path.read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        raise InputError(f"data file is empty: {path}")
    return text


def split_text(text: str, part: str = "all", train_fraction: float = 0.8) -> str:
    """``train``: the first ``train_fraction`` of the characters (cut at the next line break), ``eval``: the rest."""
    if part == "all":
        return text
    if part not in ("train", "eval"):
        raise InputError(f"part must be 'train', 'eval' or 'all', not {part!r}")
    at = int(len(text) * train_fraction)
    cut = text.find("\n", at)
    if cut < 0:  # no line break after the cut point: cut at a space, else exactly there
        cut = text.find(" ", at)
        cut = at if cut < 0 else cut
    return text[:cut] if part == "train" else text[cut:]


def _special_affixes(tok) -> tuple[list[int], list[int]]:
    """Tokens the tokenizer adds around a text (e.g. BOS), found by comparing with and without them."""
    probe = "lenscope probe text"
    plain = tok(probe, add_special_tokens=False)["input_ids"]
    full = tok(probe)["input_ids"]
    for i in range(len(full) - len(plain) + 1):
        if full[i : i + len(plain)] == plain:
            return full[:i], full[i + len(plain) :]
    return [], []


special_affixes = _special_affixes  # the public name, for other packages (features: the positions to leave out)

DEFAULT_SEQ_LEN = 256  # tokens per sequence when the user gives none (the model's context when shorter)
_noted: set = set()  # (model, context) pairs whose shortened default was already said on stderr


def fit_seq_len(lm: LoadedModel, seq_len: int | None = None, *, option: str = "--seq-len") -> int:
    """The length to cut text into for ``lm``: ``seq_len`` when given (one-line :class:`InputError` naming
    ``option`` when it is longer than the model's context); else :data:`DEFAULT_SEQ_LEN`, or the model's context
    when that is shorter (said once per model on stderr). Every command and function with a default sequence
    length resolves it here (``None`` is the default)."""
    n_ctx = int(lm.anatomy.n_ctx)
    if seq_len is None:
        if n_ctx < DEFAULT_SEQ_LEN and (lm.name, n_ctx) not in _noted:
            _noted.add((lm.name, n_ctx))
            print(f"lenscope: sequences of {n_ctx} tokens, {lm.name}'s context (the default {option} "
                  f"{DEFAULT_SEQ_LEN} is longer)", file=sys.stderr, flush=True)
        return min(DEFAULT_SEQ_LEN, n_ctx)
    seq_len = int(seq_len)
    if seq_len < 2:
        raise InputError(f"{option} must be at least 2; got {seq_len}")
    if seq_len > n_ctx:
        raise InputError(f"{option} {seq_len} is longer than {lm.name}'s context of {n_ctx} tokens; give {option} "
                         f"{n_ctx} or less (or leave it out: the default fits the context)")
    return seq_len


def token_sequences(lm: LoadedModel, text: str, seq_len: int | None = None,
                    max_tokens: int | None = None) -> torch.Tensor:
    """Tokenise ``text`` and cut it into sequences ``(n_seq, seq_len)``, each wrapped in the tokenizer's
    special tokens (e.g. BOS, which Gemma needs) like a single text would be; ``seq_len``: :func:`fit_seq_len`."""
    seq_len = fit_seq_len(lm, seq_len)
    tok = lm.tokenizer
    pre, post = _special_affixes(tok)
    body = seq_len - len(pre) - len(post)
    if body < 1:
        raise InputError(f"seq_len {seq_len} is too short for this tokenizer's special tokens")
    ids: list[int] = []
    chunk = 200_000  # characters per tokenizer call, cut at line breaks
    start = 0
    while start < len(text):
        end = text.find("\n", start + chunk)
        end = len(text) if end < 0 else end + 1
        ids.extend(tok(text[start:end], add_special_tokens=False)["input_ids"])
        start = end
        if max_tokens is not None and len(ids) >= max_tokens * body / seq_len + body:
            break
    n = len(ids) // body
    if max_tokens is not None:
        n = min(n, max(1, -(-max_tokens // seq_len)))
    if n == 0:
        raise InputError(f"the text has {len(ids)} tokens, fewer than one sequence of {seq_len}")
    seqs = torch.tensor(ids[: n * body], dtype=torch.long).reshape(n, body)
    parts = [torch.tensor(pre, dtype=torch.long).expand(n, -1), seqs,
             torch.tensor(post, dtype=torch.long).expand(n, -1)]
    return torch.cat(parts, dim=1)
