"""Dictionary files others write and read: SAELens's inference settings (``apply_b_dec_to_input``,
``rescale_acts_by_decoder_norm``, ``normalize_activations``) against SAELens's own equations, written out here from its
source (sae_lens 6.54: ``SAE.process_sae_in``, ``TopKSAE.encode/decode``, ``JumpReLUSAE.encode``, ``Transcoder``,
``ActivationScaler``) on small hand-made folders; the hook names of a transcoder's input; circuit-tracer's per-layer
layout against circuit-tracer's own equations (circuit-tracer 0.5: ``SingleLayerTranscoder``, ``load_relu_transcoder``,
``JumpReLU``)."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from lenscope.errors import InputError
from lenscope.models.dictionaries.dictionary import Dictionary, load_dictionaries, save_circuit_tracer, site_of_hook
from lenscope.models.runtime.engine import run
from tests.conftest import get_model
from tests.tolerances import U32, assert_same_computation

D_IN, WIDTH, K = 16, 48, 6


def _weights(arch: str, seed: int = 0) -> dict:
    """float32 weights with a large b_dec (so that subtracting it or not matters) and decoder rows of uneven norms
    (so that rescaling by them changes which latents are the top k)."""
    g = torch.Generator().manual_seed(seed)
    t = {"W_enc": torch.randn(D_IN, WIDTH, generator=g) / D_IN ** 0.5, "b_enc": torch.randn(WIDTH, generator=g) * 0.3,
         "W_dec": torch.randn(WIDTH, D_IN, generator=g) * (0.3 + 3 * torch.rand(WIDTH, 1, generator=g)),
         "b_dec": torch.randn(D_IN, generator=g) * 2.0}
    if "jumprelu" in arch:
        t["threshold"] = torch.rand(WIDTH, generator=g) * 0.5
    if "skip" in arch:
        t["W_skip"] = torch.randn(D_IN, D_IN, generator=g) * 0.1
    return t


def _folder(path, arch: str, t: dict, *, scaler: float | None = None, **settings):
    """A folder as SAELens writes it (6.x: the hooks under ``metadata``), written here by hand."""
    path.mkdir(parents=True, exist_ok=True)
    save_file(t, str(path / "sae_weights.safetensors"))
    transcoder = "transcoder" in arch
    cfg = {"architecture": arch, "d_in": D_IN, "d_sae": WIDTH, "dtype": "float32", "device": "cpu",
           "reshape_activations": "none",
           "metadata": {"model_name": "some-model", "sae_lens_version": "6.54.12",
                        "hook_name": "blocks.2.mlp.hook_in" if transcoder else "blocks.2.hook_resid_post",
                        **({"hook_name_out": "blocks.2.hook_mlp_out"} if transcoder else {})}}
    if arch.startswith("topk"):
        cfg["k"] = K
    if transcoder:
        cfg["d_out"] = D_IN
    cfg.update(settings)
    (path / "cfg.json").write_text(json.dumps(cfg))
    if scaler is not None:  # as SAELens's trainer saves it beside a checkpoint
        (path / "activation_scaler.json").write_text(json.dumps({"scaling_factor": scaler, "has_whitening": False}))
    return path


def _saelens(arch: str, cfg: dict, t: dict, x: torch.Tensor, scaler: float | None = None):
    """SAELens's inference, in float64: the latents and the output (and the bounds on a float32 evaluation's error:
    each pre-activation is a sum of D_IN + 2 products, each rounded once, and a fold rounds each weight once more;
    the output sums WIDTH + D_IN + 1 terms)."""
    t = {n: v.double() for n, v in t.items()}
    x = x.double()
    transcoder = "transcoder" in arch
    s = scaler if cfg.get("normalize_activations") == "expected_average_only_in" else 1.0
    sub = (not transcoder) and cfg.get("apply_b_dec_to_input", True)
    sae_in = x * s - (t["b_dec"] if sub else 0.0)  # process_sae_in (the scaler runs before the SAE in training)
    pre = sae_in @ t["W_enc"] + t["b_enc"]
    rescale = arch.startswith("topk") and cfg.get("rescale_acts_by_decoder_norm", False)
    n = t["W_dec"].norm(dim=-1) if rescale else torch.ones(WIDTH, dtype=torch.float64)
    pre = pre * n  # TopKSAE.encode: hidden_pre * W_dec.norm(dim=-1)
    if arch.startswith("topk"):
        vals, idx = pre.topk(K, dim=-1)
        z = torch.zeros_like(pre).scatter(-1, idx, vals.relu())
    elif "jumprelu" in arch:
        z = pre.relu() * (pre > t["threshold"])
    else:
        z = pre.relu()
    out = (z / n) @ t["W_dec"] + t["b_dec"]  # act_times_W_dec: feature_acts * (1 / W_dec.norm) @ W_dec
    if "skip" in arch:
        out = out + x @ t["W_skip"].T
    out = out / s  # the scaler's unscale
    # the float32 error bounds (see the docstring)
    a_enc = t["W_enc"].abs() * n
    scale_pre = (x.abs() * s + t["b_dec"].abs()) @ a_enc + t["b_enc"].abs() * n + t["b_dec"].abs() @ a_enc
    tol_pre = 2 * (D_IN + 4) * U32 * scale_pre
    a_dec = t["W_dec"].abs() / n[:, None] / s
    scale_out = z.abs() @ a_dec + t["b_dec"].abs() / s + (x.abs() @ t["W_skip"].abs().T if "skip" in arch else 0)
    tol_out = tol_pre @ a_dec + 2 * (WIDTH + D_IN + 4) * U32 * scale_out
    return z, out, tol_pre, tol_out


def _check(D: Dictionary, arch, cfg, t, x, scaler=None):
    z_ref, out_ref, tol_z, tol_out = _saelens(arch, cfg, t, x, scaler)
    z = D.encode(x).double()
    assert bool(((z != 0) == (z_ref != 0)).all()), "not the latents SAELens computes"
    assert bool(((z - z_ref).abs() <= tol_z).all()), float((z - z_ref).abs().max())
    out = D(x).double()
    assert bool(((out - out_ref).abs() <= tol_out).all()), float((out - out_ref).abs().max())


X = torch.randn(12, D_IN, generator=torch.Generator().manual_seed(9)) * 3.0


@pytest.mark.parametrize("norm", ["none", "expected_average_only_in"])
@pytest.mark.parametrize("rescale", [False, True])
@pytest.mark.parametrize("apply_b_dec", [True, False])
@pytest.mark.parametrize("arch", ["standard", "jumprelu", "topk"])
def test_saelens_sae_settings_are_honoured(tmp_path, arch, apply_b_dec, rescale, norm):
    """Every combination computes SAELens's latents and output (``rescale_acts_by_decoder_norm`` is a TopK setting:
    SAELens's other classes ignore it, and so does lenscope)."""
    t = _weights(arch, seed=1)
    scaler = 0.37 if norm != "none" else None
    settings = {"apply_b_dec_to_input": apply_b_dec, "rescale_acts_by_decoder_norm": rescale,
                "normalize_activations": norm}
    D = Dictionary.load(_folder(tmp_path / "sae", arch, t, scaler=scaler, **settings))
    assert D.site == "resid_post.2" and D.role == "sae"
    _check(D, arch, settings, t, X, scaler)
    folds = D.info.get("saelens_folded", [])
    assert ("apply_b_dec_to_input: false" in folds) == (not apply_b_dec)
    assert ("rescale_acts_by_decoder_norm: true" in folds) == (rescale and arch == "topk")
    assert any(f.startswith("normalize_activations") for f in folds) == (norm != "none")
    assert_same_computation(D.scale_in, scaler or 1.0, why="the stored factor times 1.0")
    # lenscope writes what its weights compute, and reads it back unchanged
    D.save(tmp_path / "again")
    cfg = json.loads((tmp_path / "again" / "cfg.json").read_text())
    assert cfg["apply_b_dec_to_input"] is True and cfg["normalize_activations"] == "none"
    assert cfg.get("rescale_acts_by_decoder_norm", False) is False
    E = Dictionary.load(tmp_path / "again")
    assert_same_computation(E.tensors(), D.tensors(), why="the weights written and read back")
    assert_same_computation((E.kind, E.k, E.site, E.scale_in, E.info), (D.kind, D.k, D.site, D.scale_in, D.info),
                            why="the record written to JSON and read back")


