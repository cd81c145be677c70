"""``lenscope generate``: the JSON of to_dict() on stdout, progress on stderr, files, one-line errors (exit 2)."""

import json

import pytest
from typer.testing import CliRunner

from lenscope.cli import app
from lenscope.generation import Generation, generate

from ..conftest import get_model
from ..tolerances import assert_same_computation

runner = CliRunner()
PROMPT = "the cat sat on the"


def run(*args):
    return runner.invoke(app, list(args))


def test_json_is_to_dict_and_files(tmp_path):
    r = run("generate", PROMPT, "--model", "tiny:llama", "--max-new-tokens", "3", "--explain", "logit,alti",
            "--json", "--html", str(tmp_path / "g.html"), "--png", str(tmp_path / "g.png"),
            "--save", str(tmp_path / "g.safetensors"))
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    ref = generate(get_model("tiny:llama"), PROMPT, 3, explain=("logit", "alti")).to_dict()
    assert d["methods"] == ["logit", "alti"] and d["text"] == ref["text"] and d["tokens"] == ref["tokens"]
    for a, b in zip(d["generated"], ref["generated"]):
        assert a["id"] == b["id"] and a["foil"] == b["foil"] and a["runner_up"] == b["runner_up"]
        for m in ("logit", "alti"):
            assert a["explanations"][m]["scores"] == pytest.approx(b["explanations"][m]["scores"], abs=1e-6)
    assert "generate" in r.stderr  # progress goes to stderr
    page = (tmp_path / "g.html").read_text()
    assert "<html" in page.lower() and len(page) > 1000
    assert (tmp_path / "g.png").read_bytes()[:4] == b"\x89PNG"
    g = Generation.load(tmp_path / "g.safetensors")
    assert g.ids.tolist()[: g.prompt_len] == get_model("tiny:llama").tokenizer(PROMPT)["input_ids"]
    assert_same_computation(g.to_dict()["generated"], d["generated"], why="one generation, saved and printed")
    assert float(g.matrix("alti")[0, g.prompt_len:].abs().sum()) == 0


def test_sample_with_seed_and_foil_token():
    args = ("generate", PROMPT, "--model", "tiny:gpt2", "-n", "4", "--sample", "--seed", "7", "--json", "--explain",
            "grad-x-input", "--foil", "#5")
    a, b = run(*args), run(*args)
    assert a.exit_code == 0, a.output
    da, db = json.loads(a.stdout), json.loads(b.stdout)
    assert [s["id"] for s in da["generated"]] == [s["id"] for s in db["generated"]]
    assert all(s["foil"]["id"] == 5 or s["id"] == 5 for s in da["generated"])


def test_tuned_lens_folder(tmp_path):
    import torch

    from lenscope.lenses.lenses import TunedLens

    lm = get_model("tiny:gpt2")
    lens = TunedLens(lm.anatomy, model_name=lm.name)
    with torch.no_grad():
        lens.b.copy_(torch.randn(lens.b.shape, generator=torch.Generator().manual_seed(1)))
    lens.save(tmp_path / "lens")
    r = run("generate", PROMPT, "--model", "tiny:gpt2", "-n", "3", "--explain", "", "--lens", str(tmp_path / "lens"),
            "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    ref = generate(lm, PROMPT, 3, explain=(), lens=lens)
    assert [s["tuned_depth"] for s in d["generated"]] == [s["tuned_depth"] for s in ref.to_dict()["generated"]]
    assert d["methods"] == [] and all(s["explanations"] == {} for s in d["generated"])


@pytest.mark.parametrize("args, message", [
    (("-n", "0"), "--max-new-tokens must be at least 1"),
    (("-n", "100000"), "context"),
    (("--explain", "nope"), "unknown method"),
    (("--foil", "cat sat"), "not exactly one token"),
    (("--chat",), "chat template"),
    (("--seed", "1"), "--sample"),
    (("--model", "tiny:bert"), "causal decoder"),
])
def test_bad_input_is_one_line_exit_2(args, message):
    base = ["generate", PROMPT, "--model", "tiny:llama", "-n", "2", "--json"]
    r = run(*(base + list(args)))
    assert r.exit_code == 2, r.output
    assert message in r.stderr and len(r.stderr.strip().splitlines()[-1]) < 400
    assert r.stdout == ""
