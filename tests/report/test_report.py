"""``lenscope report``: every view's data equals what the methods compute on their own, on every family; the
page is self-contained; the CLI's summary and errors."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import lenscope
from lenscope.cli import app
from lenscope.models.weights.readout import Readout
from lenscope.report import SECTION_KEYS, build_report, packed, unpack

from ..conftest import DECODERS, ENCODERS, get_model
from ..tolerances import assert_close_nested, assert_same_computation, kl_tol

TEXT = "The capital of France is"
DEFAULT_KEYS = [k for k in SECTION_KEYS if k not in ("circuit", "generation", "features", "graph", "alignment")]
runner = CliRunner()


def _section(rep, key):
    (s,) = [s for s in rep.sections if s["key"] == key]
    return s


def test_packed_round_trip_and_refuses_nan():
    x = torch.randn(3, 4, 5)
    d = packed(x)
    assert d["shape"] == [3, 4, 5]
    assert_same_computation(unpack(d), x.numpy(), why="packed and unpacked")
    with pytest.raises(ValueError, match="NaN"):
        packed(torch.tensor([1.0, float("nan")]))


@pytest.mark.parametrize("family", DECODERS)
def test_decoder_report_matches_the_methods(family):
    lm = get_model(f"tiny:{family}")
    rep = build_report(lm, TEXT, " capital", " of")
    assert rep.ok, [c for c in rep.checks if c["ok"] is False]
    assert [s["key"] for s in rep.sections] == DEFAULT_KEYS and not any("note" in s for s in rep.sections)
    tr = lenscope.trace(lm, TEXT)
    t_id = lm.tokenizer.encode(" capital", add_special_tokens=False)[0]
    f_id = lm.tokenizer.encode(" of", add_special_tokens=False)[0]
    assert rep.meta["target_id"] == t_id and rep.meta["foil_id"] == f_id

    # prediction: the top-k are the model's own
    top = _section(rep, "prediction")["data"]["top"]
    probs = torch.softmax(tr.logits[-1].double(), -1)
    assert [t["id"] for t in top] == torch.topk(probs, len(top)).indices.tolist()
    assert top[0]["prob"] == pytest.approx(float(probs.max()), rel=1e-4)

    # components: attention + MLP per layer + embed/bias = the logit difference
    views = _section(rep, "components")["data"]["views"]
    assert list(views) == ["difference", "target", "foil"]
    z = Readout.from_anatomy(lm.anatomy).uncap(tr.logits[-1])  # the logits before a soft-cap (Gemma 2)
    assert views["target"]["logit"] == pytest.approx(float(z[t_id]), abs=1e-4)
    assert views["foil"]["logit"] == pytest.approx(float(z[f_id]), abs=1e-4)
    comp = views["difference"]
    diff = float(z[t_id] - z[f_id])
    total = sum(comp["attn"]) + sum(comp["mlp"]) + sum(o["value"] for o in comp["other"])
    assert total == pytest.approx(diff, abs=1e-3) and comp["logit"] == pytest.approx(diff, abs=1e-4)
    heads = torch.tensor(comp["heads"])
    dla = lenscope.direct_logit_attribution(lm, TEXT, " capital", " of", by_head=True)
    for _name, l, h, v in zip(dla.names, dla.layers, dla.heads, dla.values.tolist()):
        if h >= 0:
            assert float(heads[l, h]) == pytest.approx(v, abs=1e-5)

    # attribution: the scores of every method are explain()'s
    att = _section(rep, "attribution")["data"]
    assert set(att["methods"]) == {"alti-logit", "logit", "grad-x-input", "grad-norm", "ig", "erasure", "alti",
                                   "value-zeroing"}
    for m in ("alti-logit", "logit", "grad-x-input", "erasure", "alti"):
        e = lenscope.explain(lm, TEXT, None if m == "alti" else " capital", None if m == "alti" else " of", method=m)
        assert np.allclose(att["methods"][m]["scores"], e.scores.numpy(), rtol=1e-4, atol=1e-5), m
    e = lenscope.explain(lm, TEXT, " capital", " of", method="alti-logit")
    assert np.allclose(unpack(att["layers"]["alti-logit"]), e.layer_scores.numpy(), atol=1e-6)

    # mixing and flow: the maps and the ALTI contributions themselves
    from lenscope.mixing.alti import mixing_matrices
    from lenscope.mixing.maps import context_mixing

    mix = _section(rep, "mixing")["data"]
    maps = context_mixing(lm, TEXT)
    assert mix["scopes"] == list(maps)
    for scope, m in maps.items():
        assert np.allclose(unpack(mix["maps"][scope]), m.maps.numpy(), atol=1e-6), scope
    flow = _section(rep, "flow")["data"]
    mm = mixing_matrices(lm.anatomy, tr, "alti")
    assert np.allclose(unpack(flow["contributions"]), mm.contributions.numpy(), atol=1e-6)

    # the trajectory: one logit lens, states 0..L
    traj = _section(rep, "trajectory")["data"]["trajectories"]
    assert [t["lens"] for t in traj] == ["logit"] and len(traj[0]["state_labels"]) == lm.anatomy.n_layers + 1
    # every exactness check that has a tolerance passed, and each view recorded one
    sections_checked = {c["section"] for c in rep.checks if c["ok"] is not None}
    assert {"prediction", "components", "attribution", "mixing", "flow"} <= sections_checked


@pytest.mark.parametrize("family", ENCODERS)
def test_encoder_report_notes_what_does_not_apply(family):
    lm = get_model(f"tiny:{family}")
    rep = build_report(lm, TEXT)
    notes = {s["key"]: s.get("note") for s in rep.sections}
    assert notes["components"] and "encoder" in notes["components"]
    assert notes["mixing"] is None and notes["flow"] is None and notes["attribution"] is None
    att = _section(rep, "attribution")["data"]
    assert "logit" not in att["methods"] and "alti" in att["methods"]
    page = rep.html()
    assert page.count('class="note"') == sum(1 for n in notes.values() if n)


def test_without_target_explains_the_top_prediction():
    lm = get_model("tiny:llama")
    rep = build_report(lm, TEXT, sections=["prediction", "components"])
    top = _section(rep, "prediction")["data"]["top"][0]["id"]
    assert list(_section(rep, "components")["data"]["views"]) == ["target"]  # no foil: the target's logit only
    assert rep.meta["target_id"] == top and rep.meta["target_is_top_prediction"] is True
    assert [s["key"] for s in rep.sections] == ["prediction", "components"]


def test_page_is_self_contained_and_escapes_tokens(tmp_path):
    lm = get_model("tiny:gpt2")
    text = 'a </script><img src="https://example.com/x.png"> b'
    rep = build_report(lm, text, sections=["prediction", "attribution"])
    page = rep.write(tmp_path / "r.html").read_text()
    assert page.lower().startswith("<!doctype html>")
    assert page.count("</script>") == page.count("<script")  # no token closes a script block early
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page, re.I)  # nothing fetched
    assert "<link" not in page.lower() and "@import" not in page
    data = re.search(r'<script type="application/json" id="lenscope-data">(.*?)</script>', page, re.S).group(1)
    assert json.loads(data)["meta"]["text"] == text


def test_bad_input_is_a_clear_error():
    lm = get_model("tiny:llama")
    with pytest.raises(lenscope.InputError, match="empty"):
        build_report(lm, "")
    with pytest.raises(lenscope.InputError, match="unknown report section"):
        build_report(lm, TEXT, sections=["nope"])
    with pytest.raises(lenscope.InputError, match="foil needs a target"):
        build_report(lm, TEXT, foil=" of")
    with pytest.raises(lenscope.InputError, match="no language-model head"):
        build_report(_headless(), TEXT, " the")
    rep = build_report(_headless(), TEXT, sections=["prediction", "trajectory", "attribution"])
    assert "no language-model head" in _section(rep, "trajectory")["note"]
    assert set(_section(rep, "attribution")["data"]["methods"]) == {"alti", "value-zeroing"}


def _headless():
    """tiny:bert without its masked-LM head (like minilm, a sentence encoder)."""
    import copy
    import dataclasses

    lm = get_model("tiny:bert")
    A = copy.copy(lm.anatomy)
    A.unembed = None
    return dataclasses.replace(lm, anatomy=A)


def test_cli_writes_page_and_json_summary(tmp_path):
    out = tmp_path / "r.html"
    r = runner.invoke(app, ["report", TEXT, "--model", "tiny:llama", "--target", " capital", "--out", str(out),
                            "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["ok"] is True and d["out"] == str(out) and d["bytes"] == out.stat().st_size
    assert [s["key"] for s in d["sections"]] == DEFAULT_KEYS
    assert set(d["timings"]) >= set(DEFAULT_KEYS) | {"trace", "total"}
    assert all({"section", "name", "value", "tolerance", "ok"} <= set(c) for c in d["checks"])
    r = runner.invoke(app, ["report", "", "--model", "tiny:llama", "--out", str(out)])
    assert r.exit_code == 2 and "empty" in r.stderr
    r = runner.invoke(app, ["report", TEXT, "--model", "tiny:llama", "--target", "two tokens maybe", "--out", str(out)])
    assert r.exit_code == 2 and "error:" in r.stderr


def test_tuned_lens_is_shown_beside_the_logit_lens():
    import torch

    from lenscope.lenses import TunedLens
    from lenscope.lenses.trajectory import prediction_trajectory

    lm = get_model("tiny:llama")
    lens = TunedLens(lm.anatomy, model_name=lm.name)
    with torch.no_grad():
        lens.b.normal_(0, 0.5)  # a lens that reads differently from the logit lens
    rep = build_report(lm, TEXT, sections=["trajectory"], lens=lens)
    trajs = _section(rep, "trajectory")["data"]["trajectories"]
    assert [t["lens"] for t in trajs] == ["tuned", "logit"] and rep.meta["lens"] == "tuned"
    direct = prediction_trajectory(lm, TEXT, lens).to_dict(digits=4)
    assert trajs[0]["top_tokens"] == direct["top_tokens"]
    # the report reads its shared trace, this call traces again: KLs apart by their float32 rounding (kl_tol each),
    # then kept to 4 decimals, which moves each by up to half a step
    z_max = float(lenscope.trace(lm, TEXT).logits.abs().max())
    assert_close_nested(trajs[0]["kl"], direct["kl"], 1e-4 + 2 * kl_tol(lm.anatomy.vocab_size, z_max))
    assert trajs[0]["kl"] != trajs[1]["kl"]


def test_cli_report_in_bfloat16(tmp_path):
    out = tmp_path / "r.html"
    r = runner.invoke(app, ["report", TEXT, "--model", "tiny:llama", "--dtype", "bfloat16", "--sections",
                            "prediction,components,mixing", "--out", str(out), "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["ok"] is True
    tols = {c["tolerance"] for c in d["checks"] if c["section"] == "mixing"}
    assert len(tols) == 1 and tols.pop() == pytest.approx(16 * torch.finfo(torch.bfloat16).eps)  # the dtype tolerance


# ----------------------------------------------------------------------------------------------
# the circuit view (issue 19): the page's drawing from circuit_json's contract, the section's inputs


def fake_circuit(L: int = 2, H: int = 4, seed: int = 0) -> dict:
    """A dict in the contract of ``lenscope.circuits.circuit_json`` (level "edges") for a model of ``L`` layers
    of ``H`` heads and an MLP: every edge of the component graph with a random signed score, and a faithfulness
    curve on a log grid from 10 edges to all of them."""
    g = torch.Generator().manual_seed(seed)
    heads = [[f"L{l}H{h}" for h in range(H)] for l in range(L)]
    nodes = ["embed"] + [n for l in range(L) for n in heads[l] + [f"L{l}.mlp"]] + ["logits"]
    edges = []
    for l in range(L + 1):
        below = ["embed"] + [n for m in range(l) for n in heads[m] + [f"L{m}.mlp"]]
        if l == L:
            edges += [(s, "logits") for s in below]
            continue
        edges += [(s, f"{r}.{c}") for r in heads[l] for c in "qkv" for s in below]
        edges += [(s, f"L{l}.mlp") for s in below + heads[l]]
    scores = (torch.randn(len(edges), generator=g) * torch.rand(len(edges), generator=g) ** 3).tolist()
    n = len(edges)
    ks = sorted({int(round(10 * (n / 10) ** (i / 12))) for i in range(13)})
    return {"method": "eap-ig", "level": "edges", "n": 1, "metric_clean": 3.1, "metric_corrupted": -2.9, "seconds": 0.5,
            "nodes": [{"name": x, "score": float(v)} for x, v in zip(nodes, torch.randn(len(nodes), generator=g))],
            "edges": [{"src": s, "dst": d, "score": v} for (s, d), v in zip(edges, scores)],
            "faithfulness": [{"k": k, "fraction": k / n, "value": 1 - math.exp(-k / 40)} for k in ks] +
                            ([] if ks[-1] == n else [{"k": n, "fraction": 1.0, "value": 1.0}]),
            "check": {"spearman": 0.9, "top10_recall": 0.6, "false_negatives": ["L0.mlp", "L1H2"]}}


def circuit_page(lm, payload: dict, text: str = TEXT, corrupted: str = "The capital of Spain is") -> dict:
    """A real report's dict (prediction only) with a circuit section carrying ``payload``."""
    rep = build_report(lm, text, " capital", " of", sections=["prediction"])
    d = rep.to_dict()
    d["meta"]["corrupted"] = corrupted
    d["sections"].append({"key": "circuit", "title": "Circuit", "blurb": "the circuit", "data": payload})
    return d


