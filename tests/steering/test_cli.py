"""``lenscope steer build | eval`` and ``lenscope generate --steer``: the folder, the JSON layout (field names exact),
the files, and one-line errors with exit code 2."""

import json

import pytest
import torch
from typer.testing import CliRunner

from lenscope.cli import app
from lenscope.generation import decode
from lenscope.steering import Direction, evaluate_steering, generation_edits

from ..conftest import get_model
from .helpers import INPUTS, PAIRS, PROMPT

runner = CliRunner()
MODEL = "tiny:llama"


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def _write(tmp_path, name, header, rows):
    import csv

    p = tmp_path / name
    with p.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(header)
        w.writerows(rows)
    return p


@pytest.fixture
def files(tmp_path):
    pairs = _write(tmp_path, "pairs.csv", ["positive", "negative"], PAIRS)
    inputs = _write(tmp_path, "inputs.csv", ["text", "answer_positive", "answer_negative"], INPUTS)
    r = run("steer", "build", "--model", MODEL, "--data", pairs, "--method", "mean-diff", "--layer", 1, "--out",
            tmp_path / "dir")
    assert r.exit_code == 0, r.output
    return pairs, inputs, tmp_path / "dir"


def test_build_writes_the_folder(tmp_path, files):
    pairs, _, folder = files
    cfg = json.loads((folder / "direction.json").read_text())
    assert cfg["site"] == "resid_pre.1" and cfg["method"] == "mean-diff" and cfg["model"] == MODEL
    assert cfg["fingerprint"] and cfg["data_hash"] and (folder / "direction.safetensors").is_file()
    for method in ("actadd", "pca", "probe"):
        r = run("steer", "build", "--model", MODEL, "--data", pairs, "--method", method, "--layer", 0, "--position",
                -1, "--out", tmp_path / method, "--json")
        assert r.exit_code == 0, r.output
        d = json.loads(r.stdout)
        assert d["method"] == method and d["site"] == "resid_pre.0" and d["out"] == str(tmp_path / method)
        assert Direction.load(tmp_path / method).method == method


def test_eval_json_is_the_evaluation(tmp_path, files):
    _, inputs, folder = files
    r = run("steer", "eval", "--model", MODEL, "--vector", folder, "--data", inputs, "--multipliers",
            "-8,-4,-2,0,2,4,8", "--layers", "0,1", "--damage-tokens", 64, "--json", "--html", tmp_path / "p.html",
            "--png", tmp_path / "p.png", "--save", tmp_path / "e.safetensors")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert set(d["layers"]) == {"0", "1"}
    for rec in d["layers"].values():
        for key in ("multipliers", "mean_effect", "effect_ci", "steerable_fraction", "anti_steerable_fraction",
                    "delta_loss", "kl"):
            assert key in rec
        assert rec["multipliers"] == [-8, -4, -2, 0, 2, 4, 8]
        assert len(rec["mean_effect"]) == len(rec["effect_ci"]) == len(rec["delta_loss"]) == len(rec["kl"]) == 7
        assert all(len(ci) == 2 for ci in rec["effect_ci"])
        assert rec["mean_effect"][3] == 0 and rec["delta_loss"][3] == 0 and rec["kl"][3] == 0
    lm = get_model(MODEL)
    ref = evaluate_steering(lm, Direction.load(folder), INPUTS, [-8, -4, -2, 0, 2, 4, 8], [0, 1], damage_tokens=64)
    for k in ("0", "1"):
        for key in ("mean_effect", "steerable_fraction", "anti_steerable_fraction", "unmoved_fraction"):
            assert d["layers"][k][key] == pytest.approx(ref.to_dict()["layers"][k][key], abs=1e-9)
    assert (tmp_path / "p.html").read_text().startswith("<!doctype html>")
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG" and (tmp_path / "e.safetensors").is_file()
    # the table, the direction's own layer by default, the = form of negative multipliers, no damage
    r = run("steer", "eval", "--model", MODEL, "--vector", folder, "--data", inputs, "--multipliers=-4,0,4",
            "--no-damage")
    assert r.exit_code == 0, r.output
    assert "layer 1: steerable" in r.stdout and "layer 0" not in r.stdout
    r = run("steer", "eval", "--model", MODEL, "--vector", folder, "--data", inputs, "--multipliers=-4,0,4",
            "--no-damage", "--json")
    d = json.loads(r.stdout)
    assert d["layers"]["1"]["delta_loss"] is None and d["layers"]["1"]["kl"] is None and d["damage"]["note"]


