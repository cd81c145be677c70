"""``lenscope lens train | eval | show`` on a tiny model."""

import json

from typer.testing import CliRunner

from lenscope.cli import app

runner = CliRunner()
TEXT = ("When Mary and John went to the store, John gave a drink to Mary.\n"
        "The capital of France is Paris. The keys to the cabinet are on the table.\n") * 40


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_train_eval_resume(tmp_path):
    data = tmp_path / "corpus.txt"
    data.write_text(TEXT)
    out = tmp_path / "lens"
    r = run("lens", "train", "--model", "tiny:gpt2", "--data", data, "--tokens", 1024, "--seq-len", 32,
            "--out", out, "--checkpoint-every", 2, "--json")
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 8 and summary["tokens_seen"] == 1024
    assert (out / "config.json").exists() and (out / "params.safetensors").exists()
    r = run("lens", "train", "--model", "tiny:gpt2", "--data", data, "--tokens", 1024, "--seq-len", 32,
            "--out", out, "--checkpoint-every", 2, "--resume", "--json")
    assert r.exit_code == 0, r.output  # resuming a finished run is a no-op that still writes the lens
    for lens in ("logit", out):
        r = run("lens", "eval", "--model", "tiny:gpt2", "--data", data, "--lens", lens, "--tokens", 256,
                "--seq-len", 32, "--json")
        assert r.exit_code == 0, r.output
        d = json.loads(r.stdout)
        assert {"lens", "layers", "mean_kl"} <= set(d)
        assert {"layer", "kl", "ce", "entropy", "top1_agreement"} <= set(d["layers"][0])
        assert len(d["layers"]) == 3
    r = run("lens", "eval", "--model", "tiny:llama", "--data", data, "--lens", out, "--seq-len", 32)
    assert r.exit_code == 2 and "trained on 'tiny:gpt2'" in r.stderr


def test_bad_input(tmp_path):
    r = run("lens", "train", "--model", "tiny:gpt2", "--data", tmp_path / "missing.txt", "--out", tmp_path / "o")
    assert r.exit_code == 2 and "data file not found" in r.stderr
    (tmp_path / "empty.txt").write_text("  \n")
    r = run("lens", "eval", "--model", "tiny:gpt2", "--data", tmp_path / "empty.txt", "--seq-len", 32)
    assert r.exit_code == 2 and "empty" in r.stderr
    r = run("lens", "eval", "--model", "tiny:gpt2", "--data", tmp_path / "empty.txt", "--lens", tmp_path / "nolens")
    assert r.exit_code == 2 and "not found" in r.stderr
    (tmp_path / "t.txt").write_text(TEXT)
    r = run("lens", "train", "--model", "tiny:gpt2", "--data", tmp_path / "t.txt", "--out", tmp_path / "o",
            "--seq-len", 4096)
    assert r.exit_code == 2 and "context" in r.stderr


def test_show_json_html_png(tmp_path):
    data = tmp_path / "corpus.txt"
    data.write_text(TEXT)
    out = tmp_path / "lens"
    assert run("lens", "train", "--model", "tiny:llama", "--data", data, "--tokens", 256, "--seq-len", 32,
               "--out", out).exit_code == 0
    html, png = tmp_path / "t.html", tmp_path / "t.png"
    r = run("lens", "show", "The capital of France is", "--model", "tiny:llama", "--lens", out, "--html", html,
            "--png", png, "--json")
    assert r.exit_code == 0, r.output
    trajs = json.loads(r.stdout)
    assert [t["lens"] for t in trajs] == ["tuned", "logit"]
    assert len(trajs[0]["state_labels"]) == 3 and html.read_text().lower().startswith("<!doctype html>")
    assert png.read_bytes()[:4] == b"\x89PNG"
    r = run("lens", "show", "The capital", "--model", "tiny:llama")
    assert r.exit_code == 0 and "logit lens" in r.stdout
    r = run("lens", "show", "The capital", "--model", "tiny:llama", "--lens", "logit", "--json", "--png", png)
    assert r.exit_code == 0 and [t["lens"] for t in json.loads(r.stdout)] == ["logit"]  # drawn once, not twice
    from PIL import Image

    assert Image.open(png).size[0] < 2 * Image.open(png).size[1] + 400  # one panel (plus its colour bar)
    r = run("lens", "show", "", "--model", "tiny:llama")
    assert r.exit_code == 2 and "empty" in r.stderr
    r = run("lens", "show", "x", "--model", "tiny:llama", "--value", "nope")
    assert r.exit_code == 2 and "--value" in r.stderr
