"""Plain text files -> token sequences for lens training and evaluation."""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import InputError
from ..models.load import LoadedModel


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


def token_sequences(lm: LoadedModel, text: str, seq_len: int, max_tokens: int | None = None) -> torch.Tensor:
    """Tokenise ``text`` and cut it into sequences ``(n_seq, seq_len)``, each wrapped in the tokenizer's
    special tokens (e.g. BOS, which Gemma needs) like a single text would be."""
    tok = lm.tokenizer
    pre, post = _special_affixes(tok)
    body = seq_len - len(pre) - len(post)
    if body < 1:
        raise InputError(f"seq_len {seq_len} is too short for this tokenizer's special tokens")
    if seq_len > lm.anatomy.n_ctx:
        raise InputError(f"seq_len {seq_len} exceeds the model's context of {lm.anatomy.n_ctx}")
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
