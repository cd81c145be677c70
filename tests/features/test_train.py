"""Training sparse dictionaries (lenscope.features.dictionaries.train): every kind and role learns, on synthetic
activations
with a known sparse dictionary and on a tiny model's streamed activations; the unit-norm decoder; BatchTopK's
stored threshold and JumpReLU's adapted sparsity give an L0 near k; one forward pass feeds every dictionary;
an interrupted run resumes to the same tensors bit for bit; the activations file and its errors."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from lenscope.errors import InputError
from lenscope.features.dictionaries import sources as src_mod
from lenscope.features.dictionaries.sources import FileSource, StreamSource, Target, last_site, load_activations
from lenscope.features.dictionaries.train import DictSettings, Trainable, train, train_dictionaries, train_memory
from lenscope.models.dictionaries.dictionary import Dictionary, load_dictionaries
from tests.conftest import get_model
from tests.tolerances import assert_same_computation, assert_same_ints

D, TRUE_W, TRUE_K = 32, 64, 4


def _synthetic(n: int = 30_000, pairs: bool = False, seed: int = 1):
    """Rows made from a known sparse dictionary: ``TRUE_K`` of ``TRUE_W`` unit directions per row, with
    coefficients in [0.5, 1.5), plus noise of std 0.01; with ``pairs``, (input, output) through two dictionaries
    sharing the latents (a sparse map a transcoder can learn)."""
    g = torch.Generator().manual_seed(seed)
    F_in = torch.nn.functional.normalize(torch.randn(TRUE_W, D, generator=g), dim=1)
    idx = torch.rand(n, TRUE_W, generator=g).topk(TRUE_K, dim=1).indices
    z = torch.zeros(n, TRUE_W).scatter(1, idx, torch.rand(n, TRUE_K, generator=g) + 0.5)
    x = z @ F_in + 0.01 * torch.randn(n, D, generator=g)
    if not pairs:
        return x, F_in
    F_out = torch.nn.functional.normalize(torch.randn(TRUE_W, D, generator=g), dim=1) * 3.0
    y = z @ F_out + 0.01 * torch.randn(n, D, generator=g)
    return torch.stack([x, y], dim=1), F_in


def _settings(kind, role="sae", **kw):
    base = dict(kind=kind, role=role, width=TRUE_W, k=TRUE_K, tokens=60_000, batch_size=512, buffer=4096,
                dead_after=4096, lr=1e-2, bf16=False)
    return DictSettings(**{**base, **kw})


def _fve(D_: Dictionary, x: torch.Tensor, y: torch.Tensor) -> float:
    r = D_.decode(D_.encode(x), x)
    return float(1 - (y - r).pow(2).sum() / (y - y.mean(0)).pow(2).sum())


def _like(role="sae"):
    return Dictionary.init(2, 2, kind="topk", k=1, role=role)


@pytest.mark.parametrize("kind", ["topk", "batchtopk", "jumprelu"])
@pytest.mark.parametrize("role", ["sae", "transcoder", "skip"])
def test_every_kind_and_role_learns_synthetic_activations(kind, role):
    data, _ = _synthetic(12_000, pairs=role != "sae")
    x3 = data if role != "sae" else data[:, None]
    s = _settings(kind, role, tokens=30_000)
    (D_,) = train_dictionaries(FileSource(x3), [Target(_like(role), 0, x3.shape[1] - 1)], s, progress=False)
    hist = D_.info["training"]["history"]
    assert D_.kind == kind and D_.role == role and (D_.W_skip is not None) == (role == "skip")
    assert hist[-1][3] > hist[0][3] + 0.1, hist  # explained variance on the batch rose
    # the folded dictionary reads and writes raw activations: its explained variance on them is the batch's
    # (BatchTopK's inference form, the threshold, differs from its training form). Transcoders learn a map
    # between two spaces: slower (after 60 steps, TopK ~0.2, JumpReLU ~0: it switches latents off first)
    x, y = x3[:, 0], x3[:, -1]
    if role == "sae":
        assert _fve(D_, x, y) > 0.5
    elif kind != "jumprelu":
        assert _fve(D_, x, y) > 0.1
    if kind != "batchtopk":
        assert abs(_fve(D_, x, y) - hist[-1][3]) < 0.1


def test_topk_at_the_true_k_recovers_the_dictionary():
    x, F_in = _synthetic(30_000)
    (D_,) = train_dictionaries(FileSource(x[:, None]), [Target(_like(), 0, 0)], _settings("topk", tokens=150_000),
                               progress=False)
    assert _fve(D_, x, x) > 0.8
    cos = (torch.nn.functional.normalize(D_.W_dec, dim=1) @ F_in.T).abs().max(0).values
    assert float(cos.mean()) > 0.9  # mean max cosine of the true features to the learnt decoder rows


def test_decoder_rows_stay_unit_norm_and_the_gradient_is_tangent():
    x, _ = _synthetic(4_000)
    (D_,) = train_dictionaries(FileSource(x[:, None]), [Target(_like(), 0, 0)], _settings("topk", tokens=8_192),
                               progress=False)
    # the normalisation folded into the decoder: rows of norm 1 / scale_out
    norms = D_.W_dec.norm(dim=1) * D_.scale_out
    assert torch.allclose(norms, torch.ones_like(norms), atol=1e-5)
    assert_same_computation(D_.info["training"]["scale_in"], D_.scale_in, why="the scale, copied into the info")
    m = Trainable(Dictionary.init(D, TRUE_W, k=TRUE_K), _settings("topk"))
    loss, _ = m(x[:512], x[:512])
    loss.backward()
    m.after_backward()
    along = (m.W_dec.grad * m.W_dec.detach()).sum(-1)
    assert float(along.abs().max()) < 1e-5 * float(m.W_dec.grad.norm(dim=-1).max())


def test_batchtopk_threshold_gives_l0_near_k_at_inference():
    x, _ = _synthetic(30_000)
    (D_,) = train_dictionaries(FileSource(x[:20_000, None]), [Target(_like(), 0, 0)],
                               _settings("batchtopk", tokens=100_000), progress=False)
    assert D_.threshold is not None
    assert_same_computation(D_.threshold, D_.threshold[0].expand_as(D_.threshold), why="one threshold, copied to "
                            "every latent")
    l0 = float((D_.encode(x[20_000:]) > 0).float().sum(-1).mean())  # held-out rows, the JumpReLU form
    assert abs(l0 - TRUE_K) < 0.25 * TRUE_K, l0


def test_jumprelu_reaches_its_target_l0():
    x, _ = _synthetic(30_000)
    for target in (3, 8):
        (D_,) = train_dictionaries(FileSource(x[:20_000, None]), [Target(_like(), 0, 0)],
                                   _settings("jumprelu", k=target, tokens=100_000), progress=False)
        l0 = float((D_.encode(x[20_000:]) > 0).float().sum(-1).mean())
        assert abs(l0 - target) < 0.3 * target, (target, l0)


def test_the_aux_loss_revives_dead_latents():
    x, _ = _synthetic(8_000)
    s = _settings("topk", width=96, tokens=40_000, dead_after=1024)
    m = Trainable(Dictionary.init(D, 96, k=TRUE_K), s)
    with torch.no_grad():
        m.b_enc[:48] = -20.0  # half the latents can never win the top-k: dead
    m.since_fired[:48] = 10_000
    loss, stats = m(x[:512], x[:512])
    mse = float(stats["mse"]) * D
    assert_same_computation(float(stats["dead_fraction"]), 0.5, why="48 of 96 latents: a ratio of counts, exact")
    assert float(loss.detach()) > mse  # the auxiliary term is on
    loss.backward()
    assert float(m.b_enc.grad[:48].abs().sum()) > 0  # gradients reach the dead latents


def _dense_loss(m: Trainable, x: torch.Tensor, y: torch.Tensor, dead: torch.Tensor, aux_coef: float) -> torch.Tensor:
    """The TopK / BatchTopK loss with dense latents, by the papers' equations: ``z = relu(TopK(pre))`` (BatchTopK:
    the top ``k·n`` of the batch), ``ŷ = z W_dec + b_dec (+ x W_skip)``, squared error summed over the row and
    averaged; AuxK: the dead latents' top ``k_aux`` pre-activations reconstruct the (detached) error."""
    xc = x - m.b_dec if m.role == "sae" else x
    pre = xc @ m.W_enc + m.b_enc
    if m.kind == "topk":
        keep = torch.zeros_like(pre, dtype=torch.bool).scatter(1, pre.detach().topk(m.k, dim=1).indices, True)
    else:
        keep = torch.zeros(pre.numel(), dtype=torch.bool)
        keep[pre.detach().reshape(-1).topk(m.k * len(x)).indices] = True
        keep = keep.reshape(pre.shape)
    z = torch.where(keep, pre, 0).relu()
    yhat = z @ m.W_dec + m.b_dec + (x @ m.W_skip.T if m.W_skip is not None else 0)
    err = y - yhat
    loss = err.pow(2).sum(-1).mean()
    if dead.any():
        ka = min(m.k_aux, int(dead.sum()))
        top = pre.detach().masked_fill(~dead, float("-inf")).topk(ka, dim=1).indices
        za = torch.zeros_like(pre).scatter(1, top, pre.gather(1, top))
        aux = (err.detach() - za @ m.W_dec).pow(2).sum(-1).mean()
        loss = loss + aux_coef * min(1.0, int(dead.sum()) / m.k_aux) * aux
    return loss


