"""Causal tracing over a fact set: ROME's position groups, averages equal to the single traces', resume, Ray."""

from __future__ import annotations

import json
import math

import pytest
import torch
from typer.testing import CliRunner

import lenscope
from lenscope.cli import app
from lenscope.interventions import causal_trace
from lenscope.sweeps.causal_trace import GROUPS, causal_trace_sweep, grouped, load_facts, position_groups

from ..conftest import get_model, jsonl_records
from ..tolerances import assert_cross_process, assert_same_computation

FACTS = [{"prompt": "The capital of France is", "subject": "France", "target": " the", "relation": "capital"},
         {"prompt": "The Eiffel Tower is in the city of", "subject": "The Eiffel Tower", "target": " the",
          "relation": "landmark"},
         {"prompt": "Paris is the capital of", "subject": "Paris", "target": " the", "relation": "capital"}]


def test_position_groups_by_hand():
    # tokens: The(0) Eiff(1) el(2) Tower(3) is(4) in(5) the(6) city(7) of(8): subject 0..3
    assert position_groups([0, 1, 2, 3], 9) == [[0], [1, 2], [3], [4], [5, 6, 7], [8]]
    # one-token subject at 3, followed directly by the last token
    assert position_groups([3], 5) == [[], [], [3], [], [], [4]]
    g = grouped(torch.arange(10.0).reshape(2, 5), [[0, 1], [], [4]])
    assert_same_computation(float(g[0, 0]), 0.5, why="the mean of 0 and 1: exact")
    assert math.isnan(g[1, 1]) and g[1, 2] == 9


def test_load_facts_round_robin_and_errors(tmp_path):
    p = tmp_path / "f.jsonl"
    p.write_text("\n".join(json.dumps(f) for f in FACTS))
    got = load_facts(str(p))
    assert [f["relation"] for f in got] == ["capital", "landmark", "capital"]
    assert len(load_facts(str(p), limit=2)) == 2
    p.write_text(json.dumps(FACTS[0]) + "\n{oops\n")
    with pytest.raises(lenscope.InputError, match="line 2"):
        load_facts(str(p))
    p.write_text(json.dumps({"prompt": "a b", "subject": "c", "target": " d"}))
    with pytest.raises(lenscope.InputError, match="not in the prompt"):
        load_facts(str(p))


def test_sweep_averages_the_single_traces_and_resumes(tmp_path):
    lm = get_model("tiny:gpt2")
    kw = dict(samples=2, window=1, noise=0.5, seed=0)
    res = causal_trace_sweep(lm, [dict(f) for f in FACTS], tmp_path / "s", progress=False, **kw)
    singles = [causal_trace(lm, f["prompt"], f["subject"], f["target"], **kw) for f in FACTS]
    for k in ("resid", "mlp", "attn"):
        per = torch.stack([grouped(getattr(t, k), position_groups(t.subject_positions, len(t.tokens)))
                           for t in singles])
        assert torch.allclose(getattr(res, k).double(), per.nanmean(0), atol=1e-6, equal_nan=True), k
    assert res.mean_p_clean == pytest.approx(sum(t.p_clean for t in singles) / 3, rel=1e-6)
    assert res.groups == GROUPS and res.n_facts == 3
    # cut the records after one fact and resume: the same records and averages
    rec = (tmp_path / "s" / "records.jsonl").read_text().splitlines()
    (tmp_path / "s" / "records.jsonl").write_text(rec[0] + "\n" + rec[1][:20])  # a torn second line
    res2 = causal_trace_sweep(lm, [dict(f) for f in FACTS], tmp_path / "s", progress=False, resume=True, **kw)
    assert (tmp_path / "s" / "records.jsonl").read_text().splitlines() == rec
    assert_same_computation(res2.resid, res.resid, why="each fact run alone by the same calls and seeds; the first "
                            "read back")
    with pytest.raises(lenscope.InputError, match="other settings"):
        causal_trace_sweep(lm, FACTS, tmp_path / "s", progress=False, resume=True, samples=3, window=1, noise=0.5)
    # save / load
    back = type(res).load(res.save(tmp_path / "r.safetensors"))
    assert back.n_facts == 3
    assert_same_computation(back.mlp, res.mlp, why="saved and read back")
    assert len(res.to_frame()) == 3 * lm.anatomy.n_layers * len(GROUPS)


def test_sweep_on_ray_matches(tmp_path):
    pytest.importorskip("ray", reason="Ray is not installed: pip install 'ray>=2.9'")
    lm = get_model("tiny:gpt2")
    kw = dict(samples=2, window=1, noise=0.5, seed=0, progress=False)
    causal_trace_sweep(lm, FACTS, tmp_path / "a", **kw)
    causal_trace_sweep(lm, FACTS, tmp_path / "b", ray=True, workers=2, **kw)
    assert_cross_process(*(jsonl_records(tmp_path / x / "records.jsonl") for x in "ba"))


def test_cli_sweep_json(tmp_path):
    p = tmp_path / "f.jsonl"
    p.write_text("\n".join(json.dumps(f) for f in FACTS))
    r = CliRunner().invoke(app, ["causal-trace-sweep", "--data", str(p), "--model", "tiny:gpt2", "--samples", "2",
                                 "--window", "1", "--out", str(tmp_path / "o"), "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["n_facts"] == 3 and d["groups"] == GROUPS and len(d["resid"]) == 2
    assert (tmp_path / "o" / "average.png").exists() and (tmp_path / "o" / "summary.safetensors").exists()
    r = CliRunner().invoke(app, ["causal-trace-sweep", "--data", str(tmp_path / "nope.jsonl"), "--model", "tiny:gpt2"])
    assert r.exit_code == 2 and "no such fact file" in r.stderr
