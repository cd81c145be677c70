"""Causal basis extraction and causal fidelity: sigma against its definition (float64 brute force), the
factored fast path and its gradient, orthonormal bases, a constructed lens whose answer is known, the
model-side ablation against a hand-made hook on the real model, results and the CLI."""

import json
import math
import warnings

import pytest
import torch
from typer.testing import CliRunner

from lenscope.cli import app
from lenscope.lenses import LogitLens, TunedLens, token_sequences
from lenscope.lenses.cbe import (
    CausalBasis,
    InfluenceObjective,
    causal_basis,
    extract_causal_basis,
    fidelity_spearman,
    layer_states,
    model_influence,
)
from lenscope.models.families import family_for
from tests.conftest import get_model, tiny_with_layers
from tests.tolerances import U32, assert_same_computation

TEXT = ("When Mary and John went to the store, John gave a drink to Mary. The capital of France is Paris. "
        "The keys to the cabinet are on the table. ") * 6
FAST = ["tiny:llama", "tiny:gpt2", "tiny:gemma3", "tiny:gpt-neox", "tiny:bloom", "tiny:opt", "tiny:qwen2"]
ENCODERS = ["tiny:bert", "tiny:roberta"]


def perturbed_lens(lm, seed=0, scale=0.3):
    lens = TunedLens(lm.anatomy, model_name=lm.name)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        lens.A.copy_(torch.randn(lens.A.shape, generator=g) * scale / lens.d_model**0.5)
        lens.b.copy_(torch.randn(lens.b.shape, generator=g) * scale)
    return lens


def decode64(A, x):
    """The model's decoder in float64: final norm (own statistics), masked-LM head, unembedding, soft-cap."""
    if A.final_norm is not None:
        x = A.final_norm.to(torch.float64)(x)
    u = A.unembed
    if u.transform_W is not None:
        from lenscope.models.weights.anatomy import ACTIVATIONS

        x = ACTIVATIONS[u.transform_act](x @ u.transform_W.double() + u.transform_b.double())
        x = u.transform_norm.to(torch.float64)(x)
    z = x @ u.W_U.double()
    if u.b_U is not None:
        z = z + u.b_U.double()
    if u.softcap is not None:
        z = torch.tanh(z / u.softcap) * u.softcap
    return z


def _definition_parts(A, lens, layer, H, mu=None):
    """The float64 pieces of sigma's definition: the states, their mean, the lens's translator ``T``."""
    H = H.double()
    mu = H.mean(0) if mu is None else mu.double()
    if isinstance(lens, TunedLens) and layer < lens.n_layers:
        M, b = lens.A[layer].detach().double(), lens.b[layer].detach().double()
        return H, mu, lambda h: h + h @ M + b
    return H, mu, lambda h: h


def sigma_by_definition(A, lens, layer, H, v, mu=None):
    """sigma(v) = E_h KL( f(h) || f(h - ((h - E h) . v) v) ), everything in float64."""
    H, mu, T = _definition_parts(A, lens, layer, H, mu)
    v = v.double()
    h2 = H - ((H - mu) @ v)[:, None] * v
    lp = torch.log_softmax(decode64(A, T(H)), -1)
    lq = torch.log_softmax(decode64(A, T(h2)), -1)
    return (lp.exp() * (lp - lq)).sum(-1).mean()


# How far float32 may fall from the float64 definition, on any CPU kernels: bounds derived from the computation
# (tests/tolerances.py), with u = U32 = 2^-24 float32's unit roundoff.


