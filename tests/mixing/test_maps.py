"""Norm-based context-mixing maps (Kobayashi et al. 2020, 2021, 2024).

Every scope is checked against loops over positions, sources and heads written here from the papers'
equations (nothing from ``lenscope.mixing``); the feed-forward split against numeric integrated gradients
by autograd through the real model's activation module and against exact Shapley values; completeness
against the activations captured by ``lenscope.trace``.
"""

import dataclasses
import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lenscope
from lenscope.errors import InvariantError
from lenscope.mixing import maps as maps_module
from lenscope.mixing.maps import MixingMaps, context_mixing, layer_decompositions
from lenscope.models.families import family_for

from ..conftest import DECODERS, ENCODERS, get_model, tiny_with_layers
from ..tolerances import U32, assert_same_computation

TEXT = "The capital of France is"
PRE = ("attention", "attn_2020", "attn", "atb", "atbln", "atblnff", "atblnffres", "atblnffres_nextln")
POST = ("attention", "attn_2020", "attn", "atb", "atbff", "atbffres", "atbffresln")
IG_STEPS = 2000


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models are dominated by per-op overhead; several torch threads on a shared 2-core machine spin
    against other processes. Restored after this module."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# --------------------------------------------------------------------------------------------------
# what each scope must add up to, read from the trace


def real_of(A, tr, l, scope):
    """The real activation of ``scope`` at layer ``l`` (pos, d_model), from the captured forward pass."""
    if scope in ("attn_2020", "attn"):
        return tr.attn_out[l]
    if scope == "atb":
        return tr.resid_mid[l]
    if A.placement == "post":
        return {"atbff": tr.mlp_out[l], "atbffres": tr.resid_mid[l] + tr.mlp_out[l],
                "atbffresln": tr.resid_post[l]}[scope]
    if scope == "atbln":
        return tr.mlp_in[l]
    if scope == "atblnff":
        return tr.mlp_write[l]
    if scope == "atblnffres":
        return tr.resid_post[l]
    assert scope == "atblnffres_nextln"
    return tr.site("ln_attn.out", l + 1) if l + 1 < A.n_layers else tr.site("ln_final.out")


def rel_gap(total, real):
    real = real.double()
    return float((total.double() - real).abs().max() / real.pow(2).mean().sqrt())


# --------------------------------------------------------------------------------------------------
# brute force, straight from the equations: loops over positions i, sources j and heads h


def lin(norm, v, real_in):
    """A norm without its bias applied to ``v``, at the scale of the norm's real input ``real_in``."""
    x, v = real_in.double(), v.double()
    if norm.kind == "identity":  # a norm slot the block does not have (OLMo 2's pre-norms)
        return v
    if norm.kind == "layernorm":
        c, s = v - v.mean(), torch.sqrt(((x - x.mean()) ** 2).mean() + norm.eps)
    else:
        c, s = v, torch.sqrt((x ** 2).mean() + norm.eps)
    out = c / s
    return out * norm.weight.double() if norm.weight is not None else out


def activation_module(lm, l):
    """The real model's own activation module of layer ``l`` (transformers' math, not lenscope's; a mixture of
    experts: its experts module's activation)."""
    hooks = family_for(lm.model).hooks(lm.model).layers[l]
    return hooks.act if hooks.experts is None else hooks.experts.act_fn


def unit_function(lm, l):
    """The real model's hidden unit of layer ``l`` as a function of (gate, up) pre-activations (up None: not
    gated): ``act(g) * u``, or GPT-OSS's clamped unit through its experts module's own ``_apply_gate``, which
    reads gate and up interleaved."""
    ex = family_for(lm.model).hooks(lm.model).layers[l].experts
    if ex is not None and not hasattr(ex, "act_fn"):
        return lambda g, u: ex._apply_gate(torch.stack([g, u], -1).flatten(-2))
    act = activation_module(lm, l)
    return lambda g, u: act(g) if u is None else act(g) * u


