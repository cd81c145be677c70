"""The kernels that the tuned lens's objective and causal basis extraction build on the readout, against brute
force: the fused log-partition and the KL terms (lenses/training/objective.py), the factored logits of a rank-one
edit of the state and their gradient (lenses/influence.py)."""

import dataclasses

import pytest
import torch

import lenscope
from lenscope.lenses.influence import AblatedLogPartition, factored_base
from lenscope.lenses.training.objective import kl_terms, log_partition
from lenscope.models.weights.readout import Readout
from tests.conftest import get_model

TEXT = "When Mary and John went to the store, John gave a drink to"


def test_log_partition_and_kl_terms():
    lm = get_model("tiny:gpt2")
    A = lm.anatomy
    b_U = torch.randn(A.vocab_size, generator=torch.Generator().manual_seed(4))  # gpt2 has none: exercise one
    ro = Readout(A.final_norm, dataclasses.replace(A.unembed, b_U=b_U))
    tr = lenscope.trace(lm, TEXT)
    x = ro.features(tr.resid_pre[1].float())  # (pos, d_model)
    z = x @ ro.W_U.float() + ro.b_U.float()
    want = torch.logsumexp(z, -1)
    W32 = ro.unembedding(torch.float32)
    assert torch.allclose(log_partition(ro, x, W32), want, atol=1e-5)
    assert torch.allclose(log_partition(ro, x, W32, tr.logits.argmax(-1)), want, atol=1e-4)
    assert torch.allclose(log_partition(ro, x[None], W32, z.argmin(-1)[None])[0], want, atol=1e-3)
    Wb = ro.unembedding(torch.bfloat16)
    assert Wb.dtype == torch.bfloat16 and Wb.is_contiguous() and ro.unembedding(torch.bfloat16) is Wb
    assert torch.allclose(log_partition(ro, x, Wb), want, atol=0.05 * float(want.abs().max()))
    # KL(p || softmax z) = c - x . pbar + lse(z)
    final = tr.logits.float()
    c, pbar = kl_terms(ro, final)
    logp = torch.log_softmax(final, -1)
    kl = (logp.exp() * (logp - torch.log_softmax(z, -1))).sum(-1)
    assert torch.allclose(c - (x * pbar).sum(-1) + want, kl, atol=1e-4)
    # the gradient of the fused path is softmax(z) W^T
    xx = x.clone().requires_grad_(True)
    log_partition(ro, xx, W32, tr.logits.argmax(-1)).sum().backward()
    assert torch.allclose(xx.grad, torch.softmax(z, -1) @ ro.W_U.float().T, atol=1e-5)


def test_factored_logits_of_a_rank_one_edit_match_brute_force():
    lm = get_model("tiny:opt")
    ro = Readout.from_anatomy(lm.anatomy)
    g = torch.Generator().manual_seed(3)
    N, d = 40, lm.anatomy.d_model
    X = torch.randn(N, d, generator=g) * 2
    xc = ro.center(X)
    var = ro.variance(xc)
    s0 = torch.rsqrt(var).float()
    assert torch.allclose(s0, ro.scale(X), rtol=1e-5)
    W, zb = ro.W_U.float(), ro.bias_logits()
    base = factored_base(ro, xc, s0, W, zb, rows=7, big=16)
    logits = ro.logits(X)
    assert torch.allclose(base["R"] + zb, logits, atol=1e-4)
    assert torch.allclose(base["lse0"], torch.logsumexp(logits, -1), atol=1e-4)
    assert float(base["lseb"].abs().max()) < 1e-5
    p = torch.softmax(logits, -1)
    assert torch.allclose(base["Pw"], p @ W.T, atol=1e-4)
    # an edit: new scale (1 + r) and a rank-one move a u
    r = (torch.rand(N, generator=g) - 0.5) * 0.2
    a = torch.randn(N, generator=g)
    u = torch.randn(W.shape[1], generator=g) * 0.1
    rr, aa, uu = (t.clone().requires_grad_(True) for t in (r, a, u))
    got = AblatedLogPartition.apply(rr, aa, uu, base["R"], base["lse0"], zb, 7, True)
    r64, a64, u64 = (t.double().requires_grad_(True) for t in (r, a, u))
    zp = (1 + r64)[:, None] * base["R"].double() + zb.double() - a64[:, None] * u64
    want = (torch.logsumexp(zp, -1) - base["lse0"].double()).sum()
    assert float(got.detach()) == pytest.approx(float(want.detach()), abs=1e-4)
    got.backward()
    want.backward()
    for mine, ref in ((rr, r64), (aa, a64), (uu, u64)):
        assert torch.allclose(mine.grad.double(), ref.grad, atol=1e-4 * float(ref.grad.abs().max()) + 1e-6)
