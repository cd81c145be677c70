"""verify: lenscope's recomputation matches the real model on every family and every embedded model."""

import pytest
import torch

import lenscope
from lenscope.models.runtime.verify import LOGIT_TOL, RESID_TOL
from tests.tolerances import assert_same_computation


def test_verify_every_tiny_family(tiny):
    rep = lenscope.verify(tiny)
    assert rep.ok, rep.to_frame()
    assert rep.max_abs_logit_error is not None and rep.max_abs_logit_error <= LOGIT_TOL
    assert rep.max_rel_resid_error <= RESID_TOL
    assert len(rep.layers) == tiny.anatomy.n_layers


def test_verify_catches_a_wrong_weight(tiny):
    """verify must fail when the Anatomy disagrees with the model (here: a perturbed MLP weight; a mixture of
    experts: every expert's)."""
    mlp = tiny.anatomy.layers[0].mlp
    owner = getattr(mlp, "experts", mlp)  # an MoE block keeps its experts' stacked weights in an MLP
    W = owner.W_out
    saved = W.clone()
    try:
        W.add_(0.05 * torch.randn_like(W))  # the Anatomy views the model's weights: perturb the model itself
        tr = lenscope.trace(tiny, "The capital of France is Paris.")
        owner.W_out = saved  # ... while lenscope's reading keeps the old weight
        rep = lenscope.verify(tiny, tr=tr)
        assert not rep.ok
        assert rep.layers[0]["mlp_out"] > RESID_TOL
    finally:
        W.copy_(saved)
        owner.W_out = W


def test_trace_shapes_and_chain(tiny):
    tr = lenscope.trace(tiny, "When Mary and John went to the store")
    A = tiny.anatomy
    L, P = A.n_layers, len(tr.tokens)
    assert tr.resid_pre.shape == (L, P, A.d_model)
    assert tr.pattern.shape == (L, A.layers[0].attn.n_heads, P, P)
    sums = tr.pattern.sum(-1)
    if A.layers[0].attn.sinks is None:
        assert torch.allclose(sums, torch.ones(L, A.layers[0].attn.n_heads, P), atol=1e-5)
    else:  # attention sinks take their share of each row: the weights over the tokens sum to less than one
        assert float(sums.max()) < 1 - 1e-3 and float(sums.min()) > 0
    if A.causal:  # nothing attends to the future
        assert float(tr.pattern.triu(1).abs().max()) == 0.0
    # each block's output is the next block's input
    assert_same_computation(tr.resid_post[:-1], tr.resid_pre[1:],
                            why="each block's output is the next one's input, copied")


def test_gemma_sliding_window_is_exercised():
    from tests.conftest import get_model

    lm = get_model("tiny:gemma3")
    windows = [layer.attn.window for layer in lm.anatomy.layers]
    assert windows[0] == 4 and windows[-1] is None
    tr = lenscope.trace(lm, "The capital of France is Paris and the capital of Italy is Rome")
    P = len(tr.tokens)
    assert P > 6
    i, j = torch.meshgrid(torch.arange(P), torch.arange(P), indexing="ij")
    assert float(tr.pattern[0][:, (i - j) >= 4].abs().max()) == 0.0  # local layer: outside window is 0
    assert float(tr.pattern[-1][:, (i - j) >= 4].abs().max()) > 0.0  # global layer sees further


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2", "gemma3-270m", "minilm"])
def test_verify_embedded_models(name):
    from tests.conftest import get_model

    lm = get_model(name)
    rep = lenscope.verify(lm)
    assert rep.ok, rep.to_frame()
    if name == "minilm":
        assert rep.max_abs_logit_error is None  # a BertModel without a masked-LM head
    else:
        assert rep.max_abs_logit_error <= LOGIT_TOL
    assert rep.n_layers == {"smollm2": 30, "gemma3-270m": 18, "minilm": 6}[name]