def test_a_gemma_scope_like_sae_is_read_without_subtracting_b_dec(tmp_path):
    """Gemma Scope's JumpReLU SAEs say apply_b_dec_to_input: false; reading them as if it were true moves every
    pre-activation by b_dec @ W_enc."""
    t = _weights("jumprelu", seed=2)
    D = Dictionary.load(_folder(tmp_path, "jumprelu", t, apply_b_dec_to_input=False, normalize_activations="none"))
    pre = X.double() @ t["W_enc"].double() + t["b_enc"].double()
    ref = pre.relu() * (pre > t["threshold"].double())
    wrong = (X.double() - t["b_dec"].double()) @ t["W_enc"].double() + t["b_enc"].double()
    assert float((wrong - pre).abs().max()) > 1.0  # what ignoring the setting costs here
    _check(D, "jumprelu", {"apply_b_dec_to_input": False}, t, X)
    assert bool(((D.encode(X).double() != 0) == (ref != 0)).all())


@pytest.mark.parametrize("arch", ["transcoder", "jumprelu_transcoder", "skip_transcoder", "jumprelu_skip_transcoder",
                                  "topk_transcoder"])
def test_transcoders_never_subtract_b_dec(tmp_path, arch):
    t = _weights(arch, seed=3)
    settings = {"apply_b_dec_to_input": False, "normalize_activations": "none",
                "rescale_acts_by_decoder_norm": arch.startswith("topk")}
    D = Dictionary.load(_folder(tmp_path / "ok", arch, t, **settings))
    assert D.site == "mlp_out.2" and D.input_site == "ln_mlp.out.2" and D.transcoder
    _check(D, arch, settings, t, X)
    with pytest.raises(InputError, match="apply_b_dec_to_input is true for a transcoder"):
        Dictionary.load(_folder(tmp_path / "bad", arch, t, apply_b_dec_to_input=True))


