"""The synthetic benchmark: the generator's statistics (Zipf frequencies, hierarchy, true L0) within sampling
error, and the recovery metrics on cases whose answer is known (perfect, permuted and scaled, random)."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from lenscope.errors import InputError
from lenscope.features.dictionaries.synthetic import (
    correlations,
    make_synthetic,
    mcc,
    mean_max_cosine,
    recovery,
    save_activations,
    zipf_frequencies,
)
from lenscope.models.dictionaries.dictionary import Dictionary
from tests.tolerances import assert_same_computation

N = 40_000


@pytest.fixture(scope="module")
def data():
    return make_synthetic(N, d=32, n_features=96, l0=6.0, zipf_exponent=1.0, hierarchy=0.25, noise=0.05, seed=3)


def test_zipf_frequencies_follow_the_law_and_sum_to_l0():
    p = zipf_frequencies(50, 5.0, exponent=1.2)
    assert math.isclose(float(p.sum()), 5.0, rel_tol=1e-12)
    ratio = p[:-1] / p[1:]
    expected = (torch.arange(2, 51, dtype=torch.float64) / torch.arange(1, 50, dtype=torch.float64)).pow(1.2)
    assert_same_computation(float(p[0]), 1.0, why="capped (5 / H_50(1.2) > 1): the constant 1")  # the rest keep the law
    assert torch.allclose(ratio[1:], expected[1:], rtol=1e-12)
    # a frequency above 1 is capped and the rest renormalised, still summing to l0
    q = zipf_frequencies(10, 6.0, exponent=2.0)
    assert_same_computation(float(q.max()), 1.0, why="capped: the constant 1")
    assert math.isclose(float(q.sum()), 6.0, rel_tol=1e-12)
    assert bool((q[:-1] >= q[1:]).all())


def test_generator_frequencies_within_sampling_error(data):
    fired = (data.codes != 0).double().mean(0)
    p = data.frequencies.double()
    se = (p * (1 - p) / N).sqrt()
    # every feature's empirical frequency within 5 binomial standard errors of its Zipf probability
    assert bool(((fired - p).abs() <= 5 * se + 1e-12).all()), float(((fired - p).abs() / se).max())
    # the Zipf law itself: frequency ∝ 1/rank below the cap at 1
    free = p < 1
    assert int((~free).sum()) <= 1
    r = torch.arange(1, 97).double()[free]
    assert torch.allclose(p[free] * r, (p[free] * r)[0].expand(int(free.sum())), rtol=1e-5)


def test_hierarchy_respected(data):
    children = torch.nonzero(data.parents >= 0).flatten()
    assert len(children) == round(0.25 * 96)
    par = data.parents[children]
    assert bool((data.parents[par] == -1).all())  # parents are roots
    assert bool((par < children).all())  # and more frequent than their children
    active = data.codes != 0
    assert not bool((active[:, children] & ~active[:, par]).any())  # a child never fires without its parent
    assert bool(active[:, children].any(0).all())  # and every child does fire


def test_true_l0_as_configured(data):
    counts = (data.codes != 0).sum(1).double()
    assert math.isclose(data.l0, 6.0, rel_tol=1e-5)
    assert abs(float(counts.mean()) - 6.0) <= 5 * float(counts.std()) / math.sqrt(N)


def test_activations_are_codes_times_directions_plus_noise(data):
    assert torch.allclose(data.directions.norm(dim=1), torch.ones(96), atol=1e-6)
    resid = data.activations.double() - data.codes.double() @ data.directions.double()
    assert abs(float(resid.std()) - 0.05) < 5 * 0.05 / math.sqrt(2 * resid.numel())  # the std's standard error
    assert abs(float(resid.mean())) < 5 * 0.05 / math.sqrt(resid.numel())
    assert bool((data.codes >= 0).all())


def test_reproducible_and_checked():
    a = make_synthetic(100, d=8, n_features=16, l0=2.0, seed=1)
    b = make_synthetic(100, d=8, n_features=16, l0=2.0, seed=1)
    assert_same_computation(a.activations, b.activations, why="the same seed, the same calls")
    assert_same_computation(a.codes, b.codes, why="the same seed, the same calls")
    with pytest.raises(InputError, match="superposition"):
        make_synthetic(10, d=16, n_features=16)
    with pytest.raises(InputError, match="L0"):
        make_synthetic(10, d=4, n_features=16, l0=20)


def test_metrics_perfect_recovery(data):
    assert math.isclose(mean_max_cosine(data.directions, data.directions), 1.0, rel_tol=1e-12)
    assert math.isclose(mcc(data.codes, data.codes), 1.0, rel_tol=1e-12)


def test_metrics_permuted_scaled_copy(data):
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(96, generator=g)
    scale = torch.rand(96, generator=g) * 3 + 0.1
    sign = torch.where(torch.rand(96, generator=g) < 0.5, -1.0, 1.0)
    learned = data.directions[perm] * (scale * sign)[:, None]
    assert math.isclose(mean_max_cosine(data.directions, learned), 1.0, rel_tol=1e-12)
    extra = torch.rand(N, 20, generator=g)  # more latents than features: the extra ones are left unmatched
    lat = torch.cat([data.codes[:, perm] * scale, extra], 1)
    assert math.isclose(mcc(data.codes, lat), 1.0, rel_tol=1e-12)


def test_metrics_random_is_low(data):
    g = torch.Generator().manual_seed(1)
    learned = torch.randn(96, 32, generator=g)
    mmc = mean_max_cosine(data.directions, learned)
    assert 0.2 < mmc < 0.75  # the max of 96 |cos| of random 32-d vectors: about 0.45, far from 1
    lat = torch.rand(N, 96, generator=g)
    assert mcc(data.codes, lat) < 0.05  # independent noise: correlations of order 1/sqrt(N)


def test_correlations_against_brute_force():
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(500, 4, generator=g), torch.randn(500, 3, generator=g)
    b[:, 2] = 0  # a constant column correlates 0
    c = correlations(a, b, chunk=77)
    import numpy as np

    ref = np.corrcoef(a.double().numpy().T, b[:, :2].double().numpy().T)[:4, 4:]
    assert torch.allclose(c[:, :2], torch.from_numpy(ref), atol=1e-12)
    assert bool((c[:, 2] == 0).all())


def test_mcc_with_fewer_latents_counts_unmatched_as_zero():
    g = torch.Generator().manual_seed(4)
    codes = torch.rand(1000, 4, generator=g)
    assert math.isclose(mcc(codes, codes[:, :2]), 0.5, rel_tol=1e-12)


def test_recovery_of_a_dictionary_made_of_the_true_features(data):
    # a TopK dictionary whose decoder is the true directions: mean max cosine 1, MCC high (noise and
    # superposition interfere, so not exactly 1)
    D = Dictionary.init(32, 96, kind="topk", k=6)
    D.W_dec = data.directions.clone()
    D.W_enc = data.directions.T.clone()
    r = recovery(D, data)
    assert math.isclose(r["mean_max_cosine"], 1.0, rel_tol=1e-6)
    assert 0.5 < r["mcc"] <= 1.0
    assert 0 < r["l0"] <= 6
    rand = recovery(Dictionary.init(32, 96, kind="topk", k=6, seed=9), data)
    assert rand["mcc"] < r["mcc"] and rand["mean_max_cosine"] < 0.8


def test_save_activations_reads_back(tmp_path, data):
    p = save_activations(tmp_path / "syn.safetensors", data.activations[:100], directions=data.directions)
    t = load_file(str(p))
    assert_same_computation(t["activations"], data.activations[:100], why="saved and read back")
    assert_same_computation(t["directions"], data.directions, why="saved and read back")
    pairs = torch.randn(5, 2, 3)
    assert_same_computation(load_file(str(save_activations(tmp_path / "p.safetensors", pairs)))["activations"], pairs,
                            why="saved and read back")
    with pytest.raises(InputError):
        save_activations(tmp_path / "bad.safetensors", torch.randn(5, 3, 3))


def test_a_fitted_topk_recovers_the_features():
    """The metrics see learning: a TopK SAE at the true L0, fitted by a few hundred Adam steps on the
    reconstruction loss (a hand-written loop, not lenscope's trainer), recovers most features (MCC about 0.72
    here; the issue's target for the trained one is 0.7), far above the same dictionary before fitting."""
    torch.manual_seed(0)
    data = make_synthetic(20_000, d=32, n_features=64, l0=4.0, hierarchy=0.2, noise=0.02, seed=0)
    D = Dictionary.init(32, 64, kind="topk", k=4, seed=1)
    x = data.activations
    D.b_dec = x.mean(0)
    before = recovery(D, data)
    params = [D.W_enc, D.b_enc, D.W_dec, D.b_dec]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=3e-3)
    g = torch.Generator().manual_seed(2)
    for _ in range(1200):
        xb = x[torch.randint(len(x), (256,), generator=g)]
        loss = (D(xb) - xb).pow(2).sum(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            D.W_dec /= D.W_dec.norm(dim=1, keepdim=True)
    for p in params:
        p.requires_grad_(False)
    after = recovery(D, data)
    assert after["mcc"] > 0.6 and after["mcc"] > before["mcc"] + 0.3, (before, after)
    assert after["mean_max_cosine"] > 0.8 > before["mean_max_cosine"]
    assert after["l0"] <= 4
