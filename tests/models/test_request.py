"""One request (``models/runtime/request.py``) and one head-write function (``models/algebra.head_writes``)."""

from __future__ import annotations

import pytest
import torch

from lenscope.errors import InputError
from lenscope.models.loading.load import encode, resolve_token
from lenscope.models.runtime.engine import run
from lenscope.models.runtime.request import Contrast, Request, by_length, contrast, contrasts, metric_of, position_in
from lenscope.models.runtime.trace import trace
from lenscope.models.weights.algebra import head_outputs, head_writes

from ..conftest import DECODERS, get_model
from ..tolerances import assert_same_computation, assert_same_ints

TEXT = "The capital of France is the city of"


@pytest.fixture(scope="module")
def gpt2():
    return get_model("tiny:gpt2")


def test_request_resolves_every_form_once(gpt2):
    t, f = resolve_token(gpt2, " the"), resolve_token(gpt2, " of")
    assert Request.of(gpt2, " the", " of") == Request(t, f, -1)
    assert Request.of(gpt2, f"#{t}", f) == Request(t, f, -1)
    assert Request.of(gpt2, t, position=-2, n=5) == Request(t, None, 3)
    assert Request.of(gpt2) == Request(None, None, -1)


def test_request_checks(gpt2):
    with pytest.raises(InputError, match="a foil needs a target"):
        Request.of(gpt2, None, " of")
    assert Request.of(gpt2, foil=" of", generated=True).foil == resolve_token(gpt2, " of")  # targets come later
    with pytest.raises(InputError, match="the foil is the same token as the target"):
        Request.of(gpt2, " of", " of", distinct=True)
    assert Request.of(gpt2, " of", " of").foil == resolve_token(gpt2, " of")  # allowed unless distinct
    with pytest.raises(InputError, match="erasure needs a target token"):
        Request.of(gpt2, None, need="erasure")
    with pytest.raises(InputError, match="outside the text's 4 tokens"):
        Request.of(gpt2, " of", position=4, n=4)
    with pytest.raises(InputError, match="not exactly one token"):
        Request.of(gpt2, " of the")


def test_top_prediction_when_no_target(gpt2):
    logits = torch.zeros(gpt2.anatomy.vocab_size)
    logits[7] = 1.0
    assert Request.of(gpt2, top=logits).target == 7
    assert Request.of(gpt2, foil=" of", top=logits) == Request(7, resolve_token(gpt2, " of"), -1)
    assert Request.of(gpt2, " of", top=logits).target == resolve_token(gpt2, " of")  # a given target wins
    assert Request(None, None).or_top(logits).target == 7 and Request(3, None).or_top(logits).target == 3


def test_position_in():
    assert [position_in(p, 4) for p in (-4, -1, 0, 3)] == [0, 3, 0, 3]
    for bad in (4, -5, 1.0, True):
        with pytest.raises(InputError):
            position_in(bad, 4)


def test_contrast_and_grouping(gpt2):
    c = contrast(gpt2, TEXT, "The capital of Italy is the city of", " the", " of")
    assert isinstance(c, Contrast) and c.length == encode(gpt2, TEXT).numel() and c.position == c.length - 1
    assert c.target == resolve_token(gpt2, " the") and c.foil == resolve_token(gpt2, " of")
    with pytest.raises(InputError, match="same number of tokens"):
        contrast(gpt2, TEXT, "The capital", " the", " of")
    with pytest.raises(InputError, match="needs a foil"):
        contrast(gpt2, TEXT, TEXT, " the", None)
    with pytest.raises(InputError, match="a foil needs a target|patching needs a target"):
        contrast(gpt2, TEXT, TEXT, None, " of")
    long, short = encode(gpt2, TEXT), encode(gpt2, TEXT)[:4]
    other = short.clone()
    other[-1] = (other[-1] + 1) % gpt2.anatomy.vocab_size
    cs = contrasts(gpt2, [long, short, long], [long.flip(0), other, long], " the", [" of", " a", " is"],
                   "logit_diff", -1)
    assert len(cs) == 3 and [x.length for x in cs] == [long.numel(), 4, long.numel()]
    groups = by_length(cs)
    assert [g.index for g in groups] == [[0, 2], [1]]
    assert groups[0].clean.shape == (2, c.length)
    assert_same_ints(groups[0].foil, [cs[0].foil, cs[2].foil])
    with pytest.raises(InputError, match="2 entries for 3 prompts"):
        contrasts(gpt2, [TEXT, TEXT, TEXT], [TEXT] * 3, " the", [" of", " a"], "logit_diff", -1)


