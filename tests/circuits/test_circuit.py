"""Circuits, faithfulness curves, the smallest faithful circuit, greedy exact pruning, and circuit_json."""

import json

import pytest
import torch

from lenscope.circuits import (
    Circuit,
    ComponentGraph,
    Faithfulness,
    attribution_patching,
    circuit_json,
    edge_attribution,
    faithfulness,
    greedy_circuit,
    log_grid,
    smallest_circuit,
)
from lenscope.circuits.circuit import _Evaluator
from lenscope.errors import InputError
from tests.circuits.test_edges import _pairs
from tests.conftest import get_model
from tests.tolerances import assert_same_computation, assert_same_ints, logit_diff_scale, pass_rounding


def _strong_pairs(lm, n=3):
    """Pairs whose corruption changes every token, so the metric moves clearly."""
    V = lm.anatomy.vocab_size
    out = []
    for i in range(n):
        c = [(7 * i + 3 * j + 1) % V for j in range(6)]
        out.append((c, [(t * 5 + 11) % V for t in c], f"#{(3 * i) % V}", f"#{(3 * i + 1) % V}"))
    return out


def test_log_grid():
    g = log_grid(123211)
    assert g[0] == 10 and g[-1] == 123211 and g == sorted(set(g)) and len(g) >= 17
    ratios = [b / a for a, b in zip(g, g[1:])]
    assert max(ratios) < 2.0
    assert log_grid(7) == [7] and log_grid(12)[0] == 10 and log_grid(12)[-1] == 12
    with pytest.raises(InputError):
        log_grid(0)


def test_faithfulness_runs_from_corrupted_to_clean(tiny_decoder):
    lm = tiny_decoder
    pairs = _strong_pairs(lm)
    eap = edge_attribution(lm, pairs, method="eap")
    curve = faithfulness(lm, pairs, eap, ks=[0, 5, eap.n_edges])
    assert curve.value[0] == pytest.approx(0.0, abs=1e-3) and curve.value[-1] == pytest.approx(1.0, abs=1e-3)
    pts = curve.points()
    assert pts[-1]["fraction"] == 1.0 and pts[1]["k"] == 5
    nodes = attribution_patching(lm, pairs=[_as_pair(p) for p in pairs])
    nc = faithfulness(lm, pairs, nodes, ks=[0, curve_total(lm)])
    assert nc.value[0] == pytest.approx(0.0, abs=1e-3) and nc.value[-1] == pytest.approx(1.0, abs=1e-3)
    assert nc.level == "nodes" and nc.total == curve_total(lm)


def curve_total(lm):
    return len(ComponentGraph.of(lm).senders)


def _as_pair(p):
    from lenscope.data.contrast import ContrastPair

    return ContrastPair(*p)


def test_a_node_circuit_is_its_outgoing_edges():
    lm = get_model("tiny:llama")
    pairs = _strong_pairs(lm)
    ev = _Evaluator(lm, pairs, "logit_diff", -1, "corrupted", 512)
    g = ev.graph
    nodes = {"embed", "L0H1", "L1.mlp"}
    by_nodes = Circuit("nodes", sorted(nodes), lm.name).edge_mask(g)
    s, r = by_nodes.nonzero(as_tuple=True)
    by_edges = Circuit("edges", [[g.senders[i], g.receivers[j]] for i, j in zip(s.tolist(), r.tolist())], lm.name)
    assert_same_ints(by_edges.edge_mask(g), by_nodes)
    assert {g.senders[i] for i in s.tolist()} == nodes


