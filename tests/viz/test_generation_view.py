"""The generation view (issue 21): the report section ``generation`` (its data are lenscope.generate's dict,
rounded), the standalone page (the report page with just that section) and the PNG's matrix."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest

from lenscope.viz.views.generation import generation_html, generation_payload, invariant_errors

from ..conftest import get_model
from ..tolerances import assert_same_computation

PROMPT = "When Mary and John went to the store, John gave a drink to"


def fake_generation(n_prompt: int = 6, n_new: int = 5, methods=("alti-logit", "logit", "alti"), seed: int = 0,
                    tuned: bool = False) -> dict:
    """A generation's dict as lenscope.generate(...).to_dict() gives it, with random but consistent numbers:
    every step's scores cover exactly the tokens before its position; tokens that need escaping included."""
    rng = np.random.default_rng(seed)
    prompt = ["<s>", " When", " Mary", " <b>&", "</script>", " to"][:n_prompt] + [f" p{i}" for i in range(n_prompt - 6)]
    new = [" Mary", ",", " and", "\n", " she"] + [f" g{i}" for i in range(max(0, n_new - 5))]
    new = new[:n_new]
    tokens = prompt + new
    generated = []
    for k, tok in enumerate(new):
        p = n_prompt + k
        runner = {"token": f" r{k}", "id": 1000 + k}
        expl = {}
        for m in methods:
            s = rng.normal(size=p)
            if m in ("alti", "value-zeroing"):
                s = np.abs(s) / np.abs(s).sum()
            expl[m] = {"scores": [float(v) for v in s], "invariant_error": float(rng.uniform(1e-8, 1e-6))}
        generated.append({"position": p, "token": tok, "id": 100 + k, "prob": float(rng.uniform(0.05, 0.99)),
                          "entropy": float(rng.uniform(0.1, 4.0)), "runner_up": runner,
                          "depth": None if k == 2 else int(rng.integers(0, 4)), "foil": runner,
                          "explanations": expl})
        if tuned:
            generated[-1]["tuned_depth"] = int(rng.integers(0, 4))
    return {"model": "tiny:fake", "prompt": "".join(prompt), "text": "".join(new), "tokens": tokens,
            "prompt_tokens": prompt, "methods": list(methods), "generated": generated, "seconds": 0.123456789}


FIVE = "rounded to 5 significant digits: the same decimal, read back"


def test_payload_rounds_and_keeps_the_shape():
    d = fake_generation()
    d["generated"][0]["entropy"] = float("nan")
    out = generation_payload(d)
    assert set(out) == set(d) and out["tokens"] == d["tokens"]
    assert_same_computation(out["seconds"], 0.12346, why=FIVE)
    g0, r0 = d["generated"][1], out["generated"][1]
    assert r0["id"] == g0["id"] and r0["depth"] == g0["depth"] and r0["runner_up"] == g0["runner_up"]
    assert_same_computation(r0["prob"], float(f"{g0['prob']:.5g}"), why=FIVE)
    assert out["generated"][0]["entropy"] is None
    for g, r in zip(d["generated"], out["generated"]):
        for m in d["methods"]:
            a, b = np.array(g["explanations"][m]["scores"]), np.array(r["explanations"][m]["scores"])
            assert len(b) == g["position"] and np.allclose(a, b, rtol=5e-5, atol=0)
            assert_same_computation(list(b), [float(f"{v:.5g}") for v in a], why=FIVE)
    assert d["generated"][0]["entropy"] != d["generated"][0]["entropy"]  # the input is not changed (NaN kept)
    errs = invariant_errors(d)
    assert_same_computation(errs["logit"], max(g["explanations"]["logit"]["invariant_error"] for g in d["generated"]),
                            why="the largest, copied")


def test_payload_refuses_what_is_not_a_generation():
    from lenscope.errors import InputError

    with pytest.raises(InputError, match="lacks"):
        generation_payload({"text": "x"})
    with pytest.raises(InputError, match="not list"):
        generation_payload([1, 2])


def _data_block(page: str) -> dict:
    m = re.search(r'<script type="application/json" id="lenscope-data">(.*?)</script>', page, flags=re.S)
    return json.loads(m.group(1))


