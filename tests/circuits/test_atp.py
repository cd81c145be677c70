"""Attribution patching is the first-order term of patching: checked against a central finite difference of the
real model along each node's (corrupted - clean) direction, on every decoder family; errors."""

import pytest
import torch

from lenscope.circuits import attribution_patching
from lenscope.errors import InputError, NotApplicableError
from lenscope.interventions.patching import metric_of
from lenscope.models.loading.load import encode, resolve_token
from lenscope.models.runtime.engine import Edit, capture, run

from ..conftest import get_model
from ..tolerances import assert_same_computation

CLEAN, CORRUPT = "The capital of France is", "The capital in France is"
# A pair whose every token differs, for the finite-difference checks: its strongest nodes move the metric by 18x
# float32 rounding (_fd_floor) or more on every tiny family; with one changed token some move it by less than that
FD_PAIR = ("The cat sat on the mat", "A dog ran in the park", " the", " a")
FD_H = 0.01
# The extrapolated difference's truncation error is O(h^4) for smooth activations (measured: within the rounding
# floor or 1e-3 relative at h = 0.01); OPT's ReLU is not smooth, and a step that crosses a kink costs O(h)
# (measured 1.2e-2 relative on its embedding node, whose patch moves every token)
FD_REL = 2e-2
EPS32 = torch.finfo(torch.float32).eps


def _directional(lm, ids, site, delta, head, tid, fid):
    """The derivative of the metric at the last position along ``delta`` added at ``site``, through the engine:
    central differences ``D(h) = (m(a + h delta) - m(a - h delta)) / 2h`` at ``h`` and ``2h``, extrapolated
    (Richardson) to ``(4 D(h) - D(2h)) / 3``, whose error is O(h^4) instead of D's O(h^2). Returns the value and the
    step used. A mixture of experts is differentiable only where its router's choice stays put: the step shrinks
    (from FD_H, by about 3x) until no run changes which experts any token uses."""
    moe = lm.anatomy.layers[0].mlp.__class__.__name__ == "MoE"
    routes = [("routing_weights", i) for i in range(lm.anatomy.n_layers)] if moe else []
    base = capture(lm, ids, routes) if moe else None

    def metric(d):
        P = ids.shape[1]
        edit = Edit(site[0], site[1], torch.zeros(P, dtype=torch.long), torch.arange(P), d, mode="add",
                    head=None if head is None else torch.full((P,), head))
        with torch.no_grad():
            lg, cap = run(lm, ids, [edit], capture=routes)
        same = all(bool(((cap[k] > 0) == (base[k] > 0)).all()) for k in routes)
        return float(metric_of(lg[:, -1], "logit_diff", tid, fid)[0]), same

    for h in (FD_H, FD_H / 3, FD_H / 10, FD_H / 30):
        runs = [metric(sign * k * h * delta) for k in (1, 2) for sign in (1, -1)]
        if all(same for _, same in runs):
            (u1, _), (d1, _), (u2, _), (d2, _) = runs
            return (4 * (u1 - d1) / (2 * h) - (u2 - d2) / (4 * h)) / 3, h
    raise AssertionError("the router's choice changes within every step tried")


def _fd_floor(lm, ids, h: float = FD_H) -> float:
    """What float32 rounding can do to :func:`_directional` at step ``h``: one metric (a difference of two logits)
    is off by at most about ``4 eps32 max|logit|`` (measured: below ``2 eps32 max|logit|`` on every tiny family), and
    the extrapolated difference divides that by ``h / 1.5`` (``4/3 * 2 / 2h + 1/3 * 2 / 4h``)."""
    with torch.no_grad():
        lg, _ = run(lm, ids, last_only=True)
    return 1.5 * 4 * EPS32 * float(lg.abs().max()) / h