def brute_ig(lm, l, players_in, steps=IG_STEPS, mlp=None):
    """Integrated gradients of the MLP's hidden units among ``players_in (player, d_model)`` (the last player
    also receives the MLP's input biases), zero baseline, straight path, midpoint rule with ``steps`` points,
    gradients by autograd through the model's activation module. Returns (player, unit) and the real hidden
    activation of the summed input. ``mlp``: one expert of a mixture of experts (default: the layer's MLP)."""
    mlp = lm.anatomy.layers[l].mlp if mlp is None else mlp
    unit = unit_function(lm, l)

    def pre(W, b):
        p = players_in.double() @ W.double()
        if b is not None:
            p[-1] += b.double()
        return p

    gated = mlp.W_gate is not None
    G = pre(mlp.W_gate, mlp.b_gate) if gated else pre(mlp.W_in, mlp.b_in)
    U = pre(mlp.W_in, mlp.b_in) if gated else None
    ig = torch.zeros_like(G)
    # GPT-OSS clamps gate and up at the config's swiglu_limit: the unit has a kink where a * G or |a * U| reaches
    # it, so each unit's path is split there and the midpoint rule runs on every smooth piece
    limit = getattr(lm.model.config, "swiglu_limit", None)
    ends = [torch.ones(G.shape[1], dtype=torch.float64)]
    if limit is not None and gated:
        Gs, Us = G.sum(0), U.sum(0)
        ends += [torch.where(Gs > limit, limit / Gs, 1.0).clamp(max=1), (limit / Us.abs()).clamp(max=1)]
    ends = torch.stack(ends).sort(0).values  # (piece, unit): where each piece of the path ends
    starts = torch.cat([torch.zeros_like(ends[:1]), ends[:-1]])
    for a0, a1 in zip(starts, ends):
        for start in range(0, steps, 250):  # blocks of path points keep memory small on real models
            t = (torch.arange(start, min(steps, start + 250), dtype=torch.float64) + 0.5) / steps
            a = (a0 + t[:, None] * (a1 - a0))[:, None, :]  # (point, 1, unit)
            with torch.enable_grad():
                g = (a * G).requires_grad_(True)
                leaves = [g]
                if gated:
                    u = (a * U).requires_grad_(True)
                    leaves.append(u)
                h = unit(g.sum(1), u.sum(1) if gated else None)
                grads = torch.autograd.grad(h.sum(), leaves)
            ig += (grads[0] * G).sum(0) * (a1 - a0) / steps
            if gated:
                ig += (grads[1] * U).sum(0) * (a1 - a0) / steps
    with torch.no_grad():
        hidden = unit(G.sum(0), U.sum(0) if gated else None)
    return ig, hidden, G, U


def brute_parts(lm, tr, l, steps=IG_STEPS, ff_rows=None):
    """Every scope of layer ``l`` as parts (pos, src, d_model), float64, from the equations. The feed-forward
    block is split for ``ff_rows`` (default: all); the scopes through it are NaN in the other rows."""
    A = lm.anatomy
    layer = A.layers[l]
    attn = layer.attn
    post = layer.placement == "post"
    n, d, H = len(tr.tokens), A.d_model, attn.n_heads
    group = H // attn.n_kv_heads
    x = tr.resid_pre[l].double()
    z = x if post else tr.attn_in[l].double()  # what attention reads, whole
    alpha = tr.pattern[l].double()
    names = ["attn_2020", "attn", "atb", "ff_in", "ff"]
    P = {s: torch.zeros(n, n, d, dtype=torch.float64) for s in names}
    for i in range(n):
        for j in range(n):
            own = x[j] if post else lin(layer.ln_attn, x[j], x[j])  # Pre-LN: LN1's linear part at x_j's own scale
            t = torch.zeros(d, dtype=torch.float64)
            for h in range(H):
                kv = h // group  # grouped-query attention: query head h reads key/value head h // (H / H_kv)
                WV, WO = attn.W_V[kv].double(), attn.W_O[h].double()
                bV = attn.b_V[kv].double() if attn.b_V is not None else 0.0
                P["attn_2020"][i, j] += alpha[h, i, j] * ((z[j] @ WV + bV) @ WO)
                P["attn"][i, j] += alpha[h, i, j] * (z[j] @ WV @ WO)
                t += alpha[h, i, j] * (own @ WV @ WO)
            if layer.ln_attn_out is not None:  # sandwich: the post-attention norm at attn_out_i's scale
                t = lin(layer.ln_attn_out, t, tr.attn_out[l][i])
            t = t * layer.residual_scale  # Granite's residual multiplier scales the write
            if i == j:
                t = t + x[i]
            if post:  # LN1 at the scale of x_i + attn_out_i
                t = lin(layer.ln_attn, t, tr.resid_pre[l][i] + tr.attn_out[l][i])
            P["atb"][i, j] = t
            if post:
                P["ff_in"][i, j] = t
            elif layer.placement == "parallel":  # the MLP reads LN2(x_i)
                P["ff_in"][i, j] = lin(layer.ln_mlp, x[i], x[i]) if i == j else 0.0
            else:
                P["ff_in"][i, j] = lin(layer.ln_mlp, t, tr.resid_mid[l][i])
    mlp_in = tr.resid_mid[l] if post else tr.site("ln_mlp.out", l)
    moe = tr.routing_weights is not None
    P["ff"].fill_(float("nan"))
    for i in range(n) if ff_rows is None else ff_rows:
        rest = mlp_in[i].double() - P["ff_in"][i].sum(0)  # the remainder player: what no source carries
        players = torch.cat([P["ff_in"][i], rest[None]])
        # a mixture of experts: each expert chosen at i (the traced routing), its output times its weight
        chosen = [(layer.mlp.expert(e), float(tr.routing_weights[l][i, e])) for e in range(layer.mlp.n_experts)
                  if tr.routing_weights[l][i, e] > 0] if moe else [(layer.mlp, 1.0)]
        ff = torch.zeros(n, d, dtype=torch.float64)
        for mlp, weight in chosen:
            ig, hidden, _, _ = brute_ig(lm, l, players, steps, mlp=mlp)
            # the brute force's own completeness: the players' IG add up to the real hidden activation
            torch.testing.assert_close(ig.sum(0), hidden, atol=2e-6 * float(hidden.abs().max()), rtol=0)
            ff += weight * (ig[:n] @ mlp.W_out.double())
        for j in range(n):
            f = ff[j]
            if layer.ln_mlp_out is not None:
                f = lin(layer.ln_mlp_out, f, tr.mlp_out[l][i])
            P["ff"][i, j] = f * layer.residual_scale
    res = P["ff"] + P["atb"]
    out = {"attn_2020": P["attn_2020"], "attn": P["attn"], "atb": P["atb"]}
    if post:
        out["atbff"], out["atbffres"] = P["ff"], res
        ln2_in = tr.resid_mid[l].double() + tr.mlp_out[l].double()
        out["atbffresln"] = torch.stack([torch.stack([lin(layer.ln_mlp, res[i, j], ln2_in[i]) for j in range(n)])
                                         for i in range(n)])
    else:
        out["atbln"], out["atblnff"], out["atblnffres"] = P["ff_in"], P["ff"], res
        if l + 1 < A.n_layers:
            norm, norm_in = A.layers[l + 1].ln_attn, tr.resid_pre[l + 1]
        else:
            norm, norm_in = A.final_norm, tr.site("ln_final.in")
        out["atblnffres_nextln"] = torch.stack([torch.stack([lin(norm, res[i, j], norm_in[i]) for j in range(n)])
                                                for i in range(n)])
    return out


