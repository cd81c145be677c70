"""The comparison helpers of tests/tolerances.py fail where they must (the suite's exact comparisons all go through
them: tests/test_ci_policy.py)."""

import math

import numpy as np
import pytest
import torch

from tests.tolerances import assert_close_nested, assert_cross_process, assert_same_computation, assert_same_ints


def test_assert_same_computation_fails_one_ulp_apart_and_asks_why():
    a = torch.tensor([1.0, float("nan"), -0.5])
    assert_same_computation(a, a.clone(), why="a copy of one tensor")
    b = a.clone()
    b[0] = torch.nextafter(b[0], torch.tensor(2.0))
    with pytest.raises(AssertionError, match="differ at 1 of 3"):
        assert_same_computation(a, b, why="one ulp apart on purpose")
    with pytest.raises(AssertionError, match="float64"):
        assert_same_computation(a, a.double(), why="another dtype on purpose")
    with pytest.raises(ValueError, match="why"):
        assert_same_computation(a, a, why="same")
    assert_same_computation({"v": torch.__version__}, {"v": str(torch.__version__)}, why="a str subclass as str")
    with pytest.raises(AssertionError, match=r"\$\.v"):
        assert_same_computation({"v": "1"}, {"v": 1}, why="a string against a number")
    with pytest.raises(AssertionError, match=r"\$\.x\[1\]"):
        assert_same_computation({"x": [0.1, 0.2]}, {"x": [0.1, 0.2 + 2**-54 * 4]}, why="nested on purpose")


def test_assert_same_ints_takes_integers_only():
    assert_same_ints(torch.tensor([1, 2], dtype=torch.int32), [1, 2])
    assert_same_ints(np.array([[1], [2]]), torch.tensor([[1], [2]]))
    with pytest.raises(AssertionError, match="differ at 1 of 2"):
        assert_same_ints(torch.tensor([1, 2]), [1, 3])
    with pytest.raises(AssertionError, match="not integers"):
        assert_same_ints(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0]))
    with pytest.raises(AssertionError, match="not an integer"):
        assert_same_ints([1, 2.0], [1, 2])


def test_assert_close_nested_integers_exact_floats_within_the_tolerance():
    assert_close_nested({"n": 3, "x": [0.5, math.nan]}, {"n": 3, "x": [0.5 + 1e-9, math.nan]}, atol=1e-8)
    with pytest.raises(AssertionError, match=r"\$\.x\[0\]"):
        assert_close_nested({"x": [0.5]}, {"x": [0.5 + 1e-7]}, atol=1e-8)
    with pytest.raises(AssertionError, match=r"\$\.n"):
        assert_close_nested({"n": 3}, {"n": 4}, atol=10.0)  # integers are exact
    assert_close_nested([100.0], [100.0 + 5e-5], atol=0.0, rel=1e-6)
    with pytest.raises(AssertionError):
        assert_close_nested([100.0], [100.0 + 5e-4], atol=0.0, rel=1e-6)
    assert_cross_process({"loss": 2.0}, {"loss": 2.0 + 1e-6})
    with pytest.raises(AssertionError, match="keys"):
        assert_cross_process({"loss": 2.0}, {"kl": 2.0})