def test_atp_is_the_derivative_along_the_patch(tiny_decoder):
    lm = tiny_decoder
    clean, corrupt, target, foil = FD_PAIR
    res = attribution_patching(lm, clean, corrupt, target, foil)
    c, x = encode(lm, clean)[None], encode(lm, corrupt)[None]
    tid, fid = resolve_token(lm, target), resolve_token(lm, foil)
    layer, h = divmod(int(res.heads.abs().argmax()), res.heads.shape[1])  # the strongest head and MLP
    m = int(res.mlps.abs().argmax())
    sites = [("resid_pre", 0), ("head", layer), ("mlp_out", m)]
    cc, cx = capture(lm, c, sites), capture(lm, x, sites)
    for site, head, atp in ((("resid_pre", 0), None, res.embed), (("head", layer), h, float(res.heads[layer, h])),
                            (("mlp_out", m), None, float(res.mlps[m]))):
        delta = cx[site][0] - cc[site][0]
        if head is not None:
            delta = delta[:, head]
        fd, step = _directional(lm, c, site, delta, head, tid, fid)
        floor = _fd_floor(lm, c, step)
        assert atp == pytest.approx(fd, abs=floor, rel=FD_REL), (lm.name, site, atp, fd)
        assert abs(fd) > 10 * floor, (lm.name, site, fd, floor)  # the node moves the metric: the check can fail
    res = attribution_patching(lm, CLEAN, CORRUPT, " capital", " of")
    assert res.heads.shape == (lm.anatomy.n_layers, lm.anatomy.layers[0].attn.n_heads)
    assert res.heads.abs().sum() > 0 and res.metric_clean != res.metric_corrupted
    names = [n["name"] for n in res.nodes()]
    assert names[0] == "embed" and "L1H2" in names and "L0.mlp" in names
    assert_same_computation(res.to_dict()["nodes"][0]["score"], res.embed, why="the embedding's score, copied")


def test_atp_errors():
    lm = get_model("tiny:gpt2")
    with pytest.raises(InputError, match="same number of tokens"):
        attribution_patching(lm, CLEAN, "The capital of France is a city", " capital", " of")
    with pytest.raises(InputError, match="needs a foil"):
        attribution_patching(lm, CLEAN, CORRUPT, " capital")
    with pytest.raises(InputError, match="unknown metric"):
        attribution_patching(lm, CLEAN, CORRUPT, " capital", " of", metric="kl")
    with pytest.raises(NotApplicableError):
        attribution_patching(get_model("tiny:bert"), CLEAN, CORRUPT, " capital", " of")


def test_atp_saves_and_reloads(tmp_path):
    from lenscope.circuits import NodeAttribution

    res = attribution_patching(get_model("tiny:llama"), CLEAN, CORRUPT, " capital", metric="prob")
    back = NodeAttribution.load(res.save(tmp_path / "atp.safetensors"))
    assert_same_computation((back.heads, back.embed), (res.heads, res.embed), why="saved and read back")
    assert back.metric == "prob"
    assert list(res.to_frame()["name"])[:2] == ["embed", "L0H0"]


def test_exact_node_patching_against_independent_paths(tiny_decoder):
    """Heads equal activation_patching's head sweep (noising, all positions); the embedding node replaced at every
    position is the corrupted run itself."""
    from lenscope.circuits import exact_node_patching
    from lenscope.interventions import activation_patching

    lm = tiny_decoder
    ex = exact_node_patching(lm, CLEAN, CORRUPT, " capital", " of", batch_size=5)
    ap = activation_patching(lm, CLEAN, CORRUPT, " capital", " of", what="heads", noising=True)
    torch.testing.assert_close(ex.heads, ap.raw - ap.clean_metric, rtol=1e-4, atol=1e-5)
    assert ex.embed == pytest.approx(ex.metric_corrupted - ex.metric_clean, abs=1e-5)
    assert ex.mlps.abs().sum() > 0


def test_check_against_exact():
    from lenscope.circuits import check_against_exact, exact_node_patching

    lm = get_model("tiny:llama")
    atp = attribution_patching(lm, CLEAN, CORRUPT, " capital", " of")
    ex = exact_node_patching(lm, CLEAN, CORRUPT, " capital", " of")
    same = check_against_exact(ex, ex)
    assert same["spearman"] == pytest.approx(1.0) and same["top10_recall"] == 1.0 and same["false_negatives"] == []
    c = check_against_exact(atp, ex, top=3)
    # every number recomputed here from the two node lists: Spearman by scipy, the top-3 sets and the MAE by hand
    from scipy.stats import spearmanr

    a = {n["name"]: n["score"] for n in atp.nodes()}
    x = {n["name"]: n["score"] for n in ex.nodes()}
    names = list(x)
    L, H = lm.anatomy.n_layers, lm.anatomy.layers[0].attn.n_heads
    assert c["nodes"] == len(names) == 1 + L * (H + 1)  # the embedding, then per layer its heads and its MLP
    assert c["spearman"] == pytest.approx(float(spearmanr([a[n] for n in names], [x[n] for n in names])[0]),
                                          abs=1e-12)
    # AtP is the first-order term of these one-token patches, so it ranks the nodes nearly as exact patching does
    # (measured 0.991 on this seeded model; a ranking unrelated to the exact one would be near 0)
    assert c["spearman"] > 0.9
    top_a = sorted(names, key=lambda n: -abs(a[n]))[:3]
    top_x = sorted(names, key=lambda n: -abs(x[n]))[:3]
    assert c["false_negatives"] == [n for n in top_x if n not in top_a]
    assert_same_computation(c["top3_recall"], (3 - len(c["false_negatives"])) / 3, why="one division of the same "
                            "two counts")
    assert c["mae"] == pytest.approx(sum(abs(a[n] - x[n]) for n in names) / len(names), rel=1e-12)
    # the reversed ranking is the worst there is
    worst = check_against_exact(ex.__class__(**{**ex.__dict__, "heads": -ex.heads, "mlps": -ex.mlps,
                                                "embed": -ex.embed}), ex)
    assert worst["spearman"] == pytest.approx(-1.0)


