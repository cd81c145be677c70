"""Training text for sparse dictionaries, streamed: documents from plain or gzip text files (the shared corpus:
documents separated by ``<|endoftext|>`` lines), a fixed held-out part, and packed token sequences.

- :func:`corpus_files`: ``--data`` as files: a file, or a folder's ``*.txt`` / ``*.txt.gz`` files (the shared
  ``corpus/`` folder: Wikipedia and Gutenberg, interleaved document by document).
- :func:`documents`: the documents of one part, ``"train"`` or ``"heldout"``: document ``i`` (counted over the
  interleaved stream) is held out when ``i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1`` (one in 20), so nothing a
  dictionary trained on is ever evaluated on. A file without separators is cut into pseudo-documents of about
  :data:`PSEUDO_DOC_CHARS` characters at paragraph breaks.
- :func:`token_batches`: the part's documents tokenised and packed into sequences ``(n, seq_len)``, each opening
  with the tokenizer's special tokens (BOS) as one text would, documents joined by the end-of-text token; the
  order is fixed, so ``skip`` sequences resumes a stream where it stopped.
"""

from __future__ import annotations

import gzip
from collections.abc import Iterator
from pathlib import Path

import torch

from ..errors import InputError

SEPARATOR = "<|endoftext|>"
HOLDOUT_EVERY = 20
PSEUDO_DOC_CHARS = 8000
PARTS = ("train", "heldout", "all")


def corpus_files(path: str | Path) -> list[Path]:
    """The text files ``path`` names: itself, or the ``*.txt`` and ``*.txt.gz`` files of a folder (sorted)."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and (p.name.endswith(".txt") or
                                                                     p.name.endswith(".txt.gz")))
        if not files:
            raise InputError(f"{path} holds no .txt or .txt.gz file")
        return files
    if not path.is_file():
        raise InputError(f"data file not found: {path}")
    return [path]


def _lines(path: Path) -> Iterator[str]:
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8", errors="replace") as f:
            yield from f
    except (OSError, EOFError) as e:
        raise InputError(f"cannot read {path}: {e}") from None


def _file_documents(path: Path) -> Iterator[str]:
    """The documents of one file: split at ``<|endoftext|>`` lines, or, where there is none, cut at paragraph
    breaks into pieces of about :data:`PSEUDO_DOC_CHARS` characters."""
    buf: list[str] = []
    size = 0
    for line in _lines(path):
        if line.rstrip("\n") == SEPARATOR:
            doc = "".join(buf).rstrip("\n")
            buf, size = [], 0
            if doc.strip():
                yield doc
            continue
        buf.append(line)
        size += len(line)
        if size >= PSEUDO_DOC_CHARS and not line.strip():  # a paragraph break in a long run without separators
            doc = "".join(buf).rstrip("\n")
            buf, size = [], 0
            if doc.strip():
                yield doc
    doc = "".join(buf).rstrip("\n")
    if doc.strip():
        yield doc


def documents(path: str | Path, part: str = "train") -> Iterator[str]:
    """The documents of ``part`` (``train``, ``heldout`` or ``all``), the files interleaved document by document."""
    if part not in PARTS:
        raise InputError(f"part must be one of {', '.join(PARTS)}; got {part!r}")
    streams = [_file_documents(p) for p in corpus_files(path)]
    i = 0
    any_doc = False
    while streams:
        alive = []
        for s in streams:
            doc = next(s, None)
            if doc is None:
                continue
            alive.append(s)
            any_doc = True
            held = i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1
            i += 1
            if part == "all" or held == (part == "heldout"):
                yield doc
        streams = alive
    if not any_doc:
        raise InputError(f"the data at {path} holds no text")


def token_batches(tokenizer, path: str | Path, *, seq_len: int, batch_size: int, part: str = "train",
                  skip: int = 0, max_sequences: int | None = None) -> Iterator[torch.Tensor]:
    """Packed token sequences ``(batch_size, seq_len)`` (the last batch may be smaller) of ``part``'s documents,
    after skipping the first ``skip`` sequences; at most ``max_sequences`` sequences (counting the skipped)."""
    from .text import _special_affixes

    pre, post = _special_affixes(tokenizer)
    body = seq_len - len(pre) - len(post)
    if body < 1:
        raise InputError(f"seq_len {seq_len} is too short for this tokenizer's special tokens")
    if batch_size < 1:
        raise InputError("batch_size must be at least 1")
    sep = [tokenizer.eos_token_id] if getattr(tokenizer, "eos_token_id", None) is not None else []
    pending: list[int] = []
    rows: list[list[int]] = []
    n = 0
    produced = False
    for doc in documents(path, part):
        pending.extend(tokenizer(doc, add_special_tokens=False)["input_ids"])
        pending.extend(sep)
        while len(pending) >= body:
            seq, pending = pending[:body], pending[body:]
            if max_sequences is not None and n >= max_sequences:
                break
            n += 1
            if n <= skip:
                continue
            rows.append(pre + seq + post)
            if len(rows) == batch_size:
                produced = True
                yield torch.tensor(rows, dtype=torch.long)
                rows = []
        if max_sequences is not None and n >= max_sequences:
            break
    if rows:
        produced = True
        yield torch.tensor(rows, dtype=torch.long)
    if not produced and skip == 0:
        raise InputError(f"the {part} part of {path} holds fewer than {body} tokens: not one sequence of {seq_len}")


__all__ = ["HOLDOUT_EVERY", "PARTS", "SEPARATOR", "corpus_files", "documents", "token_batches"]
