"""The source-target alignment of a translation (encoder-decoder) model, as the report and ``lenscope serve`` show
it: every target token's explanation over the source tokens and the target-prefix tokens by each method that reads
a source (:func:`lenscope.attribution.methods.source_readers`), from :func:`lenscope.evaluate.aer.pair_scores`
(one teacher-forced pass of the pair), each target word's best source word (the words and links of ``eval
alignment``: :func:`~lenscope.evaluate.aer.word_scores`, :func:`~lenscope.evaluate.aer.word_alignment`) and, with
gold links, each method's AER (:func:`~lenscope.evaluate.aer.alignment_error_rate`).

>>> data, checks = alignment_view(lm, "das Haus ist klein", "the house is small")   # doctest: +SKIP
"""

from __future__ import annotations

from ..data.alignments import AlignedPair
from ..errors import InputError, LenscopeError

__all__ = ["alignment_view", "check_pair", "gold_pair", "gold_of", "normalized", "view_methods", "OMITTED"]

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
    from ..data.alignments import gold_row

    return gold_row({"source": source, "target": target, "sure": [] if sure is None else sure,
                     "possible": [] if possible is None else possible}, where)


def alignment_view(lm, source: str, target: str, methods=None, gold: AlignedPair | None = None) -> tuple[dict, list]:
    """The alignment view's data (:func:`lenscope.viz.views.alignment.alignment_payload`) and its checks
    (``[(name, value, tolerance)]``: ``verify`` on the pair, then each method's invariants, checked on every target
    token by ``pair_scores``)."""
    from ..evaluate.aer import alignment_error_rate, pair_words
    from ..models.runtime.request import token_texts
    from ..models.runtime.verify import verify
    from ..viz.views.alignment import alignment_payload

    check_pair(lm, source)
    source, target = normalized(source, "source"), normalized(target, "target")
    methods = view_methods(methods)
    ps, notes = _scores(lm, source, target, methods)
    methods = tuple(ps.scores)
    src_words, tgt_words = source.split(), target.split()
    if gold is not None and (len(gold.source) != len(src_words) or len(gold.target) != len(tgt_words)):
        raise InputError(f"the gold pair has {len(gold.source)} source and {len(gold.target)} target words, the "
                         f"texts {len(src_words)} and {len(tgt_words)}")
    words = links = aer = None
    try:  # eval alignment's words and links, by its protocol (model_alignments' defaults), from these scores
        words = pair_words(lm, ps, src_words, tgt_words)
        links = words.links()
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
