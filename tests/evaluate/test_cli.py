"""``lenscope eval alignment``: the documented JSON shape, the table, files, and one-line errors (exit 2)."""

import json
from pathlib import Path

from typer.testing import CliRunner

from lenscope.cli import app

DATA = Path(__file__).with_name("data")
runner = CliRunner()


def run(*args):
    return runner.invoke(app, list(args))


def test_json_shape_and_files(tmp_path):
    out = tmp_path / "run"
    r = run("eval", "alignment", "--model", "tiny:qwen2", "--dataset", str(DATA / "tiny.csv"), "--dataset",
            f"sva:{DATA / 'sva.tsv'}", "--methods", "logit,alti-logit,grad-norm,ig", "--ig-steps", "2", "--json",
            "--no-progress", "--out", str(out))
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["model"] == "tiny:qwen2" and d["methods"] == ["logit", "alti-logit", "grad-norm", "ig"]
    assert list(d["datasets"]) == ["tiny.csv", "sva:sva.tsv"]
    for ds in d["datasets"].values():
        for key in ("n", "skipped", "accuracy", "accuracy_ci", "skip_reasons", "groups", "layers", "methods"):
            assert key in ds
        for e in ds["methods"].values():
            assert {"mrr", "mrr_ci", "n", "skipped", "accuracy", "probes", "dot", "correct"} <= set(e)
    assert set(d["datasets"]["sva:sva.tsv"]["groups"]) == {"0", "1", "2"}
    assert {"trace", "ig"} <= set(d["timing"]["per_example"])
    for f in ("records.jsonl", "summary.json", "table.md", "table.csv", "layers.png", "mrr.png"):
        assert (out / f).exists(), f
    # the plain table: rows datasets, columns methods
    r2 = run("eval", "alignment", "--model", "tiny:qwen2", "--dataset", str(DATA / "tiny.csv"), "--methods",
             "logit,alti-logit,grad-norm,ig", "--ig-steps", "2", "--no-progress", "--out", str(out))
    assert r2.exit_code == 0, r2.output
    assert "| dataset | n | skipped | accuracy | logit | alti-logit | grad-norm | ig | random |" in r2.stdout
    assert "| tiny.csv | 5 | 1 |" in r2.stdout and "| random |" in r2.stdout


def test_errors_are_one_line_with_exit_code_2(tmp_path):
    r = run("eval", "alignment", "--model", "tiny:gpt2", "--dataset", str(DATA / "bad_row.csv"))
    assert r.exit_code == 2
    msg = r.output.strip()
    assert len(msg.splitlines()) == 1 and "row 2" in msg and "one_prefix_word_bad" in msg
    r = run("eval", "alignment", "--model", "tiny:gpt2", "--dataset", f"sva:{DATA / 'bad_sva.tsv'}")
    assert r.exit_code == 2 and "line 2" in r.output and len(r.output.strip().splitlines()) == 1
    r = run("eval", "alignment", "--model", "tiny:gpt2", "--dataset", str(DATA / "tiny.csv"), "--methods", "alti")
    assert r.exit_code == 2 and "unknown method 'alti'" in r.output
    r = run("eval", "alignment", "--model", "tiny:bert", "--dataset", str(DATA / "tiny.csv"))
    assert r.exit_code == 2 and "causal decoder" in r.output
    r = run("eval", "alignment", "--model", "tiny:gpt2")
    assert r.exit_code == 2 and "--dataset" in r.output
