"""Sparse dictionaries in the core: their equations, their files (SAELens's layout), and their latents as engine
sites on every decoder family: with no edit the model's output is unchanged, an edit moves the site by exactly
the decoded change, the splice puts the reconstruction in place, and the latents' gradient is the decoder's
projection of the site's."""

from __future__ import annotations

import json

import pytest
import torch

from lenscope.errors import InputError
from lenscope.models.dictionaries.dictionary import (
    Dictionary,
    load_dictionaries,
    save_dictionaries,
    site_of_hook,
    tl_hook_name,
)
from lenscope.models.loading.summary import fingerprint
from lenscope.models.runtime.engine import Edit, run
from tests.conftest import TINY, get_model
from tests.tolerances import assert_same_computation

TEXT = "The cat sat on the mat because it was warm"


def _random(d, width=24, *, kind="topk", role="sae", site=None, seed=0, k=4):
    D = Dictionary.init(d, width, kind=kind, role=role, k=k if kind == "topk" else None, site=site, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    D.b_enc = torch.randn(width, generator=g) * 0.1
    D.b_dec = torch.randn(d, generator=g) * 0.1
    if D.threshold is not None:
        D.threshold = torch.rand(width, generator=g) * 0.2
    if D.W_skip is not None:
        D.W_skip = torch.randn(d, d, generator=g) * 0.05
    return D


def _brute_latents(D, x):
    """The equations written out, in float64, row by row."""
    x = x.double()
    pre = (x - D.b_dec.double() if D.role == "sae" else x) @ D.W_enc.double() + D.b_enc.double()
    z = torch.zeros_like(pre)
    for i in range(pre.shape[0]):
        if D.kind == "topk":
            order = pre[i].argsort(descending=True)[: D.k]
            z[i, order] = pre[i, order].clamp(min=0)
        else:
            keep = pre[i] > D.threshold.double()
            z[i] = torch.where(keep, pre[i].clamp(min=0), torch.zeros_like(pre[i]))
    return z


@pytest.mark.parametrize("kind", ["topk", "batchtopk", "jumprelu"])
@pytest.mark.parametrize("role", ["sae", "transcoder", "skip"])
def test_equations_against_brute_force(kind, role):
    D = _random(16, 40, kind=kind, role=role, seed=3)
    x = torch.randn(9, 16, generator=torch.Generator().manual_seed(5))
    z = D.encode(x)
    ref = _brute_latents(D, x)
    assert torch.allclose(z.double(), ref, atol=1e-5 * float(ref.abs().max()))
    if kind == "topk":
        assert int((z != 0).sum(-1).max()) <= D.k
    out = z.double() @ D.W_dec.double() + D.b_dec.double()
    if role == "skip":
        out = out + x.double() @ D.W_skip.double().T
    assert torch.allclose(D(x).double(), out, atol=1e-5 * float(out.abs().max()))


@pytest.mark.parametrize("role", ["sae", "transcoder", "skip"])
def test_folding_the_normalisation_keeps_the_function(role):
    D = _random(12, 30, kind="jumprelu", role=role, seed=7)
    s_in, s_out = 2.5, (2.5 if role == "sae" else 0.4)
    x = torch.randn(6, 12, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    F = D.to(torch.float64).folded(s_in, s_out)
    Dd = D.to(torch.float64)
    assert torch.allclose(F.encode(x), Dd.encode(s_in * x), atol=1e-12)
    assert torch.allclose(F(x), Dd(s_in * x) / s_out, atol=1e-12)
    assert (F.scale_in, F.scale_out) == (s_in, s_out)


@pytest.mark.parametrize("kind", ["topk", "batchtopk", "jumprelu"])
@pytest.mark.parametrize("role", ["sae", "transcoder", "skip"])
def test_save_and_load_round_trip_in_saelens_layout(tmp_path, kind, role):
    site = "mlp_out.1" if role != "sae" else "resid_post.1"
    D = _random(8, 20, kind=kind, role=role, site=site, seed=2)
    D.model, D.fingerprint, D.info = "tiny:gpt2", "abc", {"tokens": 5}
    D.save(tmp_path)
    cfg = json.loads((tmp_path / "cfg.json").read_text())
    assert cfg["d_in"] == 8 and cfg["d_sae"] == 20 and cfg["normalize_activations"] == "none"
    assert cfg["apply_b_dec_to_input"] is (role == "sae")
    assert cfg["architecture"] == {("topk", "sae"): "topk", ("batchtopk", "sae"): "jumprelu",
                                   ("jumprelu", "sae"): "jumprelu"}.get((kind, role), cfg["architecture"])
    if role == "sae":
        assert cfg["metadata"]["hook_name"] == "blocks.1.hook_resid_post"
    else:
        assert cfg["metadata"]["hook_name"] == "blocks.1.mlp.hook_in"
        assert cfg["metadata"]["hook_name_out"] == "blocks.1.hook_mlp_out" and cfg["d_out"] == 8
    E = Dictionary.load(tmp_path)
    assert (E.kind, E.role, E.k, E.site, E.model, E.fingerprint, E.info) == \
        (D.kind, D.role, D.k, D.site, D.model, D.fingerprint, D.info)
    for name, t in D.tensors().items():
        assert_same_computation(E.tensors()[name], t, why="saved and read back")


def test_reads_a_saelens_relu_sae_without_lenscopes_record(tmp_path):
    """A folder as SAELens writes a ReLU ("standard") SAE: read as a JumpReLU at threshold 0, the same function."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    t = {"W_enc": torch.randn(6, 10, generator=g), "b_enc": torch.randn(10, generator=g),
         "W_dec": torch.randn(10, 6, generator=g), "b_dec": torch.randn(6, generator=g)}
    save_file(t, str(tmp_path / "sae_weights.safetensors"))
    (tmp_path / "cfg.json").write_text(json.dumps({
        "architecture": "standard", "d_in": 6, "d_sae": 10, "apply_b_dec_to_input": True,
        "normalize_activations": "none", "metadata": {"model_name": "gpt2", "hook_name": "blocks.3.hook_resid_pre"}}))
    D = Dictionary.load(tmp_path)
    assert D.site == "resid_pre.3" and D.kind == "jumprelu" and D.model == "gpt2"
    x = torch.randn(4, 6, generator=g)
    z = torch.relu((x - t["b_dec"]) @ t["W_enc"] + t["b_enc"])
    assert torch.allclose(D.encode(x), z, atol=1e-6)


def test_bad_files_and_settings_are_one_line_errors(tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        load_dictionaries(tmp_path / "nothing")
    with pytest.raises(InputError, match="holds no dictionary"):
        load_dictionaries(tmp_path)
    with pytest.raises(InputError, match="0 < k < width"):
        Dictionary.init(8, 16, kind="topk", k=16)
    with pytest.raises(InputError, match="unknown dictionary kind"):
        Dictionary.init(8, 16, kind="relu6", k=2)
    with pytest.raises(InputError, match="transcoder replaces an MLP"):
        Dictionary.init(8, 16, k=2, role="transcoder", site="resid_post.1")
    with pytest.raises(InputError, match="site is one of"):
        Dictionary.init(8, 16, k=2, site="q.1")
    with pytest.raises(InputError, match="names no site"):
        site_of_hook("blocks.1.attn.hook_z")
    assert site_of_hook(tl_hook_name("attn_out.4")) == "attn_out.4"
    (tmp_path / "cfg.json").write_text(json.dumps({"architecture": "gated", "d_in": 2, "d_sae": 3}))
    from safetensors.torch import save_file

    save_file({n: torch.zeros(s) for n, s in [("W_enc", (2, 3)), ("b_enc", (3,)), ("W_dec", (3, 2)),
                                               ("b_dec", (2,))]}, str(tmp_path / "sae_weights.safetensors"))
    with pytest.raises(InputError, match="architecture 'gated'"):
        Dictionary.load(tmp_path)


def test_a_folder_of_sites_loads_in_site_order(tmp_path):
    ds = [_random(8, 12, role="transcoder", site=f"mlp_out.{i}", seed=i) for i in (2, 0, 1)]
    save_dictionaries(ds, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlp_out.0", "mlp_out.1", "mlp_out.2"]
    assert [d.site for d in load_dictionaries(tmp_path)] == ["mlp_out.0", "mlp_out.1", "mlp_out.2"]
    assert [d.site for d in load_dictionaries(tmp_path / "mlp_out.1")] == ["mlp_out.1"]


def test_a_dictionary_for_another_model_is_refused():
    lm = get_model("tiny:llama")
    D = _random(lm.anatomy.d_model, site="resid_post.0")
    D.fingerprint, D.model = fingerprint(get_model("tiny:gpt2").anatomy), "tiny:gpt2"
    ids = lm.tokenizer(TEXT, return_tensors="pt").input_ids
    with pytest.raises(InputError, match="trained on 'tiny:gpt2', not on 'tiny:llama'"):
        run(lm, ids, capture=["resid_post.latents.0"], dictionaries=[D])
    with pytest.raises(InputError, match="needs a dictionary for resid_post.0"):
        run(lm, ids, capture=["resid_post.latents.0"])
    E = _random(lm.anatomy.d_model + 1, site="resid_post.0")
    with pytest.raises(InputError, match="d_model"):
        run(lm, ids, capture=["resid_post.latents.0"], dictionaries=[E])


def test_the_model_in_bfloat16_or_float32_is_one_model():
    """A dictionary (a lens, a direction) made on the model loaded in bfloat16 runs on it in float32 and back: the
    fingerprint samples the weights rounded to bfloat16. A file holding the legacy fingerprint (before that
    rounding) is still accepted by the model in its dtype; another model's is not."""
    import lenscope
    from lenscope.models.loading.summary import same_model

    f32 = lenscope.load("tiny:llama")
    b16 = lenscope.load("tiny:llama", dtype="bfloat16")
    other = get_model("tiny:gpt2").anatomy
    assert fingerprint(f32.anatomy) == fingerprint(b16.anatomy) != fingerprint(other)
    assert fingerprint(f32.anatomy, legacy=True) != fingerprint(b16.anatomy, legacy=True)  # the legacy hash differed
    assert same_model(fingerprint(b16.anatomy, legacy=True), f32.anatomy)  # a file made on bfloat16, run in float32
    assert same_model(fingerprint(f32.anatomy, legacy=True), f32.anatomy)
    assert not same_model(fingerprint(other), f32.anatomy) and not same_model(None, f32.anatomy)
    D = _random(f32.anatomy.d_model, site="resid_post.0")
    D.fingerprint, D.model = fingerprint(b16.anatomy, legacy=True), "tiny:llama"
    ids = f32.tokenizer(TEXT, return_tensors="pt").input_ids
    z = run(f32, ids, capture=["resid_post.latents.0"], dictionaries=[D]).captured["resid_post.latents.0"]
    assert z.shape == ids.shape + (D.width,)


def _dicts(lm):
    A = lm.anatomy
    L = A.n_layers
    d = A.d_model
    out = [_random(d, 3 * d, kind="jumprelu", site=f"resid_post.{L - 1}", seed=1),
           _random(d, 3 * d, kind="topk", site="attn_out.0", seed=2)]
    if A.placement != "post":
        out.append(_random(d, 3 * d, kind="batchtopk", role="skip", site=f"mlp_out.{L - 1}", seed=3))
    for D in out:
        D.fingerprint = fingerprint(A)
    return out


@pytest.mark.parametrize("family", TINY)
def test_latent_sites_on_every_family(family):
    lm = get_model(f"tiny:{family}")
    A = lm.anatomy
    ids = lm.tokenizer(TEXT, return_tensors="pt").input_ids[:, :8]
    ids = torch.cat([ids, ids.flip(1)])  # two rows
    dicts = _dicts(lm)
    sites = [D.site for D in dicts]
    lats = [s.replace(".", ".latents.", 1) for s in sites]
    ins = [D.input_site for D in dicts]
    plain = run(lm, ids, capture=sites + ins)
    with_d = run(lm, ids, capture=sites + lats, dictionaries=dicts)
    # no edit: the model runs untouched (the same numbers, not merely close)
    assert_same_computation(with_d.logits, plain.logits, why="no edit: the dictionary's hooks leave the run as it is")
    for D, lat, i in zip(dicts, lats, ins):
        z = with_d.captured[lat]
        assert z.shape == (2, ids.shape[1], D.width)
        ref = D.encode(plain.captured[i].float())
        assert torch.allclose(z, ref, atol=1e-5 * (1 + float(ref.abs().max())))
    # an edit of one latent moves the site by exactly the decoded change, and nothing before it
    D, s, lat = dicts[0], sites[0], lats[0]
    unit = 5
    edit = Edit(lat.split(".latents")[0] + ".latents", D.layer, rows=torch.tensor([1]), pos=torch.tensor([3]),
                values=torch.tensor([2.0]).expand(1, 1), mode="add")
    edit.values = torch.zeros(1, D.width)
    edit.values[0, unit] = 2.0
    ed = run(lm, ids, [edit], capture=[s, lat], dictionaries=dicts)
    moved = ed.captured[s].float() - plain.captured[s].float()
    expect = torch.zeros_like(moved)
    expect[1, 3] = 2.0 * D.W_dec[unit]
    scale = float(plain.captured[s].float().abs().max()) + 2.0 * float(D.W_dec[unit].abs().max())
    assert torch.allclose(moved, expect, atol=4 * torch.finfo(torch.float32).eps * scale)
    assert_same_computation(ed.captured[lat][1, 3, unit], with_d.captured[lat][1, 3, unit] + 2.0,
                            why="one addition of 2 to the same latent")
    assert float((ed.logits[1, 3:] - plain.logits[1, 3:]).abs().max()) > 1e-3  # the edit moved what follows
    if A.causal:
        assert_same_computation((ed.logits[1, :3], ed.logits[0]), (plain.logits[1, :3], plain.logits[0]),
                                why="the same batch: rows and positions before the edit compute from the same numbers")
    # the splice: each site holds its dictionary's reconstruction
    for D, s, i in zip(dicts, sites, ins):  # (what a dictionary reads comes before what it writes)
        sp = run(lm, ids, capture=[s], dictionaries=[D], splice=True)
        rec = D(plain.captured[i].float())
        assert torch.allclose(sp.captured[s].float(), rec, atol=1e-5 * (1 + float(rec.abs().max())))
    assert float((run(lm, ids, dictionaries=dicts, splice=True).logits - plain.logits).abs().max()) > 1e-3


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2"])
def test_latents_gradient_is_the_decoders_projection_of_the_sites(family):
    lm = get_model(f"tiny:{family}")
    ids = lm.tokenizer(TEXT, return_tensors="pt").input_ids[:, :8]
    D = _dicts(lm)[0]
    lat = D.site.replace(".", ".latents.", 1)
    r = run(lm, ids, capture=[lat], dictionaries=[D], grad=True)
    r.logits[0, -1, 7].backward()
    g_lat = r.captured[lat].grad
    r2 = run(lm, ids, capture=[D.site], grad=True)
    r2.logits[0, -1, 7].backward()
    g_site = r2.captured[D.site].grad.float()
    ref = g_site @ D.W_dec.T
    assert torch.allclose(g_lat, ref, atol=1e-5 * (1 + float(ref.abs().max())))
    assert_same_computation(r.logits.detach(), r2.logits.detach(), why="no edit: the latents' leaf adds "
                            "(z - z0) @ W_dec = 0 to the same forward")
