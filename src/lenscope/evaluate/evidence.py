"""From an :class:`~lenscope.data.datasets.Example` to what a model needs: token ids of the context, the
target and foil token ids, and the token positions of the evidence.

- The continuation is the word after a space: the tokens that ``prefix + " " + word`` has beyond the prefix's
  own tokens (so SentencePiece tokenizers that prepend a space marker to every text do not add a stray one;
  if the word merges with the prefix's last token, ``" " + word`` is tokenised alone). Where target
  and foil share their first tokens (``" grocery store"`` / ``" grocery stores"``), the shared tokens are
  appended to the context and the contrast is the first token where they differ.
- Evidence words are found in the prefix as whole words (case-sensitive), every occurrence, and mapped to the
  tokens whose character span overlaps them (the tokenizer's offsets; a word split into several tokens gives
  all of them, a token carrying a leading space counts). This works the same for byte-level BPE and
  SentencePiece tokenizers. Tokenizers without offsets fall back to spans measured by decoding prefixes.
- Special tokens (a BOS) are never ranked: an explanation is judged on the text's own tokens.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..data.datasets import Example


@dataclass
class Prepared:
    """A tokenised example. ``ids``: the context (prefix tokens plus any shared continuation tokens);
    ``rankable``: positions that take part in the ranking (not special tokens); ``evidence``: evidence
    positions (a subset of ``rankable``), empty when the example has none; ``skip``: why it cannot be used for
    alignment (None if it can); ``usable``: False when not even accuracy can be measured."""

    ids: list[int]
    tokens: list[str]
    target_id: int | None
    foil_id: int | None
    rankable: list[int]
    evidence: list[int] = field(default_factory=list)
    shared: int = 0
    skip: str | None = None
    usable: bool = True
    missing: list = field(default_factory=list)  # evidence items not found (others were)

    @property
    def n(self) -> int:
        return len(self.ids)


def word_spans(text: str, word: str) -> list[tuple[int, int]]:
    """Character spans ``[start, end)`` of every whole-word occurrence of ``word`` in ``text``."""
    return [(m.start(), m.end()) for m in re.finditer(rf"(?<!\w){re.escape(word)}(?!\w)", text)]


def token_offsets(tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]], list[int]]:
    """``(ids, offsets, special_mask)`` of ``text`` with the tokenizer's special tokens."""
    try:
        enc = tokenizer(text, return_offsets_mapping=True, return_special_tokens_mask=True)
        offsets = [tuple(o) for o in enc["offset_mapping"]]
        return list(enc["input_ids"]), offsets, list(enc["special_tokens_mask"])
    except (NotImplementedError, ValueError, TypeError, KeyError):
        pass
    enc = tokenizer(text, return_special_tokens_mask=True)
    ids, special = list(enc["input_ids"]), list(enc["special_tokens_mask"])
    offsets, pos = [], 0
    for k in range(len(ids)):  # decode growing prefixes of the non-special tokens
        if special[k]:
            offsets.append((pos, pos))
            continue
        kept = [i for i, s in zip(ids[: k + 1], special[: k + 1]) if not s]
        end = len(tokenizer.decode(kept, clean_up_tokenization_spaces=False))
        offsets.append((pos, end))
        pos = end
    return ids, offsets, special


def evidence_positions(tokenizer, text: str, evidence) -> tuple[list[int], list[int], list[int], list[str]]:
    """``(ids, evidence positions, rankable positions, words not found)`` for ``text``. Every whole-word
    occurrence of every evidence item is mapped to the tokens its characters overlap."""
    ids, offsets, special = token_offsets(tokenizer, text)
    rankable = [k for k in range(len(ids)) if not special[k]]
    pos: set[int] = set()
    missing = []
    for word in evidence or ():
        spans = word_spans(text, word)
        if not spans:
            missing.append(word)
        for a, b in spans:
            pos.update(k for k in rankable if offsets[k][0] < b and offsets[k][1] > a)
    return ids, sorted(pos), rankable, missing


def sentence_ids(tokenizer, text: str) -> list[int]:
    """Token ids of a whole sentence, starting with a special token (the tokenizer's own BOS, else its BOS or
    EOS token prepended) so that the first word's probability is counted too."""
    enc = tokenizer(text, return_special_tokens_mask=True)
    ids = list(enc["input_ids"])
    if not enc["special_tokens_mask"] or not enc["special_tokens_mask"][0]:
        start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        if start is not None:
            ids = [start] + ids
    return ids


def prepare(lm, ex: Example) -> Prepared:
    """Tokenise ``ex`` for ``lm`` (see the module docstring)."""
    tok = lm.tokenizer
    if ex.info.get("unusable"):
        return Prepared([], [], None, None, [], skip=ex.info["unusable"], usable=False)
    if ex.info.get("sentence_pair"):  # accuracy only, by whole-sentence log-probability
        ids = sentence_ids(tok, ex.target)
        return Prepared(ids, [], None, None, [], skip="sentence pair (accuracy only)",
                        usable=max(len(ids), len(sentence_ids(tok, ex.foil))) <= lm.anatomy.n_ctx)
    prefix = ex.prefix.rstrip()
    ids, ev, rankable, missing = evidence_positions(tok, prefix, ex.evidence)

    def cont(word: str) -> list[int]:
        word = word if word[:1].isspace() else " " + word
        full = list(tok(prefix + word)["input_ids"])
        if full[: len(ids)] == ids and len(full) > len(ids):  # the usual case: the prefix's tokens, then the word's
            return full[len(ids):]
        return list(tok(word, add_special_tokens=False)["input_ids"])  # the word merged across the boundary

    t, f = cont(ex.target), cont(ex.foil)
    k = 0
    while k < min(len(t), len(f)) and t[k] == f[k]:
        k += 1
    tokens = lambda xs: tok.batch_decode([[i] for i in xs])
    if k == min(len(t), len(f)):
        return Prepared(ids, tokens(ids), None, None, rankable, skip=(
            f"target {ex.target!r} and foil {ex.foil!r} do not differ in a token (one tokenises as the start of "
            "the other)"), usable=False)
    ctx = ids + t[:k]
    rankable = rankable + list(range(len(ids), len(ctx)))
    if len(ctx) > lm.anatomy.n_ctx:
        return Prepared(ctx, tokens(ctx), t[k], f[k], rankable, skip="longer than the model's context", usable=False)
    p = Prepared(ctx, tokens(ctx), t[k], f[k], rankable, ev, shared=k)
    if ex.evidence is None:
        p.skip = "no evidence"
    elif not ev:
        p.skip = "evidence not found in the prefix"
    elif len(rankable) < 2:
        p.skip = "one-token context (any ranking puts the evidence first)"
    elif set(rankable) <= set(ev):
        p.skip = "the evidence is the whole context (any ranking puts it first)"
    p.missing = missing
    return p
