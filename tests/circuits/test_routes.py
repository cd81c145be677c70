"""Information-flow routes (Ferrando & Voita 2024): the proximity formula by hand, every sum complete against the
trace, head terms recomputed from the Anatomy, importances adding to one at every node, top-down pruning against a
brute-force search of the whole graph, the thresholds' extremes, results round-trip, and one real model."""

from __future__ import annotations

import json
import math

import pytest
import torch

from lenscope.circuits import InformationFlowRoutes, information_flow_routes, route_recovery
from lenscope.circuits.routes import attention_terms, ff_terms, routes_from_trace, term_importance
from lenscope.errors import InputError, InvariantError, NotApplicableError
from lenscope.mixing.alti import proximity
from lenscope.models.runtime.trace import prefix_trace, trace
from lenscope.models.runtime.verify import TOLERANCE
from lenscope.models.weights.algebra import activation_scale, relative_gap
from tests.conftest import get_model
from tests.tolerances import assert_same_computation, assert_same_ints

TEXT = "the cat sat on the mat and the dog ran"


def _trace(lm):
    return trace(lm, TEXT)


def test_proximity_and_importance_by_hand():
    y = torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64)  # ||y||_1 = 6
    terms = torch.tensor([[1.0, 0.0, 1.0],  # ||y - z||_1 = 4 -> 2
                          [0.0, -2.0, 2.0],  # 2 -> 4
                          [0.0, 0.0, 0.0],  # 6 -> 0
                          [-5.0, 0.0, 0.0]], dtype=torch.float64)  # 11 -> max(-5, 0) = 0
    assert_same_computation(proximity(terms, y).tolist(), [2.0, 4.0, 0.0, 0.0], why="sums of small integers: "
                            "exact in float64")
    imp, bad = term_importance(terms, y)
    assert torch.allclose(imp, torch.tensor([2 / 6, 4 / 6, 0.0, 0.0], dtype=torch.float64))
    assert not bool(bad)
    # no term with a positive proximity: the residual term (column 0) keeps the node
    imp, bad = term_importance(-terms[:1] * 3, y)
    assert bool(bad)
    assert_same_computation(imp.tolist(), [1.0], why="the residual term's importance: the constant 1")
    # batched: rows are independent
    imp2, _ = term_importance(torch.stack([terms, terms.flip(0)]), torch.stack([y, y]))
    assert torch.allclose(imp2[1], imp2[0].flip(0))


def _expected_heads(lm, tr, l):
    """Head h's write from source j to position i, recomputed from the Anatomy alone: ``(pos, head, src, d)``,
    and the bias term ``(pos, d)`` (after a sandwich norm with its traced scale, times a residual multiplier)."""
    layer = lm.anatomy.layers[l]
    attn = layer.attn
    v = attn.values(tr.attn_in[l]).double()  # (head, src, d_head), b_V in
    W_O = attn.W_O.double()
    probs = tr.pattern[l].double()  # (head, pos, src)
    c = torch.einsum("hij,hje,hed->ihjd", probs, v, W_O)
    n, d = c.shape[0], c.shape[-1]
    bias = attn.b_O.double().expand(n, d) if attn.b_O is not None else torch.zeros(n, d, dtype=torch.float64)
    post = layer.ln_attn_out
    if post is not None:
        post = post.to(torch.float64)
        s = post.scale(tr.attn_out[l].double())
        c = post.linear(c, s[:, None, None].expand(c.shape[:3]))
        bias = post.linear(bias, s) + (post.bias if post.bias is not None else 0)
    return c * layer.residual_scale, bias * layer.residual_scale  # Granite's residual multiplier scales the write


