"""The dictionaries' text stream: documents from gzip or plain files, a held-out part that never meets the
training part, packed sequences that resume where they stopped."""

from __future__ import annotations

import gzip

import pytest
import torch

from lenscope.data.corpus import HOLDOUT_EVERY, documents, token_batches
from lenscope.data.shared import shared_data_dir
from lenscope.errors import InputError
from tests.conftest import get_model
from tests.tolerances import assert_same_ints


def _write(path, docs):
    text = "".join(f"{d}\n<|endoftext|>\n" for d in docs)
    if path.name.endswith(".gz"):
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        path.write_text(text)


def test_held_out_documents_are_one_in_twenty_and_never_trained_on(tmp_path):
    docs = [f"Document number {i}.\n\nIts second paragraph {i}." for i in range(47)]
    _write(tmp_path / "a.txt.gz", docs)
    train = list(documents(tmp_path / "a.txt.gz", "train"))
    held = list(documents(tmp_path / "a.txt.gz", "heldout"))
    assert held == [docs[i] for i in range(47) if i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1] == [docs[19], docs[39]]
    assert train == [d for d in docs if d not in held]
    assert list(documents(tmp_path / "a.txt.gz", "all")) == docs


def test_a_folder_interleaves_its_files(tmp_path):
    _write(tmp_path / "a.txt", [f"a{i}" for i in range(3)])
    _write(tmp_path / "b.txt.gz", [f"b{i}" for i in range(5)])
    assert list(documents(tmp_path, "all")) == ["a0", "b0", "a1", "b1", "a2", "b2", "b3", "b4"]


def test_a_file_without_separators_is_cut_at_paragraphs(tmp_path):
    para = "word " * 500  # 2,500 characters
    (tmp_path / "t.txt").write_text("\n\n".join(f"{para}{i}" for i in range(12)))
    docs = list(documents(tmp_path / "t.txt", "all"))
    assert 3 <= len(docs) <= 5 and "".join(docs).count("word") == 12 * 500


def test_packed_sequences_open_like_a_text_and_resume(tmp_path):
    lm = get_model("tiny:llama")
    tok = lm.tokenizer
    _write(tmp_path / "a.txt", [f"The {i}th story is about a cat who sat on a mat all day long." for i in range(60)])
    full = torch.cat(list(token_batches(tok, tmp_path / "a.txt", seq_len=12, batch_size=4)))
    pre = tok("x")["input_ids"][:-len(tok("x", add_special_tokens=False)["input_ids"])]
    assert full.shape[1] == 12 and full.shape[0] > 8
    assert (full[:, : len(pre)] == torch.tensor(pre)).all()
    body = full[:, len(pre):].reshape(-1).tolist()
    stream = []
    for d in documents(tmp_path / "a.txt", "train"):
        stream += tok(d, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert body == stream[: len(body)]
    again = torch.cat(list(token_batches(tok, tmp_path / "a.txt", seq_len=12, batch_size=3, skip=5)))
    assert_same_ints(again, full[5:])
    capped = torch.cat(list(token_batches(tok, tmp_path / "a.txt", seq_len=12, batch_size=3, max_sequences=7)))
    assert_same_ints(capped, full[:7])
    with pytest.raises(InputError, match="fewer than"):
        list(token_batches(tok, tmp_path / "a.txt", seq_len=4000, batch_size=2, part="heldout"))
    with pytest.raises(InputError, match="not found"):
        list(documents(tmp_path / "missing.txt"))


def test_the_shared_corpus_streams_from_gzip():
    path = shared_data_dir() / "corpus"
    assert path.is_dir(), "the shared data folder's corpus/ is missing"
    first = next(documents(path, "train"))
    assert len(first) > 500 and "<|endoftext|>" not in first