def test_circuit_view_is_drawn_only_with_a_circuit_section():
    from lenscope.viz.report import asset, render

    lm = get_model("tiny:llama")
    with_circuit = render(circuit_page(lm, fake_circuit()))
    without = build_report(lm, TEXT, " capital", " of", sections=["prediction"]).html()
    script = asset("circuit.js")
    assert 'id="sec-circuit"' in with_circuit and script in with_circuit and "The capital of Spain is" in with_circuit
    assert 'id="sec-circuit"' not in without and "LS.sections.circuit" not in without
    assert 'class="prompt corrupted"' in with_circuit and 'class="prompt corrupted"' not in without
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", with_circuit, re.I)
    assert "<link" not in with_circuit.lower() and "@import" not in with_circuit
    assert not re.search(r"https?://|fetch\(|XMLHttpRequest|import\(", script)  # the script asks for nothing
    data = re.search(r'<script type="application/json" id="lenscope-data">(.*?)</script>', with_circuit, re.S).group(1)
    (sec,) = [s for s in json.loads(data)["sections"] if s["key"] == "circuit"]
    assert sec["data"]["edges"][0]["dst"] == fake_circuit()["edges"][0]["dst"]


def test_circuit_payload_keeps_the_top_edges_and_checks_the_full_graph():
    from lenscope.report.context import ReportContext
    from lenscope.report.sections import Circuit, circuit_payload

    lm = get_model("tiny:llama")
    ctx = ReportContext(lm, TEXT, " capital", " of")
    d = fake_circuit(L=4, H=8)
    assert len(d["edges"]) > Circuit.top
    out = circuit_payload(ctx, d)
    assert len(out["edges"]) == Circuit.top
    best = sorted((abs(e["score"]) for e in d["edges"]), reverse=True)[: Circuit.top]
    assert [abs(e["score"]) for e in out["edges"]] == pytest.approx(best, rel=1e-4)
    assert out["faithfulness"][-1] == {"k": len(d["edges"]), "fraction": 1.0, "value": 1.0}
    assert out["nodes"] == [{"name": n["name"], "score": pytest.approx(n["score"], rel=1e-4)} for n in d["nodes"]]
    (full,) = [c for c in ctx.checks if c.name.startswith("faithfulness with every edge")]
    assert full.value == 0 and full.ok is True
    d["faithfulness"][-1]["value"] = 0.5  # a full graph that is not the clean run fails the check
    circuit_payload(ctx, d)
    assert ctx.checks[-2].ok is False and ctx.checks[-2].value == pytest.approx(0.5)