def test_standalone_page_is_the_report_page_with_one_section(tmp_path):
    from lenscope.viz.report import asset

    d = fake_generation()
    page = generation_html(d, tmp_path / "g.html", tolerance=1e-5)
    assert (tmp_path / "g.html").read_text(encoding="utf-8") == page
    assert asset("generation.js") in page and asset("core.js") in page
    assert "</script>\"" not in page and "<b>&" not in page  # token strings travel escaped in the data block
    data = _data_block(page)
    (sec,) = data["sections"]
    assert sec["key"] == "generation"
    assert_same_computation(sec["data"], generation_payload(d), why="the payload of the same generation")
    assert data["meta"]["target"] == d["text"] and data["meta"]["tokens"] == d["tokens"]
    assert page.count('<span class="badge ok">ok</span>') == 3  # one check per method, each within 1e-5
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "") and "https://" not in page
    # without a tolerance the errors are only reported
    assert generation_html(d).count('<span class="badge info">reported</span>') == 3


# ------------------------------------------------------------------------------------ the report section


def _gen_section(rep):
    (s,) = [s for s in rep.sections if s["key"] == "generation"]
    return s


def test_report_section_on_a_real_generation():
    from lenscope.generation import generate
    from lenscope.report import SECTION_KEYS, build_report

    lm = get_model("tiny:llama")
    rep = build_report(lm, PROMPT, sections=["prediction", "generation"], generate=4, explain=("alti-logit", "logit"))
    data = _gen_section(rep)["data"]
    ref = generate(lm, PROMPT, max_new_tokens=4, explain=("alti-logit", "logit")).to_dict()
    ref_payload = generation_payload(ref)
    for k in ("text", "tokens", "prompt_tokens", "methods"):
        assert data[k] == ref_payload[k], k
    assert len(data["generated"]) == 4 and data["methods"] == ["alti-logit", "logit"]
    n_prompt = len(data["prompt_tokens"])
    for k, (g, r) in enumerate(zip(data["generated"], ref["generated"])):
        assert g["position"] == n_prompt + k and g["token"] == r["token"] and g["id"] == r["id"]
        assert g["prob"] == pytest.approx(r["prob"], rel=1e-4)
        for m in ("alti-logit", "logit"):
            assert len(g["explanations"][m]["scores"]) == g["position"]
            assert np.allclose(g["explanations"][m]["scores"], r["explanations"][m]["scores"], rtol=1e-4, atol=1e-6)
    # one check per method: its largest invariant error over the steps, within the model's tolerance
    checks = {c["name"]: c for c in rep.checks if c["section"] == "generation"}
    assert set(checks) == {"alti-logit: largest invariant error over the steps",
                           "logit: largest invariant error over the steps"}
    for m in ("alti-logit", "logit"):
        worst = max(g["explanations"][m]["invariant_error"] for g in ref["generated"])
        value = checks[f"{m}: largest invariant error over the steps"]["value"]
        assert value == pytest.approx(worst, rel=1e-3, abs=1e-9)
    assert all(c["ok"] for c in checks.values()) and rep.ok
    assert "generation" in SECTION_KEYS and "generation" in rep.timings
    assert math.isfinite(rep.timings["generation"])


def test_standalone_page_and_png_of_a_real_generation(tmp_path):
    from lenscope.generation import generate
    from lenscope.models.runtime.verify import completeness_tolerance
    from lenscope.viz.generation_plots import generation_matrix, plot_generation

    lm = get_model("tiny:llama")
    gen = generate(lm, PROMPT, max_new_tokens=5, explain=("alti-logit", "logit"))
    page = generation_html(gen, tmp_path / "g.html", lm=lm)
    data = _data_block(page)
    assert_same_computation(data["sections"][0]["data"], generation_payload(gen.to_dict()),
                            why="the payload of the same generation")
    meta = data["meta"]
    assert meta["family"] == lm.anatomy.family and meta["n_layers"] == lm.anatomy.n_layers
    assert meta["text"] == PROMPT and meta["target"] == gen.text
    tol = completeness_tolerance(lm)
    assert page.count(f"≤ {tol:g}") == 2 and page.count('<span class="badge ok">ok</span>') == 2
    # the matrix drawn is the generation's own (step, src) scores, blank from each step's position on
    m, method = generation_matrix(gen, "logit")
    ref = gen.matrix("logit").double().numpy()
    assert method == "logit" and m.shape == (5, len(gen.tokens) - 1)
    for k, p in enumerate(gen.positions):
        assert np.allclose(m[k, :p], ref[k, :p], rtol=1e-6, atol=1e-9) and np.isnan(m[k, p:]).all()
    fig = plot_generation(gen, "logit")
    assert np.ma.filled(fig.axes[0].get_images()[0].get_array(), np.nan).shape == (5, len(gen.tokens) - 1)