def test_terms_complete_and_recomputed(tiny_decoder):
    """Every sum's terms add up to the traced state (TOLERANCE, relative to the activation's RMS norm); head terms
    equal ``A_h[i, j] v_j^h W_O^h`` recomputed from the Anatomy; summing heads gives the per-source columns."""
    lm = tiny_decoder
    A, tr = lm.anatomy, _trace(lm)
    n = len(tr.tokens)
    rows = torch.arange(n)
    parallel = A.placement == "parallel"
    for l in range(A.n_layers):
        terms, y = attention_terms(A, tr, l, rows, per_head=True)
        H = A.layers[l].attn.n_heads
        assert terms.shape == (n, 1 + H * n + 1 + parallel, A.d_model)
        real = (tr.resid_post if parallel else tr.resid_mid)[l]
        assert_same_computation(y, real.double(), why="the real state, copied")
        assert relative_gap(terms.sum(1), y, activation_scale(real)) < TOLERANCE
        c, bias = _expected_heads(lm, tr, l)
        assert torch.allclose(terms[:, 1:1 + H * n], c.flatten(1, 2), atol=1e-5, rtol=1e-4)
        assert torch.allclose(terms[:, 1 + H * n], bias, atol=1e-5, rtol=1e-4)
        assert_same_computation(terms[:, 0], tr.resid_pre[l].double(), why="the block's input, copied as term 0")
        summed, y2 = attention_terms(A, tr, l, rows, per_head=False)
        assert torch.allclose(summed[:, 1:1 + n], c.sum(1), atol=1e-5, rtol=1e-4)
        assert_same_computation(y2, y, why="the real state, copied by both calls")
        if not parallel:
            ff, y3 = ff_terms(tr, l, rows)
            assert relative_gap(ff.sum(1), y3, activation_scale(tr.resid_post[l])) < TOLERANCE
        # a chunk of rows: the same terms as the whole (sources beyond the chunk read nothing, causal)
        part, _ = attention_terms(A, tr, l, rows[2:5], per_head=True)
        b = 5
        full = terms[2:5, 1:1 + H * n].reshape(3, H, n, -1)
        assert torch.allclose(part[:, 1:1 + H * b].reshape(3, H, b, -1), full[:, :, :b])
        assert full[:, :, b:].abs().max() == 0


def test_importances_add_to_one_at_every_node(tiny_decoder):
    r = information_flow_routes(tiny_decoder, TEXT, tau=0.0)
    assert r.completeness_error < TOLERANCE
    into: dict = {}
    for d, w in zip(r.dst.tolist(), r.importance.tolist()):
        into[tuple(d)] = into.get(tuple(d), 0.0) + w
    computed = 0
    for node, b in zip(r.nodes.tolist(), r.node_bias.tolist()):
        if math.isnan(b):
            assert node[0] == 0 and node[2] == 0 and tuple(node) not in into  # the embeddings: no sum
            continue
        computed += 1
        assert into.get(tuple(node), 0.0) + b == pytest.approx(1.0, abs=1e-5), node
    assert computed == len(into) and computed >= r.layers  # tau = 0: the routes go down through every layer


def _all_edges(A, tr, tau, per_head):
    """Every edge of the whole graph with importance > tau, written out column by column (no pruning)."""
    n, H = len(tr.tokens), A.layers[0].attn.n_heads
    parallel = A.placement == "parallel"
    edges = {}
    rows = torch.arange(n)
    for l in range(A.n_layers):
        imp, _ = term_importance(*attention_terms(A, tr, l, rows, per_head))
        dst_of = (lambda i: (l + 1, i, 0)) if parallel else (lambda i: (l, i, 1))
        for i in range(n):
            cols = [((l, i, 0), "resid")]
            if per_head:
                cols += [((l, j, 0), f"L{l}H{h}") for h in range(H) for j in range(n)]
            else:
                cols += [((l, j, 0), f"L{l}.attn") for j in range(n)]
            cols.append((None, "bias"))
            if parallel:
                cols.append(((l, i, 0), f"L{l}.mlp"))
            assert len(cols) == imp.shape[1]
            for c, (src, via) in enumerate(cols):
                if src is not None and float(imp[i, c]) > tau:
                    edges[(src, dst_of(i), via)] = float(imp[i, c])
        if not parallel:
            imp, _ = term_importance(*ff_terms(tr, l, rows))
            for i in range(n):
                for c, via in enumerate(["resid", f"L{l}.mlp"]):
                    if float(imp[i, c]) > tau:
                        edges[((l, i, 1), (l + 1, i, 0), via)] = float(imp[i, c])
    return edges


