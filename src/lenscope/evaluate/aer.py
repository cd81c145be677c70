"""Alignment error rate (Och & Ney 2003) of predicted word alignments against gold sure / possible links, and word
alignments read from attribution scores (Ferrando et al. 2022, 2023: each target word linked to the source word
that contributed most to its prediction).

For predicted links ``A``, sure gold links ``S`` and possible gold links ``P`` (``S`` is a subset of ``P``),
counted over the whole corpus and then divided once::

    AER = 1 - (|A & S| + |A & P|) / (|A| + |S|)
    precision = |A & P| / |A|        recall = |A & S| / |S|

A result keeps each sentence's four counts, so per-sentence values and sub-corpora are exact too.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..data.alignments import AlignedPair, Link
from ..errors import InputError
from ..results import Result

COUNTS = ("predicted", "sure", "predicted_sure", "predicted_possible")  # |A|, |S|, |A & S|, |A & P|
ROWS = ("output", "input")  # a target token's row: the step that predicts it, or that reads it (AWO / AWI)


def _ratio(num: Tensor, den: Tensor) -> Tensor:
    """``num / den`` elementwise (float64), NaN where ``den`` is 0."""
    num, den = num.double(), den.double()
    return torch.where(den > 0, num / den.clamp_min(1), torch.full_like(num, float("nan")))


@dataclass(repr=False)
class AlignmentErrorRate(Result):
    """AER of a corpus. ``counts (sentence, 4)`` int64: per sentence ``|A|, |S|, |A & S|, |A & P|``
    (:data:`COUNTS`); ``ids``: the sentences' ids."""

    ids: list[str]
    counts: Tensor
    method: str = ""

    @property
    def totals(self) -> dict[str, int]:
        return dict(zip(COUNTS, (int(v) for v in self.counts.sum(0))))

    @property
    def aer(self) -> float:
        """The corpus AER (counts summed over sentences, one ratio); NaN when ``|A| + |S| == 0``."""
        return float(_aer(self.counts.sum(0, keepdim=True))[0])

    @property
    def precision(self) -> float:
        c = self.counts.sum(0)
        return float(_ratio(c[3:4], c[0:1])[0])

    @property
    def recall(self) -> float:
        c = self.counts.sum(0)
        return float(_ratio(c[2:3], c[1:2])[0])

    def per_sentence(self) -> Tensor:
        """Each sentence's own AER ``(sentence,)`` float64 (NaN for a sentence with ``|A| + |S| == 0``)."""
        return _aer(self.counts)

    def to_dict(self) -> dict:
        return {"method": self.method, "sentences": len(self.ids), "aer": self.aer, "precision": self.precision,
                "recall": self.recall, **self.totals}

    def plot(self):
        """Each sentence's AER and the corpus AER (:func:`lenscope.viz.eval_plots.plot_aer`)."""
        from ..viz.eval_plots import plot_aer

        return plot_aer(self.ids, self.per_sentence().tolist(), self.aer, self.precision, self.recall, self.method)

    def to_frame(self):
        import pandas as pd

        df = pd.DataFrame(self.counts.numpy(), columns=list(COUNTS))
        df.insert(0, "id", self.ids)
        df["aer"] = self.per_sentence().numpy()
        return df

    def __repr__(self) -> str:
        return (f"AlignmentErrorRate({self.method + ', ' if self.method else ''}sentences={len(self.ids)}, "
                f"aer={self.aer:.4f}, precision={self.precision:.4f}, recall={self.recall:.4f})")


def _aer(counts: Tensor) -> Tensor:
    a, s, a_s, a_p = counts.double().unbind(-1)
    return 1 - _ratio(a_s + a_p, a + s)


def sentence_counts(predicted: Iterable[Link], sure: Iterable[Link], possible: Iterable[Link] = ()) -> list[int]:
    """``[|A|, |S|, |A & S|, |A & P|]`` of one sentence; ``possible`` is taken together with ``sure``."""
    A, S = set(predicted), set(sure)
    P = S | set(possible)
    return [len(A), len(S), len(A & S), len(A & P)]


