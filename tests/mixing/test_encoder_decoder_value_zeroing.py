"""Value zeroing and ALTI over an encoder-decoder model's source (issue 47): each decoder layer's value-zeroing row
against a brute force through the real model (the engine zeroing one value vector of the layer's cross-attention or
self-attention, the layer's output compared with the clean run's), the rollout over source + target prefix against
the matrix product written out, and ``explain`` / the method table's rows over a source.

The brute force runs the real float64 model; lenscope recomputes the block from its Anatomy, whose attention
softmax is float32 (``tests/models/test_encoder_decoder.py``): both outputs of a ``1 - cos`` carry float32
rounding of one block (16 u, as ``tests.tolerances.pass_rounding`` allows per block) relative to their size, which
moves ``1 - cos`` by at most twice that per vector; a row normalised over its ``n`` entries moves by at most
``4 * 16 u * n / (row sum)`` (each row its own). A value left unzeroed, or the wrong one, moves a row by tenths."""

import pytest
import torch

import lenscope
from lenscope.attribution import methods as table
from lenscope.mixing.alti import encoder_decoder_mixing, mixing_matrices, value_zeroing_decoder_layer
from lenscope.models.runtime.engine import Edit, run
from lenscope.models.runtime.trace import trace
from tests.conftest import SEQ2SEQ, get_model
from tests.models.test_encoder_decoder_engine import SRC, TGT, _lm
from tests.tolerances import U32


def _zeroed(lm, site: str, l: int, k: int):
    """The decoder's block-``l`` output with value vector ``k`` of ``site`` (``cross_v``: source position ``k`` of
    the cross-attention; ``v``: target position ``k`` of the self-attention) zeroed, by the engine on the real
    model (row 0 of TGT / SRC)."""
    e = Edit(site, l, torch.tensor([0]), torch.tensor([k]), torch.zeros(1), mode="scale")
    return run(lm, TGT[:1], [e], capture=[("resid_post", l)], source=SRC[:1]).captured[("resid_post", l)][0]


@pytest.mark.parametrize("kind", SEQ2SEQ)
def test_each_decoder_layers_row_is_value_zeroing_by_brute_force(kind):
    lm = _lm(kind)
    tr = trace(lm, TGT[0], source=SRC[0])
    S, T = SRC.shape[1], TGT.shape[1]
    for l in range(lm.anatomy.n_layers):
        base = run(lm, TGT[:1], capture=[("resid_post", l)], source=SRC[:1]).captured[("resid_post", l)][0]
        want = torch.zeros(T, S + T, dtype=torch.float64)
        for k in range(S):
            want[:, k] = 1 - torch.nn.functional.cosine_similarity(_zeroed(lm, "cross_v", l, k), base, dim=-1)
        for j in range(T):
            want[:, S + j] = 1 - torch.nn.functional.cosine_similarity(_zeroed(lm, "v", l, j), base, dim=-1)
        want = want.clamp_min(0)
        want[:, S:] = want[:, S:].tril()  # a position's state does not read later positions
        total = want.sum(-1, keepdim=True)
        want = want / total
        got, bad = value_zeroing_decoder_layer(lm.anatomy, tr, l)
        assert bad == 0 and got.shape == (T, S + T)
        tol = 4 * 16 * U32 * (S + T) / total  # (T, 1): each row's own bound
        assert ((got.double() - want).abs() <= tol).all(), (l, float((got.double() - want).abs().max()))


@pytest.mark.parametrize("method", ["value-zeroing", "alti"])
@pytest.mark.parametrize("kind", SEQ2SEQ)
def test_the_rollout_over_source_and_prefix(kind, method):
    """The explanation of a target position is row ``p`` of the rollout ``R_L``: ``R_0 = [0 | I]`` (each target
    position its own token), ``R_{l+1} = C_l[:, :S] [M_enc | 0] + C_l[:, S:] R_l`` with ``M_enc`` the encoder's
    rollout of the same method; every row sums to one; the method table's rows equal ``explain``."""
    lm = _lm(kind)
    tr = trace(lm, TGT[0], source=SRC[0])
    S, T = SRC.shape[1], TGT.shape[1]
    mm = encoder_decoder_mixing(lm.anatomy, tr, method=method)
    enc = mixing_matrices(lm.anatomy.encoder, tr.encoder, method, rollout=True).rollout[-1].double()
    C = mm.contributions.double()
    R = torch.cat([torch.zeros(T, S, dtype=torch.float64), torch.eye(T, dtype=torch.float64)], 1)
    memory = torch.cat([enc, torch.zeros(S, T, dtype=torch.float64)], 1)
    for l in range(lm.anatomy.n_layers):
        R = C[l, :, :S] @ memory + C[l, :, S:] @ R
    assert (R.sum(-1) - 1).abs().max() < 1e-5
    for p in (1, T - 1):
        e = lenscope.explain(lm, TGT[0, : p + 1], method=method, source=SRC[0])
        assert e.n_source == S and len(e.scores) == S + p + 1
        assert (e.scores.double() - R[p, : S + p + 1]).abs().max() < 1e-5  # float32 results of float64 products
        assert (R[p, S + p + 1:] == 0).all()  # later positions unread
    m = table.get(method)
    assert m.reads_source
    job = table.Rows(lm=lm, tr=tr, ids=TGT[0], rows=torch.arange(T), tok=TGT[0], foils=None)
    rows, inv = m.generation_rows(job)
    assert (rows.double() - R).abs().max() < 1e-5 and float(inv.max()) < 1e-4


def test_real_tokenizer_pairs_and_generation():
    """Through texts on a tiny model with a tokenizer: pair_scores and generate take the two methods too."""
    from lenscope.evaluate.aer import pair_scores

    lm = get_model("tiny:marian")
    ps = pair_scores(lm, [("das Haus ist klein", "the house is small")], ["alti", "value-zeroing"])[0]
    for m in ("alti", "value-zeroing"):
        rows = ps.scores[m]
        assert rows.shape == (len(ps.decoder_ids) - 1, ps.n_source + len(ps.decoder_ids))
        assert (rows.sum(-1) - 1).abs().max() < 1e-5
    g = lenscope.generate(lm, "", 3, source="das Haus", explain="value-zeroing")
    assert g.n_source == len(g.source_ids) and g.scores.shape[-1] == len(g.ids) - 1 + g.n_source
