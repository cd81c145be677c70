"""Features as units of attribution: direct logit attribution over features sums to the model's logit on every
decoder family (SAEs at resid_post and attn_out, transcoders and skip transcoders at mlp_out) and matches the
equations written out by hand in float64; attribution patching over latents equals exact patching where the
metric is affine in the latents, and reports its gap where it is not."""

from __future__ import annotations

import copy

import pytest
import torch

from lenscope.errors import InputError
from lenscope.features.dictionaries.attribution import FeatureAtP, FeatureAttribution, feature_atp, feature_dla
from lenscope.models.families import family_for
from lenscope.models.loading.load import LoadedModel, encode
from lenscope.models.runtime.engine import Edit, capture, run
from lenscope.models.runtime.request import metric_of
from tests.conftest import DECODERS, get_model
from tests.models.test_dictionary import _random
from tests.tolerances import assert_same_computation

TEXT = "The cat sat on the mat because it was warm"
EPS = torch.finfo(torch.float32).eps


def _limit(res) -> float:
    """float32 rounding of a sum of float32 parts, relative to their size (a few dozen eps of the largest terms)."""
    return 64 * EPS * max(1.0, float(res.values.double().abs().sum()), abs(res.logit))


def _site_sum(res, site) -> float:
    return sum(v for s, v in zip(res.sites, res.values.tolist()) if s == site)


@pytest.mark.parametrize("family", DECODERS)
def test_feature_dla_sums_to_the_logit_on_every_family(family, tmp_path):
    from lenscope.attribution.dla import direct_logit_attribution

    lm = get_model(f"tiny:{family}")
    d, L = lm.anatomy.d_model, lm.anatomy.n_layers
    ds = [_random(d, 40, kind="topk", site="resid_post.0", seed=1, k=6),
          _random(d, 40, kind="jumprelu", site=f"attn_out.{L - 1}", seed=2),
          _random(d, 40, kind="batchtopk", role="transcoder", site=f"mlp_out.{L - 1}", seed=3)]
    skip = [_random(d, 40, kind="jumprelu", site="attn_out.0", seed=4),
            _random(d, 40, kind="topk", role="skip", site="mlp_out.0", seed=5, k=5)]
    dla = direct_logit_attribution(lm, TEXT, " the", " cat", position=-2)
    by = dict(zip(dla.names, dla.values.tolist()))
    for dicts in (ds, skip):
        res = feature_dla(lm, TEXT, dicts, " the", " cat", position=-2)
        assert res.position == dla.position and abs(res.logit - dla.logit) < 1e-6
        assert res.completeness_error <= _limit(res), (family, res)
        assert abs(res.total - res.logit) == pytest.approx(res.completeness_error)
        for D in dicts:
            rows = [k for k, s in zip(res.kinds, res.sites) if s == D.site]
            assert rows.count("error") == 1 and rows.count("bias") == 1
            assert rows.count("skip") == (D.role == "skip")
            # the dictionary's rows add up to what DLA gives the parts it replaces
            name, layer = D.site.split(".")
            layer = int(layer)
            if name == "attn_out":
                want = by[f"L{layer}.attn"]
            elif name == "mlp_out":
                want = by[f"L{layer}.mlp"]
            else:
                want = sum(v for n, la, v in zip(dla.names, dla.layers, dla.values.tolist())
                           if n != "bias" and la <= layer)
            assert abs(_site_sum(res, D.site) - want) <= _limit(res), (family, D.site)
        # the rows DLA keeps are DLA's own values; none of the replaced ones is left
        kept = {n: v for n, k, v in zip(res.names, res.kinds, res.values.tolist()) if k in ("component", "readout")}
        for n, v in kept.items():
            assert v == pytest.approx(by[n], abs=1e-7)
        if dicts is ds:
            assert "embed" not in kept and "L0.attn" not in kept and "L0.mlp" not in kept
            assert f"L{L - 1}.attn" not in kept and f"L{L - 1}.mlp" not in kept
    path = res.save(tmp_path / "fa.safetensors")
    back = FeatureAttribution.load(path)
    assert back.names == res.names
    assert_same_computation(back.values, res.values, why="saved and read back")
    assert back.sites == res.sites
    d_ = res.to_dict()
    assert {"rows", "logit", "sum", "completeness_error", "dictionaries"} <= set(d_)
    assert {"name", "site", "feature", "value", "kind", "activation"} <= set(d_["rows"][0])
    assert len(res.to_frame()) == len(res.names)


