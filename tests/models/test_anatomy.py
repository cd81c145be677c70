"""lenscope's own math against hand computations and torch's reference ops."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lenscope.models.weights.anatomy import MLP, Attention, Norm, Rotary, alibi_slopes


def test_layernorm_matches_torch():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 16, generator=g) * 3 + 1
    w, b = torch.randn(16, generator=g), torch.randn(16, generator=g)
    n = Norm("layernorm", w, b, 1e-5)
    assert torch.allclose(n(x), torch.nn.functional.layer_norm(x, (16,), w, b, 1e-5), atol=1e-6)
    # affine given the scale: linear part + bias reproduces the norm, and is linear in x
    s = n.scale(x)
    assert torch.allclose(n.linear(x, s) + b, n(x), atol=1e-6)
    y = torch.randn(5, 16, generator=g)
    assert torch.allclose(n.linear(x + y, s), n.linear(x, s) + n.linear(y, s), atol=1e-5)


def test_rmsnorm_by_hand():
    x = torch.tensor([[3.0, 4.0]])
    n = Norm("rmsnorm", torch.tensor([1.0, 2.0]), None, 0.0)
    # rms = sqrt((9 + 16) / 2) = sqrt(12.5)
    r = math.sqrt(12.5)
    assert torch.allclose(n(x), torch.tensor([[3 / r, 8 / r]]))


def test_alibi_slopes_known_values():
    # Press et al.: for 8 heads the slopes are 1/2, 1/4, ..., 1/256
    assert torch.allclose(alibi_slopes(8), torch.tensor([2.0 ** -(i + 1) for i in range(8)]))
    # non power of two: the 4 slopes of 4 heads, then odd powers of the 8-head base
    s6 = alibi_slopes(6)
    assert torch.allclose(s6[:4], torch.tensor([2.0 ** (-2 * (i + 1)) for i in range(4)]))
    assert torch.allclose(s6[4:], torch.tensor([2.0 ** -1, 2.0 ** -3]))


def test_rotary_rotates_pairs_by_position_times_frequency():
    rot = Rotary(inv_freq=torch.tensor([0.5]), dim=2)
    x = torch.tensor([[[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]]])  # (head=1, pos=3, d_head=2)
    out = rot.apply(x, torch.arange(3))
    # position p rotates (a, b) by angle 0.5 p: (a cos - b sin, b cos + a sin)
    for p in range(3):
        a, b = x[0, p]
        c, s = math.cos(0.5 * p), math.sin(0.5 * p)
        assert torch.allclose(out[0, p], torch.tensor([a * c - b * s, b * c + a * s]), atol=1e-6)


def _brute_attention(attn: Attention, x: torch.Tensor) -> torch.Tensor:
    """Loop-over-everything attention, straight from the equations (no rotary)."""
    P = x.shape[0]
    out = torch.zeros_like(x)
    g = attn.n_heads // attn.n_kv_heads
    for h in range(attn.n_heads):
        kv = h // g
        for i in range(P):
            scores = []
            for j in range(P):
                q = x[i] @ attn.W_Q[h] + attn.b_Q[h]
                k = x[j] @ attn.W_K[kv] + attn.b_K[kv]
                sc = float(q @ k) * attn.scale
                if attn.alibi is not None:
                    sc += float(attn.alibi[h]) * (j - i)
                if attn.causal:
                    ok = j <= i and (attn.window is None or i - j < attn.window)
                else:
                    ok = attn.window is None or abs(i - j) <= attn.window
                scores.append(sc if ok else -math.inf)
            p = torch.softmax(torch.tensor(scores), 0)
            z = sum(p[j] * (x[j] @ attn.W_V[kv] + attn.b_V[kv]) for j in range(P))
            out[i] += z @ attn.W_O[h]
    return out + attn.b_O


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), P=st.integers(1, 6), kv=st.sampled_from([1, 2]), causal=st.booleans(),
       window=st.sampled_from([None, 1, 2, 3]), alibi=st.booleans())
def test_attention_matches_brute_force(seed, P, kv, causal, window, alibi):
    g = torch.Generator().manual_seed(seed)
    H, d, e = 4, 8, 3
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    attn = Attention(W_Q=r(H, d, e), W_K=r(kv, d, e), W_V=r(kv, d, e), W_O=r(H, e, d), b_Q=r(H, e), b_K=r(kv, e),
                     b_V=r(kv, e), b_O=r(d), scale=0.3, causal=causal, window=window,
                     alibi=alibi_slopes(H) if alibi else None)
    x = r(P, d)
    out, probs = attn(x, torch.arange(P))
    assert torch.allclose(out, _brute_attention(attn, x), atol=1e-4)
    assert torch.allclose(probs.sum(-1), torch.ones(H, P), atol=1e-6)
    # heads plus output bias add up to the output
    assert torch.allclose(attn.head_outputs(probs, x).sum(0) + attn.b_O, out, atol=1e-4)


def test_gated_mlp_by_hand():
    mlp = MLP(W_in=torch.tensor([[2.0]]), b_in=None, W_out=torch.tensor([[3.0]]), b_out=torch.tensor([1.0]),
              act="relu", W_gate=torch.tensor([[1.0]]), b_gate=torch.tensor([-1.0]))
    # x = 2: gate relu(2 - 1) = 1, up 4, out 3 * 4 + 1 = 13 ; x = 0.5: gate relu(-0.5) = 0 -> out 1
    assert torch.allclose(mlp(torch.tensor([[2.0], [0.5]])), torch.tensor([[13.0], [1.0]]))


@pytest.mark.parametrize("name", ["gelu", "gelu_tanh", "relu", "silu"])
def test_activations_match_torch(name):
    from lenscope.models.weights.anatomy import ACTIVATIONS

    x = torch.linspace(-4, 4, 101)
    ref = {"gelu": torch.nn.functional.gelu(x), "gelu_tanh": torch.nn.functional.gelu(x, approximate="tanh"),
           "relu": torch.relu(x), "silu": torch.nn.functional.silu(x)}[name]
    assert torch.allclose(ACTIVATIONS[name](x), ref, atol=1e-6)


def test_split_attention_equals_the_real_heads_and_reads_each_input(tiny_decoder):
    """``Attention.split`` with every head reading the block's normed input is the real model's per-head output
    (engine ``head`` site), batched; changing one head's key input changes that head alone."""
    from lenscope.models.runtime.engine import capture
    from lenscope.models.runtime.verify import TOLERANCE

    lm = tiny_decoder
    A = lm.anatomy
    ids = torch.tensor([[3, 7, 1, 9, 4, 2], [5, 5, 8, 1, 0, 6]])
    cap = capture(lm, ids, [("resid_pre", 1), ("head", 1)])
    layer = A.layers[1]
    x = cap["resid_pre", 1] if layer.placement == "post" else layer.ln_attn(cap["resid_pre", 1])
    H = layer.attn.n_heads
    per = x[:, :, None, :].expand(-1, -1, H, -1)
    pos = torch.arange(ids.shape[1])
    z = layer.attn.split(per, per, per, pos)  # (b, head, pos, d_head)
    real = cap["head", 1].permute(0, 2, 1, 3)
    assert (z - real).abs().max() <= TOLERANCE * max(1.0, real.abs().max())
    xk = per.clone()
    xk[:, :, 0] = xk[:, :, 0] + torch.randn_like(xk[:, :, 0])
    z2 = layer.attn.split(per, xk, per, pos)
    changed = (z2 - z).abs().amax(dim=(0, 2, 3))
    assert changed[0] > 1e-4 and changed[1:].max() < 1e-6