# --------------------------------------------------------------------------------------------------
# 1. completeness on every family


def test_completeness_every_family(tiny):
    lm = tiny
    A = lm.anatomy
    tr = lenscope.trace(lm, TEXT)
    n, L = len(tr.tokens), A.n_layers
    scopes = POST if A.placement == "post" else PRE
    res = context_mixing(lm, tr=tr)
    assert tuple(res) == scopes
    rows = torch.arange(n)
    for s, m in res.items():
        assert m.maps.shape == (L, n, n) and m.layers == list(range(L)) and m.tokens == tr.tokens
        assert torch.isfinite(m.maps).all() and (m.maps >= 0).all()
        if s != "attention":
            assert m.completeness_error <= 1e-4, s
            assert m.layer_errors.shape == (L,) and float(m.layer_errors.max()) == pytest.approx(m.completeness_error)
    for l in range(L):
        decs, _ = layer_decompositions(A, tr, l, rows, scopes)
        for s in scopes[1:]:
            dec = decs[s]
            assert dec.parts.shape == (n, n, A.d_model) and dec.rest.shape == (n, A.d_model)
            assert rel_gap(dec.parts.sum(1) + dec.rest, real_of(A, tr, l, s)) <= 1e-4, (s, l)
            # the maps are the norms of these parts
            torch.testing.assert_close(res[s].maps[l], dec.parts.norm(dim=-1).float(), atol=1e-6, rtol=1e-6)


# --------------------------------------------------------------------------------------------------
# 2. every scope against the brute force on 1-layer models of every family


@pytest.mark.parametrize("family", DECODERS + ENCODERS)
def test_maps_match_brute_force(family):
    """Every scope of every family (GQA in llama / qwen2 / gemma3, sandwich norms in gemma3, the parallel
    block of GPT-NeoX, LN biases, value and output biases, Post-LN encoders). Measured differences are
    <= 2e-7 of each map's scale."""
    lm = tiny_with_layers(family, 1)
    tr = lenscope.trace(lm, TEXT)
    res = context_mixing(lm, tr=tr)
    ref = brute_parts(lm, tr, 0)
    for s, parts in ref.items():
        got = res[s].maps[0].double()
        want = parts.norm(dim=-1)
        if s in ("atbff", "atblnff", "atbffres", "atblnffres", "atbffresln", "atblnffres_nextln"):
            # numeric IG: midpoint error <= max|integrand''| / (24 N^2) ~ 1e-8 times the pre-activations'
            # scale squared at N = 2000, plus lenscope's float32 rounding (~1e-7): 1e-5 of the map's scale
            tol = 1e-5 * float(want.max())
            torch.testing.assert_close(got, want, atol=tol, rtol=1e-5, msg=lambda m: f"{family} {s}: {m}")
        else:
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=lambda m: f"{family} {s}: {m}")