def _error(r, *needles):
    assert r.exit_code == 2, r.output
    err = r.stderr.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1, err
    for n in needles:
        assert n in err, err


def test_one_line_errors(tmp_path, files):
    pairs, inputs, folder = files
    ev = ("steer", "eval", "--model", MODEL, "--vector", folder, "--no-damage")
    bad = _write(tmp_path, "bad.csv", ["text", "answer_positive", "answer_negative"],
                 [INPUTS[0], ("a dog is", " catastrophe", " a")])
    _error(run(*ev, "--data", bad), "row 2", "answer_positive", "not exactly one token")
    _error(run(*ev, "--data", tmp_path / "missing.csv"), "no such file")
    (tmp_path / "broken.csv").write_text("text,answer_positive,answer_negative\n\"unclosed, a, b\n")
    _error(run(*ev, "--data", tmp_path / "broken.csv"))
    _error(run(*ev, "--data", _write(tmp_path, "few.csv", ["text", "answer_positive"], [("a", " b")])),
           "answer_negative")
    _error(run(*ev, "--data", inputs, "--multipliers", "1,x"), "--multipliers")
    _error(run(*ev, "--data", inputs, "--multipliers", "2,2"), "repeated")
    _error(run(*ev, "--data", inputs, "--layers", "7"), "outside")
    _error(run("steer", "eval", "--model", "tiny:gpt2", "--vector", folder, "--data", inputs), "built on")
    vec = Direction.load(folder)
    Direction(torch.zeros(vec.d_model + 2), vec.model, vec.fingerprint, 1, "mean-diff").save(tmp_path / "wide")
    _error(run(*ev, "--data", inputs, "--vector", tmp_path / "wide"), "width")
    _error(run(*ev, "--data", inputs, "--vector", tmp_path), "not a steering direction")
    _error(run("steer", "build", "--model", MODEL, "--data", pairs, "--method", "svd", "--out", tmp_path / "x"),
           "unknown --method")
    _error(run("steer", "build", "--model", MODEL, "--data", inputs, "--out", tmp_path / "x"), "positive")
    _error(run("steer", "build", "--model", MODEL, "--data", pairs, "--layer", 9, "--out", tmp_path / "x"), "outside")
    _error(run("generate", PROMPT, "--model", MODEL, "--steer", "nope"), "DIR:ALPHA")
    _error(run("generate", PROMPT, "--model", MODEL, "--steer", f"{folder}:x"), "not a number")
    _error(run("generate", PROMPT, "--model", MODEL, "--steer", f"{folder}:2", "--explain", "logit"), "--explain")
    _error(run("generate", PROMPT, "--model", "tiny:gpt2", "--steer", f"{folder}:2"), "built on")


def test_generate_steer(files):
    _, _, folder = files
    r = run("generate", PROMPT, "--model", MODEL, "-n", 5, "--steer", f"{folder}:3@0,1", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    lm = get_model(MODEL)
    ids = lm.tokenizer(PROMPT, return_tensors="pt")["input_ids"][0]
    ref = decode(lm, ids, 5, edits=generation_edits(Direction.load(folder), 3.0, layers=[0, 1]))
    assert d["tokens"] == lm.tokenizer.batch_decode([[int(i)] for i in ref])
    assert d["methods"] == [] and d["settings"]["steer"] == [{"direction": str(folder), "method": "mean-diff",
                                                               "site": "resid_pre", "layers": [0, 1], "alpha": 3.0,
                                                               "where": "all"}]
    r = run("generate", PROMPT, "--model", MODEL, "-n", 3, "--steer", f"{folder}:-2", "--steer-where", "generated")
    assert r.exit_code == 0, r.output
    assert "steered: -2 x mean-diff direction" in r.stdout and "generated positions" in r.stdout
