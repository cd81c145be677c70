"""AtP*: the vectorised QK fix equals a brute-force recompute of the softmax per query / key position (every decoder
family), its linear version is the derivative of the fix, it is closer to exact q/k patching than the linear
estimate; value nodes are the derivative of the real model along the patch; GradDrop leaves the last layer alone
and a row without edits is plain AtP."""

import pytest
import torch

from lenscope.circuits import atp_star, attribution_patching, check_against_exact, exact_node_patching
from lenscope.circuits.atp_star import key_scores, query_scores
from lenscope.models.loading.load import encode, resolve_token
from lenscope.models.runtime.engine import capture

from ..conftest import get_model
from ..tolerances import assert_same_computation
from .test_atp import CLEAN, CORRUPT, FD_PAIR, FD_REL, _directional, _fd_floor


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
            # fd divides a difference of float32 probabilities by eps: each is rounded to within ~4u relative (u =
            # 2^-24; the score, exp, the row sum, the division), so fd carries up to 8u sum |g_A| A / eps of rounding
            # over what moves (a query's row; every row for a key) on any kernels. The forward difference's O(eps)
            # truncation (eps/2 times the second derivative) scales with the derivatives of the whole layer, not with
            # each entry: an entry near zero (OLMoE) keeps an error of the size of the largest, hence 3e-2 of it
            w = g_A.abs() * A
            rnd = 8 * 2.0**-24 / eps * float((w.sum((-1, -2)) if fn is key_scores else w.sum(-1)).max())
            torch.testing.assert_close(fd, lin, rtol=3e-2, atol=rnd + 3e-2 * float(lin.abs().max()))


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
    clean, corrupt, target, foil = FD_PAIR  # every token differs, so every position's values move
    res = atp_star(lm, clean, corrupt, target, foil, grad_drop=False)
    c, x = encode(lm, clean)[None], encode(lm, corrupt)[None]
    tid, fid = resolve_token(lm, target), resolve_token(lm, foil)
    L, P, G = res.values.shape
    for i in res.values.abs().flatten().argsort(descending=True)[:2].tolist():  # the two strongest value nodes
        layer, p, g = i // (P * G), i // G % P, i % G
        site = ("v", layer)
        d = capture(lm, x, [site])[site][0] - capture(lm, c, [site])[site][0]  # (pos, kv_head, d_head)
        delta = torch.zeros_like(d[:, g])
        delta[p] = d[p, g]
        fd, step = _directional(lm, c, site, delta, g, tid, fid)
        floor = _fd_floor(lm, c, step)
        got = float(res.values[layer, p, g])
        assert got == pytest.approx(fd, abs=floor, rel=FD_REL), (lm.name, layer, p, g, got, fd)
        assert abs(fd) > 10 * floor, (lm.name, layer, p, g, fd, floor)  # the value moves the metric


def _detached(mod, args, out):
    """A forward hook returning the module's output detached (a tuple's first element: GPT-OSS's MoE block returns
    ``(output, router scores)``)."""
    return (out[0].detach(), *out[1:]) if isinstance(out, tuple) else out.detach()


def _brute_grad_drop_terms(lm, clean, corrupt, target, foil):
    """Per-layer GradDrop terms by brute force: for each layer ``l`` a separate gradient pass of the real model in
    which torch hooks return layer ``l``'s attention and MLP outputs detached (the forward pass is unchanged, the
    gradient through that layer's residual contributions is dropped); ``AtP_l(n)`` is then the corrupted-minus-clean
    activation of node ``n`` dotted with that gradient. Returns ``{kind: (1 + L, ...)}`` (row 0: nothing dropped,
    row ``1 + l``: layer ``l`` dropped; NaN where ``l`` is the node's own layer, whose output this run detaches)
    and the same shapes holding ``sum (|clean| + |corrupted|) |grad|``, the scale of each term's float32 rounding
    (the activations round relative to their own size, and their difference can be much smaller)."""
    from lenscope.interventions.patching import metric_of
    from lenscope.models.families import family_for
    from lenscope.models.runtime.engine import run

    L = lm.anatomy.n_layers
    c, x = encode(lm, clean)[None], encode(lm, corrupt)[None]
    tid, fid = resolve_token(lm, target), resolve_token(lm, foil)
    hooks = family_for(lm.model).hooks(lm.model)
    all_sites = [("resid_pre", 0)] + [(k, layer) for layer in range(L) for k in ("head", "mlp_out")]
    cc, cx = capture(lm, c, all_sites), capture(lm, x, all_sites)
    terms = {"embed": torch.zeros(1 + L, dtype=torch.float64),
             "heads": torch.full((1 + L, L, lm.anatomy.layers[0].attn.n_heads), float("nan"), dtype=torch.float64),
             "mlps": torch.full((1 + L, L), float("nan"), dtype=torch.float64)}
    scale = {k: torch.zeros_like(v) for k, v in terms.items()}
    for row, drop in enumerate([None, *range(L)]):
        # the dropped layer's own sites are left out: the engine would make a captured output a leaf again
        sites = [s for s in all_sites if s[1] != drop or s[0] == "resid_pre"]
        handles = []
        if drop is not None:
            for mod in (hooks.layers[drop].attn_out, hooks.layers[drop].mlp_out):
                handles.append(mod.register_forward_hook(_detached))
        try:
            lg, cap = run(lm, c, capture=sites, grad=True, last_only=True)
            m = metric_of(lg[:, -1], "logit_diff", tid, fid).sum()
            grads = torch.autograd.grad(m, [cap[s] for s in sites], allow_unused=True)
        finally:
            for h in handles:
                h.remove()
        for site, g in zip(sites, grads):
            g = torch.zeros_like(cap[site]) if g is None else g
            prod = ((cx[site] - cc[site]) * g)[0].double()
            size = ((cx[site].abs() + cc[site].abs()) * g.abs())[0].double()
            name, layer = site
            if name == "resid_pre":
                terms["embed"][row], scale["embed"][row] = prod.sum(), size.sum()
            elif name == "head":  # (pos, head, d_head)
                terms["heads"][row, layer], scale["heads"][row, layer] = prod.sum((0, 2)), size.sum((0, 2))
            else:
                terms["mlps"][row, layer], scale["mlps"][row, layer] = prod.sum(), size.sum()
    return terms, scale


