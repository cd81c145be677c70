"""The source-target alignment view of a translation (encoder-decoder) model: every target token explained over the
source and the target prefix by each method that reads a source, the word links, and with gold links each method's
AER (its data computed by :func:`lenscope.report.alignment.alignment_view`)."""

from __future__ import annotations

from ...report.payloads import packed, rounded
from .. import View


def alignment_payload(ps, source_tokens: list[str], prefix_tokens: list[str], *, words: dict | None = None,
                      links: dict | None = None, gold=None, aer: dict | None = None, source: str = "",
                      target: str = "") -> dict:
    """The ``alignment`` view of a translation pair: ``ps`` one pair's scores (``pair_scores``: ``scores[method]``
    ``(target token, n_source + decoder-input tokens)``, ``n_source``, ``decoder_ids``) with the tokens' texts; row
    ``i`` explains target token ``prefix_tokens[i + 1]``. ``words``: the pair's
    :class:`~lenscope.evaluate.aer.WordScores` (its words, each token's word, per method the word-level scores
    ``(target word, source word)``, ``null``: the index of one more column, the source's end token, which links
    nothing); ``links``: per method each target word's best source word ``{(source word, target word)}``;
    ``gold``: the pair's gold links (``sure``, ``possible``); ``aer``: per method its AlignmentErrorRate against
    them. ``summary``: what ``lenscope report --json`` prints of it (no matrix)."""
    out = {"source": source, "target": target, "n_source": int(ps.n_source), "source_tokens": list(source_tokens),
           "prefix_tokens": list(prefix_tokens), "target_tokens": list(prefix_tokens[1:]), "methods": {},
           "words": None, "links": None, "gold": None, "aer": None}
    for m, s in ps.scores.items():
        out["methods"][m] = {"scores": packed(s)}
    if words is not None:
        out["words"] = {"source": list(words.source_words), "target": list(words.target_words),
                        "source_of": list(words.source_of), "target_of": list(words.target_of),
                        "null": words.null, "scores": {m: packed(v) for m, v in words.scores.items()}}
    if links is not None:
        out["links"] = {m: sorted([int(i), int(j)] for i, j in v) for m, v in links.items()}
    if gold is not None:
        out["gold"] = {"sure": sorted([int(i), int(j)] for i, j in gold.sure),
                       "possible": sorted([int(i), int(j)] for i, j in gold.possible - gold.sure)}
    if aer is not None:
        out["aer"] = {m: {"aer": rounded(r.aer, 17), "precision": rounded(r.precision, 17),
                          "recall": rounded(r.recall, 17),
                          **r.totals} for m, r in aer.items()}
    out["summary"] = {k: out[k] for k in ("source", "target", "n_source", "source_tokens", "prefix_tokens", "links",
                                          "gold", "aer")}
    out["summary"]["methods"] = list(out["methods"])
    return out


class Alignment(View):
    key = "alignment"
    title = "Source-target alignment"
    blurb = ("A translation model's explanation of every target token (rows) over the source tokens and the "
             "target-prefix tokens it read (columns), by each method that reads a source; below, each target word's "
             "best source word (dots) and, with gold links, the sure (solid) and possible (dashed) ones and each "
             "method's AER.")
    order = 110


VIEW = Alignment()