@pytest.mark.parametrize("tau", [0.0, 0.04, 0.15])
def test_top_down_equals_brute_force(tiny_decoder, tau):
    """The routes are exactly the edges of the whole graph (every node's sum computed) that reach the top node
    backwards through kept edges: a fixed-point search over all edges."""
    lm = tiny_decoder
    A = lm.anatomy
    tr = prefix_trace(_trace(lm), 8)
    for per_head in (True, False):
        full = _all_edges(A, tr, tau, per_head)
        reached = {(A.n_layers, 7, 0)}
        while True:
            more = {s for (s, d, _) in full if d in reached} - reached
            if not more:
                break
            reached |= more
        want = {k: w for k, w in full.items() if k[1] in reached}
        r = routes_from_trace(A, tr, tau=tau, per_head=per_head)
        got = {(tuple(e["src"][:2]) + ((0 if e["src"][2] == "resid" else 1),),
                tuple(e["dst"][:2]) + ((0 if e["dst"][2] == "resid" else 1),), e["via"]): e["importance"]
               for e in r.edge_list()}
        assert got.keys() == want.keys()
        assert all(abs(got[k] - want[k]) < 1e-6 for k in got)
        assert {tuple(x) for x in r.nodes.tolist()} == reached
        assert len(r.nodes) == len(reached)  # each node once
        if tau == 0.0:
            assert len(got) > 3 * A.n_layers


def test_threshold_extremes():
    """tau >= 1 keeps no edge (an importance is at most 1): the graph is the top node alone. tau = 0 keeps every
    edge with a positive importance that reaches the top (above); the paper's 0.04 keeps a subset of it."""
    lm = get_model("tiny:gpt2")
    none = information_flow_routes(lm, TEXT, tau=1.0)
    assert len(none.importance) == 0 and none.nodes.tolist() == [[lm.anatomy.n_layers, none.position, 0]]
    assert none.components() == set()
    a, b = information_flow_routes(lm, TEXT, tau=0.0), information_flow_routes(lm, TEXT, tau=0.04)
    ea = {(tuple(e["src"]), tuple(e["dst"]), e["via"]) for e in a.edge_list()}
    eb = {(tuple(e["src"]), tuple(e["dst"]), e["via"]) for e in b.edge_list()}
    assert eb < ea and bool((b.importance > 0.04).all())


def test_position_and_refusals():
    lm = get_model("tiny:llama")
    r = information_flow_routes(lm, TEXT, position=4)
    assert r.position == 4 and len(r.tokens) == 5 and r.nodes[0].tolist() == [lm.anatomy.n_layers, 4, 0]
    assert int(r.src[:, 1].max()) <= 4
    with pytest.raises(InputError, match="position"):
        information_flow_routes(lm, TEXT, position=40)
    with pytest.raises(InputError, match="tau"):
        information_flow_routes(lm, TEXT, tau=-0.1)
    with pytest.raises(NotApplicableError, match="causal decoder"):
        information_flow_routes(get_model("tiny:bert"), TEXT)


def test_refuses_a_trace_that_does_not_add_up(tiny_decoder):
    """A state that is not the sum of its terms (here the top node, moved by its own RMS norm) is an error, not
    numbers."""
    A, tr = tiny_decoder.anatomy, _trace(tiny_decoder)
    tr.resid_post = tr.resid_post.clone()
    tr.resid_post[-1, -1] += tr.resid_post[-1].norm(dim=-1).pow(2).mean().sqrt() / A.d_model ** 0.5
    with pytest.raises(InvariantError, match="miss the traced states"):
        routes_from_trace(A, tr, tau=0.0)


def _hand_routes():
    """Two layers, three tokens: top (2, 2) <- mid (1, 2) via resid and L1.mlp; mid <- (1, 0) via L1H1; (1, 0) <-
    (0, 0, mid) via resid; that mid <- (0, 0) via L0H0 (the bottom)."""
    src = torch.tensor([[1, 2, 1], [1, 2, 1], [1, 0, 0], [0, 0, 1], [0, 0, 0]])
    dst = torch.tensor([[2, 2, 0], [2, 2, 0], [1, 2, 1], [1, 0, 0], [0, 0, 1]])
    via = torch.tensor([[1, -1], [1, -2], [1, 1], [0, -1], [0, 0]])
    nodes = torch.tensor([[2, 2, 0], [1, 2, 1], [1, 0, 0], [0, 0, 1], [0, 0, 0]])
    return InformationFlowRoutes(
        model="hand", tokens=["a", "b", "c"], position=2, prediction="d", layers=2, heads=2, tau=0.04, per_head=True,
        placement="pre", src=src, dst=dst, via=via, importance=torch.tensor([0.6, 0.4, 0.3, 1.0, 0.5]),
        nodes=nodes, node_bias=torch.tensor([0.0, 0.1, 0.0, 0.2, float("nan")]), completeness_error=1e-8)


