"""The source-target alignment of a translation (encoder-decoder) model, as the report and ``lenscope serve`` show
it: every target token's explanation over the source tokens and the target-prefix tokens by each method that reads
a source (:func:`lenscope.attribution.methods.source_readers`), from :func:`lenscope.evaluate.aer.pair_scores`
(one teacher-forced pass of the pair), each target word's best source word (the words and links of ``eval
alignment``: :func:`~lenscope.evaluate.aer.word_scores`, :func:`~lenscope.evaluate.aer.word_alignment`) and, with
gold links, each method's AER (:func:`~lenscope.evaluate.aer.alignment_error_rate`).

>>> data, checks = alignment_view(lm, "das Haus ist klein", "the house is small")   # doctest: +SKIP
"""

from __future__ import annotations

import re

from ..data.alignments import AlignedPair
from ..errors import InputError, LenscopeError

__all__ = ["alignment_view", "check_pair", "gold_pair", "gold_of", "normalized", "token_words", "view_methods", "OMITTED"]

# why the report's other views are left out for an encoder-decoder model (one note on the page)
OMITTED = ("{model} is an encoder-decoder (translation) model: the report shows the source-target alignment. Left "
           "out: {keys}; they read one text through one decoder or encoder stack (a next-token prediction, a logit "
           "lens, direct logit attribution, mixing maps and information flow of a single sequence), which a "
           "translation model's source and target prefix do not fit yet (docs/encoder-decoder.md, What remains).")


def normalized(text: str, what: str) -> str:
    """A text as the alignment reads it: its words (split on whitespace) joined by one space, so that the words
    of a gold file and the tokenizer's character offsets agree; an empty text is refused."""
    if not isinstance(text, str) or not text.split():
        raise InputError(f"the {what} is empty; give a non-empty {what}")
    return " ".join(text.split())


def check_pair(lm, source: str | None) -> None:
    """One-line errors before anything runs: an encoder-decoder model needs a source, any other model takes none."""
    A = lm.anatomy
    if A.is_encoder_decoder and source is None:
        raise InputError(f"{lm.name} is an encoder-decoder (translation) model: give the source with --source TEXT "
                         "(the text is the target)")
    if not A.is_encoder_decoder and source is not None:
        raise InputError(f"--source is for encoder-decoder (translation) models; {lm.name} is a {A.family} "
                         f"{'decoder' if A.causal else 'encoder'}: leave out --source")


def view_methods(methods=None) -> tuple[str, ...]:
    """The methods of the view: ``methods`` as given (each must read a source), default every method that reads
    a source (the method table's ``source_readers``)."""
    from ..attribution.methods import source_readers

    known = source_readers()
    if methods is None:
        return known
    methods = (methods,) if isinstance(methods, str) else tuple(methods)
    bad = [m for m in methods if not isinstance(m, str) or m not in known]
    if bad or not methods:
        raise InputError(f"unknown or not source-reading method(s) {bad}; the alignment view's methods are "
                         f"{', '.join(known)}")
    return tuple(dict.fromkeys(methods))


def gold_pair(rows: list[AlignedPair], source: str, target: str, path: str = "the gold file") -> AlignedPair:
    """The gold row of the pair: the one whose source and target words are the texts' words, else the only row of
    a file of one pair (its word counts must be the texts'); anything else a one-line error."""
    src, tgt = tuple(source.split()), tuple(target.split())
    for g in rows:
        if g.source == src and g.target == tgt:
            return g
    if len(rows) == 1:
        g = rows[0]
        if len(g.source) == len(src) and len(g.target) == len(tgt):
            return g
        raise InputError(f"{path}: its pair has {len(g.source)} source and {len(g.target)} target words, the texts "
                         f"{len(src)} and {len(tgt)}; give the gold alignment of this pair")
    raise InputError(f"{path} holds no row whose source and target words are {source!r} and {target!r} "
                     f"({len(rows)} rows); add that pair, or give a file of this pair alone")