def test_smallest_circuit_is_the_first_crossing(tmp_path):
    lm = get_model("tiny:gpt2")
    pairs = _strong_pairs(lm)
    eap = edge_attribution(lm, pairs, method="eap-ig", steps=3)
    curve = faithfulness(lm, pairs, eap)
    assert curve.k.tolist() == log_grid(eap.n_edges)
    c = smallest_circuit(lm, pairs, eap, 0.8, curve=curve)
    assert c is not None and c.level == "edges"
    k = len(c)
    ev = _Evaluator(lm, pairs, "logit_diff", -1, "corrupted", 512)
    here, below = ev(torch.stack([c.edge_mask(ev.graph), Circuit.top(lm, eap, k - 1).edge_mask(ev.graph)]))
    assert float(here) >= 0.8 and float(below) < 0.8
    # the same ratio from another batch: each metric within pass_rounding x its scale (tests/tolerances.py), the
    # ratio (m - m_corr) / (m_clean - m_corr) of at most ~1 then within 4x that over |m_clean - m_corr|
    scale = max(logit_diff_scale(lm, torch.tensor(ids), int(t[1:]), int(f[1:]))
                for clean, corrupt, t, f in pairs for ids in (clean, corrupt))
    tol = 4 * pass_rounding(lm) * scale / abs(ev.m_clean - ev.m_corr)
    assert c.info["faithfulness"] == pytest.approx(float(here), abs=tol)
    grid_k = curve.smallest(0.8)
    assert k <= grid_k
    # save, reload, diff, draw
    back = Circuit.load(c.save(tmp_path / "c.safetensors"))
    assert back.members == c.members and back.level == "edges"
    d = c.diff(Circuit.top(lm, eap, k + 3))
    assert d["only_here"] == [] and len(d["only_there"]) == 3 and len(d["both"]) == k
    assert c.draw() is not None and curve.plot() is not None
    fb = Faithfulness.load(curve.save(tmp_path / "f.safetensors"))
    assert_same_computation(fb.points(), curve.points(), why="saved and read back")
    assert list(curve.to_frame().columns) == ["k", "fraction", "value"]


def _faithfulness_of(lm, pairs, graph, kept):
    """Faithfulness of the circuits ``kept (C, S, R)`` from circuit_metrics and end_metrics directly (not the
    circuit module's evaluator): ``(metric - corrupted) / (clean - corrupted)``, means over the prompts."""
    from lenscope.circuits.graph import end_metrics, groups
    from lenscope.circuits.patch import circuit_metrics

    gs = groups(lm, pairs, "logit_diff")
    n = sum(g.size for g in gs)
    total = sum(circuit_metrics(lm, graph, g, graph.valid[None] & ~kept).sum(1) for g in gs)
    ends = [end_metrics(lm, g, "logit_diff") for g in gs]
    mc, mx = (sum(float(e[i].sum()) for e in ends) / n for i in (0, 1))
    return (total / n - mx) / (mc - mx), mc, mx


def test_greedy_pruning_keeps_faithfulness_within_its_steps():
    """Every decision replayed: greedy visits the receivers from the logits down and each one's senders in order;
    from the circuit it returns, the edges it removed are known, so each step's circuit is rebuilt and evaluated
    independently. Each accepted removal moved faithfulness by less than tau, each rejected one by tau or more."""
    lm = get_model("tiny:gpt2")
    pairs = _strong_pairs(lm, n=2)
    g = ComponentGraph.of(lm)
    everything = greedy_circuit(lm, pairs, tau=1e9)  # every removal accepted: the corrupted run
    assert everything.members == [] and everything.info["faithfulness"] == pytest.approx(0.0, abs=1e-3)
    none = greedy_circuit(lm, pairs, tau=0.0)  # nothing may move: every edge stays
    assert len(none.members) == g.n_edges
    tau = 0.02
    c = greedy_circuit(lm, pairs, tau=tau)
    final = c.edge_mask(g)
    order = [(s, r) for r in range(len(g.receivers) - 1, -1, -1) for s in g.valid[:, r].nonzero().flatten().tolist()]
    assert len(order) == g.n_edges
    states, trials, accepted = [g.valid.clone()], [], []
    for s, r in order:  # the circuit before each step, the step's trial, and whether greedy took it
        trial = states[-1].clone()
        trial[s, r] = False
        trials.append(trial)
        accepted.append(not bool(final[s, r]))
        states.append(trial if accepted[-1] else states[-1])
    f, mc, mx = _faithfulness_of(lm, pairs, g, torch.stack(states[:-1] + trials))
    before, after = f[: len(order)], f[len(order):]
    change = (after - before).abs()
    # float32 metrics, batched differently from greedy's own runs: each faithfulness value rounds by about
    # eps32 * (the logits' size) / (clean - corrupted); 1e-5 of max(1, |metric|) per metric covers that 100 times
    slack = 1e-5 * max(1.0, abs(mc), abs(mx)) / abs(mc - mx)
    acc = torch.tensor(accepted)
    assert 0 < int(acc.sum()) < g.n_edges
    assert float(change[acc].max()) < tau + slack, float(change[acc].max())
    assert float(change[~acc].min()) >= tau - slack, float(change[~acc].min())
    # the replay is not trivial: accepted steps do move faithfulness (by up to tau)
    assert float(change[acc].max()) > 10 * slack  # measured: 96 of 110 edges removed, by up to 0.018
    assert float(f[0]) == pytest.approx(c.info["start_faithfulness"], abs=slack)
    assert float(_faithfulness_of(lm, pairs, g, final[None])[0][0]) == pytest.approx(c.info["faithfulness"],
                                                                                       abs=slack)
    assert c.info["evaluations"] == 1 + g.n_edges  # the start, then one run per edge


