"""Batched teacher-forced runs of encoder-decoder models with padded sources and targets (issue 47): the engine's
``source_mask`` / ``attention_mask`` (right padding on both stacks) and :func:`batch_traces` with sources.

A padded batch is another computation than each row alone (other shapes, so other kernels and summation orders;
the padded keys' probabilities are exactly 0, so the mathematics is the same): each row's captures at its real
positions equal the row's own run within :func:`tests.tolerances.pass_rounding` (float32 units per block, of the
encoder's and the decoder's blocks) times the size of what is compared; the float64 models round far inside it,
and a mask that let one padded key through would be off by O(1). Padded positions are NaN.
"""

import pytest
import torch

from lenscope.errors import InputError, NotApplicableError
from lenscope.models.runtime.engine import run
from lenscope.models.runtime.trace import batch_traces, trace, trace_sites
from tests.conftest import get_model
from tests.models.test_encoder_decoder import KINDS
from tests.models.test_encoder_decoder_engine import _lm
from tests.tolerances import U32

SOURCES = [torch.tensor([5, 17, 33, 8, 60, 2]), torch.tensor([7, 41, 2]), torch.tensor([9, 2])]
TARGETS = [torch.tensor([2, 40, 9]), torch.tensor([2, 11, 80, 5, 30]), torch.tensor([2])]


def _tol(lm, x: torch.Tensor) -> float:
    blocks = lm.anatomy.n_layers + lm.anatomy.encoder.n_layers
    return 16 * U32 * (blocks + 1) * max(1.0, float(x.abs().max()))


def _padded(rows):
    n = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), n, dtype=torch.long)
    mask = torch.zeros(len(rows), n, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, : len(r)], mask[b, : len(r)] = r, 1
    return ids, mask


def _own(name: str, b: int) -> tuple[int, int]:
    """The (query, key) positions of row ``b`` at a site: the source's for the encoder and cross keys / values."""
    src, tgt = len(SOURCES[b]), len(TARGETS[b])
    on_source = name.startswith("enc.") or name in ("cross_k", "cross_v")
    own = src if on_source else tgt
    keys = src if name.startswith("enc.") or name == "cross_pattern" else tgt
    return own, keys


@pytest.mark.parametrize("kind", KINDS)
def test_a_padded_batch_equals_each_row_alone(kind):
    lm = _lm(kind)
    sites = trace_sites(lm) + [(n, i) for n in ("cross_k", "cross_v", "enc.v") for i in range(2)]
    src, src_mask = _padded(SOURCES)
    dec, dec_mask = _padded(TARGETS)
    logits, cap = run(lm, dec, capture=sites, source=src, source_mask=src_mask, attention_mask=dec_mask)
    for b in range(len(SOURCES)):
        one_logits, one = run(lm, TARGETS[b][None], capture=sites, source=SOURCES[b][None])
        n = len(TARGETS[b])
        assert (logits[b, :n] - one_logits[0]).abs().max() <= _tol(lm, one_logits)
        for key, want in one.items():
            own, keys = _own(key[0], b)
            got = cap[key][b]
            if key[0].endswith("pattern"):  # (h, p, s): padded rows NaN, padded keys exactly 0
                assert torch.isnan(got[:, own:]).all(), key
                assert (got[:, :own, keys:] == 0).all(), key
                got = got[:, :own, :keys]
            else:
                assert torch.isnan(got[own:]).all(), key
                got = got[:own]
            assert got.shape == want[0].shape, key
            assert (got - want[0]).abs().max() <= _tol(lm, want[0]), (key, float((got - want[0]).abs().max()))


@pytest.mark.parametrize("kind", KINDS)
def test_batch_traces_with_sources_are_each_rows_trace(kind):
    lm = _lm(kind)
    trs = batch_traces(lm, TARGETS, source=SOURCES)
    for tb, tgt, src in zip(trs, TARGETS, SOURCES):
        t1 = trace(lm, tgt, source=src)
        assert tb.input_ids.tolist() == tgt.tolist() and tb.encoder.input_ids.tolist() == src.tolist()
        for f in ("resid_pre", "resid_post", "attn_out", "mlp_out", "pattern", "cross_out", "cross_pattern",
                  "memory", "logits"):
            a, w = getattr(tb, f), getattr(t1, f)
            assert a.shape == w.shape and not torch.isnan(a).any(), f
            assert (a - w).abs().max() <= _tol(lm, w), f
        for f in ("resid_post", "pattern"):
            a, w = getattr(tb.encoder, f), getattr(t1.encoder, f)
            assert a.shape == w.shape and (a - w).abs().max() <= _tol(lm, w), f


def test_one_line_errors():
    lm = _lm("bart")
    src, src_mask = _padded(SOURCES)
    dec, dec_mask = _padded(TARGETS)
    with pytest.raises(InputError, match="right padding"):
        run(lm, dec, source=src, source_mask=src_mask.flip(1))
    with pytest.raises(InputError, match="right padding"):
        run(lm, dec, source=src, attention_mask=dec_mask.flip(1))
    with pytest.raises(InputError, match="must have the inputs' shape"):
        run(lm, dec, source=src, source_mask=src_mask[:, :2])
    with pytest.raises(InputError, match="give the source too"):
        run(get_model("tiny:llama"), dec, attention_mask=dec_mask, source_mask=src_mask)
    with pytest.raises(NotApplicableError, match="without a key/value cache"):
        run(lm, dec, source=src, inputs_embeds=torch.zeros(3, 5, 8))
    with pytest.raises(InputError, match="one source per target prefix"):
        batch_traces(lm, TARGETS, source=SOURCES[:2])


def test_a_source_too_long_or_empty_is_one_line_on_every_path():
    """The baselines call the model themselves (through forward_kwargs): a source past the encoder's context is
    the engine's one-line error there too, never an index error inside the model; an empty source text is
    refused before tokenising."""
    import lenscope

    lm = get_model("tiny:marian")
    long = "das " * (lm.anatomy.encoder.n_ctx + 8)
    for method in ("erasure", "grad-norm", "logit"):
        with pytest.raises(InputError, match="more than the encoder's context"):
            lenscope.explain(lm, "the house", " is", method=method, source=long)
    with pytest.raises(InputError, match="the source is empty"):
        lenscope.explain(lm, "the house", " is", method="ig", source="  ")