PROMPTS = [("The capital of France is", "The capital in France is", " capital", " of"),
           ("When Mary and John went to the store, John gave a drink to",
            "When Mary and John went to the store, Mary gave a drink to", " Mary", " John"),
           ("The capital of Spain is", "The capital in Spain is", " is", " The")]


def test_many_prompts_are_the_mean_of_single_runs():
    """Three prompts of two token lengths (two batches): AtP and exact patching equal the mean of the single-prompt
    runs; the pairs form and the list form agree."""
    from lenscope.circuits import exact_node_patching
    from lenscope.data.contrast import ContrastPair

    lm = get_model("tiny:llama")
    cs, xs, ts, fs = (list(z) for z in zip(*PROMPTS))
    assert len({encode(lm, c).numel() for c in cs}) == 2
    for fn, kw in ((attribution_patching, {}), (exact_node_patching, {"batch_size": 7})):
        many = fn(lm, cs, xs, ts, fs, **kw)
        singles = [fn(lm, *p, **kw) for p in PROMPTS]
        assert many.n == 3 and many.to_dict()["n"] == 3 and len(many.info["prompts"]) == 3
        torch.testing.assert_close(many.heads, sum(s.heads for s in singles) / 3, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(many.mlps, sum(s.mlps for s in singles) / 3, rtol=1e-4, atol=1e-6)
        assert many.embed == pytest.approx(sum(s.embed for s in singles) / 3, rel=1e-4, abs=1e-6)
        assert many.metric_clean == pytest.approx(sum(s.metric_clean for s in singles) / 3, rel=1e-5)
        assert many.metric_corrupted == pytest.approx(sum(s.metric_corrupted for s in singles) / 3, rel=1e-5)
        pairs = [ContrastPair(c, x, t, f) for c, x, t, f in PROMPTS]
        torch.testing.assert_close(fn(lm, pairs=pairs, **kw).heads, many.heads)
    # one target and foil for all prompts
    both = attribution_patching(lm, cs[::2], xs[::2], " capital", " of")
    one = [attribution_patching(lm, c, x, " capital", " of") for c, x in zip(cs[::2], xs[::2])]
    torch.testing.assert_close(both.heads, (one[0].heads + one[1].heads) / 2, rtol=1e-4, atol=1e-6)


def test_many_prompts_errors():
    lm = get_model("tiny:gpt2")
    cs, xs, ts, fs = (list(z) for z in zip(*PROMPTS))
    with pytest.raises(InputError, match="2 entries for 3 prompts"):
        attribution_patching(lm, cs, xs, ts[:2], fs)
    with pytest.raises(InputError, match="not both"):
        attribution_patching(lm, CLEAN, CORRUPT, pairs=[])
    with pytest.raises(NotApplicableError, match="same token length"):
        attribution_patching(lm, cs, xs, ts, fs, fine=True)


def test_per_position_nodes_sum_to_the_whole(tiny_decoder):
    """AtP is linear in the patch: per-position head/MLP nodes sum to the all-position node, and block 0's residual
    nodes to the embedding node; exact resid nodes equal activation patching's residual sweep (noising)."""
    from lenscope.circuits import exact_node_patching
    from lenscope.interventions import activation_patching

    lm = tiny_decoder
    res = attribution_patching(lm, [CLEAN, CLEAN], [CORRUPT, CORRUPT], " capital", " of", fine=True)
    P = encode(lm, CLEAN).numel()
    assert res.heads_pos.shape == (lm.anatomy.n_layers, P, lm.anatomy.layers[0].attn.n_heads)
    torch.testing.assert_close(res.heads_pos.sum(1), res.heads, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(res.mlps_pos.sum(1), res.mlps, rtol=1e-5, atol=1e-7)
    assert float(res.resid[0].sum()) == pytest.approx(res.embed, rel=1e-5, abs=1e-7)
    assert "L1H2@3" in {n["name"] for n in res.nodes(fine=True)} and len(res.nodes()) < len(res.nodes(True))
    ex = exact_node_patching(lm, CLEAN, CORRUPT, " capital", " of", fine=True, batch_size=64)
    ap = activation_patching(lm, CLEAN, CORRUPT, " capital", " of", what="resid", noising=True)
    torch.testing.assert_close(ex.resid, ap.raw - ap.clean_metric, rtol=1e-4, atol=1e-5)
    # an MLP patched at one position: the last position of the last MLP is its whole direct effect
    assert float(ex.mlps_pos[-1, :-1].abs().max()) < 1e-6  # batched rounding only
    assert float(ex.mlps_pos[-1, -1]) == pytest.approx(float(ex.mlps[-1]), rel=1e-4, abs=1e-6)


def test_exact_resid_at_the_last_block_is_its_direct_effect(tiny_decoder):
    """The residual stream entering the last block at one position, patched: the same as recomputing that block
    with lenscope's own math (Anatomy) on the patched input and reading the logits."""
    from lenscope.circuits import exact_node_patching

    lm = tiny_decoder
    A = lm.anatomy
    L = A.n_layers
    ex = exact_node_patching(lm, CLEAN, CORRUPT, " capital", " of", fine=True, batch_size=64)
    c, x = encode(lm, CLEAN)[None], encode(lm, CORRUPT)[None]
    tid, fid = resolve_token(lm, " capital"), resolve_token(lm, " of")
    hc, hx = capture(lm, c, [("resid_pre", L - 1)])[("resid_pre", L - 1)][0], capture(lm, x, [("resid_pre", L - 1)])[
        ("resid_pre", L - 1)][0]
    P = hc.shape[0]
    for p in (0, P // 2, P - 1):
        h = hc.clone()
        h[p] = hx[p]
        out = A.layers[L - 1].forward(h.float(), torch.arange(P))["resid_post"][-1]
        lg = A.logits(out)[None]
        want = float(metric_of(lg, "logit_diff", tid, fid)[0]) - ex.metric_clean
        assert float(ex.resid[L - 1, p]) == pytest.approx(want, abs=2e-4, rel=2e-3), (lm.name, p)


@pytest.mark.parametrize("family", ["mixtral", "gpt-oss"])
def test_expert_nodes(family):
    """A mixture of experts' nodes are its experts (L{l}.E{e}.mlp): their AtP scores add up to the block's, and
    exact node patching of one sets that expert's output to the corrupted run's (an engine edit written here)."""
    from lenscope.circuits import exact_node_patching

    lm = get_model(f"tiny:{family}")
    res = attribution_patching(lm, CLEAN, CORRUPT, " capital", " of")
    L, E = lm.anatomy.n_layers, lm.anatomy.layers[0].mlp.n_experts
    assert res.experts.shape == (L, E)
    torch.testing.assert_close(res.experts.sum(-1), res.mlps, atol=1e-5, rtol=1e-4)
    names = [n["name"] for n in res.nodes()]
    assert f"L0.E{E - 1}.mlp" in names and names.index("L0.E0.mlp") == names.index("L0.mlp") + 1
    ex = exact_node_patching(lm, CLEAN, CORRUPT, " capital", " of")
    c, x = encode(lm, CLEAN)[None], encode(lm, CORRUPT)[None]
    tid, fid = resolve_token(lm, " capital"), resolve_token(lm, " of")
    P = c.shape[1]
    corr = capture(lm, x, [("expert_out", 1)])["expert_out", 1][0]
    e = int(ex.experts[1].abs().argmax())
    with torch.no_grad():
        lg, _ = run(lm, c, [Edit("expert_out", 1, torch.zeros(P, dtype=torch.long), torch.arange(P), corr[:, e],
                                 head=torch.full((P,), e))])
    want = float(metric_of(lg[:, -1], "logit_diff", tid, fid)[0]) - ex.metric_clean
    assert float(ex.experts[1, e]) == pytest.approx(want, abs=1e-5) and abs(want) > 1e-5
    assert {n["name"] for n in ex.nodes()} == set(names)