def sigma_tol(lm, sigma):
    """|float32 sigma - its definition| <= u (2 ln V + sigma). sigma = E_n [sum_v p log p - sum_v p log q] is a
    KL of 1e-7..1e-2 left over when a negative entropy and a negative cross-entropy cancel; each is at most
    ln V (+ sigma) in size (V the vocabulary). In float32 each log-probability is rounded to about u |log p_v| (the
    log-partition subtracted from every logit is of that size), so the KL computed from them is off by up to about
    u (2 ln V + sigma) whichever kernels ran. Rounding of the logits themselves (~1e-6 here) counts only through
    (q - p) . error (the KL is stationary at q = p), and |q - p|_1 <= sqrt(2 sigma) is below 0.07 for the sigmas
    here. Measured: at most 0.13 of this bound (ATEN default, avx2, avx512; MKL's AVX2 kernels)."""
    return U32 * (2 * math.log(lm.anatomy.vocab_size) + abs(float(sigma)))


def assert_sigma_close(lm, got, want):
    want = torch.as_tensor(want, dtype=torch.float64).reshape(-1)
    got = torch.as_tensor(got, dtype=torch.float64).reshape(-1)
    tol = torch.tensor([sigma_tol(lm, w) for w in want], dtype=torch.float64)
    assert ((got - want).abs() <= tol).all(), (got, want, tol)


def grad_tol(A, lens, layer, H, v, mu=None):
    """Per entry, |float32 d sigma / dv - its float64 autograd| <= u E_n sum_v w_nv |d z'_nv / dv|, with
    w = p (1 + |log p|) + q (1 + |log q|). The gradient is E_n sum_v (q - p)_v d z'_v / dv (z' the ablated logits):
    a sum whose terms cancel where q ~ p. Each float32 probability is rounded to within u (1 + |log p|) relative
    (the exponent's argument is of size |log p|), and the logits' own Jacobian in float32 is off by a few u
    relative, which counts only times (q - p). Measured: at most 0.17 u E_n sum_v (p + q) |dz'/dv|, about 0.03 of
    this bound (ATEN default, avx2, avx512)."""
    H, mu, T = _definition_parts(A, lens, layer, H, mu)
    v = v.detach().double()
    lp = torch.log_softmax(decode64(A, T(H)), -1)

    def ablated(v):
        return decode64(A, T(H - ((H - mu) @ v)[:, None] * v))

    with warnings.catch_warnings():  # forward-mode AD loads torch's own jit-scripted rules (deprecated there)
        warnings.simplefilter("ignore", DeprecationWarning)
        J = torch.func.jacfwd(ablated)(v)  # (tokens, vocab, d_model)
    lq = torch.log_softmax(ablated(v), -1)
    w = lp.exp() * (1 + lp.abs()) + lq.exp() * (1 + lq.abs())
    return U32 * (w[..., None] * J.abs()).sum(1).mean(0)


def setup(name, layer=1, seed=0):
    lm = get_model(name)
    seqs = token_sequences(lm, TEXT, 32, max_tokens=128)
    lens = perturbed_lens(lm, seed)
    return lm, seqs, lens, layer_states(lm, seqs, layer)


def some_directions(H, n=3, seed=0):
    """Principal directions (strong influence) and random ones."""
    Hc = H - H.mean(0)
    pcs = torch.linalg.svd(Hc, full_matrices=False).Vh[:n]
    g = torch.Generator().manual_seed(seed)
    rnd = torch.nn.functional.normalize(torch.randn(n, H.shape[1], generator=g), dim=-1)
    return torch.cat([pcs, rnd])


@pytest.mark.parametrize("name", FAST + ENCODERS)
@pytest.mark.parametrize("kind", ["tuned", "logit"])
def test_sigma_matches_its_definition(name, kind):
    lm, _, tuned, H = setup(name)
    lens = tuned if kind == "tuned" else LogitLens(lm.anatomy)
    V = some_directions(H)
    want = torch.stack([sigma_by_definition(lm.anatomy, lens, 1, H, v) for v in V])
    paths = [False] + ([True] if name not in ENCODERS else [])
    for fast in paths:
        assert_sigma_close(lm, InfluenceObjective(lm, lens, 1, H, fast=fast).sigma(V), want)
    if name in ENCODERS:  # a masked-LM head is not affine: the general path is chosen by itself
        assert not InfluenceObjective(lm, lens, 1, H).fast
    else:
        assert InfluenceObjective(lm, lens, 1, H).fast


