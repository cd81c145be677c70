"""Edge attribution (EAP, EAP-IG) and exact edge patching, on every decoder family."""

import pytest
import torch

from lenscope.circuits.edges import EdgeAttribution, edge_attribution
from lenscope.circuits.graph import ComponentGraph, end_metrics, groups, sender_writes, writer_sites
from lenscope.circuits.patch import _writes, circuit_metrics, exact_edge_patching
from lenscope.errors import InputError, NotApplicableError
from lenscope.models.runtime.engine import Edit, capture, run
from lenscope.models.runtime.verify import TOLERANCE
from tests.conftest import get_model
from tests.tolerances import assert_derivative, pass_rounding


def _pairs(lm, n=3, P=6, seed=0):
    V = lm.anatomy.vocab_size
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        c = torch.randint(0, V, (P,), generator=g).tolist()
        x = list(c)
        x[1], x[3] = (x[1] + 5) % V, (x[3] + 7) % V
        out.append((c, x, f"#{(3 * i) % V}", f"#{(3 * i + 1) % V}"))
    return out


def test_graph_edges_by_brute_force(tiny_decoder):
    lm = tiny_decoder
    graph = ComponentGraph.of(lm)
    L, H = graph.n_layers, graph.n_heads
    M = graph.n_mlp  # a mixture of experts: one sender per expert
    assert M == getattr(lm.anatomy.layers[0].mlp, "n_experts", 1)
    assert len(graph.senders) == 1 + L * (H + M) and len(graph.receivers) == L * (3 * H + 1) + 1
    assert graph.receivers[-1] == "logits" and graph.senders[graph.mlp_of(0)] == ("L0.E0.mlp" if M > 1 else "L0.mlp")
    assert [graph.senders[i] for i in range(*graph.mlps_of(L - 1).indices(len(graph.senders)))] == (
        [f"L{L - 1}.E{e}.mlp" for e in range(M)] if M > 1 else [f"L{L - 1}.mlp"])
    parallel = graph.placement == "parallel"

    def layer_of(name):
        return -1 if name == "embed" else int(name[1:].split("H")[0].split(".")[0])

    count = 0
    for si, s in enumerate(graph.senders):
        for ri, r in enumerate(graph.receivers):
            ls = layer_of(s)
            if r == "logits":
                ok = True
            else:
                lr = layer_of(r)
                ok = ls < lr or (r.endswith(".mlp") and ls == lr and "H" in s and not parallel)
            assert bool(graph.valid[si, ri]) == ok, (s, r)
            count += ok
    assert graph.n_edges == count


def test_writes_sum_to_the_residual_stream(tiny_decoder):
    lm = tiny_decoder
    graph = ComponentGraph.of(lm)
    ids = torch.tensor([[4, 9, 2, 7, 1]])
    cap = capture(lm, ids, writer_sites(graph.n_layers, graph.n_mlp > 1) + [("resid_post", graph.n_layers - 1)])
    w = sender_writes(lm, graph, cap)
    real = cap["resid_post", graph.n_layers - 1]
    assert (w.sum(2) - real).abs().max() <= TOLERANCE * max(1.0, float(real.abs().max()))


def test_all_edges_kept_is_the_clean_run_and_none_the_corrupted(tiny_decoder):
    lm = tiny_decoder
    graph = ComponentGraph.of(lm)
    (g,) = groups(lm, _pairs(lm), "logit_diff")
    mc, mx = end_metrics(lm, g, "logit_diff")
    none = torch.zeros((1,) + tuple(graph.valid.shape), dtype=torch.bool)
    ms = circuit_metrics(lm, graph, g, torch.cat([none, graph.valid[None]]))
    assert torch.allclose(ms[0], mc, atol=1e-4) and torch.allclose(ms[1], mx, atol=1e-4)
    assert (mc - mx).abs().max() > 1e-3  # the corruption matters, so the check can fail


