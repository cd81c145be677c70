"""Evidence words -> token positions, for a byte-level BPE and a SentencePiece-like tokenizer; target/foil
continuations."""

from pathlib import Path
from types import SimpleNamespace

import pytest

from lenscope.data.datasets import Example
from lenscope.evaluate.evidence import evidence_positions, prepare, word_spans
from lenscope.models.loading.tokenizer import tiny_tokenizer

from ..conftest import get_model


def sentencepiece_like():
    """A Llama-style SentencePiece tokenizer (spaces become '▁', one is prepended to every text, a BOS is
    added), trained on lenscope's tiny corpus."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    import lenscope.models.loading.tokenizer as T

    text = Path(T.__file__).with_name("tiny_corpus.txt").read_text().splitlines()
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.train_from_iterator(text, trainer=trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                                              show_progress=False))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                       special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", unk_token="<unk>", eos_token="</s>")


def _pieces(tok, ids, pos):
    return [tok.convert_ids_to_tokens(ids[k]) for k in pos]


def test_word_spans_whole_words_only():
    assert word_spans("the cat and the category", "cat") == [(4, 7)]
    assert word_spans("Kristi met Kristi", "Kristi") == [(0, 6), (11, 17)]
    assert word_spans("she hasn't gone", "hasn't") == [(4, 10)]
    assert word_spans("Catherine", "Cat") == []


def test_byte_level_bpe_positions():
    tok = tiny_tokenizer()
    text = "The keys to the cabinet"
    ids, ev, rankable, missing = evidence_positions(tok, text, ("keys",))
    # tiny BPE: ["The", " ", "key", "s", " to", " the", " c", "ab", "in", "et"]: "keys" is two tokens
    assert tok.convert_ids_to_tokens(ids)[:4] == ["The", "Ġ", "key", "s"]
    assert ev == [2, 3] and missing == [] and rankable == list(range(len(ids)))
    # a word appearing twice, with a leading-space token each time; a missing word is reported
    text = "the cat saw the cat"
    ids, ev, _, missing = evidence_positions(tok, text, ("cat", "dog"))
    assert _pieces(tok, ids, ev) == ["Ġcat", "Ġcat"] and missing == ["dog"]
    # first word (no leading space) and a multi-word phrase
    ids, ev, _, _ = evidence_positions(tok, "cat and the dog", ("cat", "the dog"))
    assert tok.decode([ids[k] for k in ev]) == "cat the dog"


def test_sentencepiece_like_positions_and_continuation():
    tok = sentencepiece_like()
    text = "The keys to the cabinet"
    ids, ev, rankable, _ = evidence_positions(tok, text, ("keys",))
    pieces = tok.convert_ids_to_tokens(ids)
    assert pieces[0] == "<s>" and 0 not in rankable  # the BOS is never ranked
    assert _pieces(tok, ids, ev) == ["key", "s"]  # the bare "▁" piece before them is not part of the word
    assert pieces[ev[0] - 1] == "▁"
    ids, ev, _, _ = evidence_positions(tok, "the cat saw the cat", ("cat",))
    assert len(ev) == 2 and all(tok.decode([ids[k]]).strip() == "cat" for k in ev)
    # continuation: the tokens prefix + " are" has beyond the prefix (no stray "▁" from the prepended marker)
    lm = SimpleNamespace(tokenizer=tok, anatomy=SimpleNamespace(n_ctx=64))
    p = prepare(lm, Example(id="x/0", dataset="x", prefix="The keys to the cabinet", target="are", foil="is",
                            evidence=("keys",)))
    assert tok.convert_ids_to_tokens([p.target_id, p.foil_id]) == ["▁are", "▁is"] and p.shared == 0
    assert p.skip is None and p.ids[0] == tok.bos_token_id and p.rankable == list(range(1, len(p.ids)))


def test_prepare_on_a_byte_level_model():
    lm = get_model("tiny:gpt2")
    tok = lm.tokenizer
    ex = Example(id="x/0", dataset="x", prefix="The keys to the cabinet", target="are", foil="is", evidence=("keys",))
    p = prepare(lm, ex)
    assert p.skip is None and p.usable and p.evidence == [2, 3]
    assert tok.decode([p.target_id]) == " are" and tok.decode([p.foil_id]) == " is"
    # shared first tokens: the contrast moves to the first differing token, the shared ones join the context
    ex2 = Example(id="x/1", dataset="x", prefix="He saw that", target="the cat", foil="the dog", evidence=("that",))
    p2 = prepare(lm, ex2)
    assert p2.shared == 1 and tok.decode(p2.ids[-1:]) == " the" and p2.ids[:-1] == tok("He saw that")["input_ids"]
    assert tok.decode([p2.target_id]) == " cat" and tok.decode([p2.foil_id]) == " dog"
    assert p2.rankable == list(range(len(p2.ids))) and p2.skip is None
    # skips, each with its reason
    reasons = {
        "no evidence": Example(id="x/2", dataset="x", prefix="The keys", target="are", foil="is"),
        "evidence not found in the prefix": Example(id="x/3", dataset="x", prefix="The keys", target="are", foil="is",
                                                    evidence=("door",)),
        "the evidence is the whole context": Example(id="x/4", dataset="x", prefix="keys", target="are", foil="is",
                                                     evidence=("keys",)),
    }
    for why, e in reasons.items():
        q = prepare(lm, e)
        assert q.usable and q.skip.startswith(why), (why, q.skip)
    # " cat" is the start of " cats" (" cat" + "s"): no token tells them apart; not even accuracy is measured
    same = prepare(lm, Example(id="x/5", dataset="x", prefix="a", target="cat", foil="cats", evidence=("a",)))
    assert not same.usable and "do not differ" in same.skip


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2", "gemma3-270m"])
def test_real_tokenizers(name):
    """smollm2 (byte-level BPE, no BOS) and gemma3-270m (SentencePiece, BOS): evidence on crafted strings."""
    from lenscope.models.loading.load import installed

    if not installed(name):
        pytest.skip(f"{name} is not installed")
    lm = get_model(name)
    tok = lm.tokenizer
    text = "Friends Juana and Kristi found a mango. Kristi gave it to"
    ids, ev, rankable, _ = evidence_positions(tok, text, ("Kristi",))
    words = [tok.decode([ids[k]]).strip() for k in ev]
    assert "".join(words) == "Kristi" * 2 or words == ["Kristi", "Kristi"]
    p = prepare(lm, Example(id="i/0", dataset="i", prefix=text, target="Juana", foil="Kristi", evidence=("Juana",)))
    assert tok.decode([p.target_id]).strip() and p.target_id != p.foil_id
    assert "".join(tok.decode([p.ids[k]]) for k in p.evidence).strip() == "Juana"
    if name == "gemma3-270m":
        assert ids[0] == tok.bos_token_id and 0 not in rankable
        assert tok.convert_ids_to_tokens([p.foil_id])[0].startswith("▁")
