"""Word alignments from an encoder-decoder model's explanations and their AER (issue 31, ``lenscope eval alignment
--gold``): each target word linked to the source word whose tokens moved the logit of its first token most, equal
to the same computation done one prediction at a time with ``explain``; the token-to-word maps by hand; the CLI's
JSON and its predicted-alignment files, which ``eval aer`` reads back to the same AER; one-line refusals."""

import json

import pytest
import torch
from typer.testing import CliRunner

import lenscope
from lenscope.cli import app
from lenscope.data.alignments import read_gold_alignments
from lenscope.errors import InputError
from lenscope.evaluate.aer import _token_words, alignment_error_rate, model_alignments
from lenscope.models.loading.load import target_prefix_ids
from lenscope.models.runtime.trace import source_ids
from tests.conftest import get_model

GOLD = [
    {"source": "das Haus ist klein", "target": "the house is small", "sure": [[0, 0], [1, 1], [2, 2], [3, 3]]},
    {"source": "ich bin hier", "target": "I am here", "sure": [[0, 0], [1, 1]], "possible": [[2, 2]]},
]


@pytest.fixture
def gold_file(tmp_path):
    p = tmp_path / "gold.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in GOLD))
    return p


def test_token_words_by_hand():
    words = ["das", "Haus", "ist"]  # "das Haus ist": das 0-3, Haus 4-8, ist 9-12
    offsets = [(0, 0), (0, 2), (2, 3), (3, 6), (6, 8), (8, 12), (0, 0)]  # specials, "da", "s", " Ha", "us", " ist"
    assert _token_words(offsets, words) == [None, 0, 0, 1, 1, 2, None]
    assert _token_words([(3, 4)], words) == [None]  # a span of the space alone belongs to no word


# The tiny models' byte-level tokens of GOLD's sentences, each token's word read off by hand (None: a space alone or
# the end token), and the first token of each target word: the expected alignments below use these, not the
# library's token-to-word map.
HAND = {
    "das Haus ist klein": (["d", "as", "Ġ", "H", "aus", "Ġis", "t", "Ġ", "k", "le", "in", "<|endoftext|>"],
                           [0, 0, None, 1, 1, 2, 2, None, 3, 3, 3, None]),
    "ich bin hier": (["ic", "h", "Ġb", "in", "Ġh", "i", "er", "<|endoftext|>"], [0, 0, 1, 1, 2, 2, 2, None]),
    "the house is small": (["t", "he", "Ġh", "ou", "s", "e", "Ġis", "Ġs", "m", "al", "l"], [0, 2, 6, 7]),
    "I am here": (["I", "Ġa", "m", "Ġhe", "re"], [0, 1, 3]),
}


@pytest.mark.parametrize(("name", "method"), [("t5", "logit"), ("bart", "logit"), ("marian", "alti-logit"),
                                              ("mbart", "alti-logit"), ("m2m100", "logit"), ("pegasus", "alti-logit")])
def test_alignments_equal_one_explanation_per_target_token(gold_file, name, method):
    """Each target word's link is the source word (summing its tokens' scores, words by hand) with the highest
    score for the target word's first token, one ``explain`` per target word."""
    lm = get_model(f"tiny:{name}")
    gold = read_gold_alignments(gold_file)
    got = model_alignments(lm, gold, method, target_token="first", null_eos=False,
                           batch_size=2)[method]  # both pairs in one padded pass
    for g in gold:
        src_text, tgt_text = " ".join(g.source), " ".join(g.target)
        src_tokens, src_words = HAND[src_text]
        tgt_tokens, first_tokens = HAND[tgt_text]
        assert lm.tokenizer.convert_ids_to_tokens(source_ids(lm, src_text).tolist()) == src_tokens
        dec = target_prefix_ids(lm, tgt_text)  # the start token, then the target's tokens
        assert lm.tokenizer.convert_ids_to_tokens(dec[1:].tolist()) == tgt_tokens
        want = set()
        for w, i in enumerate(first_tokens):  # target token i is predicted at decoder position i
            e = lenscope.explain(lm, dec[: i + 1], int(dec[i + 1]), method=method, source=src_text)
            assert e.n_source == len(src_tokens)
            per_word = [0.0] * len(g.source)
            for s, sw in enumerate(src_words):
                if sw is not None:
                    per_word[sw] += float(e.scores[s])
            best = max(range(len(per_word)), key=lambda k: (per_word[k], -k))  # the first of equal ones
            want.add((best, w))
        assert set(got[g.id]) == want, g.id