@pytest.mark.parametrize("kind,role,dead", [("topk", "sae", False), ("batchtopk", "sae", False),
                                            ("topk", "transcoder", False), ("topk", "skip", False),
                                            ("topk", "sae", True), ("batchtopk", "transcoder", True)])
def test_the_sparse_gradients_equal_dense_autograd_in_float64(kind, role, dead):
    from lenscope.features.dictionaries.train import AUX_COEF

    x, _ = _synthetic(256, pairs=role != "sae", seed=3)
    x, y = (x, x) if role == "sae" else (x[:, 0], x[:, 1])
    s = _settings(kind, role=role, width=48, k=3, dead_after=1_000)
    m = Trainable(Dictionary.init(D, 48, kind=kind, role=role, k=3, seed=2), s).double()
    with torch.no_grad():
        m.b_enc.copy_(0.05 * torch.randn(48, generator=torch.Generator().manual_seed(4), dtype=torch.float64))
    m.since_fired[:20] = 1_000 if dead else 0
    x, y = x.double(), y.double()
    loss, stats = m(x, y)
    got = torch.autograd.grad(loss, list(m.parameters()))
    dead_now = m.since_fired >= s.dead_after  # what the forward counted as dead (after this batch)
    assert bool(dead_now.any()) == dead and (stats["dead_fraction"] > 0) == dead
    want = _dense_loss(m, x, y, dead_now, AUX_COEF)
    ref = torch.autograd.grad(want, list(m.parameters()))
    assert abs(float(loss.detach()) - float(want.detach())) < 1e-12 * float(want.detach())
    for (name, _), a, b in zip(m.named_parameters(), got, ref):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12), name


