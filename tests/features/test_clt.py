"""Training cross-layer transcoders on a tiny model: one streaming pass over every block lowers the loss, the sparse
decoding of every block at once equals dense autograd in float64, a run resumed from its checkpoint ends where an
uninterrupted one does, and ``dict train --clt`` with its one-line errors."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from lenscope.cli import app
from lenscope.errors import InputError
from lenscope.features.dictionaries.train import DictSettings
from lenscope.features.dictionaries.train_clt import CLTTarget, CLTTrainable, train_clt
from lenscope.models.dictionaries.clt import CrossLayerTranscoder
from tests.conftest import get_model
from tests.features.test_train import _text
from tests.tolerances import assert_same_computation


@pytest.mark.parametrize("kind", ["topk", "batchtopk", "jumprelu"])
def test_a_clt_trains_on_a_tiny_model(tmp_path, kind):
    lm = get_model("tiny:llama")
    s = DictSettings(kind=kind, role="transcoder", width=96, k=8, tokens=6_144, batch_size=256, buffer=2048,
                     dead_after=2048, lr=3e-3, bf16=False)
    C = train_clt(s, lm=lm, data=_text(tmp_path / "t.txt"), seq_len=32, progress=False, out=tmp_path / "c")
    hist = C.info["training"]["history"]
    assert hist[-1][3] > hist[0][3] + 0.05, hist  # the mean explained variance over blocks rises
    assert C.n_layers == lm.anatomy.n_layers and C.kind == kind and C.model == "tiny:llama"
    back = CrossLayerTranscoder.load(tmp_path / "c")
    assert_same_computation(back.tensors(), C.tensors(), why="saved and read back")
    assert not (tmp_path / "c" / "checkpoint").exists()
    fin = C.info["training"]["final"]
    assert {"explained_variance.0", "explained_variance.1", "l0.0", "l0.1"} <= set(fin)


def _dense_loss(m: CLTTrainable, x, y):
    """TopK's CLT loss written densely: the latents of every block as a (n, width) matrix, each output block the sum
    of every earlier-or-same block's latents times its decoder, plus b_dec; no dead latents."""
    n, L, d = x.shape
    yhat = [m.b_dec[t].expand(n, d) for t in range(L)]
    for i, b in enumerate(m.blocks):
        pre = x[:, i] @ b.W_enc + b.b_enc
        top = pre.detach().topk(b.k, dim=-1).indices
        z = torch.zeros_like(pre).scatter(-1, top, pre.gather(-1, top).relu())
        out = (z @ b.W_dec).reshape(n, L - i, d)
        for j in range(L - i):
            yhat[i + j] = yhat[i + j] + out[:, j]
    return sum((y[:, t] - yhat[t]).pow(2).sum(-1).mean() for t in range(L))


def test_the_sparse_step_equals_dense_autograd_in_float64():
    L, d = 3, 6
    s = DictSettings(kind="topk", role="transcoder", width=20, k=3, dead_after=10**9)
    m = CLTTrainable(L, d, s, seed=1).double()
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(7, L, d, generator=g, dtype=torch.float64), torch.randn(7, L, d, generator=g,
                                                                                 dtype=torch.float64)
    with torch.no_grad():
        m.b_dec.copy_(torch.randn(L, d, generator=g))
    loss, _ = m(x, y)
    params = [p for p in m.parameters() if p.requires_grad]
    got = torch.autograd.grad(loss, params)
    want = _dense_loss(m, x, y)
    ref = torch.autograd.grad(want, params)
    assert abs(float(loss.detach()) - float(want.detach())) <= 1e-12 * float(want.detach())
    for a, b in zip(got, ref):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)


def test_resume_gives_the_same_clt(tmp_path):
    lm = get_model("tiny:llama")
    data = _text(tmp_path / "t.txt")
    kw = dict(kind="batchtopk", role="transcoder", width=48, k=4, tokens=12 * 128, batch_size=128, buffer=640,
              dead_after=256, lr=3e-3, bf16=False)
    straight = train_clt(DictSettings(**kw), lm=lm, data=data, seq_len=32, progress=False, out=tmp_path / "a")
    assert train_clt(DictSettings(**kw), lm=lm, data=data, seq_len=32, progress=False, out=tmp_path / "b",
                     max_steps=7) is None
    assert (tmp_path / "b" / "checkpoint" / "state.json").exists()
    resumed = train_clt(DictSettings(**kw), lm=lm, data=data, seq_len=32, progress=False, out=tmp_path / "b",
                        resume=True)
    assert_same_computation(straight.tensors(), resumed.tensors(),
                            why="the same steps on the same batches: the resume restores every state")
    assert straight.info["training"]["tokens"] == resumed.info["training"]["tokens"] == 12 * 128


def test_memory_estimate_and_bad_settings():
    from lenscope.features.dictionaries.train_memory import train_memory

    s = DictSettings(kind="topk", role="transcoder", width=64, k=4, batch_size=128, buffer=256)
    t = CLTTarget(CrossLayerTranscoder.init(2, 8, 2, k=1), [0, 1], [2, 3])
    p, row = t.shape(8, s)
    assert p == CrossLayerTranscoder.parameters_count(2, 8, 64)
    # per row: each block's latents, the rows, reconstruction and error with their gradients, one block's decoding,
    # and (TopK's AuxK) each block's auxiliary decoding to every block it writes, kept for the backward
    assert row == 2 * 6 * 64 + 10 * 8 * 2 + 2 * 8 * 3
    assert t.shape(8, DictSettings(kind="jumprelu", role="transcoder", width=64, k=4))[1] == 2 * 6 * 64 + 10 * 8 * 2
    m = train_memory(s, d=8, sites=4, shapes=[(p, row)])
    assert m["weights"] == 20 * p and m["latents"] == 4 * 128 * row and m["buffer"] == 3 * 4 * 256 * 4 * 8
    lm = get_model("tiny:llama")
    with pytest.raises(InputError, match="role is 'transcoder'"):
        train_clt(DictSettings(role="sae", width=16, k=2), lm=lm, data="x")
    with pytest.raises(InputError, match="covers 1 to 2 blocks"):
        train_clt(DictSettings(role="transcoder", width=16, k=2), lm=lm, data="x", n_layers=5)


def test_cli_trains_a_clt_and_refuses_bad_combinations(tmp_path):
    r = CliRunner()
    h = r.invoke(app, ["dict", "train", "--help"])
    assert h.exit_code == 0 and "--clt" in h.output
    data = str(_text(tmp_path / "t.txt"))
    base = ["dict", "train", "--model", "tiny:llama", "--data", data, "--width", "32", "--k", "4",
            "--tokens", "1024", "--batch-size", "128", "--seq-len", "32", "--precision", "fp32"]
    ok = r.invoke(app, base + ["--clt", "--out", str(tmp_path / "c"), "--json"])
    assert ok.exit_code == 0, ok.output
    rec = json.loads(ok.output[ok.output.index("{"):])
    assert rec["clt"] is True and rec["layers"] == 2
    assert CrossLayerTranscoder.load(tmp_path / "c").n_layers == 2
    for extra, msg in [(["--skip"], "--clt"), (["--site", "resid_post.1"], "--site"),
                       (["--activations", "x.safetensors"], "--data")]:
        cmd = [a for a in base if a != "--data" and a != data] if "--activations" in extra else base
        bad = r.invoke(app, cmd + ["--clt", "--out", str(tmp_path / "e")] + extra)
        assert bad.exit_code != 0 and msg in bad.output and "Traceback" not in bad.output, bad.output
