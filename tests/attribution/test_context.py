"""Logit, ALTI-Logit, ALTI and value zeroing: exactness on every family, against brute-force loops written
here from the papers' equations (independent of lenscope.models.weights.algebra)."""

import dataclasses
import json
import math
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lenscope
from lenscope.attribution.context import alti_logit_explanation, logit_explanation, rollout_explanation
from lenscope.attribution.explain import explain, explain_all
from lenscope.attribution.explanation import Explanation
from lenscope.errors import InputError, InvariantError, NotApplicableError
from lenscope.mixing.alti import mixing_matrices
from lenscope.models.weights.anatomy import astype

from ..conftest import DECODERS, ENCODERS, get_model, tiny_with_layers
from ..tolerances import assert_same_computation

TEXT = "The capital of France is"


# --------------------------------------------------------------------------------------------------
# brute force, straight from the equations: loops over layers, positions, sources and heads


def lin(norm, v, real_in):
    """A norm's linear part applied to v, with the scale of its real input (written out by hand)."""
    x, v = real_in.double(), v.double()
    if norm.kind == "layernorm":
        c, s = v - v.mean(), torch.sqrt(((x - x.mean()) ** 2).mean() + norm.eps)
    else:
        c, s = v, torch.sqrt((x ** 2).mean() + norm.eps)
    out = c / s
    return out * norm.weight.double() if norm.weight is not None else out


def head_part(A, tr, l, i, j, h):
    """alpha^h_ij (z_j W_V^h + b_V^h) W_O^h: LN1's bias and b_V travel with the source."""
    layer = A.layers[l]
    attn = layer.attn
    z = (tr.resid_pre[l][j] if layer.placement == "post" else tr.attn_in[l][j]).double()
    kv = h // (attn.n_heads // attn.n_kv_heads)
    v = z @ attn.W_V[kv].double()
    if attn.b_V is not None:
        v = v + attn.b_V[kv].double()
    return tr.pattern[l][h, i, j].double() * (v @ attn.W_O[h].double())


def brute_logit(lm, tr, t, w, f=None):
    """(layer, head, src) logit updates Delta^{l,h}_{w <- x_j}."""
    A = lm.anatomy
    n = len(tr.tokens)
    u = A.unembed.W_U[:, w].double() - (A.unembed.W_U[:, f].double() if f is not None else 0)
    u = u * A.unembed.logit_scale  # Cohere's logits are multiplied by a constant
    out = torch.zeros(A.n_layers, A.layers[0].attn.n_heads, n, dtype=torch.float64)
    for l, layer in enumerate(A.layers):
        for h in range(layer.attn.n_heads):
            for j in range(n):
                vec = head_part(A, tr, l, t, j, h)
                if layer.ln_attn_out is not None:
                    vec = lin(layer.ln_attn_out, vec, tr.attn_out[l][t])
                vec = vec * layer.residual_scale  # Granite's residual multiplier scales the write
                out[l, h, j] = lin(A.final_norm, vec, tr.site("ln_final.in")[t]) @ u
    return out


def brute_alti(lm, tr):
    A = lm.anatomy
    n = len(tr.tokens)
    C = torch.zeros(A.n_layers, n, n, dtype=torch.float64)
    for l, layer in enumerate(A.layers):
        for i in range(n):
            y = tr.resid_mid[l][i].double()
            row = torch.zeros(n, dtype=torch.float64)
            for j in range(n):
                a = sum(head_part(A, tr, l, i, j, h) for h in range(layer.attn.n_heads))
                if layer.ln_attn_out is not None:
                    a = lin(layer.ln_attn_out, a, tr.attn_out[l][i])
                a = a * layer.residual_scale
                if i == j:
                    a = a + tr.resid_pre[l][i].double()
                if layer.placement == "post":
                    a = lin(layer.ln_attn, a, tr.site("ln_attn.in", l)[i])
                row[j] = max(0.0, float(y.abs().sum() - (y - a).abs().sum()))
            C[l, i] = row / row.sum() if row.sum() > 0 else torch.eye(n, dtype=torch.float64)[i]
    return C


