"""Automatic supernodes and their check (features/graphs/supernodes.py): average linkage on cases worked out by hand
(two obvious groups; a merge order single linkage would get wrong; the position and layer-band rules), a hand-made
graph whose two groups are known, determinism, every feature node in at most one group, the export, the check
against ``intervene`` called by hand and its Spearman against the textbook formula, the flags, the CLI's JSON
fields and one-line errors."""

from __future__ import annotations

import json

import pytest
import torch

from lenscope.errors import InputError
from lenscope.features.graphs.check import intervene
from lenscope.features.graphs.export import circuit_tracer_json
from lenscope.features.graphs.graph import AttributionGraph, attribution_graph, node_id
from lenscope.features.graphs.prune import prune
from lenscope.features.graphs.supernodes import (
    SupernodeCheck,
    agglomerate,
    auto_supernodes,
    check_supernodes,
    disagreements,
    feature_similarity,
    pooled_spearman,
)
from tests.cli.test_graph import dict_dir, run  # noqa: F401  (a fixture)
from tests.conftest import get_model
from tests.features.test_graph import TEXT, _transcoders
from tests.tolerances import assert_same_computation, assert_same_ints

FULL = {"node_threshold": 1.0, "edge_threshold": 1.0}  # every node and edge with a share kept: many feature nodes
_cache: dict = {}


def _tiny():
    if "g" not in _cache:
        lm = get_model("tiny:llama")
        ds = _transcoders(lm)
        _cache["g"] = (lm, ds, attribution_graph(lm, TEXT, ds))
    lm, ds, g = _cache["g"]
    g.supernodes = []
    return lm, ds, g


def test_average_linkage_finds_the_two_obvious_groups_and_follows_the_rules():
    S = torch.full((6, 6), -0.2, dtype=torch.float64)
    S[:3, :3], S[3:, 3:] = 0.9, 0.8
    S[0, 1] = S[1, 0] = 0.95
    assert agglomerate(S) == [[0, 1, 2], [3, 4, 5]]  # across the blocks the average is below the threshold 0
    assert agglomerate(S, threshold=-1.0, n_groups=1) == [[0, 1, 2, 3, 4, 5]]
    assert agglomerate(S, n_groups=5) == [[0, 1], [2], [3], [4], [5]]  # the most similar pair first
    pos = torch.tensor([0, 0, 1, 2, 2, 2])
    assert agglomerate(S, position=pos) == [[0, 1], [2], [3, 4, 5]]  # one position per group
    layer = torch.tensor([0, 1, 2, 0, 3, 6])
    # at most 3 consecutive blocks: 0-2 fits, 0-3-6 does not (3-6 neither)
    assert agglomerate(S, layer=layer, layer_span=3) == [[0, 1, 2], [3], [4], [5]]
    assert agglomerate(S, layer=layer, layer_span=4) == [[0, 1, 2], [3, 4], [5]]


def test_average_linkage_merges_by_the_mean_similarity_not_the_best_pair():
    """{0, 1} first (0.9); then {0, 1} with 2 averages (0.7 + 0.1) / 2 = 0.4 < S[2, 3] = 0.45, so 2 joins 3 (single
    linkage, by the best pair 0.7, would put 2 with {0, 1}); the last merge averages the four pairs, 0.9 / 4 = 0.225."""
    S = torch.zeros(4, 4, dtype=torch.float64)
    for (a, b), v in {(0, 1): 0.9, (0, 2): 0.7, (1, 2): 0.1, (2, 3): 0.45, (0, 3): 0.1, (1, 3): 0.0}.items():
        S[a, b] = S[b, a] = v
    assert agglomerate(S, n_groups=2) == [[0, 1], [2, 3]]
    assert agglomerate(S, threshold=0.22) == [[0, 1, 2, 3]]
    assert agglomerate(S, threshold=0.23) == [[0, 1], [2, 3]]