@pytest.mark.parametrize(("norm", "scaler", "match"), [
    ("constant_norm_rescale", None, "'constant_norm_rescale' normalises each token's input"),
    ("layer_norm", None, "'layer_norm' normalises each token's input"),
    ("covariance_whitening", None, "'covariance_whitening' is not folded"),
    ("expected_average_only_in", None, "a factor this folder does not hold"),
    ("something_else", None, "'something_else' is not one lenscope reads"),
])
def test_normalisations_lenscope_cannot_honour_are_refused(tmp_path, norm, scaler, match):
    t = _weights("topk")
    with pytest.raises(InputError, match=match) as e:
        Dictionary.load(_folder(tmp_path, "topk", t, scaler=scaler, normalize_activations=norm))
    assert "\n" not in str(e.value) and "normalize_activations" in str(e.value)


def test_pre_6_saelens_configs(tmp_path):
    """SAELens before 6.0: the hook at the top level (``hook_point``), ``normalize_activations`` a bool, TopK as
    ``activation_fn: topk``."""
    t = _weights("topk", seed=4)
    save_file(t, str(tmp_path / "sae_weights.safetensors"))
    (tmp_path / "cfg.json").write_text(json.dumps({
        "d_in": D_IN, "d_sae": WIDTH, "hook_point": "blocks.1.hook_resid_pre", "model_name": "gpt2",
        "activation_fn": "topk", "activation_fn_kwargs": {"k": K}, "normalize_activations": False}))
    D = Dictionary.load(tmp_path)
    assert (D.kind, D.k, D.site, D.model) == ("topk", K, "resid_pre.1", "gpt2")
    _check(D, "topk", {}, t, X)


# -- the hook a transcoder reads --------------------------------------------------------------------------------

