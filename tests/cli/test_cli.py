"""The command line: JSON fields, exit codes, one-line errors."""

import json

import pytest
from typer.testing import CliRunner

from lenscope.cli import app

runner = CliRunner()


def run(*args):
    return runner.invoke(app, list(args))


def test_models_json():
    r = run("models", "--json")
    assert r.exit_code == 0
    rows = json.loads(r.stdout)  # one list (kept as before families were listed): kinds embedded, tiny, family
    names = {row["name"] for row in rows}
    assert {"smollm2", "gemma3-270m", "minilm", "tiny:gpt2", "tiny:bert", "tiny:gemma3"} <= names
    assert all(isinstance(row["installed"], bool) for row in rows)
    # every family, with what it supports read from its tiny models' Anatomies
    from lenscope.models.families import families

    fams = {f["family"]: f for f in rows if f["kind"] == "family"}
    assert all(f["name"] == f["family"] for f in fams.values())
    assert set(fams) == set(families())
    assert {m for f in fams.values() for m in f["model_types"]} >= {"gptj", "cohere", "falcon", "starcoder2", "bert"}
    assert fams["bert"]["architecture"] == "encoder" and fams["bert"]["block"] == ["post"]
    assert fams["gpt-neox"]["parallel"] and not fams["llama"]["parallel"] and fams["llama"]["block"] == ["pre"]
    assert "shared by attention and MLP" in fams["gptj"]["norms"] and "rotary (interleaved) (partial)" in \
        fams["gptj"]["attention"]
    assert fams["cohere"]["norms"][:1] == ["layernorm"] and "no bias" in fams["cohere"]["norms"]
    assert "logit scale 0.25" in fams["cohere"]["head"] and "gated" in fams["cohere"]["mlp"]
    assert fams["falcon"]["tiny"] == ["tiny:falcon", "tiny:falcon-new"]
    assert {"multi-query", "grouped-query"} <= set(fams["falcon"]["attention"])
    assert "sliding window" in fams["starcoder2"]["attention"] and fams["gemma3"]["block"] == ["sandwich"]
    assert fams["llama"]["norms"] == ["rmsnorm"] and not fams["llama"]["moe"] and not fams["falcon"]["moe"]
    # issue 31's families, with their switches as the Anatomy holds them
    assert {m for f in fams.values() for m in f["model_types"]} >= {"gemma2", "gemma3", "phi3", "olmo2", "olmo3",
                                                                     "stablelm", "granite", "smollm3"}
    assert fams["gemma2"]["block"] == ["sandwich"] and "soft-capped" in fams["gemma2"]["attention"]
    assert fams["olmo2"]["norms"] == ["identity", "rmsnorm"] and "q/k norms across heads" in fams["olmo2"]["attention"]
    assert "q/k norms across heads" in fams["olmoe"]["attention"] and "q/k norms across heads" not in \
        fams["llama"]["attention"]
    assert fams["granite"]["block"] == ["pre", "residual scale"] and "logit scale 0.25" in fams["granite"]["head"]
    assert "rotary (not every layer)" in fams["smollm3"]["attention"]
    assert "rotary (partial)" in fams["phi3"]["attention"]
    assert "shared by attention and MLP" in fams["stablelm"]["norms"] and fams["stablelm"]["parallel"]
    text = run("models")
    assert text.exit_code == 0 and "model families" in text.stdout and "starcoder2" in text.stdout


def test_verify_json_fields():
    r = run("verify", "--model", "tiny:bloom", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    for k in ("model", "family", "n_layers", "max_abs_logit_error", "max_rel_resid_error", "ok"):
        assert k in d
    assert d["ok"] is True and d["family"] == "bloom" and d["n_layers"] == 2


def test_components_json_fields_and_token_ids():
    r = run("components", "The capital of France is", "--model", "tiny:llama", "--target", " capital", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    for k in ("tokens", "target", "foil", "components", "logit", "completeness_error"):
        assert k in d
    assert d["completeness_error"] < 1e-4
    assert {"name", "layer", "head", "value"} <= set(d["components"][0])
    tid = d["target_id"]
    r2 = run("components", "The capital of France is", "--model", "tiny:llama", "--target", f"#{tid}", "--json")
    assert json.loads(r2.stdout)["logit"] == pytest.approx(d["logit"])


def test_components_by_head_foil_png_and_table(tmp_path):
    png = tmp_path / "dla.png"
    r = run("components", "The capital of France is", "--model", "tiny:gpt2", "--target", " capital",
            "--foil", " of", "--by-head", "--png", str(png))
    assert r.exit_code == 0, r.output
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
    assert "L1.H3" in r.stdout and "completeness error" in r.stdout


@pytest.mark.parametrize("args,msg", [
    (["components", "", "--model", "tiny:gpt2", "--target", " capital"], "empty"),
    (["components", "The capital", "--model", "tiny:gpt2", "--target", " Paris"], "splits into"),
    (["components", "word " * 300, "--model", "tiny:gpt2", "--target", " capital"], "context"),
    (["components", "The capital", "--model", "nope", "--target", " capital"], "unknown model"),
    (["verify", "--model", "tiny:nope"], "unknown tiny family"),
    (["components", "The capital", "--model", "tiny:bert", "--target", " capital"], "does not apply"),
])
def test_bad_input_exit_2_one_line(args, msg):
    r = run(*args)
    assert r.exit_code == 2
    err = r.stderr.strip()
    assert err.startswith("error:") and msg in err and len(err.splitlines()) == 1