def alignment_error_rate(gold: Sequence[AlignedPair], predicted: Sequence[AlignedPair] | dict,
                         method: str = "") -> AlignmentErrorRate:
    """The AER of predicted links against gold rows (:func:`lenscope.data.alignments.read_gold_alignments`).
    ``predicted``: rows with the same ids as the gold rows (their links in ``sure``), or a dict ``id -> links``.
    A gold id without a prediction (or a prediction without gold) is an InputError, as is a corpus with no link
    at all (``|A| + |S| == 0``: the rate is undefined)."""
    pred = ({str(k): frozenset(tuple(x) for x in v) for k, v in predicted.items()} if isinstance(predicted, dict)
            else {p.id: p.sure for p in predicted})
    gold_ids = [g.id for g in gold]
    missing = [i for i in gold_ids if i not in pred]
    extra = sorted(set(pred) - set(gold_ids))
    if missing or extra:
        what = (f"gold sentence {missing[0]!r} has no predicted alignment" if missing
                else f"predicted sentence {extra[0]!r} has no gold alignment")
        raise InputError(f"{what}; the two files must hold the same ids (by default the line numbers)")
    by_id = {p.id: p for p in predicted} if not isinstance(predicted, dict) else {}
    for g in gold:
        p = by_id.get(g.id)
        if p is not None:
            for side, n in (("source", len(g.source)), ("target", len(g.target))):
                words = getattr(p, side)
                if words is not None and len(words) != n:
                    raise InputError(f"sentence {g.id!r}: the prediction's {side} has {len(words)} words, the "
                                     f"gold's {n}")
        bad = [(i, j) for i, j in pred[g.id] if i >= len(g.source) or j >= len(g.target)]
        if bad:
            raise InputError(f"sentence {g.id!r}: predicted link {list(bad[0])} is outside the sentence "
                             f"({len(g.source)} source, {len(g.target)} target words)")
    counts = torch.tensor([sentence_counts(pred[g.id], g.sure, g.possible) for g in gold], dtype=torch.int64)
    if int(counts[:, 0].sum() + counts[:, 1].sum()) == 0:
        raise InputError("neither the predictions nor the gold sure links hold any link: the AER is undefined")
    return AlignmentErrorRate(ids=gold_ids, counts=counts.reshape(len(gold), len(COUNTS)), method=method)


def word_scores(scores: Tensor, source_words: Sequence[int | None], target_words: Sequence[int | None],
                target_token: str = "first") -> Tensor:
    """Token-level attribution scores ``(tgt_token, src_token)`` -> word level ``(tgt_word, src_word)``.

    ``scores[t, s]``: how much source token ``s`` contributed to the prediction of target token ``t``.
    ``source_words[s]`` / ``target_words[t]``: the word index of each token (None: a special token, left out).
    A source word's score is the sum of its tokens' scores; a target word's row is its first token's
    (``target_token="first"``) or the mean of its tokens' rows (``"mean"``). Word indices must cover ``0..n-1``.
    """
    if target_token not in ("first", "mean"):
        raise InputError(f"unknown target_token {target_token!r}; choose first or mean")
    scores = torch.as_tensor(scores).double()
    if scores.dim() != 2 or scores.shape != (len(target_words), len(source_words)):
        raise InputError(f"scores of shape {tuple(scores.shape)} do not match {len(target_words)} target and "
                         f"{len(source_words)} source tokens")
    src = _word_map(source_words, "source")
    tgt = _word_map(target_words, "target")
    by_src = scores @ src.T  # (tgt_token, src_word)
    if target_token == "mean":
        return (tgt / tgt.sum(1, keepdim=True)) @ by_src
    first = tgt.double().cumsum(1).eq(1) & tgt.bool()  # each word's first token
    return first.double() @ by_src


