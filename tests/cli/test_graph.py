"""``lenscope graph``: the attribution graph's JSON (nodes, links, scores, the exactness error, seconds), its saved
file and circuit-tracer export; one-line errors (exit 2) for bad input."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from lenscope.cli import app
from lenscope.features.graphs.graph import AttributionGraph, attribution_graph
from lenscope.features.graphs.memory import graph_memory, nbytes
from lenscope.models.dictionaries.dictionary import save_dictionaries
from lenscope.models.loading.summary import fingerprint
from lenscope.models.runtime.trace import trace
from tests.conftest import get_model
from tests.models.test_dictionary import _random
from tests.tolerances import assert_same_computation, assert_same_ints

runner = CliRunner()
TEXT = "The cat sat on the mat"


def run(*args):
    return runner.invoke(app, list(args))


@pytest.fixture(scope="module")
def dict_dir(tmp_path_factory):
    lm = get_model("tiny:llama")
    d = lm.anatomy.d_model
    ds = [_random(d, 40, kind="topk", role="transcoder", site="mlp_out.0", seed=1, k=5),
          _random(d, 40, kind="jumprelu", role="transcoder", site="mlp_out.1", seed=2)]
    for D in ds:
        D.model, D.fingerprint = lm.name, fingerprint(lm.anatomy)
    return save_dictionaries(ds, tmp_path_factory.mktemp("dicts") / "d"), ds


def test_graph_json_save_and_export(dict_dir, tmp_path):
    folder, ds = dict_dir
    r = run("graph", TEXT, "--model", "tiny:llama", "--dict", str(folder), "--json", "--out", str(tmp_path / "g"),
            "--export-circuit-tracer", str(tmp_path / "ct.json"), "--node-threshold", "0.9")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert {"nodes", "links", "replacement_score", "completeness_score", "max_exactness_error", "seconds"} <= set(out)
    assert {"id", "kind", "layer", "position", "feature", "activation", "influence"} <= set(out["nodes"][0])
    assert {"source", "target", "weight"} <= set(out["links"][0]) and "heads" in out["links"][0]
    ids = {n["id"] for n in out["nodes"]}
    assert all(x["source"] in ids and x["target"] in ids for x in out["links"])
    assert out["max_exactness_error"] <= 1e-4 and out["seconds"] > 0
    want = attribution_graph(get_model("tiny:llama"), TEXT, ds).to_dict(node_threshold=0.9)
    assert [n["id"] for n in out["nodes"]] == [n["id"] for n in want["nodes"]]
    assert out["replacement_score"] == pytest.approx(want["replacement_score"], abs=1e-6)
    g = AttributionGraph.load(tmp_path / "g" / "graph.safetensors")
    assert g.n_features == g.n_active and g.tokens == out["tokens"]
    ct = json.loads((tmp_path / "ct.json").read_text())
    assert set(ct) == {"metadata", "qParams", "nodes", "links"}
    assert_same_computation(ct["metadata"]["node_threshold"], 0.9, why="the option, copied into the file")
    assert_same_computation(json.loads((tmp_path / "g" / "graph.json").read_text())["nodes"], ct["nodes"],
                            why="one graph's nodes written to two files")
    r = run("graph", TEXT, "--model", "tiny:llama", "--dict", str(folder), "--max-feature-nodes", "5")
    assert r.exit_code == 0 and "5 of" in r.stdout and "exactness error" in r.stdout, r.output


def test_graph_with_a_foil_has_one_contrastive_logit_node(dict_dir):
    folder, ds = dict_dir
    r = run("graph", TEXT, "--model", "tiny:llama", "--dict", str(folder), "--target", " the", "--foil", " a",
            "--json", "--no-heads")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    logits = [n for n in out["nodes"] if n["kind"] == "logit"]
    want = attribution_graph(get_model("tiny:llama"), TEXT, ds, target=" the", foil=" a")
    assert len(logits) == 1 and out["foil_id"] == want.foil_id is not None
    assert logits[0]["feature"] == int(want.logit_ids[0]) and out["max_exactness_error"] <= 1e-4


@pytest.mark.parametrize("extra,msg", [
    (["--target", " the cat"], "token"),
    (["--foil", " a"], "foil needs a target"),
    (["--node-threshold", "1.5"], "[0, 1]"),
    (["--max-feature-nodes", "-1"], "at least 0"),
    (["--max-memory", "lots"], "memory size"),
])
def test_graph_bad_input_one_line(dict_dir, extra, msg):
    folder, _ = dict_dir
    r = run("graph", TEXT, "--model", "tiny:llama", "--dict", str(folder), *extra)
    assert r.exit_code == 2, r.output
    err = r.stderr.strip()
    assert err.startswith("error: ") and "\n" not in err and msg in err


def test_graph_over_the_memory_budget_is_one_line_naming_the_options(dict_dir):
    folder, ds = dict_dir
    r = run("graph", TEXT, "--model", "tiny:llama", "--dict", str(folder), "--max-memory", "1MB")
    assert r.exit_code == 2, r.output
    err = r.stderr.strip()
    assert err.startswith("error: attribution graph: ") and "\n" not in err and "Traceback" not in r.output
    assert "--max-feature-nodes" in err and "--max-memory" in err and "1 MB" in err
    # a budget between no feature node and all of them: the number named runs within it
    lm = get_model("tiny:llama")
    g = attribution_graph(lm, TEXT, ds)
    dims = dict(n_pos=g.n_pos, n_layers=g.n_layers, d_model=lm.anatomy.d_model,
                n_heads=max(layer.attn.n_heads for layer in lm.anatomy.layers), n_active=g.n_active,
                block_active=int(torch.bincount(g.feature_layer).max()), n_logits=g.n_logits, batch_size=1,
                trace_bytes=nbytes(trace(lm, TEXT)))
    budget = (graph_memory(n_features=0, **dims).total + graph_memory(n_features=g.n_active, **dims).total) // 2
    common = ["graph", TEXT, "--model", "tiny:llama", "--dict", str(folder), "--max-memory", str(budget), "--json",
              "--no-heads"]
    r = run(*common)
    assert r.exit_code == 2 and "--max-feature-nodes " in r.stderr, r.stderr
    n = r.stderr.split("--max-feature-nodes ")[1].split()[0]
    r = run(*common, "--max-feature-nodes", n)
    assert r.exit_code == 0, r.stderr
    assert_same_ints(json.loads(r.stdout)["n_feature_nodes"], int(n))
    assert 0 < int(n) < g.n_active


def test_graph_refuses_another_models_dictionary_and_long_text(dict_dir):
    folder, _ = dict_dir
    r = run("graph", TEXT, "--model", "tiny:qwen2", "--dict", str(folder))
    assert r.exit_code == 2 and r.stderr.startswith("error: ") and "trained on" in r.stderr, r.output
    lm = get_model("tiny:llama")
    r = run("graph", "cat " * (lm.anatomy.n_ctx + 5), "--model", "tiny:llama", "--dict", str(folder))
    assert r.exit_code == 2 and r.stderr.startswith("error: "), r.output