# every target token's word (HAND lists the first tokens only): "the house is small", "I am here"
TARGET_WORDS = {"the house is small": [0, 0, 1, 1, 1, 1, 2, 3, 3, 3, 3], "I am here": [0, 1, 1, 2, 2]}


def _hand_links(rows, g, src_words, tgt_words) -> set:
    """The default protocol by hand: each target word's row the mean of its tokens' ``rows (token, source token)``,
    each source word the sum of its tokens' columns, the end token (the last column) one more candidate; a target
    word whose best candidate is the end token gets no link (the first of equal ones wins)."""
    want = set()
    for w in range(len(g.target)):
        row = rows[[i for i, tw in enumerate(tgt_words) if tw == w]].mean(0)
        per_word = [float(sum(row[s] for s, sw in enumerate(src_words) if sw == k)) for k in range(len(g.source))]
        per_word.append(float(row[-1]))  # the end token's column
        best = max(range(len(per_word)), key=lambda k: (per_word[k], -k))
        if best < len(g.source):
            want.add((best, w))
    return want


@pytest.mark.parametrize(("name", "method"), [("marian", "logit"), ("m2m100", "alti-logit"), ("t5", "alti-logit")])
def test_the_default_protocol_is_ferrando_et_al_2022s(gold_file, name, method):
    """The defaults follow Ferrando et al. 2022's alignment code: a target word's row is the mean of its tokens'
    rows, a source word's score the sum of its tokens', and the source's end token competes with the words: a
    target word whose best column is the end token gets no link. Worked here from one ``explain`` per target
    token, token-to-word maps by hand."""
    lm = get_model(f"tiny:{name}")
    gold = read_gold_alignments(gold_file)
    got = model_alignments(lm, gold, method)[method]
    eos = lm.tokenizer.eos_token_id
    for g in gold:
        src_text, tgt_text = " ".join(g.source), " ".join(g.target)
        src_tokens, src_words = HAND[src_text]
        dec = target_prefix_ids(lm, tgt_text)
        src = source_ids(lm, src_text).tolist()
        assert src[-1] == eos and src_tokens[-1] == "<|endoftext|>"  # the end token: the last column
        rows = torch.stack([lenscope.explain(lm, dec[: i + 1], int(dec[i + 1]), method=method, source=src_text).scores
                            [: len(src)].double() for i in range(len(dec) - 1)])
        assert set(got[g.id]) == _hand_links(rows, g, src_words, TARGET_WORDS[tgt_text]), g.id


@pytest.mark.parametrize(("name", "method"), [("bart", "logit"), ("pegasus", "alti-logit")])
def test_alignment_with_input_reads_the_step_after_each_token(gold_file, name, method):
    """``rows="input"`` (Ferrando et al. 2022's AWI): a target token's row is the explanation of the step that
    reads it, the prediction of the next token (of the end token after the last), worked from ``explain``; the
    words as in the default protocol (mean of a word's tokens, sum of a source word's, the end token a column that
    links nothing)."""
    lm = get_model(f"tiny:{name}")
    gold = read_gold_alignments(gold_file)
    got = model_alignments(lm, gold, method, rows="input")[method]
    eos = lm.tokenizer.eos_token_id
    for g in gold:
        src_text, tgt_text = " ".join(g.source), " ".join(g.target)
        _, src_words = HAND[src_text]
        dec = target_prefix_ids(lm, tgt_text)
        src = source_ids(lm, src_text).tolist()
        nxt = dec[2:].tolist() + [eos]  # what the step reading target token i predicts
        rows = torch.stack([lenscope.explain(lm, dec[: i + 2], nxt[i], method=method, source=src_text).scores
                            [: len(src)].double() for i in range(len(dec) - 1)])
        assert set(got[g.id]) == _hand_links(rows, g, src_words, TARGET_WORDS[tgt_text]), g.id
    with pytest.raises(InputError, match="unknown rows"):
        model_alignments(lm, gold, method, rows="both")