def _word_map(words: Sequence[int | None], side: str) -> Tensor:
    """``(word, token)`` 0/1 matrix of a token -> word map."""
    known = [w for w in words if w is not None]
    n = max(known) + 1 if known else 0
    if not known or sorted(set(known)) != list(range(n)):
        raise InputError(f"the {side} token-to-word map must name every word 0..n-1 (got {list(words)})")
    m = torch.zeros(n, len(words), dtype=torch.float64)
    for t, w in enumerate(words):
        if w is not None:
            m[w, t] = 1.0
    return m


def word_alignment(scores: Tensor, null: int | None = None) -> frozenset[Link]:
    """Links ``(source word, target word)``: each target word (a row of ``scores (tgt_word, src_word)``, e.g. from
    :func:`word_scores`) linked to its highest-scoring source word (the first of equal ones). ``null``: a column
    that links nothing (the source's end token in the protocol of Ferrando et al. 2022): a target word whose best
    column it is gets no link."""
    scores = torch.as_tensor(scores)
    if scores.dim() != 2 or scores.shape[1] == 0:
        raise InputError("word_alignment needs scores (target word, source word) with at least one source word")
    if not torch.isfinite(scores).all():
        raise InputError("the attribution scores hold NaN or infinite values")
    best = scores.argmax(1).tolist()
    return frozenset((int(i), j) for j, i in enumerate(best) if i != null)


def _token_words(offsets: Sequence[tuple[int, int]], words: Sequence[str]) -> list[int | None]:
    """The word of each token of ``" ".join(words)`` from the tokenizer's character ``offsets`` (the word its span
    overlaps most; None for a special token's empty span or a span of spaces only)."""
    starts, pos = [], 0
    for w in words:
        starts.append(pos)
        pos += len(w) + 1
    out: list[int | None] = []
    for a, b in offsets:
        overlap = [max(0, min(b, s + len(w)) - max(a, s)) for s, w in zip(starts, words)]
        best = max(range(len(words)), key=overlap.__getitem__) if words else 0
        out.append(best if words and overlap[best] > 0 else None)
    return out


def _tokens_of(lm, text: str, words: Sequence[str], side: str, ids: Tensor) -> list[int | None]:
    """The word of each of ``ids``, the tokens the model reads for ``text`` (the source with its special tokens; a
    target without its end token, after the decoder's start token): read from the fast tokenizer's offsets."""
    kw = {"text": text} if side == "source" else {"text_target": text}
    try:
        enc = lm.tokenizer(**kw, return_offsets_mapping=True)
    except (NotImplementedError, ValueError, TypeError):
        raise InputError("word alignments from a model need a fast tokenizer (character offsets of each token)"
                         ) from None
    got, offsets = list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]
    if got[: len(ids)] != ids.tolist():
        raise InputError(f"the tokenizer's {side} tokens with offsets differ from the model's input; cannot map "
                         "tokens to words")
    return _token_words(offsets[: len(ids)], words)


@dataclass
class PairScores:
    """One sentence pair's token-level explanations from one teacher-forced pass: ``scores[method]`` is ``(target
    token, source token + target-prefix token)``, row ``i`` the explanation of the prediction of target token
    ``decoder_ids[i + 1]`` (the logit of that reference token), over the ``n_source`` source tokens first, then the
    decoder's input tokens ``decoder_ids`` (start token and target prefix; a token's own and later columns are 0)."""

    id: object
    source_ids: Tensor
    decoder_ids: Tensor
    scores: dict[str, Tensor]
    end: bool = False  # one more row: the prediction of the end token after the whole target (pair_scores(end=))

    @property
    def n_source(self) -> int:
        return len(self.source_ids)


