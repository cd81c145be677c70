"""The readout (final norm, unembedding, biases, soft-cap) against the real model and brute force: full logits on
every decoder family, the linearised part readout with the traced scale, the soft-cap and its inverse, and the
fast paths (top-1, the converted unembedding); the kernels built on it are tested in tests/lenses/test_kernels.py."""

import dataclasses

import pytest
import torch

import lenscope
from lenscope.models.weights.anatomy import Norm, Unembed
from lenscope.models.weights.readout import Readout
from tests.conftest import get_model
from tests.tolerances import assert_same_computation, assert_same_ints

TEXT = "When Mary and John went to the store, John gave a drink to"


def _trace(lm):
    return lenscope.trace(lm, TEXT)


def brute_logits(A, h, capped: bool = True):
    """Logits of residual states ``h`` in float64, straight from the weights (``capped=False``: before the
    soft-cap)."""
    h = h.double()
    n = A.final_norm
    if n is not None:
        x = h - h.mean(-1, keepdim=True) if n.kind == "layernorm" else h
        var = x.pow(2).mean(-1, keepdim=True)
        x = x / torch.sqrt(var + n.eps)
        if n.weight is not None:
            x = x * n.weight.double()
        if n.bias is not None:
            x = x + n.bias.double()
    else:
        x = h
    z = x @ A.unembed.W_U.double()
    if A.unembed.b_U is not None:
        z = z + A.unembed.b_U.double()
    z = z * A.unembed.logit_scale  # Cohere
    c = A.unembed.softcap
    return torch.tanh(z / c) * c if c is not None and capped else z


def test_readout_of_the_final_residual_is_the_models_logits(tiny_decoder):
    lm = tiny_decoder
    A = lm.anatomy
    tr = _trace(lm)
    ro = Readout.from_anatomy(A)
    got = ro.logits(tr.site("ln_final.in"))
    want = tr.logits.float()
    scale = float(want.abs().max())
    assert torch.allclose(got, want, rtol=0, atol=1e-5 * scale + 1e-6), float((got - want).abs().max())
    assert torch.allclose(got.double(), brute_logits(A, tr.site("ln_final.in")), rtol=0, atol=1e-5 * scale + 1e-6)
    assert_same_computation(A.logits(tr.site("ln_final.in")), got,
                            why="Anatomy.logits is the readout: the same calls")  # Anatomy.logits is the readout
    assert_same_computation(ro.unembed(ro.features(tr.site("ln_final.in"))), got,
                            why="the readout's own two steps: the same calls")


def test_linearised_parts_sum_to_the_logit_with_the_traced_scale(tiny_decoder):
    lm = tiny_decoder
    A = lm.anatomy
    tr = _trace(lm)
    ro = Readout.from_anatomy(A)
    p = len(tr.tokens) - 1
    s = ro.scale(tr.site("ln_final.in")[p])
    # the residual stream's own parts: embeddings and every sub-layer's write
    parts = torch.cat([tr.embed[p][None], tr.attn_write[:, p], tr.mlp_write[:, p]]).float()
    assert torch.allclose(parts.sum(0), tr.site("ln_final.in")[p].float(), atol=1e-4)
    g = torch.Generator().manual_seed(0)
    noise = torch.randn(parts.shape, generator=g)
    parts = torch.cat([parts, noise, -noise])  # any split of the state reads the same
    for t, f in [(5, None), (5, 9), (int(tr.logits[p].argmax()), 3)]:
        u = ro.direction(t, f)
        want_u = A.unembed.W_U[:, t].double() - (A.unembed.W_U[:, f].double() if f is not None else 0)
        want_u = want_u * A.unembed.logit_scale  # Cohere's logits are multiplied by a constant
        assert torch.allclose(u.double(), want_u, atol=1e-6)
        values = ro.part_logits(parts, s, u)
        logit = ro.traced_logit(tr.logits[p], t, f)
        total = float(values.double().sum()) + ro.constant(t, f)
        assert total == pytest.approx(logit, abs=1e-4 * max(1.0, abs(logit)))
        # the pulled-back direction reads the same parts
        d = ro.pullback(u, s)
        assert torch.allclose(parts @ d, values, atol=1e-5 * float(values.abs().max()) + 1e-6)
        # brute force: the logit difference of the float64 readout (before the soft-cap, as traced_logit)
        z = brute_logits(A, tr.site("ln_final.in")[p], capped=False)
        assert logit == pytest.approx(float(z[t] - (z[f] if f is not None else 0)), abs=1e-4 * max(1.0, abs(logit)))
    assert ro.has_bias == (A.final_norm.bias is not None or A.unembed.b_U is not None)