def _hand_graph(layers=(0, 0, 0, 0)) -> AttributionGraph:
    """Two tokens; four features at the last position: f0, f1 read t0 and raise the logit, f2, f3 read t1 and lower
    it (each pair's edges alike, the pairs' unlike)."""
    # nodes: f0..f3 | e(0,0), e(0,1), e(1,0), e(1,1) | t0, t1 | logit
    n_layers = max(layers) + 1
    N = 4 + 2 * n_layers + 2 + 1
    t0, t1, lg = N - 3, N - 2, N - 1
    A = torch.zeros(N, N)
    A[0, t0], A[1, t0], A[2, t1], A[3, t1] = 2.0, 1.0, 1.5, 0.5
    A[lg, 0], A[lg, 1], A[lg, 2], A[lg, 3] = 1.0, 2.0, -1.0, -3.0
    z = torch.zeros(N)
    return AttributionGraph(
        model="hand", tokens=["a", "b"], input_ids=[5, 6], sites=[f"mlp_out.{L}" for L in range(n_layers)],
        n_layers=n_layers, feature_layer=torch.tensor(layers), feature_pos=torch.tensor([1, 1, 1, 1]),
        feature_index=torch.tensor([3, 7, 8, 9]), feature_act=torch.ones(4), error_norm=torch.ones(n_layers, 2),
        logit_ids=torch.tensor([9]), logit_probs=torch.tensor([0.6]), logit_tokens=["x"], adjacency=A,
        inputs=A.sum(1), biases=z, dropped=z.clone(), n_active=4, exactness_error=0.0, real_error=0.0,
        tolerance=1e-3, seconds=0.0)


def test_a_hand_made_graph_falls_into_its_two_groups_with_readable_labels():
    g = _hand_graph()
    feats, S = feature_similarity(g, **FULL)
    assert_same_ints(feats, [0, 1, 2, 3])
    # reads: f0 ~ f1 (both t0), f0 _|_ f2; writes (one target, the logit): the sign of the edge
    assert S[0, 1] == pytest.approx(1.0, abs=1e-12) and S[0, 2] == pytest.approx(-0.5, abs=1e-12)
    sns = auto_supernodes(g, **FULL)
    assert sns == [["L0 @1 'b'", "0_3_1", "0_7_1"], ["L0 @1 'b' (2)", "0_8_1", "0_9_1"]] == g.supernodes
    names = {3: "'t' → 'up'", 7: "'u' → 'up'", 8: "'u' → 'down'", 9: "'v' → 'down'"}
    labels = {"mlp_out.0": [names.get(i, "'x' → 'y'") for i in range(10)]}
    g = _hand_graph()
    sns = auto_supernodes(g, labels=labels, **FULL)
    # each group's labels differ: its most influential member's (f1: edge 2 against 1; f3: -3 against -1)
    assert [sn[0] for sn in sns] == ["'u' → 'up' · L0 @1 'b'", "'v' → 'down' · L0 @1 'b'"]
    # half the label weight where one part agrees (f0, f1: 'up'; f1, f2: 'u'), none where neither does
    S_lab = feature_similarity(g, labels=labels, label_weight=0.2, **FULL)[1]
    for (a, b), bonus in {(0, 1): 0.1, (1, 2): 0.1, (2, 3): 0.1, (0, 2): 0.0, (1, 3): 0.0, (0, 0): 0.2}.items():
        assert S_lab[a, b] - S[a, b] == pytest.approx(bonus, abs=1e-12), (a, b)
    # in four blocks a band of one block keeps f0 (block 0) from f1 (block 3); f2 and f3 (blocks 1, 2) need two
    assert [sn[1:] for sn in auto_supernodes(_hand_graph((0, 3, 1, 2)), layer_span=1, **FULL)] == []
    assert [sn[1:] for sn in auto_supernodes(_hand_graph((0, 3, 1, 2)), layer_span=2, **FULL)] == [["1_8_1", "2_9_1"]]
    # the export carries them as circuit-tracer's qParams.supernodes
    doc = circuit_tracer_json(g, **FULL)
    assert doc["qParams"]["supernodes"] == g.supernodes


