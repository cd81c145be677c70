"""A short deterministic label for every feature of a dictionary (:func:`feature_labels`), computed offline from
the feature's card (:mod:`lenscope.features.dictionaries.cards`) and cached beside the dictionary's files
(``labels.json``, :func:`save_labels` / :func:`load_labels`).

**The label** of a feature, from its card (:func:`card_label`):

    '<activating token>' → '<promoted token>'

- the *activating token* is the most frequent token at the centre of its top-activating contexts (the ``top``
  largest activations on the held-out text); between tokens as frequent, the one of the largest activation;
- the *promoted token* is the token whose logit its decoder direction raises most through the readout
  (``card.promoted[0]``);
- each token is written between single quotes with ``\\``, newlines, tabs and other control characters escaped
  (``'\\n'``), so that a leading space shows;
- a feature never active on the text read is ``dead``.

The cache also keeps, per feature, its density, its activating, promoted and suppressed tokens, and for the whole
file the model, the data, the tokens read, ``top`` and the code version it was computed with.

**One pass** over the held-out text feeds every feature of every dictionary given: each batch's latents are captured
once per pass (the pass stopped after the deepest dictionary's site) and the features are taken in chunks of
``chunk`` (:class:`~lenscope.features.dictionaries.cards.CardPass`, one per chunk; the cards are made chunk by chunk
at the end and dropped once labelled). Memory (:func:`label_memory`) is estimated before anything is read.
"""

from __future__ import annotations

import json
import math
import sys
from collections import Counter
from pathlib import Path

import torch

from ...data.corpus import token_batches
from ...errors import InputError
from ...memory import budget, format_bytes
from ...models.dictionaries.dictionary import Dictionary
from ...models.loading.load import LoadedModel
from ...models.runtime.engine import run
from ...version import code_version
from .cards import DEFAULT_TOKENS, CardPass, FeatureCard
from .result import latent_site
from .sources import last_site

LABELS_FILE = "labels.json"
DEAD = "dead"
FORMAT = 1
CHUNK = 1024
CONTEXT = (0, 0)  # the label reads only the centre token of each context


def show_token(t: str | None) -> str:
    """``t`` between single quotes, ``\\`` and control characters escaped (``'\\n'``, ``'\\t'``, ``'\\x07'``)."""
    if t is None:
        return "''"
    out = []
    for ch in t:
        if ch == "\\":
            out.append("\\\\")
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ch == "\r":
            out.append("\\r")
        elif ord(ch) < 32 or ord(ch) == 127:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return "'" + "".join(out) + "'"


def activating_token(card: FeatureCard) -> str | None:
    """The most frequent centre token of ``card``'s top contexts; between ties, the one whose first context is the
    largest (the contexts come largest first). None for a dead feature."""
    centres = [c[card.center] for c in card.context_tokens]
    if not centres:
        return None
    counts = Counter(centres)
    most = max(counts.values())
    return next(t for t in centres if counts[t] == most)


def card_label(card: FeatureCard) -> str:
    """The label of the feature of ``card`` (see the module's docstring)."""
    if card.active == 0:
        return DEAD
    return f"{show_token(activating_token(card))} → {show_token(card.promoted[0])}"


def label_memory(lm: LoadedModel, dicts: list[Dictionary], *, tokens: int, top: int, seq_len: int, batch_size: int,
                 chunk: int = CHUNK) -> dict[str, int]:
    """The estimated peak memory of :func:`feature_labels` in bytes, by term (``T = batch_size * seq_len``):

    - ``latents``: every dictionary's latents on one batch, float32 with the masked copy, ``8 T width``;
    - ``contexts``: the running top contexts of every feature, ``top * 44`` bytes each (value, window id,
      activation and where, with the batch's candidates beside them);
    - ``active``: the active values and their features, 12 bytes each, at most ``tokens * L0`` per dictionary (L0:
      its ``k`` where it has one, else 1% of its width);
    - ``logits``: one chunk's decoder logits and their top-k, ``3 * 4 chunk V``."""
    T = batch_size * seq_len
    V = lm.anatomy.vocab_size
    l0 = sum(d.k if d.k else math.ceil(0.01 * d.width) for d in dicts)
    terms = {"latents": 8 * T * sum(d.width for d in dicts),
             "contexts": 44 * top * sum(d.width for d in dicts),
             "active": 12 * int(tokens) * l0,
             "logits": 12 * min(chunk, max(d.width for d in dicts)) * V}
    terms["total"] = sum(terms.values())
    return terms