def _text(path: Path, n_docs: int = 40) -> Path:
    words = "the cat sat on a mat while John gave Mary some drink and they went to the store in Paris".split()
    g = torch.Generator().manual_seed(0)
    docs = [" ".join(words[i] for i in torch.randint(0, len(words), (120,), generator=g).tolist())
            for _ in range(n_docs)]
    path.write_text("".join(d + "\n<|endoftext|>\n" for d in docs))
    return path


@pytest.mark.parametrize("kind", ["topk", "batchtopk", "jumprelu"])
@pytest.mark.parametrize("role,site", [("sae", "resid_post.1"), ("transcoder", "mlp_out.1"), ("skip", "mlp_out.0")])
def test_every_kind_and_role_trains_on_a_tiny_model(tmp_path, kind, role, site):
    lm = get_model("tiny:llama")
    s = DictSettings(kind=kind, role=role, width=128, k=8, tokens=6_144, batch_size=256, buffer=2048,
                     dead_after=2048, lr=3e-3, bf16=False)
    (D_,) = train(s, lm=lm, sites=site, data=_text(tmp_path / "t.txt"), seq_len=32, progress=False,
                  out=tmp_path / "d")
    hist = D_.info["training"]["history"]
    assert hist[-1][3] > hist[0][3] + 0.05, hist
    (L,) = load_dictionaries(tmp_path / "d")
    assert L.site == site and L.model == "tiny:llama" and L.kind == kind and L.role == role
    assert_same_computation(L.W_enc, D_.W_enc, why="saved and read back")
    assert L.info["training"]["tokens"] == 6_144
    L.check(lm)