def test_on_a_model_every_feature_node_is_in_at_most_one_group_and_the_grouping_is_deterministic(tmp_path):
    lm, ds, g = _tiny()
    sns = auto_supernodes(g, layer_span=2, **FULL)
    kept = prune(g, **FULL).node_mask
    ids = {node_id(g, i): i for i in range(g.n_features)}
    members = [x for sn in sns for x in sn[1:]]
    assert len(sns) >= 3 and len(members) == len(set(members))  # at most one group each
    for sn in sns:
        idx = [ids[x] for x in sn[1:]]  # feature nodes of the pruned graph, two or more, one position, a band
        assert len(idx) >= 2 and all(bool(kept[i]) for i in idx)
        assert len({int(g.feature_pos[i]) for i in idx}) == 1
        assert int(g.feature_layer[idx].max() - g.feature_layer[idx].min()) <= 1
    assert len({sn[0] for sn in sns}) == len(sns)
    g.save(tmp_path / "g.safetensors")
    back = AttributionGraph.load(tmp_path / "g.safetensors")
    assert back.supernodes == sns
    back.supernodes = []
    assert auto_supernodes(back, layer_span=2, **FULL) == sns  # the same graph read back: the same groups
    n = len(feature_similarity(g, **FULL)[0])
    few = auto_supernodes(_tiny()[2], n_groups=n - 5, layer_span=2, **FULL)
    assert sum(len(sn) - 2 for sn in few) == 5  # five merges (a group of k: k - 1) leave n - 5 clusters
    with pytest.raises(InputError, match="n_groups"):
        auto_supernodes(g, n_groups=0)
    with pytest.raises(InputError, match="layer_span"):
        auto_supernodes(g, layer_span=0)
    with pytest.raises(InputError, match="square"):
        agglomerate(torch.zeros(2, 3))


def test_the_check_is_intervene_per_group_and_its_spearman_the_textbook_formula(tmp_path):
    lm, ds, g = _tiny()
    kept = prune(g, **FULL).node_mask[: g.n_features].nonzero()[:, 0].tolist()
    # five hand groups of kept feature nodes (any ids may be given; an error node is left out)
    groups = [[f"g{k}", *[node_id(g, i) for i in kept[k::5]]] for k in range(5)]
    groups[0].append(node_id(g, g.offsets()["error"]))
    chk = check_supernodes(lm, g, ds, supernodes=groups + [["errors only", node_id(g, g.offsets()["error"])]])
    assert chk.labels == [f"g{k}" for k in range(5)] and chk.skipped == ["errors only"]
    for k, grp in enumerate(groups):
        res = intervene(lm, g, ds, grp[1:-1] if k == 0 else grp[1:], factor=0.0)
        for name in ("real", "direct", "frozen_total"):
            assert_same_computation(float(getattr(chk, name)[k]), float(getattr(res, name)[0]),
                                    why="the same intervention, read on the first logit node")
    # Spearman by hand: no ties, so 1 - 6 sum d^2 / (n (n^2 - 1)) over the ranks
    n = 5
    r_real = {i: r for r, i in enumerate(sorted(range(n), key=lambda i: float(chk.real[i])))}
    r_pred = {i: r for r, i in enumerate(sorted(range(n), key=lambda i: float(chk.direct[i])))}
    d2 = sum((r_real[i] - r_pred[i]) ** 2 for i in range(n))
    assert chk.spearman == pytest.approx(1 - 6 * d2 / (n * (n * n - 1)), abs=1e-12)
    assert chk.prediction == "direct" and chk.flags == disagreements(chk.real, chk.direct, 2.0, 0.01)
    assert pooled_spearman([chk, chk], "direct") == pytest.approx(chk.spearman, abs=1e-12)
    d = chk.to_dict()
    assert {"spearman", "spearman_direct", "spearman_frozen_total", "flagged", "groups", "skipped"} <= set(d)
    assert [r["label"] for r in d["groups"]] == chk.labels and d["groups"][1]["nodes"] == groups[1][1:]
    assert list(chk.to_frame().columns) == ["label", "n_features", "real", "direct", "frozen_total", "predicted",
                                            "flag"]
    back = SupernodeCheck.load(chk.save(tmp_path / "c.safetensors"))
    assert_same_computation(back.to_dict(), d, why="saved and read back")
    with pytest.raises(InputError, match="no supernodes"):
        check_supernodes(lm, g, ds)
    with pytest.raises(InputError, match="prediction"):
        check_supernodes(lm, g, ds, supernodes=groups, prediction="total")
    with pytest.raises(InputError, match="ratio"):
        check_supernodes(lm, g, ds, supernodes=groups, ratio=0.5)
    with pytest.raises(InputError, match="no supernode holds"):
        check_supernodes(lm, g, ds, supernodes=[["e", node_id(g, g.offsets()["error"])]])