def pair_scores(lm, pairs: Sequence[tuple[str, str]], methods=("logit",), *, ids: Sequence | None = None,
                batch_size: int = 16, end: bool = False, progress=None) -> list[PairScores]:
    """Every target token of each ``(source text, target text)`` pair explained by each method that reads a source
    (:func:`lenscope.attribution.methods.source_readers`), the pairs ``batch_size`` at a time through one padded
    forward pass (:func:`lenscope.models.runtime.trace.batch_traces`; pairs of similar lengths share a batch), each
    pair's methods through the method table's rows from its own trace (the invariants checked). ``ids``: the pairs' ids
    (default their index). ``end``: one more row, the prediction of the end token after the whole target (the
    step that reads the last target token). ``progress(done, total)`` after each batch."""
    from ..attribution import methods as table
    from ..attribution.context import check_rows
    from ..models.loading.load import require_decoder, target_prefix_ids
    from ..models.runtime.trace import batch_traces, source_ids

    methods = [methods] if isinstance(methods, str) else list(methods)
    chosen = [table.get(m) for m in methods]
    for m in chosen:
        if not m.reads_source or m.rows is None:
            raise InputError(f"--method {m.name} does not explain an encoder-decoder model's source; use "
                             f"{', '.join(table.source_readers())}")
    require_decoder(lm, f"word alignments by {', '.join(methods)}", encoder_decoder=True,
                    instead="use a translation model")
    if not lm.anatomy.is_encoder_decoder:
        raise InputError(f"word alignments from a model need an encoder-decoder (translation) model; {lm.name} is "
                         f"a {lm.anatomy.family} decoder")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InputError(f"batch_size must be a positive integer, not {batch_size!r}")
    ids = list(range(len(pairs))) if ids is None else list(ids)
    eos = getattr(lm.tokenizer, "eos_token_id", None)
    if end and eos is None:
        raise InputError(f"{lm.name}'s tokenizer names no end token, whose prediction end=True explains")
    srcs = [source_ids(lm, s) for s, _ in pairs]
    decs = [target_prefix_ids(lm, t) for _, t in pairs]  # the start token, then the target's tokens
    for i, d in zip(ids, decs):
        if len(d) < 2:
            raise InputError(f"sentence {i!r}: the target has no token to explain")
    order = sorted(range(len(pairs)), key=lambda k: (len(decs[k]), len(srcs[k])))  # little padding per batch
    out: list[PairScores | None] = [None] * len(pairs)
    for start in range(0, len(order), batch_size):
        chunk = order[start: start + batch_size]
        trs = batch_traces(lm, [decs[k] for k in chunk], source=[srcs[k] for k in chunk])
        for k, tr in zip(chunk, trs):
            dec = decs[k]
            rows = torch.arange(len(dec) - (0 if end else 1))  # the prediction of each target token dec[1:]
            tok = torch.cat([dec[1:], torch.tensor([int(eos)])]) if end else dec[1:]  # (and of the end token)
            job = table.Rows(lm=lm, tr=tr, ids=dec, rows=rows, tok=tok, foils=None)
            scores = {}
            for m in chosen:
                scores[m.name], inv = m.generation_rows(job)
                check_rows(m.name, inv, lm, [f"sentence {ids[k]!r}, target token {i}" for i in range(len(rows))])
            out[k] = PairScores(ids[k], srcs[k], dec, scores, end)
        if progress is not None:
            progress(min(start + batch_size, len(order)), len(order))
    return out