def test_soft_cap_and_its_inverse_round_trip():
    g = torch.Generator().manual_seed(1)
    W = torch.randn(8, 50, generator=g)
    ro = Readout(Norm("rmsnorm", torch.ones(8), None, 1e-6), Unembed(W, torch.randn(50, generator=g), softcap=5.0))
    z = torch.linspace(-12, 12, 101)
    capped = ro.cap(z)
    assert capped.abs().max() < 5.0
    assert torch.allclose(capped, 5.0 * torch.tanh(z / 5.0))
    assert torch.allclose(ro.uncap(capped), z, atol=2e-3 * 12)
    assert torch.allclose(ro.uncap(capped[40:61]), z[40:61], atol=1e-5)  # well inside the cap: exact
    y = torch.linspace(-4.9, 4.9, 51)
    assert torch.allclose(ro.cap(ro.uncap(y)), y, atol=1e-5)
    # the linearised logit of a soft-capped model is read before the cap
    h = torch.randn(3, 8, generator=g)
    logits = ro.logits(h)
    assert torch.allclose(logits, 5.0 * torch.tanh((ro.norm(h) @ W + ro.b_U) / 5.0), atol=1e-6)
    s = ro.scale(h[0])
    u = ro.direction(4, 7)
    got = float(ro.part_logits(h[0][None], s, u).sum()) + ro.constant(4, 7)
    assert got == pytest.approx(ro.traced_logit(logits[0], 4, 7), abs=1e-4)
    # no cap: both are the identity
    plain = Readout(None, Unembed(W))
    assert_same_computation((plain.cap(z), plain.uncap(z)), (z, z), why="no cap: z returned as it is")


def test_soft_capped_decoder_parts_sum_to_the_uncapped_logit():
    lm = get_model("tiny:gemma3")
    A = lm.anatomy
    tr = _trace(lm)
    ro = Readout(A.final_norm, dataclasses.replace(A.unembed, softcap=0.5))
    p = 3
    logits = ro.logits(tr.site("ln_final.in")[p])
    assert logits.abs().max() < 0.5
    s = ro.scale(tr.site("ln_final.in")[p])
    u = ro.direction(10, 20)
    total = float(ro.part_logits(tr.site("ln_final.in")[p][None].float(), s, u).sum()) + ro.constant(10, 20)
    assert total == pytest.approx(ro.traced_logit(logits, 10, 20), abs=2e-3)


def test_no_head_is_refused():
    A = dataclasses.replace(get_model("tiny:gpt2").anatomy, unembed=None)
    with pytest.raises(lenscope.UnsupportedModelError, match="no language-model head"):
        Readout.from_anatomy(A)


@pytest.mark.parametrize("name", ["tiny:gpt2", "tiny:llama", "tiny:bert"])
def test_top1_is_the_float32_argmax(name):
    lm = get_model(name)
    ro = Readout.from_anatomy(lm.anatomy)
    g = torch.Generator().manual_seed(2)
    y = ro.features(torch.randn(64, lm.anatomy.d_model, generator=g) * 3)
    want = (y @ ro.W_U.float() + (ro.b_U.float() if ro.b_U is not None else 0)).argmax(-1)
    assert_same_ints(ro.top1(y, exact=True), want)
    assert_same_ints(ro.top1(y), want)
    assert_same_ints(ro.top1(y, candidates=2), want)


def test_converted_unembedding_is_never_another_tensors():
    """The one-entry conversion cache is keyed on the tensor itself: a later unembedding allocated where a freed
    one lived (same address, shape and version) gets its own conversion, not the stale one. (Found by the issue-17
    before/after snapshot: prediction depth on one tiny model read another one's bfloat16 unembedding.)"""
    import gc

    from lenscope.models.weights.readout import _converted

    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        W = torch.randn(64, 1000, generator=g)
        got = _converted(W, torch.bfloat16)["W"]
        assert_same_computation(got, W.to(torch.bfloat16), why="one conversion to bfloat16, round to nearest even")
        del W, got
        gc.collect()
