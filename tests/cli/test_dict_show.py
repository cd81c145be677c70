"""``lenscope dict show``: one feature's card as a page and JSON on a tiny model, and its one-line errors."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from lenscope.cli import app
from lenscope.models.dictionaries.dictionary import save_dictionaries
from lenscope.models.loading.summary import fingerprint
from tests.conftest import get_model
from tests.features.test_cards import corpus, random_dict

runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_dict_show_writes_the_card(tmp_path):
    lm = get_model("tiny:llama")
    D = random_dict(lm.anatomy.d_model, 40, site="resid_post.1", seed=2)
    D.model, D.fingerprint = lm.name, fingerprint(lm.anatomy)
    D.save(tmp_path / "sae")
    data = corpus(tmp_path)
    page = tmp_path / "card.html"
    r = run("dict", "show", "--model", "tiny:llama", "--dict", tmp_path / "sae", "--feature", 5, "--data", data,
            "--html", page, "--json", "--tokens", 500, "--top", 3)
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["site"] == "resid_post.1" and d["feature"] == 5 and d["tokens"] > 0
    assert len(d["contexts"]) <= 3 and {"histogram", "density", "promoted", "suppressed"} <= set(d)
    text = page.read_text()
    assert 'data-section="feature"' in text and "LS.sections.feature" in text


def test_dict_show_errors(tmp_path):
    lm = get_model("tiny:llama")
    D = random_dict(lm.anatomy.d_model, 40, site="resid_post.1")
    D.save(tmp_path / "one")
    data = corpus(tmp_path)
    base = ("dict", "show", "--model", "tiny:llama", "--data", data, "--json")

    def err(*args):
        r = run(*base, *args)
        assert r.exit_code == 2, r.output
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:"), r.stderr
        return lines[0]

    assert "outside the dictionary's 40 latents" in err("--dict", tmp_path / "one", "--feature", 40)
    r = run("dict", "show", "--model", "tiny:llama", "--dict", tmp_path / "one", "--feature", 1, "--data",
            tmp_path / "nope.txt", "--json")
    assert r.exit_code == 2 and "data file not found" in r.stderr
    other = random_dict(lm.anatomy.d_model, 40, site="resid_post.1")
    other.model, other.fingerprint = "tiny:gpt2", "0123456789abcdef"
    other.save(tmp_path / "other")
    assert "trained on 'tiny:gpt2'" in err("--dict", tmp_path / "other", "--feature", 1)
    save_dictionaries([D, random_dict(lm.anatomy.d_model, 40, site="resid_post.0")], tmp_path / "two")
    assert "pick one with --site" in err("--dict", tmp_path / "two", "--feature", 1)
    assert "no dictionary for site 'resid_post.5'" in err("--dict", tmp_path / "two", "--feature", 1, "--site",
                                                          "resid_post.5")
    assert "nothing to write" in run("dict", "show", "--model", "tiny:llama", "--dict", tmp_path / "one",
                                     "--feature", 1, "--data", data).stderr
    r = run(*base, "--dict", tmp_path / "two", "--feature", 1, "--site", "resid_post.0", "--tokens", 300)
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["site"] == "resid_post.0"


def test_report_with_dict(tmp_path):
    lm = get_model("tiny:llama")
    D = random_dict(lm.anatomy.d_model, 40, site="resid_post.1", seed=2)
    D.save(tmp_path / "sae")
    data = corpus(tmp_path)
    out = tmp_path / "r.html"
    r = run("report", "the cat sat on the mat", "--model", "tiny:llama", "--sections", "prediction", "--dict",
            tmp_path / "sae", "--dict-data", data, "--out", out, "--json")
    assert r.exit_code == 0, r.output
    assert [s["key"] for s in json.loads(r.stdout)["sections"]] == ["prediction", "features"]
    assert 'data-section="features"' in out.read_text()
    r = run("report", "a b", "--model", "tiny:llama", "--dict-data", data, "--out", out)
    assert r.exit_code == 2 and "give --dict DIR as well" in r.stderr
    r = run("report", "a b", "--model", "tiny:llama", "--dict", tmp_path / "none", "--out", out)
    assert r.exit_code == 2 and "does not exist" in r.stderr