def test_one_forward_pass_feeds_every_dictionary(tmp_path, monkeypatch):
    from lenscope.models.runtime import engine

    lm = get_model("tiny:llama")
    calls = []
    real = engine.capture

    def counted(lm_, ids, sites, **kw):
        calls.append((ids.shape, tuple(sites), kw.get("stop_after")))
        return real(lm_, ids, sites, **kw)

    monkeypatch.setattr(engine, "capture", counted)
    s = DictSettings(kind="topk", role="transcoder", width=32, k=4, tokens=1_024, batch_size=256, buffer=1024,
                     bf16=False)
    dicts = train(s, lm=lm, sites="mlp_out.*", data=_text(tmp_path / "t.txt"), seq_len=32, forward_batch=8,
                  progress=False)
    assert [d.site for d in dicts] == ["mlp_out.0", "mlp_out.1"]
    # 1024 rows = 32 sequences of 32 = 4 forward passes of 8 sequences, each reading the 4 sites, stopped at mlp_out.1
    assert len(calls) == 4 == dicts[0].info["training"].get("forward_passes", 4)
    assert all(c == ((8, 32), ("ln_mlp.out.0", "mlp_out.0", "ln_mlp.out.1", "mlp_out.1"), "mlp_out.1") for c in calls)


def test_last_site_stops_as_early_as_the_sites_allow():
    assert last_site(["resid_post.3", "resid_pre.1"]) == "resid_post.3"
    assert last_site(["ln_mlp.out.2", "mlp_out.2", "mlp_out.0"]) == "mlp_out.2"
    assert last_site(["attn_out.4"]) == "attn_out.4"
    assert last_site(["attn_out.4", "mlp_out.4"]) == "resid_post.4"


def test_streamed_rows_drop_the_special_positions(tmp_path, monkeypatch):
    from lenscope.data import text as text_mod
    from lenscope.models.runtime import engine

    lm = get_model("tiny:llama")
    bos = 1
    for name in ("_special_affixes", "special_affixes"):
        monkeypatch.setattr(text_mod, name, lambda tok: ([bos], []))
    src = StreamSource(lm, ["resid_post.0"], _text(tmp_path / "t.txt"), seq_len=16, forward_batch=4)
    assert src.rows_per_unit == 15
    rows, nxt = src.read(0, 60)  # 4 sequences of 15 kept positions
    assert nxt == 4 and rows.shape == (60, 1, lm.anatomy.d_model)
    ids = src._sequences(0, 4)
    assert bool((ids[:, 0] == bos).all())
    ref = engine.capture(lm, ids, ["resid_post.0"])["resid_post.0"][:, 1:]
    assert_same_computation(rows[:, 0], ref.reshape(-1, lm.anatomy.d_model),
                            why="the same four sequences in one forward batch")


def test_resume_gives_the_same_dictionary_bit_for_bit(tmp_path):
    lm = get_model("tiny:llama")
    data = _text(tmp_path / "t.txt")
    # 12 steps of 128 rows over blocks of 640 rows: the interruption (step 7) falls inside the second block
    kw = dict(kind="batchtopk", role="skip", width=48, k=4, tokens=12 * 128, batch_size=128, buffer=640,
              dead_after=256, lr=3e-3, bf16=False)
    straight = train(DictSettings(**kw), lm=lm, sites="mlp_out.0,mlp_out.1", data=data, seq_len=32,
                     progress=False, out=tmp_path / "a")
    assert train(DictSettings(**kw), lm=lm, sites="mlp_out.0,mlp_out.1", data=data, seq_len=32, progress=False,
                 out=tmp_path / "b", max_steps=7) is None
    assert (tmp_path / "b" / "checkpoint" / "state.json").exists()
    resumed = train(DictSettings(**kw), lm=lm, sites="mlp_out.0,mlp_out.1", data=data, seq_len=32,
                    progress=False, out=tmp_path / "b", resume=True)
    for a, b in zip(straight, resumed):
        for name, t in a.tensors().items():
            assert_same_computation(t, b.tensors()[name],
                                    why=f"the same steps on the same batches: the resume restores every state ({name})")
        assert a.info["training"]["tokens"] == b.info["training"]["tokens"] == 12 * 128
    assert not (tmp_path / "b" / "checkpoint").exists()
    with pytest.raises(InputError, match="settings differ"):
        train(DictSettings(**kw), lm=lm, sites="mlp_out.0,mlp_out.1", data=data, seq_len=32, progress=False,
              out=tmp_path / "c", max_steps=2)
        train(DictSettings(**{**kw, "width": 64}), lm=lm, sites="mlp_out.0,mlp_out.1", data=data, seq_len=32,
              progress=False, out=tmp_path / "c", resume=True)