_strong: dict = {}


def with_strong_mlp(family, factor=8.0):
    """A 1-layer tiny model whose MLP input projections (weights and biases) are ``factor`` times larger: the
    random tiny models keep pre-activations below ~1, where every activation is nearly linear and any
    split of the feed-forward block looks alike; here they reach ~5, deep in the non-linear range."""
    import copy

    key = ("strong", family, factor)
    if key not in _strong:
        base = tiny_with_layers(family, 1)
        model = copy.deepcopy(base.model)
        mlp = family_for(model).read(model).layers[0].mlp
        for t in (mlp.W_in, mlp.b_in, mlp.W_gate, mlp.b_gate):
            if t is not None:
                t.mul_(factor)  # detached views of the copied model's parameters
        _strong[key] = dataclasses.replace(base, model=model, anatomy=family_for(model).read(model))
    return _strong[key]


@pytest.mark.parametrize("family", ["gpt2", "opt", "llama", "gemma3", "bert"])
def test_feed_forward_matches_brute_force_in_the_nonlinear_range(family):
    lm = with_strong_mlp(family)
    tr = lenscope.trace(lm, TEXT)
    assert float(tr.mlp_pre.abs().max()) > 3  # really non-linear
    res = context_mixing(lm, tr=tr)
    ref = brute_parts(lm, tr, 0)
    for s in ("atbff", "atbffres") if lm.anatomy.placement == "post" else ("atblnff", "atblnffres"):
        want = ref[s].norm(dim=-1)
        torch.testing.assert_close(res[s].maps[0].double(), want, atol=1e-5 * float(want.max()), rtol=1e-5,
                                   msg=lambda m: f"{family} {s}: {m}")
        assert res[s].completeness_error <= 1e-4


def test_gqa_families_are_covered():
    """llama, qwen2 and gemma3 tiny models share key/value heads among query heads: the brute force above
    reads key/value head h // (H / H_kv), so a wrong grouping would fail it."""
    for fam in ("llama", "qwen2", "gemma3"):
        attn = tiny_with_layers(fam, 1).anatomy.layers[0].attn
        assert fam in DECODERS and attn.n_kv_heads < attn.n_heads


@pytest.mark.slow
@pytest.mark.parametrize("name,layer", [("smollm2", 14), ("gemma3-270m", 9), ("minilm", 3)])
def test_real_models_match_brute_force(name, layer):
    """The embedded real models (GQA 9/3 with rotary; Gemma's sandwich norms, qk-norm, GQA 4/1; a Post-LN
    encoder): every layer adds up; one middle layer matches the brute force, the FF block at the last row.
    Real weights give pre-activations up to ~14: midpoint error <= |G|^2 max|g^(3)| / (24 N^2) ~ 1e-6 at
    N = 2000; measured differences are <= 3e-7 of the map's scale (float32 rounding): tolerance 1e-5 of it."""
    lm = get_model(name)
    tr = lenscope.trace(lm, "The keys to the cabinet")
    n = len(tr.tokens)
    res = context_mixing(lm, tr=tr)
    for s, m in res.items():
        assert torch.isfinite(m.maps).all()
        assert m.completeness_error <= 1e-4, (s, m.completeness_error)  # measured <= 5e-6 (float32)
    ref = brute_parts(lm, tr, layer, ff_rows=[n - 1])
    for s, parts in ref.items():
        want = parts.norm(dim=-1)
        got = res[s].maps[layer].double()
        rows = slice(None) if s in ("attn_2020", "attn", "atb", "atbln") else slice(n - 1, n)
        tol = 1e-5 * float(want[rows].max())
        torch.testing.assert_close(got[rows], want[rows], atol=tol, rtol=1e-5, msg=lambda m: f"{name} {s}: {m}")


# --------------------------------------------------------------------------------------------------
# 3. integrated gradients against exact Shapley values (all 2^m coalitions)


def shapley(G, U, act):
    """Exact Shapley values (player, unit) of the game v(S) = act(sum_S G) * sum_S U (U None: act(sum_S G)),
    every hidden unit its own game; v(empty) = 0 is the zero baseline."""
    m = G.shape[0]
    masks = ((torch.arange(2 ** m)[:, None] >> torch.arange(m)) & 1).double()  # coalition c holds player k iff bit k
    with torch.no_grad():
        v = act(masks @ G)
        if U is not None:
            v = v * (masks @ U)
    size = masks.sum(1).long()
    w = torch.tensor([math.factorial(s) * math.factorial(m - s - 1) / math.factorial(m) for s in range(m)],
                     dtype=torch.float64)
    phi = torch.zeros_like(G)
    for k in range(m):
        without = (masks[:, k] == 0).nonzero().squeeze(1)
        phi[k] = (w[size[without]][:, None] * (v[without + 2 ** k] - v[without])).sum(0)
    return phi