def test_sigma_at_the_output_state_and_an_explicit_mean():
    lm, seqs, lens, _ = setup("tiny:gpt2")
    L = lm.anatomy.n_layers
    H = layer_states(lm, seqs, L)
    V = some_directions(H, 2)
    mu = H.mean(0) + 0.1
    want = torch.stack([sigma_by_definition(lm.anatomy, lens, L, H, v, mu) for v in V])
    got = InfluenceObjective(lm, lens, L, H, mean=mu).sigma(V)  # the lens is the identity at the output
    assert_sigma_close(lm, got, want)


@pytest.mark.parametrize("name", ["tiny:llama", "tiny:gpt2", "tiny:bloom"])
def test_gradient_matches_autograd_of_the_definition(name):
    lm, _, lens, H = setup(name)
    for v in some_directions(H, 2)[[0, 2]]:
        val, g = InfluenceObjective(lm, lens, 1, H).value_and_grad(v)
        v64 = v.double().requires_grad_(True)
        s = sigma_by_definition(lm.anatomy, lens, 1, H, v64)
        (g64,) = torch.autograd.grad(s, v64)
        assert_sigma_close(lm, val, s.detach())
        tol = grad_tol(lm.anatomy, lens, 1, H, v)
        assert ((g.double() - g64).abs() <= tol).all(), (g, g64, tol)
        g_general = InfluenceObjective(lm, lens, 1, H, fast=False).value_and_grad(v)[1]
        assert ((g_general.double() - g64).abs() <= tol).all(), (g_general, g64, tol)


def test_subset_is_every_kth_token_with_the_full_mean():
    lm, _, lens, H = setup("tiny:llama")
    obj = InfluenceObjective(lm, lens, 1, H)
    sub = obj.subset(3)
    v = some_directions(H, 1)[0]
    want = sigma_by_definition(lm.anatomy, lens, 1, H[::3], v, mu=H.mean(0))
    assert sub.N == H[::3].shape[0]
    assert_sigma_close(lm, sub.sigma(v[None]), want)


@pytest.mark.parametrize("name", ["tiny:llama", "tiny:gpt2", "tiny:bert"])
def test_cbe_basis_is_orthonormal_sorted_and_beats_principal_components(name):
    lm, _, lens, H = setup(name)
    obj = InfluenceObjective(lm, lens, 1, H)
    res = extract_causal_basis(obj, 4, max_evals=25)
    V, s = res["vectors"], res["sigma"]
    assert torch.allclose(V @ V.T, torch.eye(4), atol=1e-5)
    assert (s[:-1] >= s[1:]).all()
    # the best PC is the first start: never lost, up to the float32 rounding of the two evaluations
    assert float(s[0]) >= float(res["pca_sigma"].max()) - 2 * sigma_tol(lm, s[0])
    want = torch.stack([sigma_by_definition(lm.anatomy, lens, 1, H, v) for v in V])
    assert_sigma_close(lm, s, want)  # reported values are sigma of the returned vectors
    pca = res["pca_vectors"]
    assert torch.allclose(pca @ pca.T, torch.eye(4), atol=1e-5)
    assert (res["pca_variance"][:-1] >= res["pca_variance"][1:]).all()


def test_coarse_then_full_stage():
    lm, _, lens, H = setup("tiny:llama")
    obj = InfluenceObjective(lm, lens, 1, H)
    res = extract_causal_basis(obj, 2, coarse_tokens=40)  # 124 tokens: every 3rd one for the coarse stage
    assert all(e[0] > 0 and e[1] > 0 for e in res["evals"])
    V = res["vectors"]
    assert torch.allclose(V @ V.T, torch.eye(2), atol=1e-5)
    full = extract_causal_basis(InfluenceObjective(lm, lens, 1, H), 2, coarse_tokens=0)
    assert float(res["sigma"][0]) >= 0.95 * float(full["sigma"][0])


