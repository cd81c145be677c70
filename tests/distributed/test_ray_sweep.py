"""Dataset sweeps on a local Ray (2 workers) give the same results, files and resume as the sequential run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from lenscope.cli import app
from lenscope.distributed import run_sweep
from lenscope.sweeps.mixing_study import mixing_study

from ..conftest import get_model, jsonl_records
from ..tolerances import assert_cross_process

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'ray>=2.9' (./dev test installs it)")

SENTS = ["The cat sat on the mat.", "Dogs bark.", "A very long sentence " * 9, "She gave him the book.",
         "It rained all day in the old town.", "x", "The keys to the cabinet are on the table."]


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    yield
    ray.shutdown()


def _job(lm, item):
    """A picklable job: the model's last-position logits on a text, and the worker's model name."""
    import lenscope

    tr = lenscope.trace(lm, item)
    return lm.name, tr.logits[-1].tolist()


def test_run_sweep_is_ordered_and_equal_to_sequential():
    lm = get_model("tiny:gpt2")
    texts = ["a b c", "the cat", "one two three four", "x y", "hello there"]
    seq = list(run_sweep(_job, texts, lm=lm))
    par = list(run_sweep(_job, texts, lm=lm, ray=True, workers=2))
    assert [i for i, _ in par] == list(range(len(texts)))
    # the same numbers up to float rounding (the workers may run other kernels or thread counts)
    assert_cross_process(par, seq)
    assert_cross_process(list(run_sweep(_job, texts, lm=lm, ray=True, workers=2, start=3)), seq[3:])


def test_mixing_study_on_ray_writes_the_same_files(tmp_path):
    lm = get_model("tiny:gpt2")
    a, b = tmp_path / "seq", tmp_path / "ray"
    s1 = mixing_study(lm, SENTS, a, dataset="t", max_tokens=20, progress=False)
    s2 = mixing_study(lm, SENTS, b, dataset="t", max_tokens=20, progress=False, ray=True, workers=2)
    assert_cross_process(jsonl_records(b / "records.jsonl"), jsonl_records(a / "records.jsonl"))
    assert_cross_process(s2.to_dict(), s1.to_dict())
    assert s1.skipped == 2
    # an interrupted Ray run resumes: keep 3 records, resume on Ray, get the same files
    lines = (b / "records.jsonl").read_text().splitlines()[:3]
    (b / "records.jsonl").write_text("".join(x + "\n" for x in lines))
    st = json.loads((b / "state.json").read_text())
    st["done"], st["tokens"] = 3, sum(json.loads(x)["n"] for x in lines if not json.loads(x)["skipped"])
    from safetensors.torch import load_file, save_file

    # the saved FF sums of the first 3 records, recomputed (what the interrupted run would have saved)
    s3 = mixing_study(lm, SENTS[:3], tmp_path / "three", dataset="t", max_tokens=20, progress=False)
    save_file({"absum": load_file(str(tmp_path / "three" / "state.safetensors"))["absum"]},
              str(b / "state.safetensors"))
    st["meta"]["n"] = len(SENTS)
    (b / "state.json").write_text(json.dumps(st))
    s4 = mixing_study(lm, SENTS, b, dataset="t", max_tokens=20, progress=False, resume=True, ray=True, workers=2)
    assert_cross_process(jsonl_records(b / "records.jsonl"), jsonl_records(a / "records.jsonl"))
    assert_cross_process(s4.to_dict(), s1.to_dict())
    assert s3.n_sentences + s3.skipped == 3


def test_cli_mixing_study_ray(tmp_path):
    data = tmp_path / "s.txt"
    data.write_text("\n".join(SENTS[:4]))
    runner = CliRunner()
    r1 = runner.invoke(app, ["mixing", "study", "--model", "tiny:gpt2", "--data", str(data), "--out",
                             str(tmp_path / "a"), "--json"])
    r2 = runner.invoke(app, ["mixing", "study", "--model", "tiny:gpt2", "--data", str(data), "--out",
                             str(tmp_path / "b"), "--ray", "--workers", "2", "--json"])
    assert r1.exit_code == 0 and r2.exit_code == 0, r2.output
    assert_cross_process(json.loads(r2.stdout), json.loads(r1.stdout))


def test_without_ray_nothing_imports_it(tmp_path):
    code = ("import sys, lenscope\nfrom lenscope.sweeps.mixing_study import mixing_study\nimport lenscope.cli\n"
            "lm = lenscope.load('tiny:gpt2')\n"
            "mixing_study(lm, ['The cat sat on the mat.', 'Dogs bark loudly.'], progress=False)\n"
            "assert 'ray' not in sys.modules, 'ray was imported'\nprint('ok')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]


def test_bad_workers_is_a_clear_error():
    import lenscope

    with pytest.raises(lenscope.InputError, match="workers"):
        list(run_sweep(_job, ["a"], lm=get_model("tiny:gpt2"), ray=True, workers=0))
    assert torch.is_tensor(torch.zeros(1))


def test_ray_address_argument_forms():
    from lenscope.cli.sweeps import ray_target, split_ray_address

    assert split_ray_address(["eval", "--ray", "auto", "--json"]) == [
        "eval", "--ray", "--ray-address", "auto", "--json"]
    assert split_ray_address(["x", "--ray", "--workers", "2"]) == ["x", "--ray", "--workers", "2"]
    assert split_ray_address(["x", "--ray=ray://h:10001"]) == ["x", "--ray", "--ray-address", "ray://h:10001"]
    assert split_ray_address(["x", "--ray", "10.0.0.1:6379"])[-1] == "10.0.0.1:6379"
    assert split_ray_address(["mixing", "study", "--ray"]) == ["mixing", "study", "--ray"]
    assert ray_target(False, None) is None and ray_target(True, None) is True
    assert ray_target(True, "auto") == "auto" and ray_target(False, "local") is True


def test_eval_alignment_on_ray_matches(tmp_path):
    """The evaluation sweep on Ray: the same records (timings aside) and the same summary as sequentially."""
    from pathlib import Path

    from lenscope.evaluate.alignment import run_alignment

    data = Path(__file__).resolve().parents[1] / "evaluate" / "data"
    lm = get_model("tiny:qwen2")
    specs = [str(data / "tiny.csv"), f"sva:{data / 'sva.tsv'}"]
    kw = dict(methods=["logit", "alti-logit", "grad-x-input", "erasure"], progress=False, batch_size=2)
    a = run_alignment(lm, specs, out=tmp_path / "a", **kw)
    b = run_alignment(lm, specs, out=tmp_path / "b", ray=True, workers=2, **kw)

    def strip(path):
        recs = [json.loads(x) for x in (path / "records.jsonl").read_text().splitlines()]
        for r in recs:
            for k in [k for k in r if "time" in k or "cpu" in k]:
                r.pop(k)
        return recs

    assert_cross_process(strip(tmp_path / "b"), strip(tmp_path / "a"))
    da, db = a.to_dict(), b.to_dict()
    for d in (da, db):
        d.pop("timing", None)
        d.pop("info", None)
    assert_cross_process(db, da)
