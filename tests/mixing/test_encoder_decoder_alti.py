"""ALTI+ and ALTI-Logit of encoder-decoder models (issue 31; Ferrando et al. 2022, 2023): the cross-attention
sub-layer's contributions against a dense float64 computation from the Anatomy's weights (every part written out,
through the Post-LN norm of BART and Marian), the decoder's rollout against the full (source + target) matrix
product, and ALTI-Logit's per-layer sums equal to the Logit explanation's (mixing only redistributes).

The contributions are ratios of L1 distances computed in float32 from d_model-long sums: they differ from the
float64 ones by a few units of float32 rounding times ``d_model`` relative to a row's size (``TOL``), while a part
left out (the residual, the norm) moves them by tenths."""

import pytest
import torch

import lenscope
from lenscope.mixing.alti import carry_back_encoder_decoder, cross_alti_layer, encoder_decoder_mixing
from lenscope.models.runtime.trace import trace
from tests.conftest import SEQ2SEQ, get_model
from tests.tolerances import U32

SOURCE = "das Haus ist klein und alt"
PREFIX = "the house is"
TOL = 64 * 64 * U32  # d_model = 64 terms, a few roundings each


def _dense_cross(A, tr, l):
    """Row i of the state after layer l's cross-attention sub-layer written as its parts, in float64: each memory
    vector's (sum over heads of its weighted value times W_O), the stream itself, the output bias; through the
    Post-LN norm (affine given its traced scale); proximity and row normalisation as ALTI defines them."""
    L = A.layers[l]
    X = L.cross
    d = torch.float64
    mem, stream = tr.memory.to(d), tr.resid_mid[l].to(d)
    probs = tr.cross_pattern[l].to(d)  # (head, pos, src)
    v = torch.einsum("sd,hde->hse", mem, X.W_V.to(d)) + (0 if X.b_V is None else X.b_V.to(d)[:, None])
    per = torch.einsum("hse,hed->hsd", v, X.W_O.to(d))  # each head's write from each memory vector
    parts = torch.einsum("hts,hsd->tsd", probs, per)  # (pos, src, d)
    parts = torch.cat([parts, stream[:, None]], 1)  # the residual as one more part
    rest = (X.b_O.to(d) if X.b_O is not None else torch.zeros(A.d_model, dtype=d)).expand(len(stream), -1)
    y = parts.sum(1) + rest
    if L.placement == "post":
        norm = L.ln_cross
        s = norm.to(d).scale(y)
        parts = norm.to(d).linear(parts, s[:, None].expand(parts.shape[:2]))
        rest = norm.to(d).linear(rest, s) + (0 if norm.bias is None else norm.bias.to(d))
        y = parts.sum(1) + rest
    c = (y.abs().sum(-1, keepdim=True) - (y[:, None] - parts).abs().sum(-1)).clamp_min(0)
    return c / c.sum(-1, keepdim=True), y


@pytest.mark.parametrize("name", SEQ2SEQ)
def test_cross_attention_contributions_are_alti_on_every_part(name):
    lm = get_model(f"tiny:{name}")
    tr = trace(lm, PREFIX, source=SOURCE)
    A, S, T = lm.anatomy, len(tr.encoder.tokens), len(tr.tokens)
    for l in range(A.n_layers):
        C, err, bad = cross_alti_layer(A, tr, l)
        want, y = _dense_cross(A, tr, l)
        assert bad == 0 and err <= 1e-5
        # our (pos, src + pos): the memory's columns, and each row's residual on its own position's column
        assert float(C[:, S:].clone().fill_diagonal_(0).abs().max()) == 0.0
        got = torch.cat([C[:, :S], C[torch.arange(T), S + torch.arange(T)][:, None]], 1).double()
        assert float((got - want).abs().max()) <= TOL, (l, float((got - want).abs().max()))
        if A.layers[l].placement == "post":  # the state read is the norm's output, not its input
            assert torch.allclose(y.float(), tr.mlp_in[l], atol=1e-4 * float(y.abs().max()))


@pytest.mark.parametrize("name", ["bart", "t5", "mbart"])
def test_the_decoder_rollout_is_the_full_matrix_product(name):
    """Every decoder layer maps (memory, its input states) to its output states; with the memory's rows fixed to the
    encoder's rollout, the product of the full (source + target) matrices carries each layer's rows as
    ``carry_back_encoder_decoder`` does; the contributions' and the rollout's rows sum to one."""
    lm = get_model(f"tiny:{name}")
    tr = trace(lm, PREFIX, source=SOURCE)
    mix = encoder_decoder_mixing(lm.anatomy, tr)
    C, M = mix.contributions.double(), mix.memory
    L, T, n = C.shape
    S = n - T
    assert mix.row_sum_error <= 1e-5 and float((M.sum(-1) - 1).abs().max()) <= 1e-5
    g = torch.Generator().manual_seed(0)
    deltas = torch.randn(L, 3, n, generator=g, dtype=torch.float64)
    got = carry_back_encoder_decoder(mix, deltas[..., S:], deltas[..., :S])
    full = torch.zeros(n, n, dtype=torch.float64)  # rows: memory vectors, then the states entering the layer
    full[:S, :S] = M
    full[S:, S:] = torch.eye(T, dtype=torch.float64)
    for l in range(L):
        want = deltas[l] @ full
        torch.testing.assert_close(got[l], want, rtol=1e-12, atol=1e-12)
        nxt = full.clone()
        nxt[S:] = C[l] @ full
        full = nxt
        assert float((full.sum(-1) - 1).abs().max()) <= 1e-5


@pytest.mark.parametrize("name", SEQ2SEQ)
def test_alti_logit_redistributes_the_logit_parts(name):
    lm = get_model(f"tiny:{name}")
    e = lenscope.explain(lm, PREFIX, " the", " a", method="alti-logit", source=SOURCE)
    lg = lenscope.explain(lm, PREFIX, " the", " a", method="logit", source=SOURCE)
    assert e.n_source == lg.n_source > 0 and e.tokens == lg.tokens and e.position == lg.position
    size = float(lg.layer_scores.abs().sum(-1).max())
    torch.testing.assert_close(e.layer_scores.sum(-1), lg.layer_scores.sum(-1), rtol=0, atol=1e-5 * size)
    assert e.invariant_error <= 1e-5
    # the source tokens get a share through the cross-attention and through the decoder's states, which read it
    # and ALTI-Logit's redistribution moves the scores by far more than rounding (measured >= 0.3% of the largest)
    assert float(e.source_scores.abs().sum()) > 0
    assert float((e.scores - lg.scores).abs().max()) > 1e-3 * float(lg.scores.abs().max())
