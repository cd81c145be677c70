"""The attribution graph's memory budget: the estimate's adjacency and rows terms are the sizes of the tensors the
graph holds, and it grows with the feature nodes and the batch; a budget that one row a pass cannot meet is a
one-line error naming the most feature nodes that fit, and that many do run within it; a budget met only by a
smaller batch lowers the batch and gives the same graph, within its tolerance; the head split on the edges alike."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from lenscope.errors import InputError
from lenscope.features.graphs.graph import attribution_graph
from lenscope.features.graphs.memory import graph_memory, nbytes
from lenscope.features.graphs.replacement import active_counts, transcoders_by_layer
from lenscope.memory import format_bytes, parse_size
from lenscope.models.runtime.trace import trace
from tests.conftest import get_model
from tests.features.test_graph import TEXT, _transcoders
from tests.tolerances import assert_same_ints

PLENTY = 10**12  # bytes: a budget no tiny graph reaches


@pytest.fixture(scope="module")
def setup():
    lm = get_model("tiny:llama")
    ds = _transcoders(lm)
    g = attribution_graph(lm, TEXT, ds, max_memory=PLENTY)
    A = lm.anatomy
    dims = dict(n_pos=g.n_pos, n_layers=g.n_layers, d_model=A.d_model,
                n_heads=max(layer.attn.n_heads for layer in A.layers), n_active=g.n_active,
                block_active=int(torch.bincount(g.feature_layer).max()), n_logits=g.n_logits,
                trace_bytes=nbytes(trace(lm, TEXT)))
    return lm, ds, g, (lambda n, b: graph_memory(n_features=n, batch_size=b, **dims))


def test_the_estimate_holds_the_graphs_sizes_and_grows_with_nodes_and_batch(setup):
    lm, ds, g, est = setup
    assert g.n_features == g.n_active > 20
    # the counts the estimate is made from, before the frozen model exists, are the frozen model's active features
    counts = active_counts(trace(lm, TEXT), transcoders_by_layer(lm, ds))
    assert_same_ints(list(counts.values()), torch.bincount(g.feature_layer, minlength=g.n_layers).tolist())
    e = est(g.n_features, 256)
    assert_same_ints(e.adjacency, g.adjacency.numel() * g.adjacency.element_size())
    n_src = g.n_active + g.n_layers * g.n_pos + g.n_pos
    assert_same_ints(e.rows, (g.n_features + g.n_logits) * n_src * 4)
    assert e.trace > 0 and e.frozen > 0 and e.per_row > 0
    totals = [est(n, 1).total for n in range(g.n_active + 1)]
    assert all(a <= b for a, b in zip(totals, totals[1:])) and totals[0] < totals[-1]
    batches = [est(g.n_active, b).total for b in (1, 2, 8, 64, 256)]
    assert all(a <= b for a, b in zip(batches, batches[1:])) and batches[0] < batches[-1]


def test_a_small_budget_names_the_feature_nodes_that_fit_and_they_run_within_it(setup):
    lm, ds, g, est = setup
    budget = (est(0, 1).total + est(g.n_active, 1).total) // 2
    with pytest.raises(InputError) as e:
        attribution_graph(lm, TEXT, ds, max_memory=budget)
    msg = str(e.value)
    assert "\n" not in msg and "--max-memory" in msg and format_bytes(budget) in msg
    n = int(re.search(r"--max-feature-nodes (\d+)", msg).group(1))
    assert 0 < n < g.n_active
    assert est(n, 1).total <= budget < est(n + 1, 1).total  # the most that fit
    small = attribution_graph(lm, TEXT, ds, max_feature_nodes=n, max_memory=budget)
    assert_same_ints(small.n_features, n)
    assert small.exactness_error <= small.tolerance
    # a budget even no feature node fits: the prompt is too long
    with pytest.raises(InputError, match="even --max-feature-nodes 0 needs .*shorten the prompt"):
        attribution_graph(lm, TEXT, ds, max_memory=est(0, 1).total - 1)
    # the budget as a size: the same refusal
    with pytest.raises(InputError, match="--max-feature-nodes"):
        attribution_graph(lm, TEXT, ds, max_memory=f"{budget / 1e3}kB")


def test_a_budget_met_by_a_smaller_batch_gives_the_same_graph(setup, capsys):
    lm, ds, g, est = setup
    budget = est(g.n_active, 40).total  # past the batches whose peak is the pruning's (GraphMemory.prune)
    assert est(g.n_active, 256).total > budget > est(g.n_active, 1).total  # the default batch does not fit
    want = max(b for b in range(1, 257) if est(g.n_active, b).total <= budget)
    assert 1 < want < 256
    small = attribution_graph(lm, TEXT, ds, max_memory=budget, progress=True)
    assert f"batch size lowered from 256 to {want} " in capsys.readouterr().err
    assert_same_ints([small.feature_layer, small.feature_pos, small.feature_index, small.logit_ids],
                     [g.feature_layer, g.feature_pos, g.feature_index, g.logit_ids])
    # another batch shape is another computation: the same edges within the graph's own (relative) tolerance
    scale = float(g.adjacency.abs().max())
    torch.testing.assert_close(small.adjacency, g.adjacency, rtol=0, atol=g.tolerance * scale)
    torch.testing.assert_close(small.biases, g.biases, rtol=0, atol=g.tolerance * float(g.biases.abs().max()))


def test_heads_on_the_edges_fit_the_budget_by_their_batch_or_refuse_in_one_line(setup, capsys):
    """The head split's estimate (HeadsMemory) holds what the graph holds and grows with the batch of sources; a
    budget met only by a smaller batch lowers it (the same parts within the split's own bound: another batch shape,
    another computation); one that even one source a pass cannot meet is a one-line error naming --no-heads."""
    from lenscope.features.graphs.heads import edge_heads, heads_memory
    from lenscope.features.graphs.replacement import parts_rounding

    lm, ds, g, _ = setup
    edges = (g.adjacency != 0).nonzero()
    A = lm.anatomy
    held = nbytes(g)
    dims = dict(n_pos=g.n_pos, n_layers=g.n_layers, d_model=A.d_model,
                n_heads=max(layer.attn.n_heads for layer in A.layers), n_active=g.n_active,
                n_targets=int(edges[:, 0].unique().numel()), n_edges=edges.shape[0])
    full = edge_heads(lm, g, ds, edges=edges, max_memory=PLENTY)
    # the budget is the whole process's: what the graph holds counts, and the estimate grows with the batch
    est = [heads_memory(batch_size=b, held=held, **dims) for b in (1, 2, 8, 32)]
    assert est[0].held == held > g.adjacency.numel() * 4 and est[0].per_source > 0
    assert all(a.total < b.total for a, b in zip(est, est[1:]))
    # the real run adds the trace and the frozen model to what is held: a budget between 4 and 5 sources a pass
    from lenscope.features.graphs.memory import graph_memory

    extra = nbytes(trace(lm, TEXT)) + graph_memory(n_features=0, n_logits=0, batch_size=0, block_active=0,
                                                   **{k: v for k, v in dims.items() if k not in ("n_targets",
                                                                                                  "n_edges")}).frozen
    budget = heads_memory(batch_size=4, held=held + extra, **dims).total
    small = edge_heads(lm, g, ds, edges=edges, max_memory=budget, progress=True)
    assert "heads on the edges: batch size lowered from 32 to 4 " in capsys.readouterr().err
    assert_same_ints(small.edges, full.edges)
    assert small.error <= parts_rounding(g.n_layers)
    scale = float(torch.maximum(full.heads.abs().amax(), full.residual.abs().max()))
    bound = parts_rounding(g.n_layers) * float(g.adjacency.abs().sum(1).max() + g.biases.abs().max())
    torch.testing.assert_close(small.heads, full.heads, rtol=0, atol=max(bound, 1e-6 * scale))
    torch.testing.assert_close(small.residual, full.residual, rtol=0, atol=max(bound, 1e-6 * scale))
    with pytest.raises(InputError) as e:
        edge_heads(lm, g, ds, edges=edges, max_memory=heads_memory(batch_size=1, held=held + extra, **dims).total - 1)
    msg = str(e.value)
    assert "\n" not in msg and "--no-heads" in msg and "--max-memory" in msg and "one source a pass" in msg


def test_sizes_parse_and_print():
    assert_same_ints([parse_size("8GB"), parse_size("500 MB"), parse_size("1GiB"), parse_size("64k"),
                      parse_size("1024"), parse_size(7)], [8 * 10**9, 5 * 10**8, 2**30, 64_000, 1024, 7])
    for bad in ("eight", "8XB", "0", "-1GB", ""):
        with pytest.raises(InputError, match="memory size"):
            parse_size(bad)
    assert format_bytes(21.7e9) == "21.7 GB" and format_bytes(512_000) == "512 kB" and format_bytes(12) == "12 B"
    assert_same_ints(parse_size(format_bytes(21.7e9).replace(" ", "")), 21_700_000_000)


def test_the_default_budget_is_a_share_of_the_available_memory(monkeypatch):
    import lenscope.memory as mem

    free = mem.available_memory()
    path = Path("/proc/meminfo")
    meminfo = path.read_text() if path.exists() else ""
    if "MemAvailable:" in meminfo:  # Linux: read back, at most what /proc/meminfo says (a cgroup may leave less)
        kb = int(meminfo.split("MemAvailable:")[1].split()[0])
        assert 0 < free <= kb * 1024
    monkeypatch.setattr(mem, "available_memory", lambda: 10**9)
    assert_same_ints([mem.default_budget(), mem.budget(None), mem.budget("2GB"), mem.budget(5)],
                     [int(mem.SAFE_SHARE * 10**9), int(mem.SAFE_SHARE * 10**9), 2 * 10**9, 5])
    monkeypatch.setattr(mem, "available_memory", lambda: None)
    assert_same_ints(mem.default_budget(), mem.FALLBACK)
