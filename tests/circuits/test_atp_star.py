"""AtP*: the vectorised QK fix equals a brute-force recompute of the softmax per query / key position (every decoder
family), its linear version is the derivative of the fix, it is closer to exact q/k patching than the linear
estimate; value nodes are the derivative of the real model along the patch; GradDrop leaves the last layer alone
and a row without edits is plain AtP."""

import pytest
import torch

from lenscope.circuits import atp_star, attribution_patching, check_against_exact, exact_node_patching
from lenscope.circuits.atp_star import key_scores, query_scores
from lenscope.models.engine import capture
from lenscope.models.load import encode, resolve_token

from ..conftest import get_model
from .test_atp import CLEAN, CORRUPT, _directional


def _qk(lm, layer):
    attn = lm.anatomy.layers[layer].attn
    sites = [("ln_attn.out", layer)]
    xc = capture(lm, encode(lm, CLEAN)[None], sites)[sites[0]][0]
    xx = capture(lm, encode(lm, CORRUPT)[None], sites)[sites[0]][0]
    P = xc.shape[0]
    q, k = attn.queries_keys(xc.float(), torch.arange(P))
    q_x, k_x = attn.queries_keys(xx.float(), torch.arange(P))
    return attn, q, k, q_x, k_x, torch.arange(P)


def test_qk_fix_equals_brute_force(tiny_decoder):
    lm = tiny_decoder
    for layer in (0, lm.anatomy.n_layers - 1):
        attn, q, k, q_x, k_x, pos = _qk(lm, layer)
        H, P = q.shape[0], q.shape[1]
        g_A = torch.randn(H, P, P, generator=torch.Generator().manual_seed(layer), dtype=torch.float64)
        A = attn.probs(q, k, pos).double()
        want_k = torch.zeros(H, P, dtype=torch.float64)
        want_q = torch.zeros(H, P, dtype=torch.float64)
        for s in range(P):
            kp, qp = k.clone(), q.clone()
            kp[:, s], qp[:, s] = k_x[:, s], q_x[:, s]
            want_k[:, s] = (g_A * (attn.probs(q, kp, pos).double() - A)).sum((-1, -2))
            want_q[:, s] = (g_A[:, s] * (attn.probs(qp, k, pos).double()[:, s] - A[:, s])).sum(-1)
        got_k = key_scores(attn, q, k, k_x, g_A, pos)
        torch.testing.assert_close(got_k, want_k, rtol=1e-4, atol=1e-4 * float(want_k.abs().max()) + 1e-6)
        torch.testing.assert_close(query_scores(attn, q, k, q_x, g_A, pos), want_q, rtol=1e-4, atol=1e-6)
        assert float(want_k.abs().max()) > 1e-4, lm.name  # the keys do move the pattern
        if attn.softcap is not None:
            # soft-capped scores (Gemma 2) are not linear in q or k: the linear version takes the exact change of
            # the scores (atp_star's docstring), which is not their derivative along the corrupted key / query
            continue
        # the linear version is the derivative of the fix along the corrupted key / query
        eps = 1e-2  # float32 probs: smaller steps drown in rounding
        for fn, a, b in ((key_scores, k, k_x), (query_scores, q, q_x)):
            args = (q, a, a + eps * (b - a)) if fn is key_scores else (a, k, a + eps * (b - a))
            fd = fn(attn, *args, g_A, pos) / eps
            lin = fn(attn, *((q, a, b) if fn is key_scores else (a, k, b)), g_A, pos, linear=True)
            torch.testing.assert_close(fd, lin, rtol=3e-2, atol=3e-2 * float(lin.abs().max()) + 1e-9)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_qk_fix_is_closer_to_exact_than_linear_atp(family):
    """On these tiny models (the prompt pair of test_atp), QK-fixed q/k nodes have at most 3/4 of the linear
    estimate's mean absolute error against exact q/k patching (measured: llama 0.10x (q) and 0.12x (k), gemma3
    0.50x and 0.50x)."""
    lm = get_model(f"tiny:{family}")
    ex = exact_node_patching(lm, CLEAN, CORRUPT, " capital", " of", qkv=True, batch_size=64)
    fix = atp_star(lm, CLEAN, CORRUPT, " capital", " of", grad_drop=False)
    lin = atp_star(lm, CLEAN, CORRUPT, " capital", " of", grad_drop=False, qk_fix=False)
    for only in (".q@", ".k@"):
        e_fix = check_against_exact(fix, ex, fine=True, only=only)["mae"]
        e_lin = check_against_exact(lin, ex, fine=True, only=only)["mae"]
        assert e_fix <= 0.75 * e_lin, (family, only, e_fix, e_lin)
    # values are AtP either way
    torch.testing.assert_close(fix.values, lin.values)