def brute_value_zeroing(lm, tr):
    A = lm.anatomy
    n = len(tr.tokens)
    C = torch.zeros(A.n_layers, n, n, dtype=torch.float64)
    for l, layer in enumerate(A.layers):
        layer = astype(layer, torch.float64)
        attn = layer.attn
        x = tr.resid_pre[l].double()
        z = x if layer.placement == "post" else tr.attn_in[l].double()
        base = layer.after_attention(x, tr.attn_out[l].double())["resid_post"]
        for j in range(n):
            v = attn.values(z).clone()
            v[:, j] = 0
            o = (torch.einsum("hqk,hke->qhe", tr.pattern[l].double(), v).reshape(n, -1)
                 @ attn.W_O.reshape(-1, A.d_model))
            if attn.b_O is not None:
                o = o + attn.b_O
            out = layer.after_attention(x, o)["resid_post"]
            for i in range(n):
                if A.causal and j > i:
                    continue
                C[l, i, j] = max(0.0, 1 - float(torch.nn.functional.cosine_similarity(out[i], base[i], dim=0)))
        s = C[l].sum(-1, keepdim=True)
        C[l] = torch.where(s > 0, C[l] / s.clamp_min(1e-30), torch.eye(n, dtype=torch.float64))
    return C


# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("family", DECODERS)
def test_logit_matches_brute_force(family, layers):
    lm = tiny_with_layers(family, layers)
    tr = lenscope.trace(lm, TEXT)
    resolve = lenscope.models.loading.load.resolve_token
    w, f = resolve(lm, " capital"), resolve(lm, " of")
    ref = brute_logit(lm, tr, len(tr.tokens) - 1, w, f)
    e = logit_explanation(lm, TEXT, " capital", " of", tr=tr)
    torch.testing.assert_close(e.head_scores.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(e.layer_scores.double(), ref.sum(1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(e.scores.double(), ref.sum((0, 1)), atol=1e-5, rtol=1e-5)
    # the parts plus the remainder are the layer's attention logit update read from the trace
    torch.testing.assert_close(e.layer_scores.sum(-1) + e.remainder, e.attention_update, atol=1e-5, rtol=1e-5)
    assert e.invariant_error < 1e-5
    # with the MLPs, the embedding and the biases, the whole logit difference is accounted for
    assert e.info["completeness_error"] < 1e-4


@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("family", DECODERS)
def test_alti_matches_brute_force(family, layers):
    lm = tiny_with_layers(family, layers)
    tr = lenscope.trace(lm, TEXT)
    mm = mixing_matrices(lm.anatomy, tr, "alti")
    ref = brute_alti(lm, tr)
    torch.testing.assert_close(mm.contributions.double(), ref, atol=1e-5, rtol=1e-5)
    M = ref[0]
    for l in range(1, layers):
        M = ref[l] @ M
    torch.testing.assert_close(mm.rollout[-1].double(), M, atol=1e-5, rtol=1e-5)
    assert mm.completeness_error < 1e-5


@pytest.mark.parametrize("family", ENCODERS)
def test_alti_encoder_matches_brute_force(family):
    """Post-LN: the decomposition continues through the post-attention LayerNorm."""
    lm = tiny_with_layers(family, 1)
    tr = lenscope.trace(lm, TEXT)
    mm = mixing_matrices(lm.anatomy, tr, "alti")
    torch.testing.assert_close(mm.contributions.double(), brute_alti(lm, tr), atol=1e-5, rtol=1e-5)
    assert mm.completeness_error < 1e-5
    assert mm.contributions[0, 0, -1] > 0  # bidirectional: an early position takes from a later one


@pytest.mark.parametrize("family", DECODERS + ENCODERS)
def test_value_zeroing_matches_brute_force(family):
    lm = tiny_with_layers(family, 1)
    tr = lenscope.trace(lm, TEXT)
    mm = mixing_matrices(lm.anatomy, tr, "value-zeroing")
    torch.testing.assert_close(mm.contributions.double(), brute_value_zeroing(lm, tr), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("family", DECODERS)
def test_alti_logit_matches_brute_force_rollout(family):
    lm = tiny_with_layers(family, 2)
    tr = lenscope.trace(lm, TEXT)
    resolve = lenscope.models.loading.load.resolve_token
    w, f = resolve(lm, " capital"), resolve(lm, " of")
    delta = brute_logit(lm, tr, len(tr.tokens) - 1, w, f).sum(1)  # (layer, src)
    C = brute_alti(lm, tr)
    ref = delta[0] + delta[1] @ C[0]  # Eq. 10-11: layer 0 itself, layer 1 carried back through layer 0
    e = alti_logit_explanation(lm, TEXT, " capital", " of", tr=tr)
    torch.testing.assert_close(e.scores.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(e.layer_scores[1].double(), delta[1] @ C[0], atol=1e-5, rtol=1e-5)


def test_every_decoder_invariants(tiny_decoder):
    lm = tiny_decoder
    tr = lenscope.trace(lm, TEXT)
    lg = explain(lm, TEXT, " capital", " of", method="logit", tr=tr)
    al = explain(lm, TEXT, " capital", " of", method="alti-logit", tr=tr)
    at = explain(lm, TEXT, method="alti", tr=tr)
    # mixing redistributes, never creates: per layer and in total
    torch.testing.assert_close(al.layer_scores.sum(-1), lg.layer_scores.sum(-1), atol=1e-5, rtol=1e-5)
    assert float(al.scores.sum()) == pytest.approx(float(lg.scores.sum()), abs=1e-5)
    assert al.invariant_error < 1e-5 and lg.invariant_error < 1e-5
    # ALTI rollout rows: non-negative, summing to one; causal: nothing from the future
    mm = mixing_matrices(lm.anatomy, tr, "alti")
    for m in (mm.contributions, mm.rollout):
        assert (m >= 0).all()
        torch.testing.assert_close(m.sum(-1), torch.ones(m.shape[:2]), atol=1e-5, rtol=0)
        assert float(m.triu(1).abs().max()) == 0.0
    assert float(at.scores.sum()) == pytest.approx(1.0, abs=1e-5)
    torch.testing.assert_close(at.scores, mm.rollout[-1, -1])


def test_contrastive_is_target_minus_foil(tiny_decoder):
    lm = tiny_decoder
    tr = lenscope.trace(lm, TEXT)
    for method in ("logit", "alti-logit"):
        both = explain(lm, TEXT, " capital", " of", method=method, tr=tr)
        a = explain(lm, TEXT, " capital", method=method, tr=tr)
        b = explain(lm, TEXT, " of", method=method, tr=tr)
        torch.testing.assert_close(both.scores, a.scores - b.scores, atol=1e-5, rtol=1e-4)
        assert both.info["logit"] == pytest.approx(a.info["logit"] - b.info["logit"], abs=1e-4)


def test_earlier_position_uses_the_prefix_only(tiny_decoder):
    lm = tiny_decoder
    tr = lenscope.trace(lm, TEXT)
    e = explain(lm, TEXT, " capital", method="alti-logit", position=2, tr=tr)
    short = lenscope.trace(lm, tr.input_ids[:3])
    s = explain(lm, None, " capital", method="alti-logit", tr=short)
    torch.testing.assert_close(e.scores[:3], s.scores, atol=1e-5, rtol=1e-5)
    assert float(e.scores[3:].abs().max()) == 0.0 and e.position == 2


def test_wrong_reading_is_refused(tiny_decoder):
    """A decomposition that does not add up to the model's update is an error, not a wrong explanation."""
    lm = tiny_decoder
    A = lm.anatomy
    l0 = A.layers[-1]
    bad_layer = dataclasses.replace(l0, attn=dataclasses.replace(l0.attn, W_O=l0.attn.W_O * 1.5))
    bad = dataclasses.replace(lm, anatomy=dataclasses.replace(A, layers=A.layers[:-1] + [bad_layer]))
    with pytest.raises(InvariantError, match="verify"):
        logit_explanation(bad, TEXT, " capital")
    with pytest.raises(InvariantError):
        rollout_explanation(bad, TEXT, method="alti")


def test_encoders(tiny_encoder):
    lm = tiny_encoder
    for method in ("logit", "alti-logit"):
        with pytest.raises(NotApplicableError, match="encoder"):
            explain(lm, TEXT, " capital", method=method)
    e = explain(lm, TEXT, method="alti", position=2)
    assert e.scores.sum() == pytest.approx(1.0, abs=1e-5) and (e.scores > 0).all()
    v = explain(lm, TEXT, method="value-zeroing", position=2)
    assert v.scores.sum() == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize("kwargs,err,msg", [
    (dict(method="nope"), InputError, "unknown method"),
    (dict(method="logit"), InputError, "needs a target"),
    (dict(method="logit", target=" capital", foil=" capital"), InputError, "same token"),
    (dict(method="alti", position=40), InputError, "outside"),
    (dict(method="logit", target=" Paris xyz"), InputError, "not exactly one token"),
])
def test_bad_input(kwargs, err, msg):
    lm = get_model("tiny:llama")
    with pytest.raises(err, match=msg):
        explain(lm, TEXT, **kwargs)


def test_result_roundtrip_frame_plot_html(tmp_path):
    lm = get_model("tiny:gemma3")
    res = explain_all(lm, TEXT, " capital", " of", methods=["logit", "alti-logit", "alti", "value-zeroing"])
    e = res["logit"]
    path = e.save(tmp_path / "e.safetensors")
    back = Explanation.load(path)
    torch.testing.assert_close(back.head_scores, e.head_scores)
    assert back.tokens == e.tokens and back.foil == e.foil
    assert_same_computation(back.info, e.info, why="saved and read back")
    df = e.to_frame()
    assert list(df["token"]) == e.tokens and df["score"].sum() == pytest.approx(float(e.scores.sum()), abs=1e-5)
    assert df.shape[1] == 3 + lm.anatomy.n_layers
    d = json.loads(json.dumps(res["alti-logit"].to_dict()))
    assert {"tokens", "scores", "method", "target", "foil", "layers", "attention_update", "invariant_error"} <= set(d)
    assert len(d["scores"]) == len(e.tokens) and len(d["layers"]) == lm.anatomy.n_layers
    fig = e.plot()
    assert len(fig.axes) >= 2
    page = lenscope.attribution.explain_html(list(res.values()), tmp_path / "e.html")
    assert (tmp_path / "e.html").read_text(encoding="utf-8") == page
    assert 'data-section="attribution"' in page  # the report page with the attribution view, its own script
    block = re.search(r'<script type="application/json" id="lenscope-data">(.*?)</script>', page, re.S).group(1)
    (sec,) = json.loads(block)["sections"]
    assert sec["key"] == "attribution" and list(sec["data"]["methods"]) == list(res)  # the four methods
    assert sec["data"]["tokens"] == e.tokens and sec["data"]["target"] == " capital"
    for m, ex in res.items():
        assert sec["data"]["methods"][m]["scores"] == pytest.approx(ex.scores.tolist(), rel=1e-4, abs=1e-9)
    assert set(sec["data"]["layers"]) == {"logit", "alti-logit"}  # their per-layer scores
    assert "<script" not in block
    assert e.to_html() == lenscope.attribution.explain_html([e])


@settings(max_examples=15, deadline=None)
@given(st.lists(st.integers(min_value=5, max_value=400), min_size=2, max_size=12))
def test_fuzz_random_ids(ids):
    lm = get_model("tiny:llama")
    tr = lenscope.trace(lm, ids)
    lg = explain(lm, None, "#7", "#9", method="logit", tr=tr)
    al = explain(lm, None, "#7", "#9", method="alti-logit", tr=tr)
    assert all(math.isfinite(v) for v in al.scores.tolist())
    assert float(al.scores.sum()) == pytest.approx(float(lg.scores.sum()), abs=1e-4)
    at = explain(lm, None, method="alti", tr=tr)
    assert float(at.scores.sum()) == pytest.approx(1.0, abs=1e-5)