def one_direction_lens(lm, e, layer, alpha):
    """A tuned lens whose translator at ``layer`` is ``h -> alpha (h . e) e``: what it decodes depends on ``h``
    only through ``h . e``."""
    lens = TunedLens(lm.anatomy, model_name=lm.name)
    with torch.no_grad():
        lens.A[layer].copy_(alpha * torch.outer(e, e) - torch.eye(e.numel()))
    return lens


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_cbe_finds_the_one_direction_a_lens_reads(family):
    """Known answer: isotropic states, a readout linear in ``h . e`` (no final norm, small logits). Ablating
    ``v`` moves ``h . e`` by ``(v . e) (h - E h) . v``, whose variance is ``(v . e)^2``: ``e`` is the most
    influential direction, and every direction orthogonal to it has no influence at all."""
    import dataclasses

    from lenscope.models.loading.load import LoadedModel

    base = tiny_with_layers(family, 2)
    lm = LoadedModel(model=base.model, tokenizer=base.tokenizer, name=base.name,
                     anatomy=dataclasses.replace(base.anatomy, final_norm=None))
    d = lm.anatomy.d_model
    g = torch.Generator().manual_seed(3)
    H = torch.randn(2048, d, generator=g)
    H = (H - H.mean(0)) @ torch.linalg.inv(torch.linalg.cholesky(torch.cov(H.T, correction=0))).T  # whitened
    e = torch.nn.functional.normalize(torch.randn(d, generator=g), dim=0)
    r = e @ lm.anatomy.unembed.W_U
    lens = one_direction_lens(lm, e, 1, 0.5 / float(r.std()))  # logits move by about 0.5 per unit of h . e
    obj = InfluenceObjective(lm, lens, 1, H)
    res = extract_causal_basis(obj, 3, max_evals=40, coarse_tokens=0)
    assert abs(float(res["vectors"][0] @ e)) > 0.999
    assert float(res["sigma"][0]) > 1e-2
    # what is left of e after the search, plus float32's floor for a sigma that is 0
    assert float(res["sigma"][1:].abs().max()) < 1e-5 * float(res["sigma"][0]) + sigma_tol(lm, 0)
    assert float(res["pca_sigma"].max()) < 0.5 * float(res["sigma"][0])  # principal directions miss e
    # and the same lens on the real model's (non-isotropic) states: orthogonal directions still have none
    real = layer_states(base, token_sequences(base, TEXT, 32, max_tokens=128), 1)
    w = torch.nn.functional.normalize(torch.randn(2, d, generator=g), dim=-1)
    w = w - (w @ e)[:, None] * e
    w = torch.nn.functional.normalize(w, dim=-1)
    sig = InfluenceObjective(lm, lens, 1, real).sigma(torch.cat([e[None], w]))
    assert float(sig[0]) > 50 * sigma_tol(lm, 0) and float(sig[1:].abs().max()) <= sigma_tol(lm, 0)


def ablate_by_hand(lm, ids, layer, v, mu, skip_first=True):
    """KL(final || ablated final) with a forward pre-hook on the real block (no lenscope intervention code)."""
    block = family_for(lm.model).hooks(lm.model).layers[layer].block

    def hook(mod, args, kwargs):
        h = args[0] if args else kwargs["hidden_states"]
        c = (h - mu) @ v
        if skip_first:
            c[:, 0] = 0
        h2 = h - c[..., None] * v
        if args:
            return (h2,) + tuple(args[1:]), kwargs
        return args, {**kwargs, "hidden_states": h2}

    with torch.no_grad():
        base = lm.model(input_ids=ids).logits
        handle = block.register_forward_pre_hook(hook, with_kwargs=True)
        try:
            abl = lm.model(input_ids=ids).logits
        finally:
            handle.remove()
    first = 1 if skip_first else 0
    lp = torch.log_softmax(base[:, first:].double(), -1)
    lq = torch.log_softmax(abl[:, first:].double(), -1)
    return (lp.exp() * (lp - lq)).sum(-1).mean()