def gold_of(source: str, target: str, sure, possible=(), where: str = "gold") -> AlignedPair:
    """Gold links given as lists (``[[i, j], ...]`` or ``"i-j"`` strings, or one Pharaoh line ``"i-j i-j"``) for the
    pair's words (source word ``i``, target word ``j``, 0-based), checked as a gold file's rows are."""
    src, tgt = tuple(source.split()), tuple(target.split())
    s = _links(sure, f"{where}: 'sure'", len(src), len(tgt))
    p = _links(possible, f"{where}: 'possible'", len(src), len(tgt))
    return AlignedPair("0", src, tgt, s, s | p)


def _links(value, where: str, n_src: int, n_tgt: int) -> frozenset:
    value = [] if value is None else value.split() if isinstance(value, str) else value
    if not isinstance(value, list):
        raise InputError(f"{where} must be a list of links [i, j] or a Pharaoh line \"i-j i-j ...\"")
    out = []
    for x in value:
        if isinstance(x, str) and re.fullmatch(r"\s*\d+\s*-\s*\d+\s*", x):
            x = [int(v) for v in x.split("-")]
        if not (isinstance(x, list) and len(x) == 2 and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                                             for v in x)):
            raise InputError(f"{where} holds {x!r}, not a link [source word, target word] or \"i-j\" (0-based)")
        if x[0] >= n_src or x[1] >= n_tgt:
            raise InputError(f"{where}: the link {x} is outside the pair ({n_src} source words, {n_tgt} target words)")
        if tuple(x) in out:
            raise InputError(f"{where} lists the link {x} twice")
        out.append(tuple(x))
    return frozenset(out)


def alignment_view(lm, source: str, target: str, methods=None, gold: AlignedPair | None = None) -> tuple[dict, list]:
    """The alignment view's data (:func:`lenscope.viz.report.payloads.alignment_payload`) and its checks
    (``[(name, value, tolerance)]``: ``verify`` on the pair, then each method's invariants, checked on every target
    token by ``pair_scores``)."""
    from ..evaluate.aer import alignment_error_rate, model_alignments, word_alignment
    from ..models.request import token_texts
    from ..models.verify import verify
    from ..viz.report.payloads import alignment_payload

    check_pair(lm, source)
    source, target = normalized(source, "source"), normalized(target, "target")
    methods = view_methods(methods)
    ps, notes = _scores(lm, source, target, methods)
    methods = tuple(ps.scores)
    src_words, tgt_words = source.split(), target.split()
    if gold is not None and (len(gold.source) != len(src_words) or len(gold.target) != len(tgt_words)):
        raise InputError(f"the gold pair has {len(gold.source)} source and {len(gold.target)} target words, the "
                         f"texts {len(src_words)} and {len(tgt_words)}")
    pair = gold or AlignedPair("0", tuple(src_words), tuple(tgt_words), frozenset(), frozenset())
    words = links = aer = drawn = None
    try:
        words = _word_view(lm, ps, source, target, methods)
        got = model_alignments(lm, [pair], methods)  # eval alignment's links, by its own protocol
        links = {m: got[m][pair.id] for m in methods}
        drawn = {m: word_alignment(words["scores"][m], words["null"]) for m in methods}
    except LenscopeError:
        if gold is not None:
            raise
        words = None  # no word links without the tokenizer's offsets (a slow tokenizer): the token matrices only
    if gold is not None:
        aer = {m: alignment_error_rate([gold], {gold.id: links[m]}, method=m) for m in methods}
    data = alignment_payload(ps, token_texts(lm, ps.source_ids), token_texts(lm, ps.decoder_ids), words=words,
                             links=links, gold=gold, aer=aer, source=source, target=target)
    data["notes"] = notes
    rep = verify(lm, target, source=source)
    checks = [("verify: largest relative residual error", rep.max_rel_resid_error, rep.resid_tol),
              ("verify: largest relative sub-layer error", rep.max_rel_sublayer_error, rep.resid_tol)]
    if rep.max_abs_logit_error is not None:
        checks.append(("verify: largest absolute logit error", rep.max_abs_logit_error, rep.logit_tol))
    if drawn is not None:
        checks.append(("word links drawn from the word scores shown vs eval alignment's: target words that differ",
                       sum(len(drawn[m] ^ links[m]) for m in methods), 0))
    checks += [(f"{m}: invariants of every target token within tolerance (pair_scores refuses any beyond it)", None,
                None) for m in methods]
    return data, checks