def test_generation_is_not_in_the_default_report():
    from lenscope.report import ReportContext
    from lenscope.report.sections import Generation

    lm = get_model("tiny:llama")
    assert not Generation().wanted(ReportContext(lm, PROMPT))
    assert Generation().wanted(ReportContext(lm, PROMPT, generate=3))
    note = Generation().skip_reason(ReportContext(lm, PROMPT))
    assert "--generate" in note


def test_encoder_gets_a_note():
    from lenscope.report import build_report

    lm = get_model("tiny:bert")
    rep = build_report(lm, "The capital of France is Paris", sections=["mixing", "generation"], generate=3)
    sec = _gen_section(rep)
    assert "data" not in sec and "decoder" in sec["note"]
    assert not any(c["section"] == "generation" for c in rep.checks)


@pytest.mark.parametrize("bad, match", [(0, "at least 1"), (10_000, "context"), (2.5, "whole number")])
def test_bad_generate_is_refused_before_any_view(bad, match):
    from lenscope.errors import InputError
    from lenscope.report import build_report

    with pytest.raises(InputError, match=match):
        build_report(get_model("tiny:llama"), PROMPT, sections=["generation"], generate=bad)
    with pytest.raises(InputError, match="unknown method"):
        build_report(get_model("tiny:llama"), PROMPT, sections=["generation"], generate=2, explain=("nope",))


def test_cli_report_generate(tmp_path):
    from typer.testing import CliRunner

    from lenscope.cli import app

    out = tmp_path / "r.html"
    res = CliRunner().invoke(app, ["report", PROMPT, "--model", "tiny:llama", "--sections", "prediction",
                                   "--generate", "3", "--out", str(out), "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout[res.stdout.index("{"):])
    assert [s["key"] for s in summary["sections"]] == ["prediction", "generation"]
    data = _data_block(out.read_text(encoding="utf-8"))
    (g,) = [s for s in data["sections"] if s["key"] == "generation"]
    assert len(g["data"]["generated"]) == 3
    bad = CliRunner().invoke(app, ["report", PROMPT, "--model", "tiny:llama", "--generate", "0", "--out",
                                   str(tmp_path / "x.html")])
    assert bad.exit_code == 2 and "at least 1" in bad.output


# ------------------------------------------------------------------------------------------- the PNG


def test_plot_generation_image_shape(tmp_path):
    import matplotlib.figure

    from lenscope.viz.generation_plots import plot_generation

    d = fake_generation(n_prompt=6, n_new=5)
    fig = plot_generation(d, method="logit")
    assert isinstance(fig, matplotlib.figure.Figure)
    ax = fig.axes[0]
    (im,) = ax.get_images()
    arr = np.ma.filled(im.get_array(), np.nan)
    assert arr.shape == (5, 10)  # 5 generated tokens x the 10 tokens before the last one
    for k, g in enumerate(d["generated"]):
        p = g["position"]
        assert np.allclose(arr[k, :p], g["explanations"]["logit"]["scores"]) and np.isnan(arr[k, p:]).all()
    strip = [a for a in fig.axes if a.get_label() == "prob"]
    assert len(strip) == 1 and np.allclose(np.ma.filled(strip[0].get_images()[0].get_array()).ravel(),
                                           [g["prob"] for g in d["generated"]])
    fig.savefig(tmp_path / "g.png", dpi=80)
    w, h = fig.get_size_inches() * 80
    from PIL import Image

    with Image.open(tmp_path / "g.png") as img:
        assert img.size == (round(w), round(h))
    # the default method is the first; an unknown one is refused
    assert plot_generation(d).axes[0].get_title().startswith("alti-logit")
    from lenscope.errors import InputError

    with pytest.raises(InputError, match="erasure"):
        plot_generation(d, method="erasure")