def model_alignments(lm, gold: Sequence[AlignedPair], methods=("logit",), *, target_token: str = "mean",
                     null_eos: bool = True, rows: str = "output", batch_size: int = 16,
                     progress=None) -> dict[str, dict[object, frozenset[Link]]]:
    """Word alignments of an encoder-decoder model ``lm`` on each gold sentence pair (its ``source`` and
    ``target`` words, joined by spaces), ``{method: {pair id: links}}`` for each attribution method that reads a
    source (``logit``, ``alti-logit``): one teacher-forced run of the source and the whole target per pair, batched
    (:func:`pair_scores`); each target token's prediction is explained (the logit of that reference token), its
    scores over the source tokens summed into source words, a target word's row the mean of its tokens' rows
    (``target_token="mean"``; ``"first"``: its first token's; :func:`word_scores`), and each target word linked to
    its highest-scoring source word (:func:`word_alignment`). ``null_eos``: the source's end token competes with the
    words, and a target word it wins gets no link. The defaults are the protocol of Ferrando et al. 2022's code
    (mt-upc/transformer-contributions-nmt, ``alignment/``: source subwords summed, target subwords averaged, the
    source's ``</s>`` a candidate that writes no link; their "alignment with output" rows, the prediction of each
    target token). ``rows="input"``: their "alignment with input" (AWI): a target token's row is the step that
    reads it as the decoder's input (the prediction of the next token, of the end token after the last).
    ``progress(done, total)`` after each batch."""
    methods = [methods] if isinstance(methods, str) else list(methods)
    texts = [(" ".join(g.source), " ".join(g.target)) for g in gold]
    if rows not in ROWS:
        raise InputError(f"unknown rows {rows!r}; choose {' or '.join(ROWS)}")
    scored = pair_scores(lm, texts, methods, ids=[g.id for g in gold], batch_size=batch_size, end=rows == "input",
                         progress=progress)
    out: dict[str, dict] = {m: {} for m in methods}
    for g, ps in zip(gold, scored):
        words = pair_words(lm, ps, g.source, g.target, target_token=target_token, null_eos=null_eos, rows=rows)
        for m, links in words.links().items():
            out[m][g.id] = links
    return out


@dataclass
class WordScores:
    """A pair's explanations at the word level (:func:`pair_words`): ``scores[method] (target word, source word)``,
    with one more column ``null`` (the source's end token, which links nothing) when there is one; each token's word
    ``source_of`` / ``target_of`` (None: a special token)."""

    source_words: tuple
    target_words: tuple
    source_of: list
    target_of: list
    null: int | None
    scores: dict[str, Tensor]

    def links(self) -> dict[str, frozenset[Link]]:
        """Each method's links: every target word to its best source word (none where the null column wins)."""
        return {m: word_alignment(w, self.null) for m, w in self.scores.items()}


def pair_words(lm, ps: PairScores, source_words: Sequence[str], target_words: Sequence[str], *,
               target_token: str = "mean", null_eos: bool = True, rows: str = "output") -> WordScores:
    """The word-level scores of one pair's token-level explanations ``ps`` (:func:`pair_scores` of the pair's words
    joined by spaces), by the protocol of :func:`model_alignments` (whose options these are): token-to-word maps
    from the tokenizer's offsets, source tokens summed, a target word's row from its tokens' rows, and with
    ``null_eos`` the source's end token one more column; ``rows``: a target token's row is the step that predicts
    it (``"output"``) or that reads it (``"input"``: needs ``ps.end``)."""
    src_text, tgt_text = " ".join(source_words), " ".join(target_words)
    src_of = _tokens_of(lm, src_text, source_words, "source", ps.source_ids)
    tgt_of = _tokens_of(lm, tgt_text, target_words, "target", ps.decoder_ids[1:])
    null, cols = None, src_of
    eos = getattr(lm.tokenizer, "eos_token_id", None)
    if null_eos and eos is not None:  # the source's end token: one more column, which links nothing
        ends = [k for k, (w, t) in enumerate(zip(src_of, ps.source_ids.tolist())) if w is None and t == eos]
        if ends:
            null = len(source_words)
            cols = [null if k in ends else w for k, w in enumerate(src_of)]
    if rows not in ROWS:
        raise InputError(f"unknown rows {rows!r}; choose {' or '.join(ROWS)}")
    if rows == "input" and not ps.end:
        raise InputError("rows='input' reads the end token's prediction: score the pair with pair_scores(end=True)")
    n = len(ps.decoder_ids) - 1  # the target's tokens
    pick = slice(1, n + 1) if rows == "input" else slice(0, n)
    scores = {m: word_scores(sc[pick, : ps.n_source], cols, tgt_of, target_token) for m, sc in ps.scores.items()}
    return WordScores(tuple(source_words), tuple(target_words), src_of, tgt_of, null, scores)