@pytest.mark.parametrize("family,strong", [("llama", False), ("gpt2", False), ("llama", True), ("gpt2", True)])
def test_ig_against_exact_shapley(family, strong):
    """Players: the 7 sources of one position's FF input plus its remainder (8 players, 256 coalitions).

    Both attributions are efficient and both give every player its exact share when the unit is linear in
    its players, so they differ only through the activation's curvature. Measured on these models: the
    per-position relative L2 distance of the hidden parts (players x units) is <= 0.027 (llama) and 0.001
    (gpt2) with the tiny weights, whose pre-activations stay below ~0.7, and <= 0.13 / 0.07 with the MLP
    inputs x8 (pre-activations up to ~5); the maps correlate > 0.9996 in all four. The bounds below are
    2-3x those: loose, but a split that is not IG (e.g. the gated product divided in proportion to the gate
    parts, also efficient) breaks them.
    """
    from lenscope.models.weights.algebra import ig_hidden
    from lenscope.models.weights.anatomy import ACTIVATIONS

    lm = with_strong_mlp(family) if strong else tiny_with_layers(family, 1)
    layer = lm.anatomy.layers[0]
    tr = lenscope.trace(lm, TEXT)
    n = len(tr.tokens)
    assert n + 1 <= 8
    ref = brute_parts(lm, tr, 0)
    act = activation_module(lm, 0)
    cm = context_mixing(lm, tr=tr, scopes=["atblnff"])["atblnff"]
    W_out = layer.mlp.W_out.double()
    shap_map = torch.zeros(n, n, dtype=torch.float64)
    for i in range(n):
        players = torch.cat([ref["atbln"][i], (tr.mlp_in[0][i].double() - ref["atbln"][i].sum(0))[None]])
        _, _, G, U = brute_ig(lm, 0, players, steps=2)
        phi = shapley(G, U, act)
        # efficiency: the Shapley values add up to the model's real hidden activation (read from the trace)
        real = act(tr.mlp_pre[0][i].double())
        if U is not None:
            real = real * tr.mlp_up[0][i].double()
        # the trace is float32: it rounds each pre-activation x . W to within d u sum |x| |W| (a dot product's worst
        # case, d = d_model); the activation (slope below 1.2) and the gated product carry that into the gap
        x = tr.mlp_in[0][i].double()

        def dot_err(W):
            return x.numel() * U32 * (x.abs() @ W.double().abs())

        if U is None:
            gap = 1.2 * dot_err(layer.mlp.W_in)
        else:
            gap = 1.2 * dot_err(layer.mlp.W_gate) * U.sum(0).abs() + act(G.sum(0)).abs() * dot_err(layer.mlp.W_in)
        assert ((phi.sum(0) - real).abs() <= gap).all(), ((phi.sum(0) - real).abs() / gap).max()
        # null players: sources after i carry nothing
        assert i + 1 == n or float(phi[i + 1: n].abs().max()) < 1e-12
        ig, ig_rest, _ = ig_hidden(ACTIVATIONS[layer.mlp.act], G[None, :-1], G[None, -1],
                                   None if U is None else U[None, :-1], None if U is None else U[None, -1])
        ig = torch.cat([ig[0], ig_rest])
        assert float((ig - phi).norm() / phi.norm()) < (0.4 if strong else 0.06)
        shap_map[i] = (phi[:n] @ W_out).norm(dim=-1)
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    a, b = cm.maps[0].double()[mask], shap_map[mask]
    assert float(torch.corrcoef(torch.stack([a, b]))[0, 1]) > (0.98 if strong else 0.998)


# --------------------------------------------------------------------------------------------------
# 4. closed form against the paper's numeric IG