@pytest.mark.parametrize("name", ["tiny:llama", "tiny:gpt2", "tiny:gpt-neox", "tiny:bert"])
@pytest.mark.parametrize("layer", [0, 1])
def test_model_side_ablation_matches_editing_the_real_model(name, layer):
    lm = get_model(name)
    seqs = token_sequences(lm, TEXT, 24, max_tokens=72)
    H = layer_states(lm, seqs, layer)
    V = some_directions(H, 2)
    mu = H.mean(0)
    got = model_influence(lm, seqs, layer, V, mu)
    want = torch.stack([ablate_by_hand(lm, seqs, layer, v, mu) for v in V])
    # the KL by hand is float64 on float32 logits, model_influence's is float32 (sigma_tol); the two runs' logits
    # differ in rounding, which moves a KL only at second order
    assert_sigma_close(lm, got, want)
    # one direction per forward pass gives the same numbers as several (the same bound: only rounding differs)
    assert_sigma_close(lm, model_influence(lm, seqs, layer, V, mu, budget_bytes=1), want)


def test_model_side_at_the_output_state_is_the_logit_lens():
    lm = get_model("tiny:llama")
    seqs = token_sequences(lm, TEXT, 24, max_tokens=72)
    L = lm.anatomy.n_layers
    H = layer_states(lm, seqs, L)
    V = some_directions(H, 2)
    got = model_influence(lm, seqs, L, V, H.mean(0))
    want = torch.stack([sigma_by_definition(lm.anatomy, LogitLens(lm.anatomy), L, H, v) for v in V])
    assert_sigma_close(lm, got, want)


def test_logit_lens_at_last_state_is_perfectly_faithful():
    """At the output state the logit lens *is* the model: its influences equal the model's."""
    lm = get_model("tiny:llama")
    L = lm.anatomy.n_layers
    res = causal_basis(lm, LogitLens(lm.anatomy), TEXT, L, k=3, tokens=96, seq_len=32, model_tokens=None)
    # two float32 evaluations of the same sigma (the lens's and the model's), each within sigma_tol of the exact one
    tol = torch.tensor([2 * sigma_tol(lm, s) for s in res.model_sigma])
    assert ((res.sigma.double() - res.model_sigma.double()).abs() <= tol).all(), (res.sigma, res.model_sigma)
    assert res.fidelity_spearman == pytest.approx(1.0)


def test_causal_basis_result_roundtrip_and_fields(tmp_path):
    lm = get_model("tiny:gpt2")
    res = causal_basis(lm, perturbed_lens(lm), TEXT, 1, k=3, tokens=128, seq_len=32, model_tokens=60, name="tuned")
    assert isinstance(res, CausalBasis) and res.k == 3 and res.layer == 1 and res.lens == "tuned"
    assert res.n_model_tokens == 62  # two sequences of 31 predicted positions
    d = res.to_dict()
    assert {"layer", "sigma", "model_sigma", "pca_sigma", "fidelity_spearman"} <= set(d)
    assert len(d["sigma"]) == len(d["model_sigma"]) == len(d["pca_sigma"]) == 3
    json.dumps(d)
    back = CausalBasis.load(res.save(tmp_path / "cbe.safetensors"))
    assert_same_computation((back.vectors, back.to_dict()), (res.vectors, d), why="saved and read back")
    assert list(res.to_frame().columns) == ["sigma", "model_sigma", "pca_sigma", "pca_variance"]
    assert res.plot().axes
    assert fidelity_spearman([res, res]) == pytest.approx(res.fidelity_spearman)
    none = causal_basis(lm, LogitLens(lm.anatomy), TEXT, 1, k=2, tokens=64, seq_len=32, model_tokens=0)
    assert none.to_dict()["model_sigma"] is None and none.fidelity_spearman is None


