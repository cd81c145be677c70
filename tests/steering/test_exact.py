"""Steering is exact on every decoder family: multiplier 0 is the unsteered model bit for bit (no edit at all), a
steered forward pass is the real model with the vector added by a plain PyTorch hook, and steered greedy generation
(the engine's edits at every decoding step, with the key/value cache) is a brute-force loop that re-runs the model
without a cache and adds the vector with that hook at each step."""

import pytest
import torch

from lenscope.errors import NotApplicableError
from lenscope.generation import decode, generate
from lenscope.models.families import family_for
from lenscope.steering import generation_edits, steered_logits, steering_edits

from ..conftest import get_model
from ..tolerances import assert_same_computation, assert_same_ints
from .helpers import PROMPT, add_hook, blocks, direction

# Generation compares the cached decoding loop with full passes over the sequence: the same float32 sums in another
# order (attention over the cache, longer matmuls), about 1e-7 relative per operation over a few layers; logits of
# the tiny models are O(1), so 1e-5 absolute bounds the difference with a wide margin and still catches a missed or
# misplaced edit (the vectors below move the logits by 1e-2 or more).
GEN_ATOL = 1e-5


def _ids(lm):
    return lm.tokenizer(PROMPT, return_tensors="pt")["input_ids"][0]


def test_the_hook_finds_the_engines_blocks(tiny_decoder):
    lm = tiny_decoder
    found = blocks(lm.model, lm.anatomy.n_layers)
    hooks = family_for(lm.model).hooks(lm.model)
    assert all(a is b.block for a, b in zip(found, hooks.layers))


def test_multiplier_zero_is_the_model_bit_for_bit(tiny_decoder):
    lm = tiny_decoder
    d = direction(lm)
    ids = _ids(lm)
    assert steering_edits(d, 0.0, ids.numel()) == []
    assert steering_edits(d, -0.0, ids.numel(), layers=[0, 1]) == []
    with torch.no_grad():
        ref = lm.model(ids[None]).logits[0]
    assert_same_computation(steered_logits(lm, ids, d, 0.0), ref, why="alpha 0 adds no edit: the model's own forward")
    assert_same_computation(steered_logits(lm, ids, d, 0.0, layers=[0, 1]), ref,
                            why="alpha 0 adds no edit: the model's own forward")


@pytest.mark.parametrize("alpha", [2.5, -7.0])
def test_steered_forward_is_the_model_with_a_plain_hook(tiny_decoder, alpha):
    lm = tiny_decoder
    ids = _ids(lm)
    L = lm.anatomy.n_layers
    for layer in range(L):
        d = direction(lm, layer)
        got = steered_logits(lm, ids, d, alpha)
        h = add_hook(blocks(lm.model, L)[layer], alpha * d.vector)
        try:
            with torch.no_grad():
                ref = lm.model(ids[None]).logits[0]
        finally:
            h.remove()
        assert_same_computation(got, ref, why=f"one addition of the same vector, by the engine or a plain hook "
                                f"({lm.name}, layer {layer})")
        with torch.no_grad():
            plain = lm.model(ids[None]).logits[0]
        assert float((got - plain).abs().max()) > 1e-3  # the vector changed something
    # several blocks at once: one hook per block
    d = direction(lm, 0)
    got = steered_logits(lm, ids, d, alpha, layers=list(range(L)))
    hs = [add_hook(b, alpha * d.vector) for b in blocks(lm.model, L)]
    try:
        with torch.no_grad():
            ref = lm.model(ids[None]).logits[0]
    finally:
        for h in hs:
            h.remove()
    assert_same_computation(got, ref, why="one addition of the same vector per block, by the engine or plain hooks")


def _brute_force(lm, ids, vec, layer, lo, hi, n):
    """Greedy decoding by re-running the model on the whole sequence at every step (no cache), the vector added at
    positions lo..hi-1 (clipped to the sequence) by a plain hook; returns the tokens and each step's logits."""
    seq = ids.tolist()
    logits = []
    block = blocks(lm.model, lm.anatomy.n_layers)[layer]
    for _ in range(n):
        h = add_hook(block, vec, lo, min(hi, len(seq)))
        try:
            with torch.no_grad():
                lg = lm.model(torch.tensor([seq]), use_cache=False).logits[0, -1]
        finally:
            h.remove()
        logits.append(lg)
        seq.append(int(lg.argmax()))
    return torch.tensor(seq), torch.stack(logits)