@pytest.mark.parametrize("family,tol", [("gpt2", 1e-6), ("bert", 1e-6), ("llama", 1e-5), ("gemma3", 1e-5)])
def test_closed_form_matches_numeric_ig(family, tol):
    """Midpoint rule, N = 4000: error <= max|integrand''| / (24 N^2) ~ 3e-9 for these pre-activations (< 1);
    what remains is float32 rounding. Element-wise activations: closed form exact (g(S)/S), so the tight
    tolerance; gated: Gauss-Legendre on one side, midpoint on the other and float32 parts, looser."""
    lm = get_model(f"tiny:{family}")
    tr = lenscope.trace(lm, TEXT)
    ff = ("atbff", "atbffres", "atbffresln") if lm.anatomy.placement == "post" else (
        "atblnff", "atblnffres", "atblnffres_nextln")
    exact = context_mixing(lm, tr=tr, scopes=ff)
    numeric = context_mixing(lm, tr=tr, scopes=ff, numeric_steps=4000)
    coarse = context_mixing(lm, tr=tr, scopes=ff[:1], numeric_steps=10, check=False)[ff[0]]
    for s in ff:
        scale = float(exact[s].maps.abs().max())
        assert float((exact[s].maps - numeric[s].maps).abs().max()) <= tol * scale, s
        assert numeric[s].info["ig"] == "numeric" and numeric[s].info["numeric_steps"] == 4000
        assert exact[s].info["ig"] == "exact" and exact[s].info["nodes"] == 32
        assert numeric[s].completeness_error <= 1e-4
    # the numeric path is really taken: 10 midpoints are visibly off (error ~ 1/N^2)
    assert float((exact[ff[0]].maps - coarse.maps).abs().max()) > 1e-6 * float(exact[ff[0]].maps.max())


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
def test_gated_quadrature_error_is_small(family):
    lm = get_model(f"tiny:{family}")
    res = context_mixing(lm, TEXT, scopes=["atblnff"])["atblnff"]
    assert 0 <= res.info["quadrature_error"] < 1e-10
    strong = with_strong_mlp(family if family != "qwen2" else "llama")
    res = context_mixing(strong, TEXT, scopes=["atblnff"])["atblnff"]
    assert 0 <= res.info["quadrature_error"] < 1e-8  # pre-activations ~5: still converged at 32 nodes
    scale = float(res.maps.max())
    for nodes in (2, 4):
        few = context_mixing(strong, TEXT, scopes=["atblnff"], nodes=nodes)["atblnff"]
        assert few.info["nodes"] == nodes and few.info["quadrature_error"] > res.info["quadrature_error"]
        # the estimate is conservative: the maps move by less than it from the converged ones
        assert float((few.maps - res.maps).abs().max()) <= few.info["quadrature_error"] * scale
        assert few.completeness_error <= 1e-4  # integration by parts keeps the parts exact whatever the nodes


def test_ig_hidden_against_autograd_on_wide_inputs():
    """The closed forms of every activation on pre-activations up to ~30 in size (and exactly 0 for some units),
    gated and element-wise, against a 4000-point midpoint rule through autograd (measured gap <= 1e-6)."""
    from lenscope.models.weights.algebra import ig_hidden
    from lenscope.models.weights.anatomy import ACTIVATIONS

    g = torch.Generator().manual_seed(0)
    rows, src, units = 3, 4, 50
    Gp = torch.randn(rows, src, units, generator=g, dtype=torch.float64) * 3
    Gr = torch.randn(rows, units, generator=g, dtype=torch.float64) * 3
    Up = torch.randn(rows, src, units, generator=g, dtype=torch.float64)
    Ur = torch.randn(rows, units, generator=g, dtype=torch.float64)
    Gr[0, :5] = -Gp[0, :, :5].sum(0)  # S = 0 exactly for some units
    a = ((torch.arange(4000, dtype=torch.float64) + 0.5) / 4000)[:, None, None, None]
    allG = torch.cat([Gp, Gr[:, None]], 1)
    allU = torch.cat([Up, Ur[:, None]], 1)
    for name, act in ACTIVATIONS.items():
        for gated in (False, True):
            with torch.enable_grad():
                gg = (a * allG).requires_grad_(True)
                uu = (a * allU).requires_grad_(True)
                h = act(gg.sum(2)) * (uu.sum(2) if gated else 1)
                dg, du = torch.autograd.grad(h.sum(), [gg, uu], allow_unused=True)
            ref = (dg * allG).mean(0) + ((du * allU).mean(0) if gated else 0)
            parts, rest, err = ig_hidden(act, Gp, Gr, Up if gated else None, Ur if gated else None)
            got = torch.cat([parts, rest[:, None]], 1)
            if name == "relu":  # not differentiable at S = 0: the split of those units is a convention
                keep = allG.sum(1).abs() > 1e-9
                got, ref = got.transpose(1, 2)[keep], ref.transpose(1, 2)[keep]
            torch.testing.assert_close(got, ref, atol=2e-6, rtol=1e-5, msg=lambda m: f"{name} gated={gated}: {m}")
            full = act(allG.sum(1)) * (allU.sum(1) if gated else 1)
            total = parts.sum(1) + rest
            torch.testing.assert_close(total, full, atol=1e-10, rtol=1e-10)  # completeness, exactly
            # gated: the estimate compares 16 with 32 nodes, on pre-activations up to ~30 (measured <= 1e-4)
            assert err == 0.0 if not gated else err < 1e-3


