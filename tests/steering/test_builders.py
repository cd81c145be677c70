"""The table of steering-direction builders (``lenscope.steering.builders``): a builder registered in this file, with
no other edit, is listed by ``lenscope steer build --help``, built by the command and by
:func:`lenscope.steering.build_direction` (given its declared option, its needs checked), and steers a generation
from its folder; the built-in table keeps its names, order and needs."""

from __future__ import annotations

import json
import re

import pytest
import torch
from typer.testing import CliRunner

import lenscope.steering
from lenscope.cli import app
from lenscope.errors import InputError
from lenscope.models.loading.load import token_ids
from lenscope.steering import Builder, Direction, build_direction, builders
from lenscope.steering.directions import states_at

from ..conftest import get_model
from ..tolerances import assert_same_computation
from .helpers import PAIRS, PROMPT

NAME = "pair-k"  # the difference of pair k alone (option ``pair``, default 0)
MODEL = "tiny:llama"

runner = CliRunner()


def _pair_k(pos: torch.Tensor, neg: torch.Tensor, pair: int = 0):
    d = pos[pair] - neg[pair]
    return d / d.norm(), {"pair": pair}


@pytest.fixture
def dummy():
    builders.register(Builder(NAME, _pair_k, help="one pair's difference", min_pairs=2, options=("pair",)))
    try:
        yield NAME
    finally:
        builders.unregister(NAME)
    assert NAME not in builders.names()


def _help() -> str:
    r = runner.invoke(app, ["steer", "build", "--help"])
    assert r.exit_code == 0, r.output
    return " ".join(re.sub(r"-\n\s+", "-", r.output).split())


def test_builtin_table():
    assert builders.names() == ("actadd", "mean-diff", "pca", "probe") == lenscope.steering.METHODS
    assert [(b.min_pairs, b.one_pair, b.options) for b in builders.builders()] == [
        (1, True, ()), (1, False, ()), (2, False, ()), (2, False, ())]
    assert "--method actadd|mean-diff|pca|probe actadd (first pair), mean-diff, pca or probe." in _help()
    with pytest.raises(ValueError, match="already registered"):
        builders.register(Builder("pca", _pair_k))
    with pytest.raises(InputError, match="unknown method 'nope'; choose from actadd, mean-diff, pca, probe"):
        builders.get("nope")


def test_a_registered_builder_is_everywhere(dummy, tmp_path):
    lm = get_model(MODEL)
    # the command line's choices and help, and the package's names
    assert (f"--method actadd|mean-diff|pca|probe|{dummy} actadd (first pair), mean-diff, pca, probe or {dummy} "
            "(one pair's difference).") in _help()
    assert lenscope.steering.METHODS[-1] == dummy

    # the Python API: its option reaches it; the vector is scaled as every builder's is
    d = build_direction(lm, PAIRS, dummy, 1, pair=2)
    assert d.method == dummy and d.n_pairs == len(PAIRS) and d.stats["pair"] == 2
    ids = [token_ids(lm, t) for t in [p for p, _ in PAIRS] + [n for _, n in PAIRS]]
    h = states_at(lm, ids, 1, -1)
    pos, neg = h[: len(PAIRS)], h[len(PAIRS):]
    u = (pos[2] - neg[2]) / (pos[2] - neg[2]).norm()
    want = (float((pos - neg).mean(0) @ u) * u).float()
    assert_same_computation(d.vector, want, why="the builder's and this test's float64 steps on the same states")

    # its declarations are checked
    with pytest.raises(InputError, match=f"{dummy} takes no option 'alpha'; it takes pair"):
        build_direction(lm, PAIRS, dummy, 1, alpha=1)
    with pytest.raises(InputError, match="mean-diff takes no option 'pair'"):
        build_direction(lm, PAIRS, "mean-diff", 1, pair=1)
    with pytest.raises(InputError, match=f"{dummy} needs at least 2 pairs; the pairs has 1"):
        build_direction(lm, PAIRS[:1], dummy, 1)

    # lenscope steer build writes its folder; lenscope generate --steer reads it
    data = tmp_path / "pairs.csv"
    data.write_text("positive,negative\n" + "".join(f"{p},{n}\n" for p, n in PAIRS))
    r = runner.invoke(app, ["steer", "build", "--model", MODEL, "--data", str(data), "--method", dummy, "--layer",
                            "1", "--out", str(tmp_path / "dir"), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["method"] == dummy and Direction.load(tmp_path / "dir").method == dummy
    r = runner.invoke(app, ["generate", PROMPT, "--model", MODEL, "-n", "2", "--steer", f"{tmp_path / 'dir'}:4"])
    assert r.exit_code == 0, r.output
    assert f"+4 x {dummy} direction" in r.stdout


def test_after_unregistering_it_is_gone(tmp_path):
    assert NAME not in _help()
    r = runner.invoke(app, ["steer", "build", "--model", MODEL, "--data", str(tmp_path / "x.csv"), "--method", NAME,
                            "--out", str(tmp_path / "dir")])
    assert r.exit_code == 2 and r.stderr.strip() == (f"error: unknown --method {NAME!r}; choose from actadd, "
                                                      "mean-diff, pca, probe")
    with pytest.raises(InputError, match=f"unknown method '{NAME}'"):
        build_direction(get_model(MODEL), PAIRS, NAME, 1)