def test_training_from_an_activations_file(tmp_path):
    pairs, _ = _synthetic(4_000, pairs=True)
    save_file({"activations": pairs, "other": torch.zeros(3)}, str(tmp_path / "p.safetensors"))
    s = _settings("topk", "transcoder", tokens=8_192)
    (D_,) = train(s, activations=tmp_path / "p.safetensors", out=tmp_path / "d", progress=False)
    assert D_.site is None and D_.d_in == D and D_.role == "transcoder"
    assert D_.info["training"]["source"]["activations"].endswith("p.safetensors")
    (L,) = load_dictionaries(tmp_path / "d")
    assert_same_computation(L.W_dec, D_.W_dec, why="saved and read back")
    assert L.scale_out == D_.scale_out != L.scale_in
    x, _ = _synthetic(2_000)
    save_file({"x": x}, str(tmp_path / "x.safetensors"))
    (S,) = train(_settings("jumprelu", tokens=4_096), activations=tmp_path / "x.safetensors", sites="resid_post.3",
                 progress=False)
    assert S.site == "resid_post.3" and S.threshold is not None


@pytest.mark.parametrize("tensors,msg", [
    ({"a": torch.zeros(10, 3, 4)}, r"shape \(10, 3, 4\)"),
    ({"a": torch.zeros(10, 4, dtype=torch.int64)}, "must be float"),
    ({"a": torch.zeros(10, 4), "b": torch.zeros(10, 4)}, "name the one to train on 'activations'"),
    ({"a": torch.full((10, 4), float("nan"))}, "NaN"),
])
def test_a_bad_activations_file_is_a_one_line_error(tmp_path, tensors, msg):
    save_file(tensors, str(tmp_path / "bad.safetensors"))
    with pytest.raises(InputError, match=msg) as e:
        load_activations(tmp_path / "bad.safetensors")
    assert "\n" not in str(e.value)


def test_bad_training_input_is_refused(tmp_path):
    x, _ = _synthetic(1_000)
    save_file({"x": x}, str(tmp_path / "x.safetensors"))
    pairs, _ = _synthetic(1_000, pairs=True)
    save_file({"x": pairs}, str(tmp_path / "p.safetensors"))
    lm = get_model("tiny:llama")
    text = _text(tmp_path / "t.txt", 3)
    cases = [
        (dict(activations=tmp_path / "p.safetensors"), "sae", "an SAE trains on"),
        (dict(activations=tmp_path / "x.safetensors"), "transcoder", "a transcoder trains on"),
        (dict(activations=tmp_path / "x.safetensors", data=text), "sae", "exactly one of"),
        (dict(), "sae", "exactly one of"),
        (dict(lm=lm, sites="resid_post.5", data=text), "sae", "past the model's 2 blocks"),
        (dict(lm=lm, sites="resid_post.1", data=text), "transcoder", "mlp_out"),
        (dict(lm=lm, sites="mlp_hidden.1", data=text), "sae", "a dictionary's site is one of"),
        (dict(lm=lm, sites="resid_post.1,resid_post.1", data=text), "sae", "named twice"),
        (dict(lm=lm, sites="resid_post.1", activations=tmp_path / "x.safetensors"), "sae", "d_model"),
    ]
    for kw, role, msg in cases:
        with pytest.raises(InputError, match=msg):
            train(_settings("topk", role, tokens=1024), progress=False, **kw)
    for bad in (dict(k=64), dict(width=0), dict(k=0), dict(tokens=0)):
        with pytest.raises(InputError):
            train(_settings("topk", **bad), activations=tmp_path / "x.safetensors", progress=False)


def test_the_text_running_out_ends_training(tmp_path):
    lm = get_model("tiny:llama")
    s = DictSettings(kind="topk", width=32, k=4, tokens=10**7, batch_size=256, buffer=1024, bf16=False)
    (D_,) = train(s, lm=lm, sites="resid_post.0", data=_text(tmp_path / "t.txt", 4), seq_len=32, progress=False)
    n = D_.info["training"]["tokens"]
    assert 0 < n < 4 * 130 and n % 256 == 0