def _norm_linear(norm, v, x):
    """A norm applied to ``v`` as an affine map, its per-token scale that of ``x`` (float64, by hand)."""
    x, v = x.double(), v.double()
    if norm.kind == "layernorm":
        s = 1 / torch.sqrt(x.var(-1, unbiased=False) + norm.eps)
        v = v - v.mean(-1, keepdim=True)
    else:
        s = 1 / torch.sqrt(x.pow(2).mean(-1) + norm.eps)
    y = v * s
    return y * norm.weight.double() if norm.weight is not None else y


@pytest.mark.parametrize("family,site,role", [("gemma3", "mlp_out.1", "transcoder"), ("granite", "mlp_out.0", "skip"),
                                              ("gpt2", "resid_post.0", "sae"), ("olmo2", "attn_out.1", "sae"),
                                              ("cohere", "mlp_out.1", "transcoder")])
def test_feature_values_against_brute_force(family, site, role):
    """Each feature's value: its decoded write pushed by hand (float64) through the sandwich norm with its traced
    scale, the residual multiplier, the final norm with its traced scale and ``W_U``."""
    lm = get_model(f"tiny:{family}")
    A = lm.anatomy
    D = _random(A.d_model, 32, kind="jumprelu", role=role, site=site, seed=7)
    D.threshold = D.threshold * 0  # a ReLU: more latents active
    res = feature_dla(lm, TEXT, [D], " the", " cat", position=4)
    name, layer = site.split(".")
    layer = int(layer)
    ids = encode(lm, TEXT)[None]
    cap = capture(lm, ids, [site, "ln_final.in", "ln_mlp.out." + str(layer)])
    x, fin = cap[site][0, 4].double(), cap["ln_final.in"][0, 4].double()
    x_in = cap[f"ln_mlp.out.{layer}"][0, 4].double() if role != "sae" else x
    pre = (x_in - D.b_dec.double() if role == "sae" else x_in) @ D.W_enc.double() + D.b_enc.double()
    z = pre.clamp(min=0)
    t, f = (int(lm.tokenizer(w, add_special_tokens=False).input_ids[0]) for w in (" the", " cat"))
    u = (A.unembed.W_U[:, t].double() - A.unembed.W_U[:, f].double()) * A.unembed.logit_scale

    def read(v):  # a vector at the site, as its direct effect on the logit difference
        if name in ("attn_out", "mlp_out"):
            lay = A.layers[layer]
            norm = lay.ln_attn_out if name == "attn_out" else lay.ln_mlp_out
            v = _norm_linear(norm, v, x) if norm is not None else v
            v = v * lay.residual_scale
        return float(_norm_linear(A.final_norm, v, fin) @ u)

    want = {i: read(z[i] * D.W_dec[i].double()) for i in z.nonzero()[:, 0].tolist()}
    got = {f_: v for k, f_, v in zip(res.kinds, res.features, res.values.tolist()) if k == "feature"}
    assert set(got) == set(want) and len(want) > 3
    scale = max(abs(v) for v in want.values())
    for i in want:
        assert got[i] == pytest.approx(want[i], abs=1e-5 * scale), (i, got[i], want[i])
    acts = {f_: a for k, f_, a in zip(res.kinds, res.features, res.activations.tolist()) if k == "feature"}
    assert all(acts[i] == pytest.approx(float(z[i]), rel=1e-5) for i in want)
    bias = next(v for k, v in zip(res.kinds, res.values.tolist()) if k == "bias")
    norm = None if name == "resid_post" else (A.layers[layer].ln_mlp_out if name == "mlp_out" else
                                              A.layers[layer].ln_attn_out)
    nb = 0.0 if norm is None or norm.bias is None else float(norm.bias.double() @ u) * A.layers[layer].residual_scale
    assert bias == pytest.approx(read(D.b_dec.double()) + nb, abs=1e-5 * scale)
    recon = z @ D.W_dec.double() + D.b_dec.double() + (x_in @ D.W_skip.double().T if role == "skip" else 0)
    err = next(v for k, v in zip(res.kinds, res.values.tolist()) if k == "error")
    assert err == pytest.approx(read(x - recon), abs=1e-5 * max(scale, abs(read(x - recon))))


