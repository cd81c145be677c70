"""Generic statistics (lenscope/stats.py): average ranks with ties by hand, Spearman against the O(n^2) definition
of ranks, Pearson and the undefined cases."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lenscope.stats import average_ranks, pearson, spearman, spearman_or_none
from tests.tolerances import assert_same_computation

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
