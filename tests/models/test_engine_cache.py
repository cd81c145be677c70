"""The engine with a key/value cache (``run(..., past=)``): a sequence run step by step with the cache and the same
edits (positions counted from the start of the sequence) gives the logits and captures of one pass over the whole
sequence, on every decoder family; ``edits_within`` keeps the entries of a window."""

import pytest
import torch

from lenscope.errors import InputError, NotApplicableError
from lenscope.models.runtime.engine import Edit, edits_within, new_cache, run

from ..conftest import get_model
from ..tolerances import assert_same_computation

# the cached steps sum the same float32 products in another order (attention over the cache); the tiny models'
# logits and states are O(1), so 1e-5 absolute is far above that rounding and far below the edits' effects
ATOL = 1e-5


def _edits(lm, n):
    A = lm.anatomy
    g = torch.Generator().manual_seed(0)
    d, dh = A.d_model, A.layers[0].attn.d_head
    pos = torch.tensor([0, 2, n - 3, n - 1])
    z = torch.zeros(len(pos), dtype=torch.long)
    return [Edit("resid_pre", 1, z, pos, torch.randn(len(pos), d, generator=g), mode="add"),
            Edit("head", 0, z[:2], pos[1:3], torch.zeros(2, dh), head=torch.tensor([1, 0])),
            Edit("mlp_out", 0, torch.tensor([0]), torch.tensor(n - 2), 0.5 * torch.ones(1), mode="scale")]


def test_cached_steps_equal_one_pass(tiny_decoder):
    lm = tiny_decoder
    ids = lm.tokenizer("the cat sat on the mat and", return_tensors="pt")["input_ids"]
    n = ids.shape[1]
    edits = _edits(lm, n)
    full = run(lm, ids, edits, capture=[("resid_post", 1)])
    plain = run(lm, ids).logits
    assert float((full.logits - plain).abs().max()) > 1e-3  # the edits matter
    cache = new_cache(lm)
    split = [0, 3, 4, n]  # a prompt of 3, then one token, then the rest
    logits, states = [], []
    for a, b in zip(split, split[1:]):
        r = run(lm, ids[:, a:b], edits, capture=[("resid_post", 1)], past=cache)
        logits.append(r.logits)
        states.append(r.captured[("resid_post", 1)])
        assert cache.get_seq_length() == b
    assert torch.allclose(torch.cat(logits, 1), full.logits, atol=ATOL)
    assert torch.allclose(torch.cat(states, 1), full.captured[("resid_post", 1)], atol=ATOL)


KEPT = "the edit's values, kept for the window"


def test_edits_within_a_window():
    e = Edit("resid_pre", 0, torch.tensor([0]), torch.tensor([1, 4, 6]), torch.arange(3.0)[:, None].expand(3, 2),
             mode="add")
    assert edits_within([e], 0, 10) == [e]  # all inside, from 0: the edit itself
    (w,) = edits_within([e], 4, 7)
    assert w.pos.tolist() == [0, 2] and w.rows.tolist() == [0]
    assert_same_computation(w.values[:, 0].tolist(), [1.0, 2.0], why=KEPT)
    assert edits_within([e], 7, 9) == []
    v = Edit("resid_pre", 0, torch.tensor([0, 0]), torch.tensor([2, 5]), torch.ones(3), mode="add")  # a (d,) vector
    (w,) = edits_within([v], 3, 9)
    assert w.pos.tolist() == [2]
    assert_same_computation(w.values.tolist(), [1.0, 1.0, 1.0], why=KEPT)
    s = Edit("mlp_hidden", 0, torch.tensor([0, 0]), torch.tensor([2, 5]), torch.tensor([0.5, 2.0]), mode="scale")
    (w,) = edits_within([s], 3, 9)
    assert_same_computation(w.values.tolist(), [2.0], why=KEPT)


def test_cache_errors():
    lm = get_model("tiny:llama")
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(InputError, match="attention_mask"):
        run(lm, ids, attention_mask=torch.ones(1, 3, dtype=torch.long), past=new_cache(lm))
    with pytest.raises(NotApplicableError, match="causal"):
        run(get_model("tiny:bert"), ids, past=new_cache(get_model("tiny:bert")))