def test_grad_drop_equals_a_brute_force_of_its_definition(tiny_decoder, monkeypatch):
    """GradDrop (Kramar et al. 2024): ``AtP_l(n)`` is AtP with the gradient through layer ``l``'s residual
    contributions dropped; AtP* scores ``sign(AtP(n)) * mean over l != layer(n) of |AtP_l(n)|`` (the embedding:
    over every layer). Each per-layer term of every head, MLP and the embedding equals a separate gradient pass with
    layer ``l``'s outputs detached by torch hooks on the model's modules (not the engine edits atp_star uses), and
    the final score equals that combination of the brute-force terms. Both fixes off is plain AtP."""
    import importlib

    star = importlib.import_module("lenscope.circuits.atp_star")  # the module (the package exports the function)
    lm = tiny_decoder
    L = lm.anatomy.n_layers
    atp = attribution_patching(lm, CLEAN, CORRUPT, " capital", " of")
    plain = atp_star(lm, CLEAN, CORRUPT, " capital", " of", grad_drop=False, qk_fix=False, batch_size=2)
    torch.testing.assert_close(plain.heads, atp.heads, rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(plain.mlps, atp.mlps, rtol=1e-5, atol=1e-8)
    assert plain.embed == pytest.approx(atp.embed, rel=1e-5)
    seen = {}
    real = star._grad_drop

    def spy(rows, L_):
        seen.update({k: v[0].clone() for k, v in rows.items()})  # one prompt: (1 + L, ...)
        return real(rows, L_)

    monkeypatch.setattr(star, "_grad_drop", spy)
    gd = atp_star(lm, CLEAN, CORRUPT, " capital", " of", qk_fix=False, batch_size=2)
    assert gd.method == "atp-star" and gd.info == {"grad_drop": True, "qk_fix": False}
    want, scale = _brute_grad_drop_terms(lm, CLEAN, CORRUPT, " capital", " of")
    # float32 activations and gradients of two differently batched passes: a term rounds by a few eps32 of
    # sum (|clean| + |corrupted|) |grad| (measured: below 0.5 eps32 of it on every tiny family)
    eps = torch.finfo(torch.float32).eps
    tol = {kind: 8 * eps * v + 1e-15 for kind, v in scale.items()}
    for kind in ("embed", "heads", "mlps"):
        ok = ~want[kind].isnan()
        err = (seen[kind][ok] - want[kind][ok]).abs()
        assert bool((err <= tol[kind][ok]).all()), (lm.name, kind, float((err / tol[kind][ok]).max()))
    # the drops matter: a first-layer head's term moves by far more than that tolerance when a later layer drops
    moved = (want["heads"][2:, 0] - want["heads"][:1, 0]).abs() / tol["heads"][2:, 0]
    assert float(moved.max()) > 100, lm.name
    # the score from the brute-force terms: sign(AtP) * the mean of |AtP_l| over the other layers
    layer_of = torch.arange(L)
    for kind in ("heads", "mlps"):
        mag = torch.stack([want[kind][1:][layer_of != m, m].abs().mean(0) for m in range(L)])
        ref = torch.sign(want[kind][0]) * mag
        err = (getattr(gd, kind).double() - ref).abs()
        bound = tol[kind][1:].nan_to_num().amax(0)  # a mean errs by at most its largest term's tolerance
        assert bool((err <= bound).all()), (lm.name, kind, float((err / bound).max()))
    emb = float(torch.sign(want["embed"][0]) * want["embed"][1:].abs().mean())
    assert gd.embed == pytest.approx(emb, abs=float(tol["embed"].max()))
    # a last-layer node has no later layer to drop: its score is plain AtP
    torch.testing.assert_close(gd.heads[-1], plain.heads[-1], rtol=1e-4, atol=1e-7)


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
    assert_same_computation(back.keys, two.keys, why="saved and read back")
    assert back.heads_pos is None and back.n == 2
    mixed = atp_star(lm, [CLEAN, "When Mary and John went to the store, John gave a drink to"],
                     [CORRUPT, "When Mary and John went to the store, Mary gave a drink to"], " capital", " of")
    assert mixed.queries is None and mixed.keys is None and mixed.heads.shape == two.heads.shape