def test_the_cli_writes_alignments_that_eval_aer_reads_back(gold_file, tmp_path):
    out = tmp_path / "out"
    r = CliRunner().invoke(app, ["eval", "alignment", "--gold", str(gold_file), "--model", "tiny:marian", "--out",
                                 str(out), "--json", "--no-progress"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    res = d["methods"]["logit"]
    assert d["model"] == "tiny:marian" and list(d["methods"]) == ["logit", "alti-logit"] and res["sentences"] == 2
    gold = read_gold_alignments(gold_file)
    want = alignment_error_rate(gold, model_alignments(get_model("tiny:marian"), gold)["logit"], method="logit")
    assert res["aer"] == pytest.approx(want.aer, abs=1e-12) and res["predicted"] == int(want.counts[:, 0].sum())
    assert d["target_token"] == "mean" and d["null_eos"] is True and d["rows"] == "output"
    back = CliRunner().invoke(app, ["eval", "aer", "--gold", str(gold_file), "--predicted",
                                    str(out / "predicted-logit.jsonl"), "--json"])
    assert back.exit_code == 0 and json.loads(back.stdout)["aer"] == pytest.approx(want.aer, abs=1e-12)


@pytest.mark.parametrize(("args", "message"), [
    (["--model", "tiny:llama"], "need an encoder-decoder (translation) model"),
    (["--model", "tiny:t5", "--methods", "recent"], "unknown method 'recent'"),
    (["--model", "tiny:t5", "--dataset", "ioi"], "--gold and --dataset are two evaluations"),
    (["--model", "tiny:t5", "--target-token", "last"], "unknown --target-token"),
    (["--model", "tiny:t5", "--rows", "both"], "unknown --rows"),
])
def test_one_line_errors(gold_file, args, message):
    r = CliRunner().invoke(app, ["eval", "alignment", "--gold", str(gold_file), "--no-progress"] + args)
    err = r.stderr.strip().splitlines()
    assert r.exit_code == 2 and len(err) == 1 and message in err[0], r.output


def test_a_non_fast_tokenizer_is_refused():
    lm = get_model("tiny:t5")

    class Slow:
        def __call__(self, *a, **kw):
            if kw.get("return_offsets_mapping"):
                raise NotImplementedError
            return lm.tokenizer(*a, **kw)

        def __getattr__(self, k):
            return getattr(lm.tokenizer, k)

    slow = type(lm)(model=lm.model, tokenizer=Slow(), anatomy=lm.anatomy, name=lm.name)
    with pytest.raises(InputError, match="need a fast tokenizer"):
        model_alignments(slow, read_gold_alignments_from(GOLD[:1]))


def read_gold_alignments_from(rows):
    import tempfile
    from pathlib import Path

    p = Path(tempfile.mkdtemp()) / "g.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return read_gold_alignments(p)


@pytest.mark.parametrize("name", ["bart", "pegasus", "t5"])
def test_pair_scores_in_padded_batches_equal_one_pair_at_a_time(name):
    """A padded batch is another computation (other shapes) than each pair alone: every method's token-level scores
    agree within float32 rounding of a pass through both stacks (16 u per block, as ``tests.tolerances.pass_rounding``)
    relative to the size of what a row sums (the sum of its scores' sizes). Measured: at most 0.03 of it."""
    from lenscope.evaluate.aer import pair_scores
    from tests.tolerances import U32

    lm = get_model(f"tiny:{name}")
    pairs = [(r["source"], r["target"]) for r in GOLD] + [("klein", "the small house is here")]
    methods = ["logit", "alti-logit"]
    batched = pair_scores(lm, pairs, methods, batch_size=3)
    alone = pair_scores(lm, pairs, methods, batch_size=1)
    rounding = 16 * U32 * (lm.anatomy.n_layers + lm.anatomy.encoder.n_layers + 1)
    for b, a in zip(batched, alone):
        assert b.source_ids.tolist() == a.source_ids.tolist() and b.decoder_ids.tolist() == a.decoder_ids.tolist()
        for m in methods:
            assert b.scores[m].shape == (len(a.decoder_ids) - 1, a.n_source + len(a.decoder_ids))
            tol = rounding * float(a.scores[m].abs().sum(1).max())
            assert (b.scores[m] - a.scores[m]).abs().max() <= tol, (m, float((b.scores[m] - a.scores[m]).abs().max()))