TORCHRUN = Path(sys.executable).with_name("torchrun")
LENSCOPE = Path(sys.executable).with_name("lenscope")


def test_two_ranks_train_the_same_dictionary_as_one(tmp_path):
    assert TORCHRUN.exists() and LENSCOPE.exists()
    data = _text(tmp_path / "t.txt")
    args = ["dict", "train", "--model", "tiny:llama", "--site", "resid_post.1", "--kind", "topk", "--width", "48",
            "--k", "4", "--data", str(data), "--tokens", "1536", "--batch-size", "256", "--buffer", "768",
            "--seq-len", "32", "--precision", "fp32", "--lr", "3e-3"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for ranks, out in ((1, tmp_path / "one"), (2, tmp_path / "two")):
        cmd = ([str(LENSCOPE)] if ranks == 1 else
               [str(TORCHRUN), "--standalone", f"--nproc-per-node={ranks}", str(LENSCOPE)])
        r = subprocess.run(cmd + args + ["--out", str(out)], capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
    (a,), (b,) = load_dictionaries(tmp_path / "one"), load_dictionaries(tmp_path / "two")
    assert b.info["training"]["ranks"] == 2 and a.info["training"]["ranks"] == 1
    for name, t in a.tensors().items():
        # the same steps; only the order of the gradient sums differs (float32 rounding, amplified by Adam's
        # normalisation over 6 steps): agreement far below the weights' scale
        scale = float(t.abs().max())
        assert float((t - b.tensors()[name]).abs().max()) < 1e-3 * scale, name
    # trained: Adam moves every weight by about the learning rate (3e-3) per step, far beyond rounding
    assert float((a.W_enc - Dictionary.init(a.d_in, 48, k=4).W_enc * a.scale_in).abs().max()) > 1e-3 * float(
        a.W_enc.abs().max())
    assert math.isclose(a.scale_in, b.scale_in, rel_tol=1e-6)
    assert src_mod is not None


def test_default_learning_rates_by_role():
    from lenscope.features.dictionaries.train import TRANSCODER_LR, DictSettings

    assert DictSettings(width=16384).base_lr() == pytest.approx(2e-4)  # Gao et al.'s scaling for SAEs
    assert DictSettings(width=4096).base_lr() == pytest.approx(4e-4)
    assert_same_computation((DictSettings(role="transcoder", width=4608).base_lr(), TRANSCODER_LR), (8e-3, 8e-3),
                            why="the constant, returned as it is")
    assert DictSettings(role="skip", width=4 * 4608).base_lr() == pytest.approx(4e-3)
    assert_same_computation(DictSettings(role="transcoder", width=4608, lr=1e-3).base_lr(), 1e-3,
                            why="the option, returned as it is")


def test_the_memory_estimate_counts_the_block_and_parameters_and_a_small_budget_is_refused(tmp_path):
    pairs, _ = _synthetic(4_000, pairs=True)
    s = _settings("jumprelu", "skip", tokens=4_096, buffer=2048, batch_size=256)
    m = train_memory(s, d=D, sites=2, roles=["skip"])
    # the shuffle block a FileSource returns, three times; the parameters Trainable trains, five times
    block, _ = FileSource(pairs).read(0, s.buffer)
    assert_same_ints(m["buffer"], 3 * block.numel() * block.element_size())
    T = Trainable(Dictionary.init(D, s.width, kind=s.kind, role="skip", k=s.k), s)
    assert_same_ints(m["weights"], 5 * sum(p.numel() * p.element_size() for p in T.parameters()))
    bigger = [train_memory(DictSettings(**{**vars(s), key: 2 * getattr(s, key)}), d=D, sites=2, roles=["skip"])
              for key in ("buffer", "batch_size", "width")]
    assert all(b["total"] > m["total"] for b in bigger)
    save_file({"activations": pairs}, str(tmp_path / "p.safetensors"))
    with pytest.raises(InputError) as e:
        train(s, activations=tmp_path / "p.safetensors", out=tmp_path / "d", progress=False,
              max_memory=m["total"] - 1)
    msg = str(e.value)
    assert "\n" not in msg and all(o in msg for o in ("--buffer", "--batch-size", "--width", "--max-memory"))
    assert not (tmp_path / "d").exists()
    (D_,) = train(s, activations=tmp_path / "p.safetensors", progress=False, max_memory=m["total"])
    assert D_.role == "skip"
