"""docs/steering.md's Python example runs as written on smollm2 (the one slow steering test), and what it prints
holds: the sentiment direction moves held-out inputs, its interval excluding 0, and the locus adds up."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_docs_example_on_smollm2(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "benchmarks").symlink_to(ROOT / "benchmarks")  # the example reads the committed contrast sets
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "steering.md").read_text(), flags=re.S)
    assert blocks
    ns: dict = {}
    for code in blocks:
        exec(compile(code, "steering.md", "exec"), ns)
    r = ns["ev"].to_dict()["layers"]["12"]
    assert r["effect_ci"][2][0] > 0 and r["effect_ci"][0][1] < 0  # +4 raises the measure, -4 lowers it
    assert r["mean_effect"][1] == 0
    assert (tmp_path / "out" / "sentiment" / "direction.json").is_file()
    assert ns["g"].n_steps > 0 and ns["g"].settings["edits"] == 1
    assert float(ns["loc"].completeness_error.max()) < 1e-3
