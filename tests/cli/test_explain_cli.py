"""``lenscope explain``: JSON fields as the issue names them, files, model folders, one-line errors."""

import json

import pytest
from typer.testing import CliRunner

from lenscope.cli import app

from ..conftest import get_model

runner = CliRunner()
TEXT = "The capital of France is"


def run(*args):
    return runner.invoke(app, list(args))


@pytest.mark.parametrize("method", ["logit", "alti-logit"])
def test_logit_methods_json(method):
    r = run("explain", TEXT, "--model", "tiny:llama", "--target", " capital", "--foil", " of", "--method", method,
            "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    for k in ("tokens", "scores", "method", "target", "foil", "layers", "attention_update", "invariant_error"):
        assert k in d
    assert d["method"] == method and d["target"] == " capital" and d["foil"] == " of"
    assert len(d["scores"]) == len(d["tokens"]) and len(d["layers"]) == 2 and len(d["attention_update"]) == 2
    assert d["invariant_error"] < 1e-5
    # per-layer scores add up to the total
    assert sum(map(sum, d["layers"])) == pytest.approx(sum(d["scores"]), abs=1e-5)


@pytest.mark.parametrize("model", ["tiny:gpt2", "tiny:bert"])
def test_alti_without_target_is_a_rollout_row(model):
    r = run("explain", TEXT, "--model", model, "--method", "alti", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["target"] is None and sum(d["scores"]) == pytest.approx(1.0, abs=1e-5)
    r2 = run("explain", TEXT, "--model", model, "--method", "alti", "--position", "1", "--json")
    d2 = json.loads(r2.stdout)
    assert d2["position"] == 1 and d2["scores"] != d["scores"]
    if model == "tiny:gpt2":  # causal: position 1 takes nothing from later tokens
        assert all(v == 0 for v in d2["scores"][2:])


def test_token_ids_html_png_save_and_table(tmp_path):
    lm = get_model("tiny:qwen2")
    tid = lm.tokenizer(" capital", add_special_tokens=False)["input_ids"][0]
    html, png, save = tmp_path / "e.html", tmp_path / "e.png", tmp_path / "e.safetensors"
    r = run("explain", TEXT, "--model", "tiny:qwen2", "--target", f"#{tid}", "--method", "logit",
            "--html", str(html), "--png", str(png), "--save", str(save))
    assert r.exit_code == 0, r.output
    assert "invariant error" in r.stdout and "' capital'" in r.stdout
    assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 5000
    page = html.read_text()
    assert page.startswith("<!doctype html>") and "https://" not in page
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "")  # the SVG namespace is a name, not fetched
    assert 'data-section="attribution"' in page  # the report page with the attribution view
    from lenscope import Explanation

    back = Explanation.load(save)
    assert back.target_id == tid and back.method == "logit"


def test_model_folder(tmp_path):
    lm = get_model("tiny:opt")
    lm.model.save_pretrained(tmp_path / "m")
    lm.tokenizer.save_pretrained(tmp_path / "m")
    r = run("explain", TEXT, "--model", str(tmp_path / "m"), "--target", " capital", "--method", "alti-logit", "--json")
    assert r.exit_code == 0, r.output
    ref = run("explain", TEXT, "--model", "tiny:opt", "--target", " capital", "--method", "alti-logit", "--json")
    assert json.loads(r.stdout)["scores"] == pytest.approx(json.loads(ref.stdout)["scores"], abs=1e-6)


def test_encoder_without_head(tmp_path):
    from transformers import BertModel

    lm = get_model("tiny:bert")
    BertModel(lm.model.config).save_pretrained(tmp_path / "enc")  # an encoder without a masked-LM head
    lm.tokenizer.save_pretrained(tmp_path / "enc")
    r = run("explain", TEXT, "--model", str(tmp_path / "enc"), "--target", " capital", "--method", "logit")
    assert r.exit_code == 2 and "no language-model head" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = run("explain", TEXT, "--model", str(tmp_path / "enc"), "--method", "alti", "--json")
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("args,msg", [
    (["--model", "tiny:bert", "--target", " capital", "--method", "logit"], "does not apply"),
    (["--model", "tiny:gpt2", "--method", "logit"], "needs a target"),
    (["--model", "tiny:gpt2", "--target", " capital", "--method", "shap"], "unknown method"),
    (["--model", "tiny:gpt2", "--target", " capital", "--foil", " capital"], "same token"),
    (["--model", "tiny:gpt2", "--method", "alti", "--position", "99"], "outside"),
    (["--model", "tiny:gpt2", "--target", " capital", "--method", "logit", "--steps", "4"], "--steps"),
    (["--model", "nope", "--method", "alti"], "unknown model"),
    (["--model", "tiny:gpt2", "--target", " capital", "--method", "logit", "--baseline", "pad"], "--baseline"),
    (["--model", "tiny:gpt2", "--target", " capital", "--method", "ig", "--baseline", "blur"], "unknown --baseline"),
])
def test_bad_input_exit_2_one_line(args, msg):
    r = run("explain", TEXT, *args)
    assert r.exit_code == 2, r.output
    err = r.stderr.strip()
    assert err.startswith("error:") and msg in err and len(err.splitlines()) == 1


def test_empty_text():
    r = run("explain", "", "--model", "tiny:gpt2", "--method", "alti")
    assert r.exit_code == 2 and "empty" in r.stderr


@pytest.mark.parametrize("baseline", ["zero", "pad", "mean"])
def test_ig_baseline_option_equals_the_python_call(baseline):
    """``--baseline`` reaches integrated gradients: the command's scores are the Python call's."""
    from lenscope.attribution import integrated_gradients

    r = run("explain", TEXT, "--model", "tiny:llama", "--target", " capital", "--foil", " of", "--method", "ig",
            "--steps", "4", "--baseline", baseline, "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    want = integrated_gradients(get_model("tiny:llama"), TEXT, " capital", " of", steps=4, baseline=baseline)
    assert d["scores"] == pytest.approx(want.scores.tolist(), abs=1e-6)
    assert d["info"]["baseline"] == want.info["baseline"]