def test_components_and_recovery():
    r = _hand_routes()
    assert r.components() == {"L1.mlp", "L1H1", "L0H0", "embed"}
    rec = route_recovery(r, ["L1H1", "L0H0", "L0.mlp", "L1H0"])
    assert_same_computation(rec, {"recall": 0.5, "precision": 0.5, "found": ["L0H0", "L1H1"],
                                  "missed": ["L0.mlp", "L1H0"]}, why="ratios of small counts: 2 / 4, exact")
    rec = route_recovery(r, ["embed", "L1.mlp"])
    assert_same_computation((rec["recall"], rec["precision"]), (1.0, 0.5), why="ratios of small counts: 2 / 2 "
                            "and 2 / 4, exact")
    lm = get_model("tiny:gemma3")
    layer = information_flow_routes(lm, TEXT, per_head=False, tau=0.0)
    assert all(v.endswith((".attn", ".mlp")) for v in layer.components() - {"embed"})
    heads = [f"L0H{h}" for h in range(lm.anatomy.layers[0].attn.n_heads)]
    rec = route_recovery(layer, heads)  # every head of layer 0 is the one node L0.attn
    assert rec["found"] + rec["missed"] == ["L0.attn"]


def test_save_load_frame_dict(tmp_path):
    r = information_flow_routes(get_model("tiny:qwen2"), TEXT, tau=0.02)
    p = r.save(tmp_path / "routes.safetensors")
    back = InformationFlowRoutes.load(p)
    for k in ("src", "dst", "via", "importance", "nodes"):
        assert_same_computation(getattr(back, k), getattr(r, k), why=f"saved and read back ({k})")
    assert_same_ints(back.node_bias.isnan(), r.node_bias.isnan())
    assert back.tokens == r.tokens and back.prediction == r.prediction
    assert_same_computation((back.tau, back.to_dict()), (r.tau, r.to_dict()), why="saved and read back")
    empty = information_flow_routes(get_model("tiny:qwen2"), TEXT, tau=2.0)
    assert len(InformationFlowRoutes.load(empty.save(tmp_path / "empty.safetensors")).importance) == 0
    f = r.to_frame()
    assert list(f.columns) == ["src_layer", "src_token", "src_kind", "dst_layer", "dst_token", "dst_kind", "via",
                               "importance"]
    assert len(f) == len(r.importance) and set(f.src_kind) <= {"resid", "mid"}
    d = json.loads(json.dumps(r.to_dict()))
    assert d["edges"][0]["dst"] == [r.layers, r.position, "resid"] and d["components"] == sorted(r.components())
    assert sum(n["bias"] is None for n in d["nodes"]) == int(r.node_bias.isnan().sum())


def test_plot():
    from lenscope.viz.circuit_plots import route_segments

    r = _hand_routes()
    segs = route_segments(r)
    assert [k for k, _, _ in segs] == ["resid", "mlp", "attn", "resid", "attn"]
    # (1, 0, resid) -> (1, 2, mid)
    assert_same_computation(segs[2][1], [(0, 1.0), (2, 1.5)], why="positions and half steps: exact")
    fig = r.plot()
    ax = fig.axes[0]
    assert len(ax.collections) >= 3 and [t.get_text() for t in ax.get_xticklabels()] == ["a", "b", "c"]
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_smollm2_routes(smollm2):
    """A real model (sequential pre-norm, grouped heads): complete sums, importances adding to one, and routes that
    reach the input at the paper's threshold."""
    r = information_flow_routes(smollm2, "When Mary and John went to the store, John gave a drink to")
    assert r.prediction == " Mary"
    assert r.completeness_error < TOLERANCE and r.degenerate == 0
    into: dict = {}
    for d, w in zip(r.dst.tolist(), r.importance.tolist()):
        into[tuple(d)] = into.get(tuple(d), 0.0) + w
    for node, b in zip(r.nodes.tolist(), r.node_bias.tolist()):
        if tuple(node) in into:
            assert into[tuple(node)] + b <= 1.0 + 1e-5
    comps = r.components()
    assert "embed" in comps and any("H" in c for c in comps) and any(c.endswith(".mlp") for c in comps)
    assert len(comps) < 30 * 10  # a subgraph, not every component