def test_exact_edge_patch_equals_the_real_model_with_that_input(tiny_decoder):
    """One edge into an MLP and one into a head's query, patched through the real model (engine edits of the
    receiver's output computed from its changed input) == lenscope's patched run."""
    lm = tiny_decoder
    A = lm.anatomy
    graph = ComponentGraph.of(lm)
    V = lm.anatomy.vocab_size
    pairs = [([3, 8, 1, 6, 2, 9], [(t * 7 + 11) % V for t in (3, 8, 1, 6, 2, 9)], "#5", "#7")]  # every token differs
    (g,) = groups(lm, pairs, "logit_diff")
    clean, abl = _writes(lm, graph, g, "corrupted")
    P = g.clean.shape[1]
    s = graph.sender_index("embed")
    delta = (abl - clean)[0, :, s]
    cap = capture(lm, g.clean, [("ln_mlp.in", 0), ("resid_pre", 0)])
    blk = A.layers[0]
    rows, positions = torch.zeros(P, dtype=torch.long), torch.arange(P)
    # MLP receiver
    out = blk.mlp(blk.ln_mlp(cap["ln_mlp.in", 0][0] + delta))
    lg, _ = run(lm, g.clean, [Edit("mlp_out", 0, rows, positions, out)])
    real_mlp = float(lg[0, -1, g.target[0]] - lg[0, -1, g.foil[0]])
    # query receiver of head 1
    x = cap["resid_pre", 0][0]
    H = graph.n_heads
    per = x[:, None, :].expand(P, H, x.shape[-1]).clone()
    xq = per.clone()
    xq[:, 1] += delta
    z = blk.attn.split(blk.ln_attn(xq), blk.ln_attn(per), blk.ln_attn(per), positions)[1]  # (pos, d_head)
    lg, _ = run(lm, g.clean, [Edit("head", 0, rows, positions, z, head=torch.full((P,), 1))])
    real_q = float(lg[0, -1, g.target[0]] - lg[0, -1, g.foil[0]])
    ex = exact_edge_patching(lm, pairs, [("embed", "L0.mlp"), ("embed", "L0H1.q")])
    mc = ex.metric_clean
    r_mlp, r_q = graph.receiver_index("L0.mlp"), graph.receiver_index("L0H1.q")
    assert ex.scores[s, r_mlp] == pytest.approx(real_mlp - mc, abs=2e-6)
    assert ex.scores[s, r_q] == pytest.approx(real_q - mc, abs=2e-6)
    assert min(abs(real_mlp - mc), abs(real_q - mc)) > 5e-6  # larger than the tolerance above
    assert ex.scores.isnan().sum() == graph.n_edges - 2


def test_eap_is_the_first_order_term_of_edge_patching(tiny_decoder):
    """Scaling every sender's change by eps: (metric(eps) - metric(-eps)) / (2 eps) -> the EAP score."""
    lm = tiny_decoder
    graph = ComponentGraph.of(lm)
    pairs = _pairs(lm, n=2)
    eap = edge_attribution(lm, pairs, method="eap")
    (g,) = groups(lm, pairs, "logit_diff")
    clean, abl = _writes(lm, graph, g, "corrupted")
    top = eap.ranking()[:6]
    removed = torch.zeros((len(top),) + tuple(graph.valid.shape), dtype=torch.bool)
    removed[torch.arange(len(top)), top[:, 0], top[:, 1]] = True

    def metric(step):
        return circuit_metrics(lm, graph, g, removed, writes=(clean, clean + step * (abl - clean))).mean(1)

    want = eap.scores[top[:, 0], top[:, 1]]
    # central differences at two steps (tests/tolerances.assert_derivative); a metric (a difference of two float32
    # logits, averaged) is off by at most about pass_rounding times the logits' size
    lg, _ = run(lm, g.clean, last_only=True)
    assert_derivative(metric, want, 0.05, 2 * pass_rounding(lm) * float(lg.abs().max()))
    assert float(want.abs().max()) > 1e-4


# Fixed edges into every receiver kind on grouped-query models (gemma3: 4 query heads share 1 key/value head;
# llama: 4 share 2), so receiver_grads' grouped branch (each query head's share of a shared key/value head) is
# checked for query heads other than a group's first. Chosen where the edge moves the metric by far more than the
# difference's rounding floor; llama's queries and keys move it by 1e-4 at most on these prompts.
GROUPED_EDGES = {
    "gemma3": [("embed", "L0H2.q"), ("L0H0", "L1H2.q"), ("L0.mlp", "L2H0.q"),
               ("embed", "L0H3.k"), ("L0.mlp", "L1H2.k"), ("L0H1", "L1H1.k"),
               ("embed", "L0H1.v"), ("L0H2", "L1H2.v"), ("L0H3", "L1H3.v"),
               ("L0H2", "L0.mlp"), ("L0H0", "L1.mlp"), ("L1H0", "L2.mlp"),
               ("L2H3", "logits"), ("L1H1", "logits"), ("L0H0", "logits")],
    "llama": [("L0H1", "L1H2.q"), ("embed", "L1H2.k"), ("embed", "L1H3.k"),
              ("embed", "L0H2.v"), ("L0H1", "L1H1.v"), ("L0H0", "L1H3.v"),
              ("L0H1", "L0.mlp"), ("L1H1", "L1.mlp"), ("L1H0", "logits"), ("L0H1", "logits")],
}


