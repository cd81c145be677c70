"""Attribution patching is the first-order term of patching: checked against a central finite difference of the
real model along each node's (corrupted - clean) direction, on every decoder family; errors."""

import pytest
import torch

from lenscope.circuits import attribution_patching
from lenscope.errors import InputError, NotApplicableError
from lenscope.interventions.patching import metric_of
from lenscope.models.engine import Edit, capture, run
from lenscope.models.load import encode, resolve_token

from ..conftest import get_model

CLEAN, CORRUPT = "The capital of France is", "The capital in France is"
EPS = 1e-2


def _directional(lm, ids, site, delta, head, tid, fid):
    """(metric(a + eps delta) - metric(a - eps delta)) / (2 eps) at the last position, through the engine. A mixture
    of experts is differentiable only where its router's choice stays put: eps shrinks (from EPS, by 3x) until
    neither run changes which experts any token uses."""
    P = ids.shape[1]
    L = lm.anatomy.n_layers
    moe = lm.anatomy.layers[0].mlp.__class__.__name__ == "MoE"
    routes = [("routing_weights", i) for i in range(L)] if moe else []
    base = capture(lm, ids, routes) if moe else None
    for eps in (EPS, EPS / 3, EPS / 10, EPS / 30):
        vals, same = [], True
        for sign in (1, -1):
            d = sign * eps * delta
            edit = Edit(site[0], site[1], torch.zeros(P, dtype=torch.long), torch.arange(P), d, mode="add",
                        head=None if head is None else torch.full((P,), head))
            with torch.no_grad():
                lg, cap = run(lm, ids, [edit], capture=routes)
            vals.append(float(metric_of(lg[:, -1], "logit_diff", tid, fid)[0]))
            same = same and all(torch.equal(cap[k] > 0, base[k] > 0) for k in routes)
        if same:
            return (vals[0] - vals[1]) / (2 * eps)
    raise AssertionError("the router's choice changes within every step tried")


def test_atp_is_the_derivative_along_the_patch(tiny_decoder):
    lm = tiny_decoder
    res = attribution_patching(lm, CLEAN, CORRUPT, " capital", " of")
    c, x = encode(lm, CLEAN)[None], encode(lm, CORRUPT)[None]
    tid, fid = resolve_token(lm, " capital"), resolve_token(lm, " of")
    sites = [("resid_pre", 0), ("head", 1), ("mlp_out", 0)]
    cc, cx = capture(lm, c, sites), capture(lm, x, sites)
    for site, head, atp in ((("resid_pre", 0), None, res.embed), (("head", 1), 2, float(res.heads[1, 2])),
                            (("mlp_out", 0), None, float(res.mlps[0]))):
        delta = cx[site][0] - cc[site][0]
        if head is not None:
            delta = delta[:, head]
        fd = _directional(lm, c, site, delta, head, tid, fid)
        assert atp == pytest.approx(fd, abs=2e-3, rel=5e-2), (lm.name, site, atp, fd)
    assert res.heads.shape == (lm.anatomy.n_layers, lm.anatomy.layers[0].attn.n_heads)
    assert res.heads.abs().sum() > 0 and res.metric_clean != res.metric_corrupted
    names = [n["name"] for n in res.nodes()]
    assert names[0] == "embed" and "L1H2" in names and "L0.mlp" in names
    assert res.to_dict()["nodes"][0]["score"] == res.embed


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
    assert torch.equal(back.heads, res.heads) and back.embed == res.embed and back.metric == "prob"
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
    assert -1.0 <= c["spearman"] <= 1.0 and len(c["false_negatives"]) == round(3 * (1 - c["top3_recall"]))
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
