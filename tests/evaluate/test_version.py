"""Records carry the code version; a resume that would mix versions is refused unless forced."""

import json

import pytest

import lenscope
from lenscope.errors import InputError
from lenscope.evaluate.alignment import read_records, run_alignment
from lenscope.version import code_version

from ..conftest import get_model
from .test_alignment import DATA


def test_code_version():
    v = code_version()
    assert v.startswith(lenscope.__version__)
    # in this repository's checkout: the version plus the commit, e.g. 0.1.0+git.9c41435abcde
    if v != lenscope.__version__:
        head = v.split("+git.")[1]
        assert len(head) == 12 and int(head, 16) >= 0


def test_resume_refuses_to_mix_versions(tmp_path):
    lm = get_model("tiny:gpt2")
    specs = [str(DATA / "tiny.csv")]
    run_alignment(lm, specs, ["logit"], out=tmp_path, progress=False)
    path = tmp_path / "records.jsonl"
    recs = read_records(path)
    assert {r["version"] for r in recs.values()} == {code_version()}
    # records written before this change (no version field), and one example left to compute
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    for r in lines:
        r.pop("version")
    path.write_text("".join(json.dumps(r) + "\n" for r in lines[:-1]))
    with pytest.raises(InputError, match=r"another code version \(5 of version unrecorded; this is"):
        run_alignment(lm, specs, ["logit"], out=tmp_path, progress=False)
    # another version string counts as different too
    lines[0]["version"] = "0.0.1"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines[:-1]))
    with pytest.raises(InputError, match="--force"):
        run_alignment(lm, specs, ["logit"], out=tmp_path, progress=False)
    forced = run_alignment(lm, specs, ["logit"], out=tmp_path, progress=False, force=True)
    assert forced.info["computed_now"] == 1
    assert forced.info["versions"] == {"0.0.1": 1, "unrecorded": 4, code_version(): 1}
    # nothing left to compute: only the summary is rewritten, no refusal
    again = run_alignment(lm, specs, ["logit"], out=tmp_path, progress=False)
    assert again.info["computed_now"] == 0 and again.info["versions"] == forced.info["versions"]


def test_cli_force_and_baseline(tmp_path):
    from typer.testing import CliRunner

    from lenscope.cli import app

    runner = CliRunner()
    args = ["eval", "alignment", "--model", "tiny:gpt2", "--dataset", str(DATA / "tiny.csv"), "--methods", "logit",
            "--no-progress", "--out", str(tmp_path)]
    assert runner.invoke(app, args).exit_code == 0
    path = tmp_path / "records.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    for r in lines:
        r["version"] = "0.0.1"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines[:-1]))
    r = runner.invoke(app, args)
    assert r.exit_code == 2 and "another code version" in r.output and len(r.output.strip().splitlines()) == 1
    r = runner.invoke(app, args + ["--force", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["info"]["versions"] == {"0.0.1": 5, code_version(): 1}
    r = runner.invoke(app, args[:-2] + ["--baseline", "ones"])
    assert r.exit_code == 2 and "--baseline" in r.output
