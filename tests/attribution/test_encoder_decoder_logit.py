"""Issue 31 (draft; docs/encoder-decoder.md): the Logit explanation's per-head, per-source parts of a decoder block's
self-attention (over the target prefix) and cross-attention (over the source tokens) add up exactly to what each
sub-layer writes, read along any direction (tiny BART, Marian, T5, gated T5); and with the read-out direction
carried back through each block (``block_pullback``: through the norms of Post-LN blocks), the parts, the MLP writes,
the embedding and the constants add up to the model's logit difference at every target position, split into a
source part and a target-prefix part.

Everything runs in float64 (the models and lenscope's recomputation from the Anatomy, whose blocks
tests/models/test_encoder_decoder.py checks against the real model), so a sum of parts differs from its whole by
float64 rounding: below 1e-12 of the sizes summed (a few hundred terms of unit roundoff 1.1e-16), while a part
left out or read in the wrong place is off by the size of a part.
"""

import pytest
import torch

from lenscope.attribution.context import value_logit_rows
from lenscope.models.weights.readout import Readout
from tests.models.test_encoder_decoder import KINDS, _model, _reader

REL = 1e-12
SRC = torch.tensor([5, 17, 33, 8, 60, 2])
TGT = torch.tensor([2, 40, 9, 71, 12])


def _runs(A):
    """The encoder's output (the memory) and each decoder block's intermediates, recomputed from the Anatomy."""
    h = A.encoder.embed(SRC, torch.arange(len(SRC)))
    for L in A.encoder.layers:
        h = L.forward(h, torch.arange(len(SRC)))["resid_post"]
    memory = A.encoder.final_norm(h) if A.encoder.final_norm is not None else h
    h = A.embed(TGT, torch.arange(len(TGT)))
    runs = []
    for L in A.layers:
        r = L.forward(h, torch.arange(len(TGT)), memory=memory)
        r["resid_pre"] = h
        runs.append(r)
        h = r["resid_post"]
    return memory, runs, h


def _constant(A, ro, u, target, foil) -> float:
    """The logit difference's constant term, in float64: the logits' bias and the final LayerNorm's bias (mBART,
    M2M-100, Pegasus) read along ``u``."""
    b = 0.0 if ro.b_U is None else float(ro.b_U[target] - ro.b_U[foil])
    norm = A.final_norm
    return b + (0.0 if norm is None or norm.bias is None else float(norm.bias.double() @ u[0]))


def _gap(parts, rem, want):
    got = parts.sum((1, 2)) + rem
    scale = parts.abs().sum((1, 2)) + rem.abs() + want.abs()
    return float(((got - want).abs() / scale).max())


@pytest.mark.parametrize("kind", KINDS)
def test_self_and_cross_attention_parts_add_up_to_each_write(kind):
    A = _reader(kind).read(_model(kind))
    memory, runs, _ = _runs(A)
    g = torch.Generator().manual_seed(2)
    for l, (L, r) in enumerate(zip(A.layers, runs)):
        dirs = torch.randn(len(TGT), A.d_model, generator=g, dtype=torch.float64)  # one direction per position
        z = r["resid_pre"] if L.placement == "post" else r["attn_in"]
        parts, rem = value_logit_rows(L, "attn", z, None, r["pattern"].transpose(0, 1), r["attn_out"], dirs)
        assert parts.shape == (len(TGT), 4, len(TGT))  # (position, head, target-prefix token)
        assert float(parts[0, :, 1:].abs().max()) == 0.0  # causal: position 0 reads no later token
        assert _gap(parts, rem, (r["attn_write"] * dirs).sum(-1)) <= REL, f"self-attention {l}"
        parts, rem = value_logit_rows(L, "cross", memory, None, r["cross_pattern"].transpose(0, 1), r["cross_out"],
                                      dirs)
        assert parts.shape == (len(TGT), 4, len(SRC))  # (position, head, source token)
        assert _gap(parts, rem, (r["cross_write"] * dirs).sum(-1)) <= REL, f"cross-attention {l}"
        # a wrong memory (the encoder's input instead of its output) does not add up
        wrong, wrong_rem = value_logit_rows(L, "cross", A.encoder.embed(SRC, torch.arange(len(SRC))), None,
                                            r["cross_pattern"].transpose(0, 1), r["cross_out"], dirs)
        assert _gap(wrong, wrong_rem, (r["cross_write"] * dirs).sum(-1)) > 1e-3