def test_bad_input():
    from lenscope.errors import InputError

    lm, seqs, lens, H = setup("tiny:llama")
    with pytest.raises(InputError, match="k must be"):
        extract_causal_basis(InfluenceObjective(lm, lens, 1, H), 0)
    with pytest.raises(InputError, match="outside"):
        layer_states(lm, seqs, 7)
    bert = get_model("tiny:bert")
    Hb = layer_states(bert, token_sequences(bert, TEXT, 32, max_tokens=64), 1)
    with pytest.raises(InputError, match="factored path"):
        InfluenceObjective(bert, LogitLens(bert.anatomy), 1, Hb, fast=True)


runner = CliRunner()
CORPUS = ("When Mary and John went to the store, John gave a drink to Mary.\n"
          "The capital of France is Paris. The keys to the cabinet are on the table.\n") * 40


def test_cli_cbe_json_and_files(tmp_path):
    data = tmp_path / "corpus.txt"
    data.write_text(CORPUS)
    lens_dir = tmp_path / "lens"
    perturbed_lens(get_model("tiny:llama")).save(lens_dir)
    out = tmp_path / "out"
    r = runner.invoke(app, ["lens", "cbe", "--model", "tiny:llama", "--data", str(data), "--lens", str(lens_dir),
                            "--lens", "logit", "--layer", "1", "--k", "3", "--tokens", "128", "--seq-len", "32",
                            "--model-tokens", "62", "--part", "all", "--json", "--out", str(out)])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert {"layer", "sigma", "model_sigma", "pca_sigma", "fidelity_spearman"} <= set(d)
    assert d["layer"] == 1 and d["lens"] == "tuned" and len(d["sigma"]) == 3
    assert set(d["lenses"]) == {"tuned", "logit"}
    assert all(a >= b for a, b in zip(d["sigma"], d["sigma"][1:]))
    names = {p.name for p in out.iterdir()}
    assert {"cbe.json", "sigma-state1.png", "fidelity.png", "cbe-tuned-state1.safetensors",
            "cbe-logit-state1.safetensors"} <= names
    r = runner.invoke(app, ["lens", "cbe", "--model", "tiny:llama", "--data", str(data), "--layer", "0", "--layer",
                            "2", "--k", "2", "--tokens", "64", "--seq-len", "32", "--model-tokens", "31", "--part",
                            "all", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert [x["layer"] for x in d["layers"]] == [0, 2] and "layer" not in d
    assert d["lens"] == "logit" and "fidelity_spearman" in d
    r = runner.invoke(app, ["lens", "cbe", "--model", "tiny:llama", "--data", str(data), "--layer", "1",
                            "--k", "2", "--tokens", "64", "--seq-len", "32", "--part", "all"])
    assert r.exit_code == 0 and "σ lens" in r.stdout
    r = runner.invoke(app, ["lens", "cbe", "--model", "tiny:llama", "--data", str(data), "--layer", "9"])
    assert r.exit_code == 2 and "outside" in r.stderr


@pytest.mark.slow
def test_smollm2_cbe_small(smollm2):
    res = causal_basis(smollm2, LogitLens(smollm2.anatomy), TEXT * 4, 20, k=2, tokens=512, seq_len=128,
                       model_tokens=127, max_evals=10)
    assert res.fast and res.k == 2
    assert torch.allclose(res.vectors @ res.vectors.T, torch.eye(2), atol=1e-5)
    assert float(res.sigma[0]) >= float(res.sigma[1]) and float(res.sigma[0]) > float(res.pca_sigma.max()) * 0.999
    assert (res.model_sigma > 0).all()