# --------------------------------------------------------------------------------------------------
# 5. structure


def test_structure(tiny):
    lm = tiny
    A = lm.anatomy
    tr = lenscope.trace(lm, TEXT)
    n = len(tr.tokens)
    res = context_mixing(lm, tr=tr)
    # the mean over the heads, per layer there and of the stacked layers here (another reduction shape): the mean
    # of H probabilities (each at most 1) is within (H - 1) u of exact, 2 H u for two evaluations
    H = A.layers[0].attn.n_heads
    torch.testing.assert_close(res["attention"].maps, tr.pattern.float().mean(1), atol=2 * H * U32, rtol=0)
    assert res["attention"].completeness_error == 0.0
    for s, m in res.items():
        if A.causal:  # nothing from the future, exactly
            assert float(m.maps.triu(1).abs().max()) == 0.0, s
        else:  # bidirectional: the upper triangle is really used
            assert float(m.maps.triu(1).max()) > 0, s
    ff, res_, atb = ("atbff", "atbffres", "atb") if A.placement == "post" else ("atblnff", "atblnffres", "atb")
    rows = torch.arange(n)
    for l in range(A.n_layers):
        decs, _ = layer_decompositions(A, tr, l, rows, [ff, res_, atb])
        torch.testing.assert_close(decs[res_].parts, decs[ff].parts + decs[atb].parts, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(decs[res_].rest, decs[ff].rest + decs[atb].rest, atol=1e-6, rtol=1e-6)
        if A.placement == "parallel":  # the MLP reads LN2(x_i): atbln and atblnff are diagonal
            d = layer_decompositions(A, tr, l, rows, ["atbln", "atblnff"])[0]
            for s in ("atbln", "atblnff"):
                off = d[s].parts.norm(dim=-1) * (1 - torch.eye(n))
                assert float(off.abs().max()) == 0.0 and float(d[s].parts.norm(dim=-1).diagonal().min()) > 0


def test_chunked_rows_equal_one_pass(monkeypatch):
    """Long inputs are split into row chunks (causal models cut the trace to the chunk's prefix): the maps
    must not depend on it."""
    for name in ("tiny:llama", "tiny:gemma3", "tiny:gpt-neox", "tiny:bert"):
        lm = get_model(name)
        tr = lenscope.trace(lm, TEXT)
        whole = context_mixing(lm, tr=tr)
        with monkeypatch.context() as mp:
            mp.setattr(maps_module, "CHUNK_BYTES", 1)  # one row per chunk
            assert len(maps_module._chunks(len(tr.tokens), lm.anatomy, lm.anatomy.causal)) == len(tr.tokens)
            rowwise = context_mixing(lm, tr=tr)
        for s in whole:
            torch.testing.assert_close(rowwise[s].maps, whole[s].maps, atol=1e-6, rtol=1e-5)
            assert rowwise[s].completeness_error <= 1e-4


def test_float64():
    lm = get_model("tiny:gpt2")
    tr = lenscope.trace(lm, TEXT)
    a = context_mixing(lm, tr=tr)
    b = context_mixing(lm, tr=tr, dtype=torch.float64)
    for s in a:
        torch.testing.assert_close(b[s].maps, a[s].maps, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------------------
# 6. API


@pytest.mark.parametrize("name,kwargs,match", [
    ("tiny:llama", dict(scopes=["nope"]), "scope 'nope'"),
    ("tiny:llama", dict(scopes="atbff"), "Pre-LN"),
    ("tiny:bert", dict(scopes=["atbln"]), "Post-LN"),
    ("tiny:bert", dict(scopes="atblnffres_nextln"), "Post-LN"),
    ("tiny:llama", dict(layers=2), "layer 2"),
    ("tiny:llama", dict(layers=[0, -3]), "layer -3"),
])
def test_bad_input(name, kwargs, match):
    with pytest.raises(lenscope.InputError, match=match):
        context_mixing(get_model(name), TEXT, **kwargs)


@pytest.mark.parametrize("name,kwargs", [("tiny:llama", dict(nodes=0)), ("tiny:llama", dict(numeric_steps=0)),
                                         ("tiny:gpt2", dict(numeric_steps=0)), ("tiny:gpt2", dict(numeric_steps=-3))])
def test_bad_quadrature_settings(name, kwargs):
    with pytest.raises(lenscope.InputError):
        context_mixing(get_model(name), TEXT, scopes=["atb", "atblnff"], **kwargs)


def test_needs_text_or_trace():
    with pytest.raises(lenscope.InputError):
        context_mixing(get_model("tiny:llama"))


def test_one_layer_and_scope_string():
    lm = get_model("tiny:qwen2")
    tr = lenscope.trace(lm, TEXT)
    full = context_mixing(lm, tr=tr)
    one = context_mixing(lm, TEXT, layers=1)
    last = context_mixing(lm, tr=tr, scopes="atb", layers=-1)
    assert set(last) == {"atb"} and last["atb"].layers == [1]
    for s in full:
        assert one[s].maps.shape == (1, len(tr.tokens), len(tr.tokens)) and one[s].layers == [1]
        torch.testing.assert_close(one[s].maps[0], full[s].maps[1])
        assert one[s].completeness_error == pytest.approx(float(full[s].layer_errors[1]), rel=1e-6, abs=1e-12)
    torch.testing.assert_close(last["atb"].maps[0], full["atb"].maps[1])


def test_result_roundtrip_frame_dict_plot(tmp_path):
    import matplotlib.pyplot as plt

    lm = get_model("tiny:gemma3")
    res = context_mixing(lm, TEXT)
    m = res["atblnff"]
    L, n = lm.anatomy.n_layers, len(m.tokens)
    back = MixingMaps.load(m.save(tmp_path / "m.safetensors"))
    assert_same_computation((back.maps, back.layer_errors), (m.maps, m.layer_errors), why="saved and read back")
    assert (back.tokens, back.scope, back.layers, back.model, back.completeness_error, back.info) == (
        m.tokens, m.scope, m.layers, m.model, m.completeness_error, m.info)
    assert "atblnff" in repr(m)
    df = m.to_frame()
    assert list(df.columns) == ["layer", "pos", "src", "token", "source_token", "value"]
    assert len(df) == L * n * n and df["value"].sum() == pytest.approx(float(m.maps.double().sum()), rel=1e-9)
    row = df[(df.layer == 1) & (df.pos == 3) & (df.src == 2)].iloc[0]
    assert row.value == pytest.approx(float(m.maps[1, 3, 2]))
    assert row.token == m.tokens[3] and row.source_token == m.tokens[2]
    d = json.loads(json.dumps(res["atb"].to_dict()))
    assert {"tokens", "scope", "layers", "completeness_error"} <= set(d)
    assert d["scope"] == "atb" and d["tokens"] == m.tokens
    assert len(d["layers"]) == L and all(len(x) == n and all(len(r) == n for r in x) for x in d["layers"])
    assert d["layers"][1][3][2] == pytest.approx(float(res["atb"].maps[1, 3, 2]))
    fig = m.plot()
    assert len([a for a in fig.axes if a.images]) == L
    plt.close(fig)


def test_wrong_reading_is_refused(tiny_decoder):
    """An Anatomy that misreads the model (W_O 1.5x in the last layer) makes the parts miss the real
    activations: with check=True that is an error, not a wrong map."""
    lm = tiny_decoder
    A = lm.anatomy
    l0 = A.layers[-1]
    bad_layer = dataclasses.replace(l0, attn=dataclasses.replace(l0.attn, W_O=l0.attn.W_O * 1.5))
    bad = dataclasses.replace(lm, anatomy=dataclasses.replace(A, layers=A.layers[:-1] + [bad_layer]))
    with pytest.raises(InvariantError, match="verify"):
        context_mixing(bad, TEXT)
    loose = context_mixing(bad, TEXT, check=False)
    assert loose["attn"].completeness_error > 1e-2
    assert float(loose["attn"].layer_errors[0]) <= 1e-4  # only the misread layer misses


def test_wrong_reading_is_refused_encoder():
    lm = get_model("tiny:bert")
    A = lm.anatomy
    l0 = A.layers[0]
    bad_layer = dataclasses.replace(l0, attn=dataclasses.replace(l0.attn, W_O=l0.attn.W_O * 1.5))
    bad = dataclasses.replace(lm, anatomy=dataclasses.replace(A, layers=[bad_layer] + A.layers[1:]))
    with pytest.raises(InvariantError):
        context_mixing(bad, TEXT, scopes=["atbffresln"])


# --------------------------------------------------------------------------------------------------
# 7. property test


@settings(max_examples=12, deadline=None)
@given(st.lists(st.integers(min_value=2, max_value=511), min_size=1, max_size=10))
def test_fuzz_random_ids(ids):
    lm = get_model("tiny:qwen2")
    res = context_mixing(lm, ids)
    n = len(ids)
    for s, m in res.items():
        assert m.maps.shape == (lm.anatomy.n_layers, n, n)
        assert torch.isfinite(m.maps).all() and (m.maps >= 0).all()
        assert m.completeness_error <= 1e-4, s
