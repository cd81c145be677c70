"""``lenscope dict eval`` on a tiny model: the JSON's shape for one dictionary and for a folder of transcoders,
the text output, and one-line errors (exit 2)."""

from __future__ import annotations

import json

import torch
from typer.testing import CliRunner

from lenscope.cli import app
from lenscope.models.dictionaries.dictionary import Dictionary, save_dictionaries
from lenscope.models.loading.summary import fingerprint
from tests.conftest import get_model
from tests.features.test_evaluate import write_corpus
from tests.tolerances import assert_same_computation

runner = CliRunner()
FIELDS = {"explained_variance", "l0", "dead_fraction", "delta_loss", "loss_recovered", "kl", "tokens"}


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def _sae(lm, site="resid_post.0", seed=0):
    D = Dictionary.init(lm.anatomy.d_model, 64, kind="topk", k=4, site=site, seed=seed, model=lm.name,
                        fingerprint=fingerprint(lm.anatomy))
    D.b_enc = torch.randn(64, generator=torch.Generator().manual_seed(seed)) * 0.1
    return D


def test_one_sae_json(tmp_path):
    lm = get_model("tiny:llama")
    data = write_corpus(tmp_path / "docs.txt")
    folder = _sae(lm).save(tmp_path / "sae")
    r = run("dict", "eval", "--model", "tiny:llama", "--dict", folder, "--data", data, "--tokens", 100, "--seq-len",
            32, "--batch-size", 2, "--json", "--save", tmp_path / "ev.json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert FIELDS <= set(d) and {"site", "kind", "role", "width", "baselines", "beats_baseline"} <= set(d)
    assert (d["site"], d["kind"], d["role"], d["width"]) == ("resid_post.0", "topk", "sae", 64)
    assert set(d["baselines"]) == {"pca"} and FIELDS <= set(d["baselines"]["pca"])
    assert d["tokens"] >= 100 and d["dead_reliable"] is False
    assert json.loads((tmp_path / "ev.json").read_text())["dictionaries"][0]["fired"]
    r = run("dict", "eval", "--model", "tiny:llama", "--dict", folder, "--data", data, "--tokens", 60, "--seq-len",
            32)
    assert r.exit_code == 0, r.output
    assert "explained variance" in r.stdout and "pca" in r.stdout and "not reliable" in r.stdout


def test_transcoders_folder_json(tmp_path):
    lm = get_model("tiny:llama")
    data = write_corpus(tmp_path / "docs.txt")
    T = [Dictionary.init(lm.anatomy.d_model, 48, kind="topk", k=4, role="transcoder", site=f"mlp_out.{i}", seed=i,
                         model=lm.name, fingerprint=fingerprint(lm.anatomy)) for i in range(lm.anatomy.n_layers)]
    folder = save_dictionaries(T, tmp_path / "tc")
    r = run("dict", "eval", "--model", "tiny:llama", "--dict", folder, "--data", data, "--tokens", 60, "--seq-len",
            32, "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert FIELDS <= set(d) and len(d["dictionaries"]) == 2
    for x in d["dictionaries"]:
        assert FIELDS <= set(x) and set(x["baselines"]) == {"linear"} and FIELDS <= set(x["baselines"]["linear"])
    assert_same_computation(d["explained_variance"], sum(x["explained_variance"] for x in d["dictionaries"]) / 2,
                            why="the mean of the same two numbers")
    assert {"top1_agreement", "delta_loss", "kl"} <= set(d["replacement"])


def test_errors_one_line_exit_2(tmp_path):
    lm = get_model("tiny:llama")
    data = write_corpus(tmp_path / "docs.txt")
    folder = _sae(lm).save(tmp_path / "sae")
    few = write_corpus(tmp_path / "few.txt", n_docs=5)
    other = _sae(get_model("tiny:gpt2")).save(tmp_path / "gpt2sae")
    cases = [(("--dict", tmp_path / "missing", "--data", data), "does not exist"),
             (("--dict", folder, "--data", data, "--tokens", 0), "--tokens must be at least 1"),
             (("--dict", folder, "--data", few), "no held-out text"),
             (("--dict", other, "--data", data), "trained on 'tiny:gpt2'"),
             (("--dict", folder, "--data", tmp_path / "nothing.txt"), "not found")]
    for args, msg in cases:
        r = run("dict", "eval", "--model", "tiny:llama", "--seq-len", 32, *args)
        assert r.exit_code == 2, (args, r.output)
        assert msg in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_eval_over_the_memory_budget_is_one_line(tmp_path):
    lm = get_model("tiny:llama")
    data = write_corpus(tmp_path / "docs.txt")
    folder = _sae(lm).save(tmp_path / "sae")
    r = run("dict", "eval", "--model", "tiny:llama", "--dict", folder, "--data", data, "--tokens", 100, "--seq-len",
            32, "--batch-size", 2, "--max-memory", "10kB")
    assert r.exit_code == 2, r.output
    err = r.stderr.strip()
    assert err.startswith("error: dict eval: needs about ") and "\n" not in err and "Traceback" not in r.output
    assert "--batch-size" in err and "--seq-len" in err and "--max-memory" in err