def test_a_group_is_flagged_for_an_opposite_sign_or_a_size_more_than_the_ratio_apart():
    real = torch.tensor([1.0, -1.0, 0.001, 1.0, 5.0, 0.0], dtype=torch.float64)
    pred = torch.tensor([1.5, 1.0, -0.002, 3.0, 1.0, 0.5], dtype=torch.float64)
    # below 1% of the largest (5): 0.001 and -0.002 count as none and agree; 0 against 0.5: size
    assert disagreements(real, pred, ratio=2.0, floor=0.01) == ["", "sign", "", "size", "size", "size"]
    # a ratio of 6: 3 against 1 and 1 against 5 agree; 0.5 against none is still more than 6 times the floor 0.05
    assert disagreements(real, pred, ratio=6.0, floor=0.01) == ["", "sign", "", "", "", "size"]
    assert disagreements(real, pred, ratio=6.0, floor=0.1) == ["", "sign", "", "", "", ""]


def test_cli_builds_checks_and_exports_the_supernodes(dict_dir, tmp_path):  # noqa: F811
    folder, ds = dict_dir
    args = ["graph", "The cat sat on the mat", "--model", "tiny:llama", "--dict", str(folder), "--no-heads",
            "--node-threshold", "1.0", "--edge-threshold", "1.0"]
    r = run(*args, "--supernodes", "12", "--check-supernodes", "--json", "--export-circuit-tracer",
            str(tmp_path / "ct.json"))
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    lm = get_model("tiny:llama")
    g = attribution_graph(lm, "The cat sat on the mat", ds)
    want = auto_supernodes(g, n_groups=12, **FULL)
    assert want and out["supernodes"] == want
    chk = check_supernodes(lm, g, ds).to_dict()
    assert [x["label"] for x in out["supernode_check"]["groups"]] == [x["label"] for x in chk["groups"]]
    assert out["supernode_check"]["spearman"] == pytest.approx(chk["spearman"], abs=1e-9, nan_ok=True)
    assert json.loads((tmp_path / "ct.json").read_text())["qParams"]["supernodes"] == want
    r = run(*args, "--supernodes", "12")
    assert r.exit_code == 0 and f"{len(want)} supernodes" in r.stdout, r.output
    for extra, msg in ((["--supernodes", "-1"], "--supernodes must be at least 0"),
                       (["--supernodes", "3", "--supernode-threshold", "2"], "--supernode-threshold in"),
                       (["--check-supernodes"], "needs supernodes"),
                       (["--supernodes", "3", "--check-supernodes", "--prediction", "total"], "--prediction")):
        r = run(*args, *extra)
        assert r.exit_code == 2 and msg in r.output and len(r.output.strip().splitlines()) == 1, (extra, r.output)