@pytest.mark.parametrize("family", sorted(GROUPED_EDGES))
def test_eap_of_fixed_edges_into_every_receiver_kind_under_grouped_query_attention(family):
    """EAP is the derivative of exact edge patching along the edge's patch: exact patching with the sender's
    change scaled by ``+-h`` and ``+-2h`` (central differences extrapolated to ``(4 D(h) - D(2h)) / 3``, error
    O(h^4)) equals the EAP score of every fixed q, k, v, MLP and logits edge."""
    lm = get_model(f"tiny:{family}")
    A = lm.anatomy
    assert A.layers[0].attn.n_kv_heads < A.layers[0].attn.n_heads
    graph = ComponentGraph.of(lm)
    pairs = _pairs(lm, n=2)
    eap = edge_attribution(lm, pairs, method="eap")
    (g,) = groups(lm, pairs, "logit_diff")
    clean, abl = _writes(lm, graph, g, "corrupted")
    edges = GROUPED_EDGES[family]
    assert {r.split(".")[-1] if "." in r else r for _, r in edges} == {"q", "k", "v", "mlp", "logits"}
    idx = torch.tensor([[graph.sender_index(s), graph.receiver_index(r)] for s, r in edges])
    removed = torch.zeros((len(edges),) + tuple(graph.valid.shape), dtype=torch.bool)
    removed[torch.arange(len(edges)), idx[:, 0], idx[:, 1]] = True
    h = 0.05

    def central(step):
        up = circuit_metrics(lm, graph, g, removed, writes=(clean, clean + step * (abl - clean))).mean(1)
        down = circuit_metrics(lm, graph, g, removed, writes=(clean, clean - step * (abl - clean))).mean(1)
        return (up.double() - down.double()) / (2 * step)

    fd = (4 * central(h) - central(2 * h)) / 3
    want = eap.scores[idx[:, 0], idx[:, 1]].double()
    # float32 rounding: a metric (a difference of two logits) is off by at most about 4 eps32 max|logit|, and the
    # extrapolated difference divides that by h / 1.5; the O(h^4) truncation is measured below 4e-3 relative
    lg, _ = run(lm, g.clean, last_only=True)
    floor = 1.5 * 4 * torch.finfo(torch.float32).eps * float(lg.abs().max()) / h
    err = (fd - want).abs()
    assert bool((err <= torch.maximum(1e-2 * fd.abs(), torch.tensor(floor))).all()), \
        [(e, float(a), float(b)) for e, a, b in zip(edges, fd, want)]
    assert float(fd.abs().min()) > 10 * floor, (float(fd.abs().min()), floor)  # every edge moves the metric


def test_eap_ig_with_one_step_is_eap_and_converges_towards_exact():
    lm = get_model("tiny:gpt2")
    pairs = _pairs(lm)
    eap = edge_attribution(lm, pairs, method="eap")
    one = edge_attribution(lm, pairs, method="eap-ig", steps=1)
    assert torch.allclose(one.scores, eap.scores, atol=1e-7, rtol=1e-5)
    ex = exact_edge_patching(lm, pairs)
    v = eap.valid
    err_eap = (eap.scores[v] - ex.scores[v]).abs().mean()
    err_ig = (edge_attribution(lm, pairs, method="eap-ig", steps=10).scores[v] - ex.scores[v]).abs().mean()
    assert err_ig < 0.5 * err_eap


def test_mean_ablation_of_a_single_prompt_changes_nothing():
    lm = get_model("tiny:llama")
    graph = ComponentGraph.of(lm)
    (g,) = groups(lm, _pairs(lm, n=1), "logit_diff")
    mc, _ = end_metrics(lm, g, "logit_diff")
    ms = circuit_metrics(lm, graph, g, graph.valid[None].clone(), ablation="mean")
    assert torch.allclose(ms[0], mc, atol=1e-4)