def _stop_site(dicts: list[Dictionary]) -> str:
    last = last_site([d.site for d in dicts])
    for d in dicts:
        if d.site == last:
            return latent_site(d)
    return last


def feature_labels(lm: LoadedModel, dicts: Dictionary | list[Dictionary], data, *, tokens: int = DEFAULT_TOKENS,
                   top: int = 20, seq_len: int = 128, batch_size: int = 8, chunk: int = CHUNK,
                   max_memory: int | str | None = None, progress: bool = True) -> dict:
    """The labels of every feature of ``dicts`` from one pass over about ``tokens`` held-out tokens of ``data``, as
    the document :func:`save_labels` writes: ``{"format", "model", "data", "tokens", "top", "seq_len",
    "code_version", "dictionaries": {site: {"width", "kind", "role", "label", "density", "activating",
    "promoted", "suppressed"}}}`` (one list entry per feature)."""
    D = [dicts] if isinstance(dicts, Dictionary) else list(dicts)
    if not D:
        raise InputError("no dictionary to label")
    if any(d.site is None for d in D) or len({d.site for d in D}) != len(D):
        raise InputError("each dictionary to label needs its own site")
    for d in D:
        d.check(lm)
    if int(tokens) < 1 or int(top) < 1 or int(chunk) < 1:
        raise InputError("tokens, top and chunk must be at least 1")
    seq_len = min(int(seq_len), lm.anatomy.n_ctx)
    need = label_memory(lm, D, tokens=tokens, top=top, seq_len=seq_len, batch_size=batch_size, chunk=chunk)
    limit = budget(max_memory)
    if need["total"] > limit:
        raise InputError(f"dict label: needs about {format_bytes(need['total'])}, more than the memory budget of "
                         f"{format_bytes(limit)}; lower --tokens or --top, or raise --max-memory")
    say = (lambda m: sys.stderr.write(f"dict label: {m}\n")) if progress else (lambda m: None)
    say(f"{sum(d.width for d in D)} features of {len(D)} dictionaries, about {format_bytes(need['total'])}")
    passes = {d.site: [(range(a, min(a + chunk, d.width)), CardPass(min(chunk, d.width - a), top, CONTEXT))
                       for a in range(0, d.width, chunk)] for d in D}
    sites = {d.site: latent_site(d) for d in D}
    special = torch.tensor(sorted(set(lm.tokenizer.all_special_ids)), dtype=torch.long)
    n_seq = -(-int(tokens) // seq_len)
    seen = done = 0
    bar = _bar(progress, n_seq)
    for ids in token_batches(lm.tokenizer, data, seq_len=seq_len, batch_size=batch_size, part="heldout",
                             max_sequences=n_seq):
        cap = run(lm, ids, capture=list(sites.values()), dictionaries=D, stop_after=_stop_site(D),
                  logits=False).captured
        counted = ~torch.isin(ids, special)
        seen += int(counted.sum())
        for d in D:
            z = torch.where(counted[..., None], cap[sites[d.site]].float(), torch.zeros(()))
            for rows, state in passes[d.site]:
                state.update(ids, z[..., rows.start:rows.stop])
        done += ids.shape[0]
        bar(done)
    if seen == 0:
        raise InputError(f"the held-out part of {data} holds no token to measure the features on")
    out = {"format": FORMAT, "model": lm.name, "data": str(data), "tokens": seen, "tokens_asked": int(tokens),
           "top": int(top), "seq_len": seq_len, "code_version": code_version(), "dictionaries": {}}
    vocab: dict = {}
    for d in D:
        rec = {"width": d.width, "kind": d.kind, "role": d.role, "label": [], "density": [], "activating": [],
               "promoted": [], "suppressed": []}
        for rows, state in passes[d.site]:
            for c in state.cards(lm, d, list(rows), data, seen, bins=1, vocab_top=1, vocab_cache=vocab):
                rec["label"].append(card_label(c))
                rec["density"].append(c.density)
                rec["activating"].append(activating_token(c))
                rec["promoted"].append(c.promoted[0])
                rec["suppressed"].append(c.suppressed[0])
        out["dictionaries"][d.site] = rec
        say(f"{d.site}: {d.width} labels, {rec['label'].count(DEAD)} dead")
    return out


def _bar(on: bool, total: int):
    """A progress bar on stderr over ``total`` sequences (none when ``on`` is false or stderr is no terminal)."""
    if not on or not sys.stderr.isatty():
        return lambda done: None

    def show(done: int) -> None:
        n = min(done, total)
        fill = int(30 * n / max(total, 1))
        sys.stderr.write(f"\rdict label: [{'#' * fill}{'.' * (30 - fill)}] {n}/{total} sequences")
        if n >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()

    return show


def save_labels(doc: dict, folder: str | Path) -> Path:
    """Write ``doc`` (:func:`feature_labels`) to ``folder/labels.json``, beside the sites already there when those
    were computed from the same model, data, token budget, ``top`` and sequence length (else replacing them)."""
    path = Path(folder) / LABELS_FILE
    old = load_labels(folder)
    if old is not None and _source(old) == _source(doc):
        doc = {**doc, "dictionaries": {**old["dictionaries"], **doc["dictionaries"]}}
    path.write_text(json.dumps(doc, ensure_ascii=False))
    return path


def _source(doc: dict) -> tuple:
    return tuple(doc.get(k) for k in ("model", "data", "tokens_asked", "top", "seq_len"))


def load_labels(folder: str | Path) -> dict | None:
    """The labels cached in ``folder`` (``labels.json``), or None where there are none."""
    path = Path(folder) / LABELS_FILE
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise InputError(f"{path} is not valid JSON ({e}); delete it and run lenscope dict label again") from None
    if doc.get("format") != FORMAT or not isinstance(doc.get("dictionaries"), dict):
        raise InputError(f"{path} is not a labels file lenscope writes (format {FORMAT}); run lenscope dict label")
    return doc


def labels_for(folder: str | Path | None) -> dict[str, list[str]]:
    """``{site: [label of each feature]}`` cached in ``folder``; empty where there are none."""
    doc = load_labels(folder) if folder is not None else None
    return {} if doc is None else {s: r["label"] for s, r in doc["dictionaries"].items()}


def cached_labels(lm: LoadedModel, dicts: list[Dictionary], folder: str | Path, data, *, tokens: int = DEFAULT_TOKENS,
                  top: int = 20, force: bool = False, **kw) -> tuple[dict, bool]:
    """The labels of ``dicts`` kept in ``folder``: read back when every dictionary's are there, computed with the
    same model, data, token budget and ``top`` (and the same width); otherwise computed (:func:`feature_labels`)
    and saved. Returns ``(doc, computed)``."""
    doc = None if force else load_labels(folder)
    if doc is not None:
        recs = doc["dictionaries"]
        same = _source(doc)[:4] == (lm.name, str(data), int(tokens), int(top))
        if same and all(d.site in recs and recs[d.site]["width"] == d.width for d in dicts):
            return doc, False
    doc = feature_labels(lm, dicts, data, tokens=tokens, top=top, **kw)
    save_labels(doc, folder)
    return doc, True


__all__ = ["CHUNK", "DEAD", "LABELS_FILE", "activating_token", "cached_labels", "card_label", "feature_labels",
           "label_memory", "labels_for", "load_labels", "save_labels", "show_token"]