def _scores(lm, source: str, target: str, methods: tuple[str, ...]):
    """``pair_scores`` of the pair by every method in one pass; where that fails (a method that refuses the pair),
    each method on its own, a method that fails left out with its one-line reason: ``(PairScores, {method:
    reason})``."""
    from ..evaluate.aer import PairScores, pair_scores

    try:
        return pair_scores(lm, [(source, target)], methods)[0], {}
    except LenscopeError:
        if len(methods) == 1:
            raise
    got, notes = {}, {}
    for m in methods:
        try:
            got[m] = pair_scores(lm, [(source, target)], [m])[0]
        except LenscopeError as e:
            notes[m] = (str(e).strip().splitlines() or [type(e).__name__])[0]
    if not got:
        raise InputError(f"no method explains this pair: {'; '.join(f'{m}: {r}' for m, r in notes.items())}")
    first = next(iter(got.values()))
    return PairScores(first.id, first.source_ids, first.decoder_ids, {m: p.scores[m] for m, p in got.items()}), notes


def _word_view(lm, ps, source: str, target: str, methods) -> dict:
    """The word-level scores drawn under the links, by model_alignments' defaults (a target word's row from its
    tokens' rows, ``target_token``; with ``null_eos`` the source's end token one more column, which links nothing):
    ``{"source", "target", "source_of", "target_of", "null", "scores": {method: (target word, source word [+ end])}}``.
    """
    import inspect

    from ..evaluate.aer import model_alignments, word_scores

    opts = {k: p.default for k, p in inspect.signature(model_alignments).parameters.items()
            if p.default is not inspect.Parameter.empty}
    src_words, tgt_words = source.split(), target.split()
    s_of = token_words(lm, source, "source", ps.source_ids)
    t_of = token_words(lm, target, "target", ps.decoder_ids[1:])
    null, cols = None, list(s_of)
    eos = getattr(lm.tokenizer, "eos_token_id", None)
    if opts.get("null_eos") and eos is not None:
        ends = [k for k, (w, t) in enumerate(zip(s_of, ps.source_ids.tolist())) if w is None and t == eos]
        if ends:
            null = len(src_words)
            cols = [null if k in ends else w for k, w in enumerate(s_of)]
    scores = {m: word_scores(ps.scores[m][:, : ps.n_source], cols, t_of, opts.get("target_token", "first"))
              for m in methods}
    return {"source": src_words, "target": tgt_words, "source_of": s_of, "target_of": t_of, "null": null,
            "scores": scores}


def token_words(lm, text: str, side: str, ids) -> list[int | None]:
    """The word (of ``text.split()``, ``text`` being its words joined by one space) of each of ``ids``, the tokens
    the model reads for ``text`` (the source with its special tokens; the target after the decoder's start token):
    the word its character span (the fast tokenizer's offsets) overlaps most, None for a special token. The rule of
    ``eval alignment`` (its own maps are private to :mod:`lenscope.evaluate.aer`; the view checks on every run that
    its word scores give eval alignment's links)."""
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
    spans, pos = [], 0
    for w in text.split():
        spans.append((pos, pos + len(w)))
        pos += len(w) + 1
    out: list[int | None] = []
    for a, b in offsets[: len(ids)]:
        overlap = [max(0, min(b, e) - max(a, s)) for s, e in spans]
        best = max(range(len(spans)), key=overlap.__getitem__)
        out.append(best if overlap[best] > 0 else None)
    return out