def test_circuit_json_fields_and_check():
    lm = get_model("tiny:qwen2")
    pairs = _strong_pairs(lm)
    seen = []
    out = circuit_json(lm, pairs, method="eap-ig", level="edges", top=5, check=True, steps=2, check_top=5,
                       check_sample=10, progress=lambda stage, done, total: seen.append((stage, done, total)))
    assert [s for s, _, _ in seen if s != seen[0][0]][:1] == ["faithfulness"] and seen[0][0] == "scores"
    assert seen[-1] == ("check", 15, 15) and ("scores", 3, 3) in seen
    json.dumps(out)
    for key in ("method", "level", "n", "metric_clean", "metric_corrupted", "seconds", "nodes", "edges",
                "faithfulness", "check"):
        assert key in out
    assert out["method"] == "eap-ig" and out["level"] == "edges" and out["n"] == 3 and len(out["edges"]) == 5
    assert {n["name"] for n in out["nodes"]} >= {"embed", "L0H0", "L0.mlp", "logits"}
    assert set(out["check"]) >= {"spearman", "top10_recall", "false_negatives"} and out["check"]["edges"] == 15
    assert out["faithfulness"][-1]["value"] == pytest.approx(1.0, abs=1e-3)
    nodes = circuit_json(lm, [_as_pair(p) for p in pairs], method="atp", level="nodes", check=True)
    assert nodes["edges"] == [] and nodes["total"] == curve_total(lm) and "check" in nodes
    with pytest.raises(InputError, match="use --level edges"):
        circuit_json(lm, pairs, method="eap", level="nodes")
    with pytest.raises(InputError, match="level"):
        circuit_json(lm, pairs, method="eap", level="paths")


def test_faithfulness_refuses_a_corruption_that_changes_nothing():
    lm = get_model("tiny:gpt2")
    same = [([1, 2, 3, 4], [1, 2, 3, 4], "#5", "#6")]
    eap = edge_attribution(lm, _pairs(lm, n=1), method="eap")
    with pytest.raises(InputError, match="same metric"):
        faithfulness(lm, same, eap)


def test_mean_ablation_over_a_reference_set():
    """With the corrupted prompt as the only reference prompt, mean ablation of every edge is the corrupted run;
    a reference of another length falls back to the mean over its positions (and still runs)."""
    lm = get_model("tiny:gpt2")
    pairs = _strong_pairs(lm, n=1)
    c, x, t, f = pairs[0]
    eap = edge_attribution(lm, pairs, method="eap")
    curve = faithfulness(lm, pairs, eap, ks=[0, eap.n_edges], ablation="mean", reference=[(x, x, t, f)])
    assert curve.value[0] == pytest.approx(0.0, abs=1e-3) and curve.value[1] == pytest.approx(1.0, abs=1e-3)
    own = faithfulness(lm, pairs, eap, ks=[0], ablation="mean")  # a single prompt's own mean is itself: clean
    assert own.value[0] == pytest.approx(1.0, abs=1e-3)
    other = faithfulness(lm, pairs, eap, ks=[0], ablation="mean", reference=[([1, 2, 3], [1, 2, 4], t, f)])
    assert torch.isfinite(other.value).all() and abs(float(other.value[0]) - 1.0) > 1e-3
