"""``lenscope mixing`` and ``lenscope mixing study`` from the command line."""

import json

import pytest
from typer.testing import CliRunner

from lenscope.cli import app
from tests.tolerances import assert_same_computation

runner = CliRunner()
TEXT = "The capital of France is"


def run(*args):
    return runner.invoke(app, list(args))


def test_maps_json_fields():
    r = run("mixing", TEXT, "--model", "tiny:qwen2", "--scope", "atblnff", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    for k in ("tokens", "scope", "layers", "completeness_error"):
        assert k in d
    n = len(d["tokens"])
    assert d["scope"] == "atblnff" and len(d["layers"]) == 2 and len(d["layers"][0]) == n
    assert all(len(row) == n for row in d["layers"][0]) and d["completeness_error"] < 1e-4
    assert all(d["layers"][1][i][j] == 0 for i in range(n) for j in range(i + 1, n))  # causal
    one = json.loads(run("mixing", TEXT, "--model", "tiny:qwen2", "--scope", "atblnff", "--layer", "1",
                         "--json").stdout)
    assert one["layers"] == [d["layers"][1]] and one["layer_indices"] == [1]


def test_encoder_default_scope_png_and_folder(tmp_path):
    png = tmp_path / "m.png"
    r = run("mixing", TEXT, "--model", "tiny:bert", "--png", str(png))
    assert r.exit_code == 0, r.output
    assert "scope atbffresln" in r.stdout and png.read_bytes()[:4] == b"\x89PNG"
    from ..conftest import get_model

    lm = get_model("tiny:bloom")
    lm.model.save_pretrained(tmp_path / "m")
    lm.tokenizer.save_pretrained(tmp_path / "m")
    r = run("mixing", TEXT, "--model", str(tmp_path / "m"), "--scope", "atb", "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["scope"] == "atb"


def test_study_json_and_resume(tmp_path):
    data = tmp_path / "s.txt"
    data.write_text("the cat sat on the mat\nthe keys to the cabinet are here\na dog ran in the park\n")
    out = tmp_path / "out"
    r = run("mixing", "study", "--model", "tiny:gpt2", "--data", str(data), "--limit", "2", "--out", str(out), "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout.strip().splitlines()[-1])
    assert d["n_sentences"] + d["skipped"] == 2 and d["dataset"] == "s.txt"
    assert (out / "summary.json").exists() and (out / "contextualization.png").exists()
    r2 = run("mixing", "study", "--model", "tiny:gpt2", "--data", str(data), "--limit", "2", "--out", str(out),
             "--resume", "--json")
    assert r2.exit_code == 0
    assert_same_computation(json.loads(r2.stdout.strip().splitlines()[-1]), d, why="the resume reads every record "
                            "back: nothing is recomputed")


@pytest.mark.parametrize("args,msg", [
    (["mixing", TEXT, "--model", "tiny:bert", "--scope", "atbln"], "does not apply"),
    (["mixing", TEXT, "--model", "tiny:gpt2", "--scope", "nope"], "does not apply"),
    (["mixing", TEXT, "--model", "tiny:gpt2", "--layer", "7"], "does not exist"),
    (["mixing", TEXT, "--model", "tiny:gpt2", "--data", "sst2"], "mixing study"),
    (["mixing", "study", "--model", "tiny:gpt2"], "needs --data"),
    (["mixing", "study", "--model", "tiny:gpt2", "--data", "nope.txt"], "neither"),
    (["mixing", "study", "--model", "tiny:gpt2", "--data", "sst2", "--resume"], "--out"),
    (["mixing", "", "--model", "tiny:gpt2"], "empty"),
])
def test_bad_input_exit_2_one_line(args, msg):
    r = run(*args)
    assert r.exit_code == 2, r.output
    err = r.stderr.strip()
    assert err.startswith("error:") and msg in err and len(err.splitlines()) == 1