def test_value_nodes_are_the_derivative_along_the_patch(tiny_decoder):
    lm = tiny_decoder
    res = atp_star(lm, CLEAN, CORRUPT, " capital", " of", grad_drop=False)
    c, x = encode(lm, CLEAN)[None], encode(lm, CORRUPT)[None]
    P = c.shape[1]
    tid, fid = resolve_token(lm, " capital"), resolve_token(lm, " of")
    site = ("v", 0)
    d = capture(lm, x, [site])[site][0] - capture(lm, c, [site])[site][0]  # (pos, kv_head, d_head)
    for p in (1, P - 2):
        delta = torch.zeros_like(d[:, 0])
        delta[p] = d[p, 0]
        fd = _directional(lm, c, site, delta, 0, tid, fid)
        assert float(res.values[0, p, 0]) == pytest.approx(fd, abs=2e-3, rel=5e-2), (lm.name, p)


def test_grad_drop(tiny_decoder):
    """Both fixes off is plain AtP; with GradDrop a last-layer node keeps its AtP score (no later layer to drop),
    earlier nodes keep AtP's sign and change magnitude."""
    lm = tiny_decoder
    atp = attribution_patching(lm, CLEAN, CORRUPT, " capital", " of")
    plain = atp_star(lm, CLEAN, CORRUPT, " capital", " of", grad_drop=False, qk_fix=False, batch_size=2)
    torch.testing.assert_close(plain.heads, atp.heads, rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(plain.mlps, atp.mlps, rtol=1e-5, atol=1e-8)
    assert plain.embed == pytest.approx(atp.embed, rel=1e-5)
    gd = atp_star(lm, CLEAN, CORRUPT, " capital", " of", qk_fix=False, batch_size=2)
    assert gd.method == "atp-star" and gd.info == {"grad_drop": True, "qk_fix": False}
    for kind in ("heads", "mlps", "queries", "keys", "values"):
        torch.testing.assert_close(getattr(gd, kind)[-1], getattr(plain, kind)[-1], rtol=1e-4, atol=1e-7)
    early = torch.cat([gd.heads[:-1].flatten(), gd.mlps[:-1].flatten()])
    base = torch.cat([plain.heads[:-1].flatten(), plain.mlps[:-1].flatten()])
    # AtP's sign, or 0: e.g. an MLP whose patch changes only a position the last one reads through later layers
    assert bool(((torch.sign(early) == torch.sign(base)) | (early == 0)).all())
    assert float((early.abs() - base.abs()).abs().max()) > 1e-4 * float(base.abs().max())
    assert gd.embed != pytest.approx(plain.embed, rel=1e-3) and gd.embed * plain.embed > 0


def test_atp_star_prompts_and_result(tmp_path):
    from lenscope.circuits import NodeAttribution

    lm = get_model("tiny:llama")
    two = atp_star(lm, [CLEAN, "The capital of Spain is"], [CORRUPT, "The capital in Spain is"], " capital", " of")
    ones = [atp_star(lm, c, x, " capital", " of") for c, x in ((CLEAN, CORRUPT),
                                                                ("The capital of Spain is", "The capital in Spain is"))]
    for kind in ("heads", "queries", "keys", "values"):
        torch.testing.assert_close(getattr(two, kind), (getattr(ones[0], kind) + getattr(ones[1], kind)) / 2,
                                   rtol=1e-4, atol=1e-8)
    names = {n["name"] for n in two.nodes(fine=True)}
    assert {"L0H1.q@2", "L1KV0.k@0", "L1KV0.v@3", "L1H0"} <= names
    back = NodeAttribution.load(two.save(tmp_path / "star.safetensors"))
    assert torch.equal(back.keys, two.keys) and back.heads_pos is None and back.n == 2
    mixed = atp_star(lm, [CLEAN, "When Mary and John went to the store, John gave a drink to"],
                     [CORRUPT, "When Mary and John went to the store, Mary gave a drink to"], " capital", " of")
    assert mixed.queries is None and mixed.keys is None and mixed.heads.shape == two.heads.shape