SMALL = "differences of small integers: exact"


def test_metric_of_by_hand():
    logits = torch.tensor([[1.0, 2.0, 4.0], [0.0, -1.0, 3.0]])
    assert_same_computation(metric_of(logits, "logit_diff", 2, 0).tolist(), [3.0, 3.0], why=SMALL)
    assert_same_computation(metric_of(logits, "logit_diff", torch.tensor([1, 2]), torch.tensor([0, 1])).tolist(),
                            [1.0, 4.0], why=SMALL)
    assert torch.allclose(metric_of(logits, "prob", 2), logits.softmax(-1)[:, 2])
    assert_same_computation(metric_of(logits[:, None].expand(2, 3, 3), "logit_diff", 2, at=1).tolist(), [4.0, 3.0],
                            why=SMALL)


@pytest.mark.parametrize("family", DECODERS)
def test_head_writes_sum_to_the_attention_write_in_both_conventions(family):
    """Both bias conventions on every decoder family: the heads' writes (with the remainder for ``"rest"``) add up
    to what the attention part wrote in the real run (``attn_write``, after a sandwich norm), and the two
    conventions differ by exactly the bias share ``b_O / H`` (through the norm)."""
    lm = get_model(f"tiny:{family}")
    A = lm.anatomy
    assert A.placement != "post"  # decoders: the residual stream is a sum of what each part writes
    ids = encode(lm, TEXT)
    tr = trace(lm, ids)
    P = ids.numel()
    _, cap = run(lm, ids[None], capture=[("head", layer) for layer in range(A.n_layers)])
    rows = torch.arange(P)
    for layer in range(A.n_layers):
        real = tr.attn_write[layer].double()
        scale = real.norm(dim=-1, keepdim=True).clamp_min(1e-6)
        z_traced = head_outputs(A, tr, layer, rows)
        assert torch.allclose(z_traced, cap["head", layer][0].float(), atol=1e-4 * float(z_traced.abs().max()))
        shared, none = head_writes(A.layers[layer], cap["head", layer][0], "shared")
        heads, rest = head_writes(A.layers[layer], z_traced, "rest", tr.attn_out[layer], dtype=torch.float32)
        assert none is None and heads.shape == shared.shape == (P, A.layers[layer].attn.n_heads, real.shape[-1])
        # float32 sums of O(d_model) terms: a few thousand eps32 relative to the write's size
        tol = 2e-4
        assert ((shared.double().sum(1) - real).abs() / scale).max() < tol
        assert (((heads.sum(1) + rest).double() - real).abs() / scale).max() < tol
        if A.layers[layer].attn.b_O is None and A.layers[layer].ln_attn_out is None:
            assert torch.allclose(rest, torch.zeros_like(rest))


def test_methods_take_checked_contrasts_as_pairs(gpt2):
    """A :class:`Contrast` (ids and token ids) is a pair every contrast method takes, with the same result as the
    plain strings it came from."""
    from lenscope.circuits import attribution_patching, exact_node_patching

    corrupted = "The capital of Italy is the city of"
    c = contrast(gpt2, TEXT, corrupted, " the", " of")
    for method in (attribution_patching, exact_node_patching):
        a, b = method(gpt2, pairs=[c]), method(gpt2, TEXT, corrupted, " the", " of")
        assert_same_computation(a.heads, b.heads, why="the same contrast, given as a pair or as strings")
        assert a.target == b.target and a.foil == b.foil
