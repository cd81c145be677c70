"""A small byte-level BPE tokenizer for ``tiny:`` models, trained on a short text shipped with
lenscope so that tests and demos never need a hub."""

from __future__ import annotations

from functools import cache
from pathlib import Path

TINY_VOCAB = 512
SPECIALS = ["<|endoftext|>", "<pad>", "<s>", "</s>", "<mask>"]
TINY_CORPUS = Path(__file__).with_name("tiny_corpus.txt")  # the tiny tokenizer's text; causal tracing's corpus


@cache
def _tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY_VOCAB, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = TINY_CORPUS.read_text().splitlines()
    tok.train_from_iterator(text, trainer=trainer)
    return tok.to_str()


def tiny_tokenizer(encoder: bool = False, *, kind: str | None = None):
    """A ``PreTrainedTokenizerFast``; ``encoder=True`` (``kind="encoder"``) wraps texts as ``<s> ... </s>``;
    ``kind="encoder-decoder"`` ends each text with the end token (the source's and the target's form in T5 and
    Marian: ``text <|endoftext|>``), which :func:`~lenscope.models.loading.load.target_prefix_ids` drops from a target
    prefix."""
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    kind = kind or ("encoder" if encoder else "decoder")
    tok = Tokenizer.from_str(_tokenizer_json())
    if kind == "encoder":
        s, e = tok.token_to_id("<s>"), tok.token_to_id("</s>")
        tok.post_processor = processors.TemplateProcessing(single="<s> $A </s>",
                                                           special_tokens=[("<s>", s), ("</s>", e)])
    elif kind == "encoder-decoder":
        e = tok.token_to_id("<|endoftext|>")
        tok.post_processor = processors.TemplateProcessing(single="$A <|endoftext|>",
                                                           special_tokens=[("<|endoftext|>", e)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<pad>",
                                   bos_token="<s>" if kind == "encoder" else "<|endoftext|>", mask_token="<mask>")
    return fast


def tiny_special_ids() -> dict:
    tok = tiny_tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIALS}
    return {"vocab_size": len(tok), "bos": ids["<|endoftext|>"], "eos": ids["<|endoftext|>"], "pad": ids["<pad>"]}