def test_chunks_and_groups_do_not_change_scores(tmp_path):
    lm = get_model("tiny:qwen2")
    pairs = _pairs(lm, n=3) + _pairs(lm, n=2, P=8, seed=1)
    a = edge_attribution(lm, pairs, method="eap-ig", steps=2)
    b = edge_attribution(lm, pairs, method="eap-ig", steps=2, memory_mb=0.01)
    assert a.n == 5 and torch.allclose(a.scores, b.scores, atol=1e-7, rtol=1e-4)
    parts = [edge_attribution(lm, [p], method="eap-ig", steps=2) for p in pairs]
    mean = torch.stack([p.scores for p in parts]).mean(0)
    assert torch.allclose(a.scores, mean, atol=1e-7, rtol=1e-4)
    path = a.save(tmp_path / "e.safetensors")
    back = EdgeAttribution.load(path)
    from tests.tolerances import assert_same_computation

    assert_same_computation((back.scores, back.edges(5)), (a.scores, a.edges(5)), why="saved and read back")
    d = a.to_dict(top=3)
    assert set(d) >= {"method", "level", "n", "metric_clean", "metric_corrupted", "seconds", "edges"}
    assert [set(e) for e in d["edges"]] == [{"src", "dst", "score"}] * 3
    assert list(a.to_frame().columns) == ["src", "dst", "score"]


def test_bad_requests():
    lm = get_model("tiny:gpt2")
    with pytest.raises(InputError, match="pair 2"):
        edge_attribution(lm, _pairs(lm, n=1) + [([1, 2, 3], [1, 2], "#1", "#2")])
    with pytest.raises(InputError, match="foil"):
        edge_attribution(lm, [([1, 2, 3], [1, 2, 4], "#1", None)])
    with pytest.raises(InputError, match="no edge"):
        exact_edge_patching(lm, _pairs(lm, n=1), [("L1.mlp", "L0H0.q")])
    with pytest.raises(InputError, match="method"):
        edge_attribution(lm, _pairs(lm, n=1), method="acdc")
    with pytest.raises(NotApplicableError):
        ComponentGraph.of(get_model("tiny:bert"))


MOE = [n for n in ("mixtral", "qwen3-moe", "olmoe", "gpt-oss")]


@pytest.mark.parametrize("family", MOE)
def test_expert_edges_are_the_real_model_patched(family):
    """A mixture of experts sends one edge per expert: patching the edge (L0.E{e}.mlp -> logits) equals the real
    model with that expert's corrupted-minus-clean output added to the final norm's input (the engine's edit; the
    expert's outputs read by the engine from both runs)."""
    lm = get_model(f"tiny:{family}")
    graph = ComponentGraph.of(lm)
    V = lm.anatomy.vocab_size
    ids = [3, 8, 1, 6, 2, 9]
    pairs = [(ids, [(t * 7 + 11) % V for t in ids], "#5", "#7")]
    (g,) = groups(lm, pairs, "logit_diff")
    P = g.clean.shape[1]
    rows, positions = torch.zeros(P, dtype=torch.long), torch.arange(P)
    cc, cx = capture(lm, g.clean, [("expert_out", 0)]), capture(lm, g.corrupted, [("expert_out", 0)])
    delta = cx["expert_out", 0][0] - cc["expert_out", 0][0]  # (pos, expert, d)
    e = int(delta.norm(dim=-1).sum(0).argmax())  # the expert whose write moves most
    lg, _ = run(lm, g.clean, [Edit("ln_final.in", None, rows, positions, delta[:, e], mode="add")])
    real = float(lg[0, -1, g.target[0]] - lg[0, -1, g.foil[0]])
    ex = exact_edge_patching(lm, pairs, [(f"L0.E{e}.mlp", "logits")])
    s, r = graph.sender_index(f"L0.E{e}.mlp"), graph.receiver_index("logits")
    assert ex.scores[s, r] == pytest.approx(real - ex.metric_clean, abs=2e-6)
    assert abs(real - ex.metric_clean) > 1e-5
    with pytest.raises(InputError, match="L{l}.E{e}.mlp"):
        graph.sender_index("L0.mlp")