@pytest.mark.parametrize("kind", KINDS)
def test_every_family_logit_difference_splits_into_source_and_target_prefix_parts(kind):
    """Through Post-LN blocks (BART, Marian) too: each write read along the direction pulled back through the norms
    after it (``block_pullback``), the parts, the MLP writes, the embedding and the norms' biases add up to the
    model's logit difference at every target position."""
    from lenscope.models.weights.readout import block_pullback

    A = _reader(kind).read(_model(kind))
    memory, runs, final = _runs(A)
    ro = Readout.from_anatomy(A)
    target, foil = 7, 30
    u = (ro.W_U[:, target] - ro.W_U[:, foil]).double().expand(len(TGT), -1)
    b = _constant(A, ro, u, target, foil)
    d = ro.pullback(u, ro.scale(final)).double() if A.final_norm is not None else u
    logits = A.logits(final)
    want = (logits[:, target] - logits[:, foil]).double()
    source = torch.zeros(len(TGT), len(SRC), dtype=torch.float64)
    prefix = torch.zeros(len(TGT), len(TGT), dtype=torch.float64)
    total = torch.full((len(TGT),), b, dtype=torch.float64)
    for L, r in reversed(list(zip(A.layers, runs))):
        dirs, d, c = block_pullback(L, d, r)
        z = r["resid_pre"] if L.placement == "post" else r["attn_in"]
        parts, rem = value_logit_rows(L, "attn", z, None, r["pattern"].transpose(0, 1), r["attn_out"], dirs["attn"])
        prefix += parts.sum(1)
        total = total + rem + c
        parts, rem = value_logit_rows(L, "cross", memory, None, r["cross_pattern"].transpose(0, 1), r["cross_out"],
                                      dirs["cross"])
        source += parts.sum(1)
        total = total + rem + (r["mlp_write"] * dirs["mlp"]).sum(-1)
    total = total + (A.embed(TGT, torch.arange(len(TGT))) * d).sum(-1) + source.sum(1) + prefix.sum(1)
    scale = source.abs().sum(1) + prefix.abs().sum(1) + want.abs()
    assert float(((total - want).abs() / scale).max()) <= REL
    assert float(prefix.triu(1).abs().max()) == 0.0
    if A.layers[0].placement == "post":  # reading the writes along the final direction instead does not add up
        flat = torch.zeros(len(TGT), dtype=torch.float64)
        for r in runs:
            flat = flat + ((r["attn_write"] + r["cross_write"] + r["mlp_write"]) * u).sum(-1)
        assert float(((flat - want).abs() / scale).max()) > 1e-3


@pytest.mark.parametrize("kind", KINDS)
def test_direct_logit_attribution_with_cross_attention_heads(kind):
    """Direct logit attribution's components of an encoder-decoder model: the embedding, every self-attention head,
    every cross-attention head (``head_writes(..., which="cross")``), every MLP and the biases add up to the
    logit difference at every target position, each write read along its ``block_pullback`` direction; the
    cross-attention heads alone equal the source part of the Logit explanation."""
    from lenscope.models.weights.algebra import head_writes
    from lenscope.models.weights.readout import block_pullback

    A = _reader(kind).read(_model(kind))
    memory, runs, final = _runs(A)
    ro = Readout.from_anatomy(A)
    target, foil = 7, 30
    u = (ro.W_U[:, target] - ro.W_U[:, foil]).double().expand(len(TGT), -1)
    d = ro.pullback(u, ro.scale(final)).double() if A.final_norm is not None else u
    logits = A.logits(final)
    want = (logits[:, target] - logits[:, foil]).double()
    total = torch.full((len(TGT),), _constant(A, ro, u, target, foil), dtype=torch.float64)
    scale = want.abs().clone()
    for L, r in reversed(list(zip(A.layers, runs))):
        dirs, d, c = block_pullback(L, d, r)
        total = total + c
        for which, probs, values_in in (("attn", r["pattern"], r["resid_pre"] if L.placement == "post"
                                         else r["attn_in"]), ("cross", r["cross_pattern"], memory)):
            attn = L.cross if which == "cross" else L.attn
            z = torch.einsum("hqk,hke->qhe", probs, attn.values(values_in))  # each head's output (pos, head, d_head)
            heads, rest = head_writes(L, z, "rest", which=which)
            torch.testing.assert_close(heads.sum(-2) + rest, r[f"{which}_write"], rtol=0, atol=1e-12)
            per_head = (heads * dirs[which][:, None]).sum(-1)  # (pos, head): the DLA components
            total = total + per_head.sum(-1) + (rest * dirs[which]).sum(-1)
            scale = scale + per_head.abs().sum(-1)
            if which == "cross":
                parts, rem = value_logit_rows(L, "cross", memory, None, probs.transpose(0, 1), r["cross_out"],
                                              dirs["cross"])
                torch.testing.assert_close(per_head, parts.sum(-1), rtol=0, atol=1e-12 * float(scale.max()))
        total = total + (r["mlp_write"] * dirs["mlp"]).sum(-1)
    total = total + (A.embed(TGT, torch.arange(len(TGT))) * d).sum(-1)
    assert float(((total - want).abs() / scale).max()) <= REL
