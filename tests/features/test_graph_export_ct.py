"""lenscope's circuit-tracer export against a graph file circuit-tracer 0.5 itself wrote (issue 42).

``tests/features/data/ct_smollm2.json`` is circuit-tracer's ``create_graph_files`` output for ``smollm2`` on one
prompt with 30 seeded random JumpReLU transcoders; ``ct_smollm2_recipe.json`` holds the prompt's ids and the
transcoders' recipe. Both were written by ``benchmarks/ct_export_fixture.py`` (its docstring: the command and the
versions); this test needs neither circuit-tracer nor its environment, only the two committed files.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks.ct_export_fixture import transcoders
from lenscope.features.graphs.export import cantor, circuit_tracer_json
from lenscope.features.graphs.graph import attribution_graph
from lenscope.features.graphs.replacement import parts_rounding
from lenscope.models.loading.load import encode
from tests.conftest import get_model
from tests.tolerances import U32, assert_same_ints

DATA = Path(__file__).parent / "data"
ERROR = "mlp reconstruction error"


def _lenscope_id(n: dict) -> str:
    """A circuit-tracer node's id as lenscope writes it: an error node ``0_{layer}_{pos}`` is ``{layer}_-1_{pos}``
    (circuit-tracer's id collides with the layer-0 feature ``{pos}``'s); every other id is the same."""
    return f"{n['layer']}_-1_{n['ctx_idx']}" if n["feature_type"] == ERROR else n["node_id"]


@pytest.fixture(scope="module")
def docs():
    ct = json.loads((DATA / "ct_smollm2.json").read_text())
    recipe = json.loads((DATA / "ct_smollm2_recipe.json").read_text())
    lm = get_model("smollm2")
    ids = torch.tensor(recipe["input_ids"])
    assert_same_ints(ids[1:], encode(lm, recipe["prompt"]))
    dicts = transcoders(lm.anatomy.d_model, recipe["threshold_scales"], recipe["decoder_scales"], recipe["width"])
    g = attribution_graph(lm, ids, dicts)
    ours = circuit_tracer_json(g, slug="ct_smollm2", node_threshold=recipe["node_threshold"],
                               edge_threshold=recipe["edge_threshold"])
    return ct, ours, g


def test_the_same_nodes_as_circuit_tracers_file_with_error_ids_mapped(docs):
    ct, ours, g = docs
    theirs = {_lenscope_id(n): n for n in ct["nodes"]}
    assert len(theirs) == len(ct["nodes"])  # no two circuit-tracer nodes map to one lenscope id
    mine = {n["node_id"]: n for n in ours["nodes"]}
    assert sorted(mine) == sorted(theirs)
    kinds = {n["feature_type"] for n in ct["nodes"]}
    assert kinds == {"cross layer transcoder", ERROR, "embedding", "logit"}, kinds
    for i, n in theirs.items():
        m = mine[i]
        for k in ("feature", "layer", "ctx_idx", "feature_type", "is_target_logit", "jsNodeId"):
            assert m[k] == n[k], (i, k, m[k], n[k])
        if n["feature_type"] == "cross layer transcoder":
            layer, latent, pos = map(int, i.split("_"))
            assert n["feature"] == cantor(layer, latent) and n["ctx_idx"] == pos
        if n["feature_type"] == ERROR:
            assert n["node_id"] == f"0_{n['layer']}_{n['ctx_idx']}" and i == f"{n['layer']}_-1_{n['ctx_idx']}"
    # circuit-tracer's file uses one id twice (the layer-0 feature 26 at position 5 and the error of block 26
    # there); lenscope's ids are all distinct
    ct_ids = [n["node_id"] for n in ct["nodes"]]
    assert sorted({i for i in ct_ids if ct_ids.count(i) > 1}) == ["0_26_5"]
    assert {"0_26_5", "26_-1_5"} <= set(mine) and len(ours["nodes"]) == len(mine)


def test_the_same_links_within_float32_rounding_of_the_largest(docs):
    """Each link is one float32 backward pass of each program's frozen replacement model, whose forward pass (the
    frozen attention patterns and norms, the activations that scale each row) each program ran itself in float32:
    lenscope's and circuit-tracer's weights can differ by :func:`parts_rounding` (32 (n_layers + 1) u: two passes)
    times the sizes summed into a weight, once per program. The sizes are bounded by the largest link weight
    times the number of nodes summed into one row, which would be loose; we allow ``2 parts_rounding(n_layers)``
    of the largest weight (1984 u for 30 blocks), i.e. each program within its own bound of the largest link.
    Measured: 28 u of the largest weight (9.87) at most, over 2948 links; 4e-5 relative to the link itself."""
    ct, ours, g = docs
    theirs = {_lenscope_id(n): n for n in ct["nodes"]}
    by_ct_id: dict[str, list[str]] = {}
    for i, n in theirs.items():
        by_ct_id.setdefault(n["node_id"], []).append(i)
    mine = {(x["source"], x["target"]): x["weight"] for x in ours["links"]}
    scale = max(abs(w) for w in mine.values())
    tol = 2 * parts_rounding(g.n_layers) * scale
    assert len(ct["links"]) == len(mine)
    groups: dict[tuple[str, str], list[float]] = {}  # circuit-tracer's links by their ids: where an error's id is
    for x in ct["links"]:  # also a feature's, one pair of ids holds a link of each, told apart by their weights
        groups.setdefault((x["source"], x["target"]), []).append(x["weight"])
    worst, n_shared = 0.0, 0
    for (s, t), ws in groups.items():
        pairs = [(a, b) for a in by_ct_id[s] for b in by_ct_id[t] if (a, b) in mine]
        assert len(pairs) == len(ws), (s, t, ws, pairs)
        n_shared += len(ws) > 1
        for w, v in zip(sorted(ws), sorted(mine[ab] for ab in pairs)):
            worst = max(worst, abs(w - v))
    assert n_shared  # the file has links whose circuit-tracer ids are shared (layer-0 feature, error)
    assert worst <= tol, (worst, tol, worst / (U32 * scale))


def test_the_values_on_the_nodes_and_the_metadata_circuit_tracer_writes_too(docs):
    ct, ours, g = docs
    theirs = {_lenscope_id(n): n for n in ct["nodes"]}
    mine = {n["node_id"]: n for n in ours["nodes"]}
    rounding = 2 * parts_rounding(g.n_layers)
    acts = [n["activation"] for n in theirs.values() if n["activation"] is not None]
    for i, n in theirs.items():
        m = mine[i]
        if n["activation"] is not None:  # a forward pass each: within rounding of the largest activation
            assert abs(m["activation"] - n["activation"]) <= rounding * max(map(abs, acts)), i
        if n["feature_type"] == "logit":  # a softmax of float32 logits each
            assert abs(m["token_prob"] - n["token_prob"]) <= rounding, i
        elif n["influence"] is not None:  # cumulative shares of the total influence, in [0, 1]
            assert abs(m["influence"] - n["influence"]) <= rounding, i
    meta, want = ours["metadata"], ct["metadata"]
    for k in ("prompt_tokens", "prompt", "node_threshold", "schema_version"):
        assert meta[k] == want[k], k
    assert set(meta) == set(want) and set(ours) == set(ct)
    # where lenscope writes its own: the model's name (circuit-tracer: the transcoder set's name) and the sites
    assert meta["scan"] == "smollm2" and meta["transcoder_list"] == [f"mlp_out.{i}" for i in range(g.n_layers)]
