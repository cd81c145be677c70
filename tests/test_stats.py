"""Generic statistics (lenscope/stats.py): average ranks with ties by hand, Spearman against the O(n^2) definition
of ranks, Pearson and the undefined cases; the bootstrap (one home for eval alignment, detect and the steering
evaluation) against its draws by hand; the loss and KL of an edited model against float64."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lenscope.stats import (
    UneditedNextToken,
    average_ranks,
    bootstrap_mean_ci,
    pearson,
    percentile_interval,
    resample,
    spearman,
    spearman_or_none,
)
from tests.tolerances import assert_close_nested, assert_same_computation, assert_same_ints, kl_tol

RANKS = "ranks of ties: means of small integers, exact"


def test_average_ranks_match_hand_computed():
    assert_same_computation(average_ranks(torch.tensor([10.0, 20.0, 20.0, 5.0])).tolist(), [2.0, 3.5, 3.5, 1.0],
                            why=RANKS)
    assert_same_computation(average_ranks(torch.tensor([1.0, 1.0, 1.0])).tolist(), [2.0, 2.0, 2.0], why=RANKS)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=3, max_size=30), st.lists(st.integers(0, 5), min_size=3, max_size=30))
def test_spearman_equals_pearson_of_average_ranks_by_brute_force(a, b):
    n = min(len(a), len(b))
    x, y = torch.tensor(a[:n], dtype=torch.float64), torch.tensor(b[:n], dtype=torch.float64)

    def ranks(v):  # O(n^2) definition: 1 + #smaller + (#equal - 1) / 2
        return torch.tensor([1 + float((v < t).sum()) + (float((v == t).sum()) - 1) / 2 for t in v],
                            dtype=torch.float64)

    rx, ry = ranks(x), ranks(y)
    if rx.std() == 0 or ry.std() == 0:
        assert spearman(x, y) != spearman(x, y)  # NaN for a constant side
        return
    ref = float(torch.corrcoef(torch.stack([rx, ry]))[0, 1])
    assert spearman(x, y) == pytest.approx(ref, abs=1e-9)


def test_pearson_and_spearman_or_none():
    x = torch.tensor([1.0, 2.0, 4.0, 8.0])
    y = torch.tensor([0.5, 1.0, 3.0, 2.0])
    ref = float(torch.corrcoef(torch.stack([x, y]).double())[0, 1])
    assert pearson(x, y) == pytest.approx(ref, abs=1e-12)
    assert math.isnan(pearson(x, torch.ones(4)))
    assert spearman_or_none(x, y) == pytest.approx(spearman(x, y)) == pytest.approx(0.8)
    assert spearman_or_none(x[:1], y[:1]) is None  # one value
    assert spearman_or_none(x, torch.ones(4)) is None  # a constant side


def test_resample_draws_from_the_callers_generator():
    a = resample(7, 5, np.random.default_rng(3))
    assert_same_computation(a.tolist(), np.random.default_rng(3).integers(0, 7, (5, 7)).tolist(),
                            why="the same numpy draws")
    rng, ref = np.random.default_rng(4), np.random.default_rng(4)
    both = [resample(3, 2, rng), resample(9, 2, rng)]  # consecutive calls continue the stream
    assert_same_computation([x.tolist() for x in both], [ref.integers(0, 3, (2, 3)).tolist(),
                                                         ref.integers(0, 9, (2, 9)).tolist()],
                            why="the same numpy draws in the same order")
    t = resample(6, 4, torch.Generator().manual_seed(5))
    assert_same_computation(t.tolist(), torch.randint(0, 6, (4, 6), generator=torch.Generator().manual_seed(5))
                            .tolist(), why="the same torch draws")


def test_percentile_interval_and_the_bootstrap_of_a_mean_by_hand():
    x = np.random.default_rng(0).normal(size=(200, 3))
    lo_hi = percentile_interval(x, 0.9)
    assert lo_hi.shape == (3, 2)
    lo, hi = (1 - 0.9) / 2, (1 + 0.9) / 2  # the quantiles as the interval writes them (1 - 0.9 is not 0.1)
    assert_same_computation(lo_hi.tolist(), np.stack([np.quantile(x, lo, axis=0), np.quantile(x, hi, axis=0)],
                                                     -1).tolist(), why="numpy quantiles of the same draws")
    t = percentile_interval(torch.from_numpy(x), 0.9)
    q = torch.tensor([lo, hi], dtype=torch.float64)
    assert_same_computation(t.tolist(), torch.quantile(torch.from_numpy(x), q, dim=0).T.tolist(),
                            why="torch quantiles of the same draws")
    v = [0.3, 1.2, -0.5, 2.0, 0.7]
    idx = np.random.default_rng(2).integers(0, 5, (50, 5))
    means = np.asarray(v)[idx].mean(1)
    a = (1 - 0.95) / 2  # as eval alignment's bootstrap_ci drew its interval before it came here
    want = [float(np.quantile(means, a)), float(np.quantile(means, 1 - a))]
    assert_same_computation(bootstrap_mean_ci(v, n_boot=50, seed=2), want, why="the same draws and quantiles")
    assert bootstrap_mean_ci([]) is None
    assert_same_computation(bootstrap_mean_ci([0.4]), [0.4, 0.4], why="one value, copied as both ends")


def test_the_loss_and_kl_of_an_edited_model_against_float64():
    g = torch.Generator().manual_seed(0)
    V, P, R = 500, 6, 3
    z0 = torch.randn(P, V, generator=g) * 4
    z = z0 + torch.randn(R, P, V, generator=g)
    tgt = torch.randint(0, V, (P - 1,), generator=g)
    ref = UneditedNextToken(z0)
    nll, kl, top1 = ref.compare(z, tgt)
    lp0, lp = torch.log_softmax(z0.double(), -1), torch.log_softmax(z.double(), -1)
    exact_kl = (lp0.exp() * (lp0 - lp)).sum(-1)
    exact_nll = -lp[:, :-1].gather(2, tgt.expand(R, -1)[..., None])[..., 0]
    top = float(max(z0.abs().max(), z.abs().max()))
    assert_close_nested(kl.tolist(), exact_kl.tolist(), atol=kl_tol(V, top))
    # a loss is lse(z) - z_t: two sums of size at most ln V + 2 max|z|, each within (log2 V + 2) u of it
    assert_close_nested(nll.tolist(), exact_nll.tolist(), atol=kl_tol(V, top))
    assert_close_nested(ref.nll(tgt).tolist(), (-lp0[:-1].gather(1, tgt[:, None])[:, 0]).tolist(),
                        atol=kl_tol(V, top))
    assert_same_ints(top1.tolist(), (lp.argmax(-1) == lp0.argmax(-1)).tolist())
    # the steering damage's KL before it came here, sum p0 log p0 - (sum p0 z - lse z) in float32: within the
    # rounding of both (the change of formula moves a KL by float32 rounding only)
    h0 = (ref.p * ref.logp).sum(-1).double()
    before = h0 - (torch.einsum("pv,rpv->rp", ref.p, z) - torch.logsumexp(z, -1)).double()
    assert_close_nested(kl.tolist(), before.tolist(), atol=2 * kl_tol(V, top))
    # rows of their own unedited distribution: the same numbers as one shared row
    nll_r, kl_r, top1_r = UneditedNextToken(z0.expand(R, P, V)).compare(z, tgt)
    assert_same_computation([nll_r.tolist(), kl_r.tolist()], [nll.tolist(), kl.tolist()],
                            why="the same log-probabilities, broadcast or repeated")
    # an edit that changes nothing: KL 0 exactly (token by token differences), every top token kept
    _, kl0, same = ref.compare(z0[None], tgt)
    assert_same_computation(kl0.tolist(), [[0.0] * P], why="identical log-probabilities subtract to 0")
    assert bool(same.all())