def test_circuit_section_needs_a_corrupted_prompt_a_target_and_a_foil(tmp_path):
    lm = get_model("tiny:llama")
    rep = build_report(lm, TEXT, " capital", " of", sections=["prediction"])
    assert [s["key"] for s in rep.sections] == ["prediction"] and "corrupted" not in rep.meta
    rep = build_report(lm, TEXT, " capital", " of", sections=["prediction", "circuit"])
    assert "--corrupted" in _section(rep, "circuit")["note"]
    with pytest.raises(lenscope.InputError, match="needs a target and a foil"):
        build_report(lm, TEXT, " capital", corrupted="The capital of Spain is")
    with pytest.raises(lenscope.InputError, match="same number of tokens"):
        build_report(lm, TEXT, " capital", " of", corrupted="The capital city of Spain is")
    with pytest.raises(lenscope.LenscopeError, match="causal decoder"):
        build_report(get_model("tiny:bert"), TEXT, " capital", " of", corrupted="The capital of Spain is")
    out = tmp_path / "r.html"
    r = runner.invoke(app, ["report", TEXT, "--model", "tiny:llama", "--target", " capital", "--corrupted",
                            "The capital of Spain is", "--out", str(out)])
    assert r.exit_code == 2 and "--corrupted needs --target and --foil" in r.stderr and not out.exists()
    r = runner.invoke(app, ["report", TEXT, "--model", "tiny:llama", "--target", " capital", "--foil", " of",
                            "--corrupted", "The capital city of Spain is", "--out", str(out)])
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.exit_code == 2 and len(errors) == 1 and "same number of tokens" in errors[0]


