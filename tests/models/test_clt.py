"""Cross-layer transcoders in the core: the equations written out in float64, lenscope's files and circuit-tracer's
CLT layout (a file circuit-tracer itself wrote included), and the latents as engine sites on a tiny model: with no
edit the run is the real run, an edit of block l's latents moves mlp_out of block l and of every later block by
exactly the decoded change, and the splice puts the CLT's reconstruction in every MLP output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from lenscope.errors import InputError
from lenscope.models.dictionaries.clt import CrossLayerTranscoder
from lenscope.models.dictionaries.clt_formats import save_circuit_tracer_clt
from lenscope.models.dictionaries.dictionary import load_dictionaries
from lenscope.models.runtime.engine import Edit, run
from tests.conftest import get_model, tiny_with_layers
from tests.tolerances import U32, assert_same_computation, matmul_rounding

DATA = Path(__file__).parent / "data"
TEXT = "The cat sat on the mat because it was warm"


def _random(L=3, d=8, width=12, *, kind="topk", seed=0, k=3, model=None):
    C = CrossLayerTranscoder.init(L, d, width, kind=kind, k=k if kind == "topk" else None, seed=seed, model=model)
    g = torch.Generator().manual_seed(seed + 1)
    C.b_enc = torch.randn(L, width, generator=g) * 0.1
    C.b_dec = torch.randn(L, d, generator=g) * 0.1
    if C.threshold is not None:
        C.threshold = torch.rand(L, width, generator=g) * 0.2
    return C


def _brute(C, xs):
    """The equations of the module's docstring, in float64, token by token: latents per block, then every MLP
    output as the sum over earlier-or-same blocks of their latents times the decoder of that pair, plus its bias."""
    L = C.n_layers
    z = []
    for i in range(L):
        pre = xs[i].double() @ C.W_enc[i].double() + C.b_enc[i].double()
        zi = torch.zeros_like(pre)
        for r in range(pre.shape[0]):
            if C.kind == "topk":
                top = pre[r].argsort(descending=True)[:C.k]
                zi[r, top] = pre[r, top].clamp(min=0)
            else:
                keep = pre[r] > C.threshold[i].double()
                zi[r] = torch.where(keep, pre[r].clamp(min=0), torch.zeros_like(pre[r]))
        z.append(zi)
    out = torch.stack([sum(z[s] @ C.W_dec[s][:, t - s].double() for s in range(t + 1)) + C.b_dec[t].double()
                       for t in range(L)])
    return z, out


def _out_tol(C, xs, z):
    """How far float32's reconstruction may lie from the float64 one: each pre-activation within
    :func:`matmul_rounding` (carried to the output through the decoders' sizes), then the output's own sum."""
    tol = []
    for t in range(C.n_layers):
        acc = C.b_dec[t].double().abs() * 0
        terms = 0
        for s in range(t + 1):
            pre_tol = matmul_rounding(xs[s].float(), C.W_enc[s], C.b_enc[s]).double()
            acc = acc + (z[s].abs() + pre_tol) @ C.W_dec[s][:, t - s].double().abs() + pre_tol @ \
                C.W_dec[s][:, t - s].double().abs()
            terms += C.width
        n = terms + t + 2
        tol.append(2 * n * U32 * (acc + C.b_dec[t].double().abs()) + 1e-30)
    return torch.stack(tol)


@pytest.mark.parametrize("kind", ["topk", "batchtopk", "jumprelu"])
def test_reconstruction_is_the_equation(kind):
    C = _random(kind=kind, seed=2)
    xs = torch.randn(C.n_layers, 9, C.d_in, generator=torch.Generator().manual_seed(5))
    z, out = _brute(C, xs)
    got = C(xs).double()
    assert got.shape == out.shape
    assert bool(((got - out).abs() <= _out_tol(C, xs, z)).all())
    for i in range(C.n_layers):  # block i is a per-layer transcoder: the same encoder, its own-block decoder
        B = C.block(i)
        assert_same_computation(B.encode(xs[i]), C.encode(xs[i], i), why="the block's encoder is the CLT's encoder")
        assert B.site == f"mlp_out.{i}" and B.W_dec.shape == (C.width, C.d_out)


def test_folding_the_scales_keeps_the_function():
    C = _random(kind="jumprelu", seed=4)
    s_in, s_out = [2.0, 0.5, 4.0], [0.25, 3.0, 1.5]
    xs = torch.randn(3, 6, C.d_in, generator=torch.Generator().manual_seed(1))
    F = C.to(torch.float64).folded(s_in, s_out)
    scaled = torch.stack([xs[i].double() * s_in[i] for i in range(3)])
    want = C.to(torch.float64)(scaled) / torch.tensor(s_out, dtype=torch.float64)[:, None, None]
    got = F(xs.double())
    assert float((got - want).abs().max()) <= 64 * 2.0**-53 * (1 + float(want.abs().max()))
    assert F.scale_in == s_in and F.scale_out == s_out


@pytest.mark.parametrize("kind", ["topk", "jumprelu"])
def test_lenscope_files_round_trip(tmp_path, kind):
    C = _random(kind=kind, seed=7, model="tiny:llama")
    C.info = {"note": "x"}
    C.save(tmp_path)
    rec = json.loads((tmp_path / "clt.json").read_text())
    assert rec["format"] == "lenscope-clt" and rec["n_layers"] == 3 and rec["kind"] == kind
    back = CrossLayerTranscoder.load(tmp_path)
    assert (back.kind, back.k, back.model, back.info) == (C.kind, C.k, C.model, C.info)
    assert_same_computation(back.tensors(), C.tensors(), why="the same tensors written and read")
    assert not any(p.suffix in (".pt", ".pkl", ".bin") for p in tmp_path.iterdir())
    with pytest.raises(InputError, match="CrossLayerTranscoder.load"):
        load_dictionaries(tmp_path)


def test_circuit_tracer_layout_round_trip(tmp_path):
    C = _random(kind="jumprelu", seed=3, model="tiny:llama")
    C.threshold[0, 0] = -0.1  # written raised to 0: circuit-tracer's pre * (pre > θ) is then lenscope's function
    save_circuit_tracer_clt(C, tmp_path)
    assert yaml.safe_load((tmp_path / "config.yaml").read_text()) == {
        "model_kind": "cross_layer_transcoder", "feature_input_hook": "mlp.hook_in",
        "feature_output_hook": "mlp.hook_out", "model_name": "tiny:llama"}
    for i in range(3):
        e, d = load_file(str(tmp_path / f"W_enc_{i}.safetensors")), load_file(str(tmp_path / f"W_dec_{i}.safetensors"))
        assert set(e) == {f"W_enc_{i}", f"b_enc_{i}", f"b_dec_{i}", f"threshold_{i}"} and set(d) == {f"W_dec_{i}"}
        assert e[f"W_enc_{i}"].shape == (C.width, C.d_in) and d[f"W_dec_{i}"].shape == (C.width, 3 - i, C.d_out)
    back = CrossLayerTranscoder.load(tmp_path)
    assert (back.kind, back.model) == ("jumprelu", "tiny:llama")
    xs = torch.randn(3, 7, C.d_in, generator=torch.Generator().manual_seed(2))
    assert_same_computation(back(xs), C(xs), why="the same weights, a threshold of -0.1 and 0 zero the same entries")
    with pytest.raises(InputError, match="TopK"):
        save_circuit_tracer_clt(_random(kind="topk"), tmp_path / "t")
    with pytest.raises(InputError, match="CrossLayerTranscoder.load"):
        load_dictionaries(tmp_path)
    (tmp_path / "W_dec_2.safetensors").unlink()
    with pytest.raises(InputError, match="W_dec_2"):
        CrossLayerTranscoder.load(tmp_path)


def test_reads_a_clt_circuit_tracer_wrote():
    """``data/ct_clt``: written by circuit-tracer 0.5's ``CrossLayerTranscoder.to_safetensors``, with its own
    reconstruction of seeded inputs (``benchmarks/ct_clt_fixture.py``)."""
    folder = DATA / "ct_clt"
    C = CrossLayerTranscoder.load(folder)
    ref = load_file(str(folder.parent / "ct_clt_reference.safetensors"))
    xs, want = ref["inputs"], ref["reconstruction"].double()
    assert (C.n_layers, C.kind) == (xs.shape[0], "jumprelu")
    z, exact = _brute(C, xs)
    got = C(xs).double()
    tol = _out_tol(C, xs, z)
    assert bool(((got - exact).abs() <= tol).all())
    assert bool(((want - exact).abs() <= tol).all())  # circuit-tracer's float32 against the same exact values


def test_bad_clts_are_one_line_errors(tmp_path):
    C = _random()
    with pytest.raises(InputError, match="W_dec"):
        CrossLayerTranscoder(W_enc=C.W_enc, b_enc=C.b_enc, W_dec=C.W_dec[:2], b_dec=C.b_dec, k=3)
    with pytest.raises(InputError, match="0 < k < width"):
        CrossLayerTranscoder(W_enc=C.W_enc, b_enc=C.b_enc, W_dec=C.W_dec, b_dec=C.b_dec, k=None)
    with pytest.raises(InputError, match="no CLT"):
        CrossLayerTranscoder.load(tmp_path)
    lm = get_model("tiny:llama")
    with pytest.raises(InputError, match="d_model"):
        _random(L=2, d=8).check(lm)
    with pytest.raises(InputError, match="covers 3 blocks"):
        _random(L=3, d=lm.anatomy.d_model).check(lm)
    assert CrossLayerTranscoder.parameters_count(3, 8, 12) == sum(v.numel() for v in C.tensors().values())


# -- the engine --------------------------------------------------------------------------------------------------

def _engine_setup(kind="jumprelu"):
    lm = tiny_with_layers("llama", 3)
    d = lm.anatomy.d_model
    C = _random(L=3, d=d, width=40, kind=kind, seed=11, k=6)
    if C.threshold is not None:
        C.threshold = C.threshold * 0.1
    ids = lm.tokenizer(TEXT, return_tensors="pt").input_ids[:, :8]
    return lm, C, torch.cat([ids, ids.flip(1)])


@pytest.mark.parametrize("kind", ["topk", "jumprelu"])
def test_latent_sites_edits_and_splice(kind):
    lm, C, ids = _engine_setup(kind)
    L = C.n_layers
    outs, ins = [f"mlp_out.{i}" for i in range(L)], [f"ln_mlp.out.{i}" for i in range(L)]
    lats = [f"mlp_out.latents.{i}" for i in range(L)]
    plain = run(lm, ids, capture=outs + ins)
    with_c = run(lm, ids, capture=outs + lats, dictionaries=[C])
    assert_same_computation(with_c.logits, plain.logits, why="no edit: the CLT's hooks leave the run as it is")
    for i in range(L):
        z, ref = with_c.captured[lats[i]], C.encode(plain.captured[ins[i]].float(), i)
        assert z.shape == (2, ids.shape[1], C.width)
        assert_same_computation(z, ref, why="the same encoder on the same captured input")
    # an edit of block 0's latent 5 at row 1, position 3 moves mlp_out of blocks 0, 1 and 2 there by its decoders
    unit, add = 5, 2.0
    values = torch.zeros(1, C.width)
    values[0, unit] = add
    edit = Edit("mlp_out.latents", 0, rows=torch.tensor([1]), pos=torch.tensor([3]), values=values, mode="add")
    ed = run(lm, ids, [edit], capture=outs + ins, dictionaries=[C])
    # what the edit does to block 0's output is exact; later blocks see a changed input too, so their moved output
    # is the decoded change plus the real MLP's and the CLT's own change of input: compared through the CLT's
    # latents on the edited run's inputs
    moved0 = ed.captured[outs[0]].float() - plain.captured[outs[0]].float()
    expect = torch.zeros_like(moved0)
    expect[1, 3] = add * C.decoder(0, 0)[unit]
    scale = float(plain.captured[outs[0]].abs().max()) + add * float(C.W_dec[0][unit].abs().max())
    assert float((moved0 - expect).abs().max()) <= 4 * U32 * scale
    B, P = ids.shape
    rows, pos = torch.arange(B).repeat_interleave(P), torch.arange(P).repeat(B)
    for t in (1, 2):  # later blocks: the real MLP on the edited run's input plus the decoded change of the latent
        put = [Edit("mlp_out", s, rows=rows, pos=pos, values=ed.captured[outs[s]].reshape(B * P, -1), mode="set")
               for s in range(t)]  # the MLP outputs before block t as the edited run had them
        real = run(lm, ids, put, capture=[outs[t]])
        delta = ed.captured[outs[t]].float() - real.captured[outs[t]].float()
        expect = torch.zeros_like(delta)
        expect[1, 3] = add * C.decoder(0, t)[unit]
        scale = float(real.captured[outs[t]].abs().max()) + add * float(C.W_dec[0][unit].abs().max())
        assert float((delta - expect).abs().max()) <= 4 * U32 * scale
    # the splice: every MLP output is the CLT's reconstruction from the spliced run's own MLP inputs
    sp = run(lm, ids, capture=outs + ins, dictionaries=[C], splice=True)
    xs = torch.stack([sp.captured[i].float() for i in ins])
    rec = C(xs)
    for t in range(L):
        tol = 8 * (C.width * (t + 1) + 1) * U32 * (1 + float(rec[t].abs().max()))
        assert float((sp.captured[outs[t]].float() - rec[t]).abs().max()) <= tol
    assert float((sp.logits - plain.logits).abs().max()) > 1e-3


def test_latents_gradient_is_the_decoders_projection():
    lm, C, ids = _engine_setup("jumprelu")
    r = run(lm, ids, capture=["mlp_out.latents.0", "mlp_out.0", "mlp_out.2"], dictionaries=[C], grad=True)
    z, y0, y2 = r.captured["mlp_out.latents.0"], r.captured["mlp_out.0"], r.captured["mlp_out.2"]
    g = torch.randn(y0.shape, generator=torch.Generator().manual_seed(0))
    (gz,) = torch.autograd.grad((y0 * g).sum(), z, retain_graph=True)
    want = g @ C.decoder(0, 0).T
    assert float((gz - want).abs().max()) <= 4 * (C.d_out + 1) * U32 * float((g.abs() @ C.decoder(0, 0).abs().T).max())
    (gz2,) = torch.autograd.grad((y2 * g).sum(), z)  # block 0's latents reach mlp_out.2: its decoder and the model
    assert float(gz2.abs().max()) > 0
