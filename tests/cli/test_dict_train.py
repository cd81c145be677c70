"""``lenscope dict train`` on a tiny model and on an activations file: the folder it writes, --json, --resume, and
bad input as one ``error:`` line with exit 2."""

import json

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from lenscope.cli import app
from lenscope.models.dictionaries.dictionary import load_dictionaries

runner = CliRunner()
TEXT = "".join(f"Document {i}: when Mary and John went to the store, John gave a drink to Mary.\n<|endoftext|>\n"
               for i in range(200))


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture
def text(tmp_path):
    p = tmp_path / "corpus.txt"
    p.write_text(TEXT)
    return p


def test_train_every_layer_transcoders_json_and_resume(tmp_path, text):
    out = tmp_path / "tc"
    common = ["dict", "train", "--model", "tiny:llama", "--site", "mlp_out.*", "--transcoder", "--kind", "topk",
              "--width", 32, "--k", 4, "--data", text, "--tokens", 2048, "--batch-size", 256, "--buffer", 512,
              "--seq-len", 32, "--precision", "fp32", "--out", out]
    r = run(*common, "--json")
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["tokens"] == 2048 and summary["role"] == "transcoder" and summary["precision"] == "float32"
    assert [d["site"] for d in summary["dictionaries"]] == ["mlp_out.0", "mlp_out.1"]
    assert {"explained_variance", "l0", "dead_fraction", "mse", "scale_in", "scale_out"} <= set(
        summary["dictionaries"][0])
    assert "shuffle buffer 512 rows x 4 sites x 64 = 524288 bytes" in r.stderr
    dicts = load_dictionaries(out)
    assert [d.site for d in dicts] == ["mlp_out.0", "mlp_out.1"] and all(d.role == "transcoder" for d in dicts)
    tr = dicts[0].info["training"]
    assert tr["tokens"] == 2048 and tr["source"]["data"] == str(text) and tr["source"]["part"] == "train"
    assert tr["precision"]["matmul_dtype"] == "float32" and "cpu" in tr["machine"]
    # interrupted runs resume from --out; a run that cannot resume says why
    r = run(*common[:-1], tmp_path / "none", "--resume")
    assert r.exit_code == 2 and r.stderr.startswith("error: cannot resume")


def test_train_from_an_activations_file_without_a_model(tmp_path):
    x = torch.randn(3000, 16)
    save_file({"activations": x}, str(tmp_path / "a.safetensors"))
    r = run("dict", "train", "--activations", tmp_path / "a.safetensors", "--kind", "batchtopk", "--width", 32,
            "--k", 3, "--tokens", 4096, "--batch-size", 512, "--out", tmp_path / "d", "--json")
    assert r.exit_code == 0, r.output
    (D,) = load_dictionaries(tmp_path / "d")
    assert D.site is None and D.d_in == 16 and D.kind == "batchtopk" and D.threshold is not None


@pytest.mark.parametrize("args,msg", [
    (["--site", "resid_post.9"], "past the model's 2 blocks"),
    (["--site", "resid_post.1", "--k", 32], "0 < k < width"),
    (["--site", "resid_post.1", "--width", 0], "width must be at least 1"),
    (["--site", "resid_post.1", "--transcoder"], "its site is mlp_out"),
    (["--site", "resid_post.1", "--activations", "A"], "exactly one of"),
    (["--site", "resid_post.1", "--transcoder", "--skip"], "not both"),
    (["--site", "resid_post.1", "--kind", "relu"], "unknown dictionary kind"),
    (["--site", "resid_post.1", "--precision", "fp8"], "--precision"),
])
def test_bad_input_is_one_error_line(tmp_path, text, args, msg):
    save_file({"a": torch.zeros(4, 3, 64)}, str(tmp_path / "A"))
    base = ["--model", "tiny:llama", "--width", 32, "--k", 4, "--data", text, "--out", tmp_path / "o"]
    r = run("dict", "train", *base, *[tmp_path / "A" if a == "A" else a for a in args])  # the last option wins
    assert r.exit_code == 2, r.output
    assert r.stderr.startswith("error:") and msg in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("tensor,msg", [
    (torch.zeros(10, 3, 8), r"shape (10, 3, 8)"),
    (torch.zeros(10, 8, dtype=torch.int32), "must be float"),
    (torch.zeros(10, 2, 8), "an SAE trains on (n, d) rows"),
])
def test_a_bad_activations_file_exits_2(tmp_path, tensor, msg):
    save_file({"activations": tensor}, str(tmp_path / "a.safetensors"))
    r = run("dict", "train", "--activations", tmp_path / "a.safetensors", "--width", 16, "--k", 2, "--out",
            tmp_path / "o")
    assert r.exit_code == 2 and msg in r.stderr and r.stderr.startswith("error:")


def test_neither_data_nor_activations(tmp_path):
    r = run("dict", "train", "--width", 16, "--k", 2, "--out", tmp_path / "o")
    assert r.exit_code == 2 and "exactly one of" in r.stderr


def test_train_over_the_memory_budget_is_one_line(tmp_path, text):
    r = run("dict", "train", "--model", "tiny:llama", "--site", "mlp_out.*", "--transcoder", "--width", 32, "--k", 4,
            "--data", text, "--tokens", 2048, "--batch-size", 256, "--buffer", 512, "--seq-len", 32, "--out",
            tmp_path / "tc", "--max-memory", "10kB")
    assert r.exit_code == 2, r.output
    err = r.stderr.strip()
    assert err.startswith("error: dict train: needs about ") and "\n" not in err and "Traceback" not in r.output
    assert "--buffer" in err and "--batch-size" in err and "--max-memory" in err and "10 kB" in err
    assert not (tmp_path / "tc").exists()
    r = run("dict", "train", "--activations", tmp_path / "none.safetensors", "--width", 32, "--k", 4, "--out",
            tmp_path / "x", "--max-memory", "much")
    assert r.exit_code == 2 and r.stderr.startswith("error: a memory size"), r.output