CORRUPTED = "The capital of Spain is"  # as many tokens as TEXT under the tiny tokenizers


def test_report_circuit_is_circuit_json_of_the_contrast():
    from lenscope.circuits import circuit_json
    from lenscope.data.contrast import ContrastPair

    lm = get_model("tiny:gpt2")
    rep = build_report(lm, TEXT, " capital", " of", corrupted=CORRUPTED, sections=["prediction", "circuit"])
    assert rep.ok and rep.meta["corrupted"] == CORRUPTED and "note" not in _section(rep, "circuit")
    d = _section(rep, "circuit")["data"]
    direct = circuit_json(lm, [ContrastPair(TEXT, CORRUPTED, " capital", " of")], method="eap-ig", level="edges",
                          top=300, faithfulness=True)
    assert (d["method"], d["level"], d["n"]) == ("eap-ig", "edges", 1)
    mine = {(e["src"], e["dst"]): e["score"] for e in d["edges"]}  # every edge (fewer than 300): order-free
    theirs = {(e["src"], e["dst"]): e["score"] for e in direct["edges"]}
    assert set(mine) == set(theirs) and [mine[e] for e in theirs] == pytest.approx(list(theirs.values()), rel=1e-4,
                                                                                 abs=1e-8)
    assert [abs(e["score"]) for e in d["edges"]] == sorted((abs(e["score"]) for e in d["edges"]), reverse=True)
    assert [(f["k"], f["fraction"]) for f in d["faithfulness"]] == [
        (f["k"], pytest.approx(f["fraction"], rel=1e-4)) for f in direct["faithfulness"]]
    assert [f["value"] for f in d["faithfulness"]] == pytest.approx([f["value"] for f in direct["faithfulness"]],
                                                                    rel=1e-4)
    # every edge of the component graph was scored: a head of block l reads embed and the l blocks below; an MLP
    # also its own block's heads; the logits everything
    A = lm.anatomy
    L, H = A.n_layers, A.layers[0].attn.n_heads
    n_edges = sum(3 * H * (1 + l * (H + 1)) + 1 + l * (H + 1) + H for l in range(L)) + 1 + L * (H + 1)
    assert d["total"] == n_edges == d["faithfulness"][-1]["k"] and d["faithfulness"][-1]["fraction"] == 1
    assert len(d["edges"]) == min(300, n_edges)
    # the metrics are the model's own logit differences on the two prompts
    t_id, f_id = rep.meta["target_id"], rep.meta["foil_id"]
    for text, key in ((TEXT, "metric_clean"), (CORRUPTED, "metric_corrupted")):
        logits = lenscope.trace(lm, text).logits[-1]
        assert d[key] == pytest.approx(float(logits[t_id] - logits[f_id]), abs=1e-4)
    # keeping every edge is the clean run
    (full,) = [c for c in rep.checks if c["section"] == "circuit"]
    assert full["ok"] is True and full["value"] < 1e-3


def test_cli_report_with_corrupted_adds_the_circuit_view(tmp_path):
    out = tmp_path / "r.html"
    r = runner.invoke(app, ["report", TEXT, "--model", "tiny:llama", "--target", " capital", "--foil", " of",
                            "--corrupted", CORRUPTED, "--out", str(out), "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert [s["key"] for s in d["sections"]] == DEFAULT_KEYS + ["circuit"] and d["ok"] is True
    assert d["meta"]["corrupted"] == CORRUPTED and d["timings"]["circuit"] > 0
    page = out.read_text()
    assert 'id="sec-circuit"' in page and "LS.sections.circuit" in page