def test_default_target_and_bad_input():
    lm = get_model("tiny:llama")
    d = lm.anatomy.d_model
    D = _random(d, 24, site="resid_post.1", seed=1)
    res = feature_dla(lm, TEXT, [D])
    logits = run(lm, encode(lm, TEXT)[None]).logits[0, -1]
    assert res.target_id == int(logits.argmax()) and res.foil is None
    assert set(res.kinds) <= {"feature", "bias", "error", "readout"}  # the last block's output stands for all
    with pytest.raises(InputError, match="alternatives"):
        feature_dla(lm, TEXT, [D, _random(d, 24, site="resid_post.0", seed=2)])
    with pytest.raises(InputError, match="already splits"):
        feature_dla(lm, TEXT, [D, _random(d, 24, site="attn_out.1", seed=2)])
    with pytest.raises(InputError, match="outside"):
        feature_dla(lm, TEXT, [D], position=99)
    with pytest.raises(InputError, match="no dictionary"):
        feature_dla(lm, TEXT, [])
    other = _random(d, 24, site="resid_post.1", seed=1)
    other.fingerprint, other.model = "0" * 16, "someone-else"
    with pytest.raises(InputError, match="trained on"):
        feature_dla(lm, TEXT, [other])
    with pytest.raises(InputError, match="same token"):
        feature_dla(lm, TEXT, [D], " cat", " cat")


def test_feature_attribution_plots_its_largest_parts_by_kind(tmp_path):
    from matplotlib.colors import to_hex

    from lenscope.viz.plots import KIND_COLORS

    lm = get_model("tiny:llama")
    D = _random(lm.anatomy.d_model, 24, site="resid_post.1", seed=1)
    res = feature_dla(lm, TEXT, [D], " the", " cat")
    top = res.top(4, kind=None)
    fig = res.plot(top=4)
    bars = fig.axes[0].patches
    assert len(bars) == 4
    # the bars are the four largest parts, in the result's order, each coloured by its kind
    rows = [r for r in res.to_records() if r in top]
    assert sorted(round(b.get_width(), 9) for b in bars) == sorted(round(r["value"], 9) for r in rows)
    for b, r in zip(bars, rows):
        assert b.get_width() == pytest.approx(r["value"])
        if r["kind"] in ("feature", "error"):
            assert to_hex(b.get_facecolor()) == KIND_COLORS[r["kind"]]
    assert len(res.plot(top=None).axes[0].patches) == len(res.names)


# -- attribution patching over latents ---------------------------------------------------------------------------

CLEAN, CORRUPTED = "The cat sat on the mat", "The dog ran on the mat"


def _affine_readout(lm) -> LoadedModel:
    """A copy of ``lm`` whose final norm is affine: its eps far above any state's variance (its per-token scale is
    then one float32 number, whatever the state) and its weight scaled to keep the logits' size. From the last
    block's output to the logits the model is then affine, so the metric is affine in that block's latents."""
    model = copy.deepcopy(lm.model)
    norm = family_for(model).hooks(model).final_norm
    attr = "variance_epsilon" if hasattr(norm, "variance_epsilon") else "eps"
    setattr(norm, attr, 1e12)
    with torch.no_grad():
        norm.weight.mul_(1e6)
    out = LoadedModel(model=model, tokenizer=lm.tokenizer, anatomy=family_for(model).read(model), name=lm.name)
    return out


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_atp_equals_exact_patching_where_the_metric_is_affine(family):
    lm = _affine_readout(get_model(f"tiny:{family}"))
    A = lm.anatomy
    D = _random(A.d_model, 48, kind="jumprelu", site=f"resid_post.{A.n_layers - 1}", seed=11)
    D.threshold = D.threshold * 0
    res = feature_atp(lm, CLEAN, CORRUPTED, " the", " cat", dictionaries=[D], top=8)
    assert len(res.node_names) == 8  # all at the metric's position: nothing else reaches it
    assert all(p == res.position for p in res.node_pos.tolist())
    # exact patching subtracts two float32 forward passes: their rounding, relative to the logits' size
    scale = float(run(lm, encode(lm, CLEAN)[None]).logits[0, -1].abs().max())
    limit = 32 * EPS * scale
    assert res.agreement["max_abs_error"] <= limit, res.agreement
    assert float(res.node_exact.abs().max()) > 100 * limit  # the patches do move the metric, well above rounding
    assert res.agreement["sign_agreement"] == 1.0