@pytest.mark.parametrize("where", ["all", "prompt", "generated"])
def test_steered_greedy_generation_is_a_brute_force_loop(tiny_decoder, where):
    lm = tiny_decoder
    ids = _ids(lm)
    P, n, layer, alpha = ids.numel(), 6, lm.anatomy.n_layers - 1, 1.5
    d = direction(lm, layer)
    edits = generation_edits(d, alpha, where=where)
    lo, hi = {"all": (0, P + n), "prompt": (0, P), "generated": (P, P + n)}[where]
    ref, ref_logits = _brute_force(lm, ids, alpha * d.vector, layer, lo, hi, n)
    full = decode(lm, ids, n, edits=edits)
    assert_same_ints(full, ref)
    # the generation's statistics come from a pass over the final sequence with the same edits
    g = generate(lm, ids, n, explain=(), edits=edits)
    assert g.ids.tolist() == ref.tolist()
    p = torch.softmax(ref_logits.double(), -1)
    assert torch.allclose(g.prob.double(), p[torch.arange(n), ref[P:]], atol=GEN_ATOL)
    assert g.settings["edits"] == 1
    # and the vector mattered: the unsteered continuation's logits differ
    _, plain = _brute_force(lm, ids, torch.zeros_like(d.vector), layer, 0, 0, n)
    assert float((plain - ref_logits).abs().max()) > 100 * GEN_ATOL


def test_cached_steps_see_the_edits_of_their_own_positions():
    """A head ablated while the model writes: the engine's edits of any site reach every decoding step."""
    from lenscope.models.runtime.engine import Edit

    lm = get_model("tiny:llama")
    ids = _ids(lm)
    P, n = ids.numel(), 5
    A = lm.anatomy.layers[0].attn
    rows = torch.zeros(P + n, dtype=torch.long)
    ablate = [Edit("head", 0, rows, torch.arange(P + n), torch.zeros(P + n, A.d_head), head=torch.zeros_like(rows))]
    full = decode(lm, ids, n, edits=ablate)
    seq = ids.tolist()
    for _ in range(n):  # brute force: zero head 0's slice of the output projection's input, no cache
        o_proj = family_for(lm.model).hooks(lm.model).layers[0].attn_out

        def zero(mod, args):
            x = args[0].clone()
            x[..., : A.d_head] = 0
            return (x,)

        h = o_proj.register_forward_pre_hook(zero)
        try:
            with torch.no_grad():
                seq.append(int(lm.model(torch.tensor([seq]), use_cache=False).logits[0, -1].argmax()))
        finally:
            h.remove()
    assert_same_ints(full, seq)


def test_explanations_are_refused_with_edits_and_no_edit_is_transformers():
    lm = get_model("tiny:gpt2")
    d = direction(lm)
    with pytest.raises(NotApplicableError, match="unedited model"):
        generate(lm, PROMPT, 3, explain=("logit",), edits=generation_edits(d, 2.0))
    ids = _ids(lm)
    plain = lm.model.generate(ids[None], attention_mask=torch.ones(1, ids.numel(), dtype=torch.long),
                              max_new_tokens=4, do_sample=False, pad_token_id=lm.tokenizer.pad_token_id)[0]
    assert_same_ints(decode(lm, ids, 4, edits=generation_edits(d, 0.0)), plain)  # alpha 0: no edit at all
    assert_same_ints(decode(lm, ids, 4, edits=[]), plain)


def test_steered_sampling_is_reproducible():
    lm = get_model("tiny:gpt2")
    d = direction(lm)
    e = generation_edits(d, 1.0)
    ids = _ids(lm)
    state = torch.random.get_rng_state()
    a = decode(lm, ids, 8, edits=e, sample=True, seed=3)
    assert_same_ints(torch.random.get_rng_state(), state)
    assert_same_ints(a, decode(lm, ids, 8, edits=e, sample=True, seed=3))
    others = [decode(lm, ids, 8, edits=e, sample=True, seed=s) for s in (4, 5, 6)]
    assert any(o.shape != a.shape or bool((o != a).any()) for o in others)