def _transcoder(d, layer=1, kind="jumprelu", seed=0, role="transcoder"):
    D = Dictionary.init(d, 3 * d, kind=kind, role=role, k=4 if kind == "topk" else None, site=f"mlp_out.{layer}",
                        seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    D.b_enc = torch.randn(D.width, generator=g) * 0.02
    D.b_dec = torch.randn(d, generator=g) * 0.1
    if D.threshold is not None:
        D.threshold = torch.rand(D.width, generator=g) * 0.02 - 0.005  # some negative: ReLU's zero still applies
    if D.W_skip is not None:
        D.W_skip = torch.randn(d, d, generator=g) * 0.05
    return D


def _strip_record(folder):
    cfg = json.loads((folder / "cfg.json").read_text())
    del cfg["metadata"]["lenscope"]
    (folder / "cfg.json").write_text(json.dumps(cfg))
    return cfg


def test_a_transcoders_hooks_name_its_input_after_the_gain_and_map_back_to_its_site(tmp_path):
    """lenscope names a transcoder's input blocks.L.mlp.hook_in: the MLP module's input (what circuit-tracer's
    ReplacementModel hooks there, TransformerLens loaded without fold_ln), after the norm's gain, which is what the
    transcoder reads. TransformerLens's blocks.L.ln2.hook_normalized holds it before the gain. A file with those
    hooks and no lenscope record loads to the same site and latents."""
    lm = get_model("tiny:llama")
    d = lm.anatomy.d_model
    D = _transcoder(d, layer=0)
    D.save(tmp_path / "t")
    cfg = _strip_record(tmp_path / "t")
    assert (cfg["metadata"]["hook_name"], cfg["metadata"]["hook_name_out"]) == \
        ("blocks.0.mlp.hook_in", "blocks.0.hook_mlp_out")
    E = Dictionary.load(tmp_path / "t")
    assert (E.site, E.input_site) == ("mlp_out.0", "ln_mlp.out.0")
    assert site_of_hook("blocks.0.mlp.hook_out") == "mlp_out.0"

    ids = lm.tokenizer("The cat sat on the mat because it was warm", return_tensors="pt").input_ids
    seen = {}
    mlp = lm.model.model.layers[0].mlp
    h = mlp.register_forward_pre_hook(lambda mod, args: seen.setdefault("mlp_in", args[0].detach().clone()))
    try:
        r = run(lm, ids, capture=["ln_mlp.out.0", "ln_mlp.in.0", "mlp_out.latents.0"], dictionaries=[E])
    finally:
        h.remove()
    assert_same_computation(r.captured["ln_mlp.out.0"], seen["mlp_in"],
                            why="one forward pass: the norm's output is the MLP's input")
    # what ln2.hook_normalized holds: the input over its root mean square, before the gain (the gains are not 1)
    x = r.captured["ln_mlp.in.0"].double()
    ln = lm.anatomy.layers[0].ln_mlp
    pre_gain = x / (x.pow(2).mean(-1, keepdim=True) + ln.eps).sqrt()
    post_gain = seen["mlp_in"].double()
    ref = pre_gain * ln.weight.double()  # float32 rounds the mean of d squares, the root and two products
    assert bool(((post_gain - ref).abs() <= (d + 8) * U32 * ref.abs()).all())
    assert float((post_gain - pre_gain).abs().max()) > 0.05 * float(post_gain.abs().max())
    z = r.captured["mlp_out.latents.0"].double()
    z_ref = E.to(torch.float64).encode(post_gain)
    assert bool(((z != 0) == (z_ref != 0)).all())
    tol = 2 * (d + 4) * U32 * (post_gain.abs() @ E.W_enc.double().abs() + E.b_enc.double().abs())
    assert bool(((z - z_ref).abs() <= tol).all())


def test_the_old_pre_gain_name(tmp_path):
    """lenscope's own files written before the hook was renamed say blocks.L.ln2.hook_normalized, but their record
    says the site: they load as before. Another file with that name means the activations before the norm's gain,
    which lenscope does not read: refused in one line, saying what to do."""
    D = _transcoder(8, layer=3)
    D.save(tmp_path / "old")
    cfg = json.loads((tmp_path / "old" / "cfg.json").read_text())
    cfg["metadata"]["hook_name"] = "blocks.3.ln2.hook_normalized"
    (tmp_path / "old" / "cfg.json").write_text(json.dumps(cfg))
    E = Dictionary.load(tmp_path / "old")
    assert (E.site, E.input_site) == ("mlp_out.3", "ln_mlp.out.3")
    assert_same_computation(E.tensors(), D.tensors(), why="the weights written and read back")
    _strip_record(tmp_path / "old")
    with pytest.raises(InputError, match=r"blocks\.3\.ln2\.hook_normalized, TransformerLens's MLP input before the "
                                         r"norm's gain.*blocks\.3\.mlp\.hook_in") as e:
        Dictionary.load(tmp_path / "old")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(("hook_in", "hook_out", "match"), [
    ("blocks.3.hook_resid_mid", "blocks.3.hook_mlp_out", "reads blocks.3.hook_resid_mid"),
    ("blocks.3.mlp.hook_in", "blocks.4.hook_mlp_out", "writes blocks.4.hook_mlp_out"),
    ("blocks.3.hook_mlp_in", "blocks.3.hook_mlp_out", "names no site lenscope knows"),
])
def test_a_foreign_transcoder_reading_another_activation_is_refused(tmp_path, hook_in, hook_out, match):
    D = _transcoder(8, layer=3)
    D.save(tmp_path)
    cfg = _strip_record(tmp_path)
    cfg["metadata"].update(hook_name=hook_in, hook_name_out=hook_out)
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    with pytest.raises(InputError, match=match):
        Dictionary.load(tmp_path)
    cfg["metadata"].update(hook_name="blocks.3.mlp.hook_in", hook_name_out="blocks.3.mlp.hook_out")
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    assert Dictionary.load(tmp_path).site == "mlp_out.3"


# -- circuit-tracer's per-layer layout ----------------------------------------------------------------------------

def _circuit_tracer(path, L: int, x: torch.Tensor):
    """circuit-tracer 0.5's transcoder of block L, as ``load_relu_transcoder`` reads ``layer_{L}.safetensors``
    (JumpReLU where ``activation_function.threshold`` is in the file, ReLU otherwise) and
    ``SingleLayerTranscoder.encode/decode`` compute, in float64."""
    t = {n: v.double() for n, v in load_file(str(path / f"layer_{L}.safetensors")).items()}
    x = x.double()
    pre = torch.nn.functional.linear(x, t["W_enc"], t["b_enc"])
    thr = t.get("activation_function.threshold")
    acts = pre * (pre > thr) if thr is not None else pre.relu()  # jumprelu.forward; F.relu
    out = acts @ t["W_dec"] + t["b_dec"] + (x @ t["W_skip"].T if "W_skip" in t else 0)
    tol_pre = 2 * (x.shape[-1] + 4) * U32 * (x.abs() @ t["W_enc"].abs().T + t["b_enc"].abs())
    tol_out = tol_pre @ t["W_dec"].abs() + 2 * (acts.shape[-1] + x.shape[-1] + 4) * U32 * (
        acts.abs() @ t["W_dec"].abs() + t["b_dec"].abs() + (x.abs() @ t["W_skip"].abs().T if "W_skip" in t else 0))
    return acts, out, tol_pre, tol_out


@pytest.mark.parametrize("role", ["transcoder", "skip"])
def test_circuit_tracers_layout_computes_what_lenscope_computes(tmp_path, role):
    d = 12
    ds = [_transcoder(d, layer=L, kind=kind, seed=L, role=role) for L, kind in enumerate(["jumprelu", "batchtopk"])]
    ds[1].threshold = ds[1].threshold.abs()
    ds[0].model = ds[1].model = "tiny:llama"
    save_circuit_tracer(ds[::-1], tmp_path)  # any order
    cfg = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert cfg == {"model_kind": "transcoder_set", "feature_input_hook": "mlp.hook_in",
                   "feature_output_hook": "mlp.hook_out", "model_name": "tiny:llama"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml", "layer_0.safetensors", "layer_1.safetensors"]
    x = torch.randn(10, d, generator=torch.Generator().manual_seed(4))
    for D in ds:
        t = load_file(str(tmp_path / f"layer_{D.layer}.safetensors"))
        assert set(t) == {"W_enc", "W_dec", "b_enc", "b_dec", "activation_function.threshold"} | \
            ({"W_skip"} if role == "skip" else set())
        assert t["W_enc"].shape == (D.width, d) and t["W_dec"].shape == (D.width, d)
        acts, out, tol_z, tol_out = _circuit_tracer(tmp_path, D.layer, x)
        z = D.encode(x).double()
        assert bool(((z != 0) == (acts != 0)).all())
        assert bool(((z - acts).abs() <= tol_z).all())
        assert bool(((D(x).double() - out).abs() <= tol_out).all())
    back = load_dictionaries(tmp_path)
    assert [(E.site, E.kind, E.role, E.model) for E in back] == [(D.site, D.kind, D.role, D.model) for D in ds]
    for D, E in zip(ds, back):
        assert_same_computation(E.W_enc, D.W_enc, why="a transpose written and read back")
        assert_same_computation(E.threshold, D.threshold.clamp(min=0), why="the threshold raised to 0, read back")


def test_circuit_tracers_layout_cannot_say_topk(tmp_path):
    """circuit-tracer (0.5) reads a per-layer file as a JumpReLU (with ``activation_function.threshold``) or a ReLU;
    it has no TopK, so a TopK transcoder would run there as a ReLU: refused in one line, with the alternatives."""
    ds = [_transcoder(8, layer=0, kind="topk"), _transcoder(8, layer=1)]
    with pytest.raises(InputError, match=r"TopK, which circuit-tracer \(0\.5\) cannot read.*--kind batchtopk") as e:
        save_circuit_tracer(ds, tmp_path)
    assert "\n" not in str(e.value) and not tmp_path.joinpath("config.yaml").exists()
    with pytest.raises(InputError, match=r"one transcoder for each block from 0; these are for blocks \[1\]"):
        save_circuit_tracer(ds[1:], tmp_path)
    sae = Dictionary.init(8, 16, kind="jumprelu", site="resid_post.0")
    with pytest.raises(InputError, match="holds transcoders"):
        save_circuit_tracer([sae], tmp_path)
    save_circuit_tracer([_transcoder(8, layer=L) for L in range(3)], tmp_path / "three")
    with pytest.raises(InputError, match="already holds layer_2.safetensors"):
        save_circuit_tracer([_transcoder(8, layer=L) for L in range(2)], tmp_path / "three")


def test_reads_circuit_tracers_files(tmp_path):
    """A folder as circuit-tracer's cache holds it (no lenscope record): ReLU without a threshold; a pre-gain input
    hook or cross-layer transcoders are refused."""
    g = torch.Generator().manual_seed(0)
    for L in range(2):
        save_file({"W_enc": torch.randn(20, 8, generator=g), "W_dec": torch.randn(20, 8, generator=g),
                   "b_enc": torch.randn(20, generator=g), "b_dec": torch.randn(8, generator=g)},
                  str(tmp_path / f"layer_{L}.safetensors"))
    cfg = {"model_kind": "transcoder_set", "feature_input_hook": "mlp.hook_in", "feature_output_hook": "hook_mlp_out"}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    ds = load_dictionaries(tmp_path)
    assert [(D.site, D.kind, D.role) for D in ds] == [("mlp_out.0", "jumprelu", "transcoder"),
                                                      ("mlp_out.1", "jumprelu", "transcoder")]
    x = torch.randn(5, 8, generator=g)
    acts, out, tol_z, tol_out = _circuit_tracer(tmp_path, 1, x)
    assert bool(((ds[1].encode(x).double() - acts).abs() <= tol_z).all())
    assert bool(((ds[1](x).double() - out).abs() <= tol_out).all())
    for change, match in [({"feature_input_hook": "ln2.hook_normalized"}, "before the norm's gain"),
                          ({"model_kind": "cross_layer_transcoder"}, "CrossLayerTranscoder.load"),
                          ({"transcoders": ["hf://org/repo/layer_0.safetensors"]}, "download them")]:
        (tmp_path / "config.yaml").write_text(yaml.safe_dump({**cfg, **change}))
        with pytest.raises(InputError, match=match):
            load_dictionaries(tmp_path)