def test_atp_against_exact_on_a_nonlinear_case_reports_the_gap(tmp_path):
    lm = get_model("tiny:llama")
    A = lm.anatomy
    D = _random(A.d_model, 48, kind="topk", role="transcoder", site="mlp_out.0", seed=5, k=6)
    res = feature_atp(lm, CLEAN, CORRUPTED, " the", " cat", dictionaries=[D], top=6, batch_size=4)
    assert len(res.node_names) == 6
    c, x = encode(lm, CLEAN)[None], encode(lm, CORRUPTED)[None]
    t, f = (int(lm.tokenizer(w, add_special_tokens=False).input_ids[0]) for w in (" the", " cat"))
    site = "mlp_out.latents.0"
    zc = run(lm, c, capture=[site], dictionaries=[D]).captured[site][0]
    zx = run(lm, x, capture=[site], dictionaries=[D]).captured[site][0]
    m0 = float(metric_of(run(lm, c).logits, "logit_diff", t, f, at=-1)[0])
    assert res.metric_clean == pytest.approx(m0, abs=1e-5)
    lg, cap = run(lm, c, capture=[site], grad=True, dictionaries=[D])
    g, = torch.autograd.grad(metric_of(lg, "logit_diff", t, f, at=-1).sum(), [cap[site]])
    want_atp = ((zx - zc) * g[0]).detach()
    assert torch.allclose(res.scores("mlp_out.0"), want_atp.float(), atol=1e-6)
    for p, i, exact in zip(res.node_pos.tolist(), res.node_feature.tolist(), res.node_exact.tolist()):
        e = Edit(site.rsplit(".", 1)[0], 0, torch.tensor([0]), torch.tensor([p]), zx[p, i].reshape(1),
                 head=torch.tensor([i]))
        m = float(metric_of(run(lm, c, [e], dictionaries=[D]).logits, "logit_diff", t, f, at=-1)[0])
        assert exact == pytest.approx(m - m0, abs=1e-5)
    gap = (res.node_atp - res.node_exact).abs()
    assert res.agreement["max_abs_error"] == pytest.approx(float(gap.max()))
    assert res.agreement["max_abs_error"] > 1e-4  # the linearisation's error through the later block, reported
    back = FeatureAtP.load(res.save(tmp_path / "atp.safetensors"))
    assert back.node_names == res.node_names
    assert_same_computation(back.atp, res.atp, why="saved and read back")
    assert {"nodes", "agreement", "metric_clean", "sites"} <= set(res.to_dict())
    assert list(res.to_frame().columns) == ["name", "site", "position", "feature", "atp", "exact", "error"]


def test_feature_dla_by_head_keeps_the_other_heads():
    """With the attention writes split into heads, an attn_out dictionary replaces its block's heads and output
    bias only; the other block's heads stay, and the sum still holds (a sandwich model: gemma3)."""
    lm = get_model("tiny:gemma3")
    D = _random(lm.anatomy.d_model, 40, kind="jumprelu", site="attn_out.1", seed=3)
    res = feature_dla(lm, TEXT, [D], " the", " cat", by_head=True)
    assert res.completeness_error <= _limit(res)
    assert "L0.H0" in res.names and "L0.attn_bias" in res.names and "L2.H1" in res.names
    assert not any(n.startswith("L1.H") or n == "L1.attn_bias" for n in res.names)
    assert res.top(3)[0]["kind"] == "feature" and len(res.top(3)) == 3


def test_feature_atp_over_two_prompts_is_their_mean():
    lm = get_model("tiny:llama")
    D = _random(lm.anatomy.d_model, 32, kind="topk", site="resid_post.0", seed=9, k=6)
    other = ("The dog sat on the mat", "The cat ran on the mat")
    both = feature_atp(lm, [CLEAN, other[0]], [CORRUPTED, other[1]], " the", " cat", dictionaries=[D], top=3)
    one = feature_atp(lm, CLEAN, CORRUPTED, " the", " cat", dictionaries=[D], top=0)
    two = feature_atp(lm, other[0], other[1], " the", " cat", dictionaries=[D], top=0)
    assert both.n == 2 and len(one.node_names) == 0 and one.agreement == {"nodes": 0}
    assert torch.allclose(both.atp, (one.atp + two.atp) / 2, atol=1e-6)
    assert both.metric_clean == pytest.approx((one.metric_clean + two.metric_clean) / 2, abs=1e-6)
    assert len(both.node_names) == 3 and both.node_names[0].startswith("resid_post.0/F")
