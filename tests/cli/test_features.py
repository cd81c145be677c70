"""``lenscope features``: the active features per token and, with a target, the feature attribution and its
completeness error as JSON; one-line errors (exit 2) for bad input."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from lenscope.cli import app
from lenscope.features.dictionaries.attribution import feature_dla
from lenscope.features.dictionaries.result import active_features
from lenscope.models.dictionaries.dictionary import save_dictionaries
from lenscope.models.loading.summary import fingerprint
from lenscope.models.runtime.engine import run as run_model
from tests.conftest import get_model
from tests.models.test_dictionary import _random
from tests.tolerances import assert_same_ints, matmul_rounding

runner = CliRunner()
TEXT = "The cat sat on the mat"


def run(*args):
    return runner.invoke(app, list(args))


@pytest.fixture(scope="module")
def dict_dir(tmp_path_factory):
    lm = get_model("tiny:llama")
    d = lm.anatomy.d_model
    ds = [_random(d, 32, site="resid_post.0", seed=1, k=5),
          _random(d, 40, kind="jumprelu", role="transcoder", site="mlp_out.1", seed=2)]
    for D in ds:
        D.model, D.fingerprint = lm.name, fingerprint(lm.anatomy)
    return save_dictionaries(ds, tmp_path_factory.mktemp("dicts") / "d"), ds


def test_features_json_active_and_dla(dict_dir):
    folder, ds = dict_dir
    r = run("features", TEXT, "--model", "tiny:llama", "--dict", str(folder), "--json", "--top", "4")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert {"model", "tokens", "sites", "active", "l0"} <= set(out) and "dla" not in out
    lm = get_model("tiny:llama")
    fa = active_features(lm, TEXT, ds, top=4)
    assert out["tokens"] == fa.tokens and out["sites"] == ["resid_post.0", "mlp_out.1"]
    _same_records_within_encoder_rounding(lm, ds, out["active"], fa.to_records())
    assert_same_ints(out["l0"], fa.l0)
    assert {"site", "position", "token", "feature", "activation"} == set(out["active"][0])

    r = run("features", TEXT, "--model", "tiny:llama", "--dict", str(folder), "--json", "--target", " the",
            "--foil", " cat", "--position", "3")
    assert r.exit_code == 0, r.output
    dla = json.loads(r.stdout)["dla"]
    want = feature_dla(lm, TEXT, ds, " the", " cat", position=3)
    assert dla["position"] == 3 and dla["target"] == " the" and dla["foil"] == " cat"
    assert {"rows", "logit", "sum", "completeness_error"} <= set(dla)
    assert [r_["name"] for r_ in dla["rows"]] == want.names
    assert torch.allclose(torch.tensor([r_["value"] for r_ in dla["rows"]]), want.values)
    assert {"name", "site", "feature", "value"} <= set(dla["rows"][0])
    assert abs(dla["sum"] - dla["logit"]) == pytest.approx(dla["completeness_error"])
    assert dla["completeness_error"] < 1e-4 * max(1.0, sum(abs(r_["value"]) for r_ in dla["rows"]))


def _same_records_within_encoder_rounding(lm, ds, got, want):
    """The CLI's records are the API's, their activations within two evaluations' rounding of each dictionary's
    encoder (tests/tolerances.matmul_rounding): the CLI reads the dictionaries back from their files, contiguous
    tensors at other addresses where the fixture's ``W_enc`` is a transposed view, so some CPUs run another matmul
    kernel on them (1 ulp apart on an AMD EPYC)."""
    def without_activation(rows):
        return [{k: v for k, v in r_.items() if k != "activation"} for r_ in rows]

    assert without_activation(got) == without_activation(want)
    ids = lm.tokenizer(TEXT, return_tensors="pt").input_ids
    cap = run_model(lm, ids, capture=[D.input_site for D in ds], logits=False).captured
    tol = {}
    for D in ds:
        x = cap[D.input_site][0].to(D.W_enc.dtype)
        tol[D.site] = matmul_rounding(x - D.b_dec if D.role == "sae" else x, D.W_enc, D.b_enc)
    for g, w in zip(got, want):
        assert abs(g["activation"] - w["activation"]) <= float(tol[w["site"]][w["position"], w["feature"]]), (g, w)


def test_features_table_and_site_choice(dict_dir):
    folder, _ = dict_dir
    r = run("features", TEXT, "--model", "tiny:llama", "--dict", str(folder), "--target", " the",
            "--site", "mlp_out.1")
    assert r.exit_code == 0, r.output
    assert "mlp_out.1" in r.stdout and "resid_post.0 (L0)" not in r.stdout and "completeness error" in r.stdout


@pytest.mark.parametrize("extra,msg", [
    (["--position", "40"], "outside the text"),
    (["--target", " notatoken"], ""),
    (["--foil", " cat"], "foil needs a target"),
    (["--site", "attn_out.0"], "has dictionaries at"),
    (["--top", "0"], "at least 1"),
])
def test_features_bad_input_one_line(dict_dir, extra, msg):
    folder, _ = dict_dir
    r = run("features", TEXT, "--model", "tiny:llama", "--dict", str(folder), *extra)
    assert r.exit_code == 2, r.output
    err = r.stderr.strip()
    assert err.startswith("error: ") and "\n" not in err and msg in err


def test_features_refuses_another_models_dictionary(dict_dir):
    folder, _ = dict_dir
    r = run("features", TEXT, "--model", "tiny:qwen2", "--dict", str(folder))
    assert r.exit_code == 2 and r.stderr.startswith("error: ") and "trained on" in r.stderr, r.output
    r = run("features", TEXT, "--model", "tiny:llama", "--dict", str(folder / "nothing"))
    assert r.exit_code == 2 and "does not exist" in r.stderr


def test_features_html(dict_dir, tmp_path):
    """The page is the report page with the features view alone (drawn by the views' own script)."""
    folder, _ = dict_dir
    path = tmp_path / "f.html"
    r = run("features", TEXT, "--model", "tiny:llama", "--dict", str(folder), "--html", str(path))
    page = path.read_text()
    assert r.exit_code == 0 and page.startswith("<!doctype html>"), r.output
    assert 'LS.sections["features"]' in page or "LS.sections.features" in page


def test_features_refuses_two_residual_dictionaries_in_one_attribution(tmp_path):
    lm = get_model("tiny:llama")
    d = lm.anatomy.d_model
    folder = save_dictionaries([_random(d, 32, site="resid_post.0", seed=1), _random(d, 32, site="resid_post.1",
                                                                                      seed=2)], tmp_path / "two")
    r = run("features", TEXT, "--model", "tiny:llama", "--dict", str(folder), "--json")
    assert r.exit_code == 0, r.output  # the active features of both
    r = run("features", TEXT, "--model", "tiny:llama", "--dict", str(folder), "--target", " the")
    assert r.exit_code == 2 and "alternatives" in r.stderr and "--site" in r.stderr
    r = run("features", TEXT, "--model", "tiny:llama", "--dict", str(folder), "--target", " the", "--site",
            "resid_post.1", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["dla"]["dictionaries"] == ["resid_post.1"]
