"""Alignment metrics computed by hand on small cases, and the bootstrap interval."""

import numpy as np
import pytest

from lenscope.evaluate.metrics import alignment, bootstrap_ci, mean_ci, paired_difference
from tests.tolerances import assert_same_computation


def test_reciprocal_rank_probes_and_dot_by_hand():
    # scores of 5 tokens; evidence = {1, 3}; sorted: t2 (0.9), t3 (0.5), t1 (0.2), t0 (0.1), t4 (-0.3)
    s = [0.1, 0.2, 0.9, 0.5, -0.3]
    a = alignment(s, [1, 3])
    assert a["rank"] == 2 and a["rr"] == pytest.approx(1 / 2) and a["probes"] == 1
    # dot: evidence mass over the L1 norm: (0.2 + 0.5) / (0.1 + 0.2 + 0.9 + 0.5 + 0.3)
    assert a["dot"] == pytest.approx(0.7 / 2.0)
    # evidence ranked first
    assert alignment(s, [2]) == {"rr": 1.0, "probes": 0, "dot": pytest.approx(0.45), "rank": 1}
    # signed ranking: the most negative token comes last
    assert alignment(s, [4])["rank"] == 5 and alignment(s, [4])["rr"] == pytest.approx(0.2)


def test_mrr_of_a_small_dataset_by_hand():
    exs = [([3.0, 1.0, 2.0], [0]),   # rank 1
           ([3.0, 1.0, 2.0], [2]),   # rank 2
           ([3.0, 1.0, 2.0], [1]),   # rank 3
           ([0.5, 0.4, 0.3, 0.2], [3, 2])]  # best evidence 0.3 -> rank 3
    rr = [alignment(s, e)["rr"] for s, e in exs]
    assert rr == pytest.approx([1, 1 / 2, 1 / 3, 1 / 3])
    assert np.mean(rr) == pytest.approx((1 + 0.5 + 1 / 3 + 1 / 3) / 4)


def test_ties_count_against_the_evidence_and_rankable_positions():
    # a constant explanation earns no credit: every non-evidence token ranks before the evidence
    a = alignment([1.0, 1.0, 1.0, 1.0], [2])
    assert a["rank"] == 4 and a["probes"] == 3
    assert alignment([0.0, 0.0, 0.0], [0])["dot"] == 0.0
    # a BOS at position 0 is not ranked even with the largest score
    assert alignment([9.0, 0.1, 0.5], [2], rankable=[1, 2])["rank"] == 1
    with pytest.raises(ValueError):
        alignment([1.0, 2.0], [0], rankable=[1])
    with pytest.raises(ValueError):
        alignment([1.0, float("nan")], [0])


def test_bootstrap_interval_is_reproducible_and_brackets_the_mean():
    v = [1.0, 0.5, 0.25, 1.0, 0.2, 0.33, 1.0, 0.5]
    lo, hi = bootstrap_ci(v)
    assert lo < np.mean(v) < hi and 0.2 <= lo and hi <= 1.0
    assert bootstrap_ci(v) == [lo, hi]  # seeded
    assert_same_computation(bootstrap_ci([0.7]), [0.7, 0.7], why="one value, copied as both ends")
    assert bootstrap_ci([]) is None
    assert mean_ci([1.0, 1.0, 1.0]) == (1.0, [1.0, 1.0])
    d = paired_difference([1.0, 0.5, 1.0], [0.5, 0.5, 0.25])
    assert d["mean"] == pytest.approx(0.4166666, abs=1e-6) and d["n"] == 3 and d["ci"][0] >= 0


def test_random_baseline_by_enumeration():
    import itertools

    from lenscope.evaluate.metrics import random_rr

    for n, k in ((2, 1), (4, 1), (5, 2), (6, 3)):
        ev = set(range(k))
        rrs = [1 / (1 + next(i for i, t in enumerate(perm) if t in ev)) for perm in itertools.permutations(range(n))]
        assert random_rr(n, k) == pytest.approx(np.mean(rrs))
    assert random_rr(3, 3) == 1.0
