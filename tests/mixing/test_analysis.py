"""The mixing analyses (lenscope/mixing/analysis.py) by hand: contextualization change, FF-amp, top pairs."""

import pytest
import torch

from lenscope.mixing.analysis import column_normalize, contextualization_change, ff_amp, top_pairs
from lenscope.stats import spearman


def test_contextualization_change_and_ff_amp_by_hand():
    a = torch.tensor([[1.0, 0.0], [0.5, 2.0]])
    assert contextualization_change(a, a) == pytest.approx(0.0)
    assert contextualization_change(a, -a) == pytest.approx(2.0)
    # lower triangle: cells (0,0), (1,0), (1,1)
    b = torch.tensor([[3.0, 9.0], [1.0, 2.0]])
    assert contextualization_change(a, b, lower=True) == pytest.approx(1 - spearman(torch.tensor([1, .5, 2.]),
                                                                                    torch.tensor([3, 1, 2.])))
    pre = torch.tensor([[1.0, 1.0], [1.0, 1.0]])
    post = torch.tensor([[1.0, 3.0], [1.0, 1.0]])
    amp = ff_amp(pre, post)
    assert column_normalize(post).sum(0).tolist() == pytest.approx([1.0, 1.0])
    assert amp[0, 1] == pytest.approx(0.75 - 0.5) and amp[1, 1] == pytest.approx(0.25 - 0.5)
    assert top_pairs(amp, 1) == [(0, 1, pytest.approx(0.25))]  # the diagonal is never a pair
