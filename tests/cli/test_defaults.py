"""Defaults that work on every model: a command left at its default sequence length fits it to the model's
context (tiny:llama's is 128, below the default 256) and says so in one stderr line; a length the user gave that is
too long is a one-line error naming --seq-len; ``dict train --help`` states each kind's default learning rate as
the code computes it."""

import json

import pytest
from typer.testing import CliRunner

import lenscope.data.text as text_mod
from lenscope.cli import app
from lenscope.models.dictionaries.dictionary import load_dictionaries

runner = CliRunner()
TEXT = "".join(f"Document {i}: when Mary and John went to the store, John gave a drink to Mary. The capital of "
               f"France is Paris.\n<|endoftext|>\n" for i in range(300))
NOTE = "lenscope: sequences of 128 tokens, tiny:llama's context (the default --seq-len 256 is longer)"


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture
def data(tmp_path, monkeypatch):
    monkeypatch.setattr(text_mod, "_noted", set())  # the note is said once per model and process
    p = tmp_path / "corpus.txt"
    p.write_text(TEXT)
    return p


def test_dict_train_fits_the_default_length_to_the_context(tmp_path, data):
    out = tmp_path / "tc"
    r = run("dict", "train", "--model", "tiny:llama", "--site", "mlp_out.*", "--transcoder", "--width", 16, "--k", 2,
            "--data", data, "--tokens", 512, "--batch-size", 128, "--buffer", 256, "--precision", "fp32",
            "--out", out, "--json")
    assert r.exit_code == 0, r.output
    assert r.stderr.count(NOTE) == 1, r.stderr
    dicts = load_dictionaries(out)
    assert [D.info["training"]["source"]["seq_len"] for D in dicts] == [128, 128]
    assert json.loads(r.stdout.strip().splitlines()[-1])["tokens"] == 512


def test_lens_train_and_eval_fit_the_default_length_to_the_context(tmp_path, data):
    out = tmp_path / "lens"
    r = run("lens", "train", "--model", "tiny:llama", "--data", data, "--tokens", 1024, "--batch-size", 2,
            "--validation-tokens", 256, "--init", "identity", "--out", out, "--json")
    assert r.exit_code == 0, r.output
    assert r.stderr.count(NOTE) == 1, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["tokens_seen"] == 1024  # 4 steps of 2 x 128 tokens
    r = run("lens", "eval", "--model", "tiny:llama", "--data", data, "--lens", out, "--tokens", 256, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["n_tokens"] > 0


@pytest.mark.parametrize("cmd", [["dict", "train", "--site", "mlp_out.0", "--transcoder", "--width", 16, "--k", 2,
                                  "--out", "unused"],
                                 ["lens", "train", "--out", "unused"],
                                 ["lens", "eval"]])
def test_a_given_length_longer_than_the_context_is_a_one_line_error(data, cmd):
    r = run(*cmd, "--model", "tiny:llama", "--data", data, "--seq-len", 200)
    assert r.exit_code == 2, r.output
    assert r.stderr.strip() == ("error: --seq-len 200 is longer than tiny:llama's context of 128 tokens; give "
                                "--seq-len 128 or less (or leave it out: the default fits the context)")


def test_dict_train_help_states_each_roles_default_learning_rate():
    from lenscope.features.dictionaries.train import (
        SAE_LR,
        SAE_LR_WIDTH,
        TRANSCODER_LR,
        TRANSCODER_LR_WIDTH,
        DictSettings,
    )

    def sci(x: float) -> str:  # 0.0002 -> "2e-4", as the help writes it
        m, e = f"{x:e}".split("e")
        return f"{float(m):g}e{int(e)}"

    r = run("dict", "train", "--help")
    assert r.exit_code == 0
    flat = " ".join(r.stdout.split())
    assert f"SAEs {sci(SAE_LR)} * sqrt({SAE_LR_WIDTH} / width)" in flat
    assert f"transcoders and skip transcoders {sci(TRANSCODER_LR)} * sqrt({TRANSCODER_LR_WIDTH} / width)" in flat
    # what the help says is what the code computes (width 1024)
    for role, lr, w0 in (("sae", SAE_LR, SAE_LR_WIDTH), ("transcoder", TRANSCODER_LR, TRANSCODER_LR_WIDTH),
                         ("skip", TRANSCODER_LR, TRANSCODER_LR_WIDTH)):
        assert DictSettings(role=role, width=1024).base_lr() == pytest.approx(lr * (w0 / 1024) ** 0.5, rel=1e-12)
