"""``dict eval`` of a cross-layer transcoder on tiny models: each block's explained variance against the CLT's
reconstruction computed by hand (float64) from captured activations, the whole replacement's loss, KL and top-1
against a hand computation on the engine's splice, a CLT without cross-layer decoders scoring as its blocks do as
per-layer transcoders, the memory estimate, the CLI's JSON and text on a CLT folder, and one-line errors."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from lenscope.cli import app
from lenscope.data.corpus import token_batches
from lenscope.errors import InputError
from lenscope.features.dictionaries.evaluate import eval_memory, evaluate_dictionaries
from lenscope.models.dictionaries.clt_formats import save_circuit_tracer_clt
from lenscope.models.loading.summary import fingerprint
from lenscope.models.runtime.engine import capture, run
from tests.conftest import get_model, tiny_with_layers
from tests.features.test_evaluate import BATCH, SEQ, TOKENS, heldout_ids, write_corpus
from tests.models.test_clt import _brute, _out_tol, _random
from tests.tolerances import assert_same_ints, kl_tol, matmul_rounding, unit_roundoff

U64 = unit_roundoff(torch.float64)
FIELDS = {"explained_variance", "l0", "dead_fraction", "delta_loss", "loss_recovered", "kl", "tokens"}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus") / "docs.txt")


def _clt(lm, kind="jumprelu", width=40, seed=11, named=False, scale=0.02):
    """A random CLT for ``lm``, its outputs scaled by ``scale`` to about the size of a tiny model's MLP outputs."""
    C = _random(L=lm.anatomy.n_layers, d=lm.anatomy.d_model, width=width, kind=kind, seed=seed, k=6)
    if C.threshold is not None:
        C.threshold = C.threshold * 0.1
    C.W_dec = [w * scale for w in C.W_dec]
    C.b_dec = C.b_dec * scale
    if named:
        C.model, C.fingerprint = lm.name, fingerprint(lm.anatomy)
    return C


def _captured(lm, corpus, L):
    """Every block's MLP input and output on the held-out tokens the evaluation reads, ``(L, n, d)`` each."""
    ids = heldout_ids(lm, corpus)
    sites = [f"ln_mlp.out.{i}" for i in range(L)] + [f"mlp_out.{i}" for i in range(L)]
    cap = capture(lm, ids, sites)
    d = lm.anatomy.d_model
    xs = torch.stack([cap[("ln_mlp.out", i)].reshape(-1, d).float() for i in range(L)])
    ys = torch.stack([cap[("mlp_out", i)].reshape(-1, d).double() for i in range(L)])
    return xs, ys


def _ev_and_tol(y, yh, delta):
    """The explained variance of ``y`` by ``yh`` (float64) and how far the evaluator's may lie from it when its
    reconstruction is within ``delta`` of ``yh`` entry by entry: ``sum (y - ŷ)^2`` moves by at most
    ``sum 2 |y - ŷ| delta + delta^2``, and both running float64 sums (the error's and ``sum y^2 - |sum y|^2 / n``) by
    a few u64 of the ``N = n d`` squares summed, in any order."""
    r = y - yh
    sse, tss = float(r.pow(2).sum()), float((y - y.mean(0)).pow(2).sum())
    N = y.numel()
    d_sse = float((2 * r.abs() * delta + delta.pow(2)).sum()) + 4 * N * U64 * (sse + float(y.pow(2).sum()))
    d_tss = 4 * N * U64 * float(y.pow(2).sum())
    return 1 - sse / tss, (d_sse + (sse / tss) * d_tss) / tss * 2


@pytest.mark.parametrize("kind", ["topk", "jumprelu"])
def test_each_block_against_the_reconstruction_by_hand(corpus, kind):
    lm = tiny_with_layers("llama", 3)
    C = _clt(lm, kind)
    L = C.n_layers
    ev = evaluate_dictionaries(lm, C, corpus, tokens=TOKENS, seq_len=SEQ, batch_size=BATCH)
    assert [s.site for s in ev.dictionaries] == [f"mlp_out.{i}" for i in range(L)]
    xs, ys = _captured(lm, corpus, L)
    z, exact = _brute(C, xs)  # the equations in float64: block l's output from the latents of blocks 0 .. l
    tol = _out_tol(C, xs, z)
    for i, s in enumerate(ev.dictionaries):
        assert (s.role, s.kind, s.width, s.tokens) == ("clt", kind, C.width, xs.shape[1])
        want, ev_tol = _ev_and_tol(ys[i], exact[i], tol[i])
        assert abs(s.explained_variance - want) <= ev_tol, (i, s.explained_variance, want, ev_tol)
        zi = C.encode(xs[i], i)  # the block's encoder on every row at once, as test_evaluate's statistics test does
        assert_same_ints(s.fired, (zi != 0).sum(0))
        assert abs(s.l0 - float((zi != 0).sum(-1).double().mean())) <= s.l0 * 4 * xs.shape[1] * U64
        # no per-block splice; the linear baseline's explained variance only, and the comparison on it alone
        assert s.delta_loss is None and s.kl is None and s.splice_tokens == 0
        lin = s.baselines["linear"]
        assert set(lin) == {"explained_variance", "l0", "dead_fraction", "tokens", "mse"}
        assert s.beats_baseline == (s.explained_variance > lin["explained_variance"])
    r = ev.replacement
    assert (r["dictionaries"], r["blocks"], r["cross_layer"]) == (1, L, True)
    out = ev.to_dict()
    assert len(out["dictionaries"]) == L and out["delta_loss"] is None and "replacement" in out
    assert any(line.startswith("replacement model (a cross-layer transcoder, 3 blocks)") for line in ev.lines())


def test_the_replacement_against_the_engine_splice_by_hand(corpus):
    lm = tiny_with_layers("llama", 3)
    C = _clt(lm, "jumprelu")
    ev = evaluate_dictionaries(lm, C, corpus, tokens=TOKENS, seq_len=SEQ, batch_size=BATCH, baselines=False)
    r = ev.replacement
    # by hand on the same batches (the same engine passes): float64 log-softmax, cross-entropy, KL, top-1
    ce0 = ce1 = kl = 0.0
    agree = n = ambiguous = 0
    tol = 0.0
    for ids in token_batches(lm.tokenizer, corpus, seq_len=SEQ, batch_size=BATCH, part="heldout",
                             max_sequences=-(-ev.tokens // SEQ)):
        clean = run(lm, ids).logits[:, :-1]
        spl = run(lm, ids, dictionaries=[C], splice=True).logits[:, :-1]
        tgt = ids[:, 1:]
        lp0, lp1 = clean.double().log_softmax(-1), spl.double().log_softmax(-1)
        ce0 += float(-lp0.gather(-1, tgt[..., None]).sum())
        ce1 += float(-lp1.gather(-1, tgt[..., None]).sum())
        kl += float((lp0.exp() * (lp0 - lp1)).sum())
        agree += int((spl.argmax(-1) == clean.argmax(-1)).sum())
        n += tgt.numel()
        # each float32 log-probability (a logit minus a log-partition) and KL term is within kl_tol of float64's
        big = float(max(clean.abs().max(), spl.abs().max()))
        step = kl_tol(lm.anatomy.vocab_size, big)
        tol = max(tol, step)
        # a top-1 may flip where the two best logits are closer than the float32 log-softmax's rounding
        for lg in (clean, spl):
            top2 = lg.double().topk(2, -1).values
            ambiguous += int(((top2[..., 0] - top2[..., 1]) <= 2 * step).sum())
    assert r["splice_tokens"] == n == ev.splice_tokens
    assert abs(r["delta_loss"] - (ce1 - ce0) / n) <= 2 * tol + 4 * n * U64 * (ce0 + ce1) / n
    assert abs(r["kl"] - kl / n) <= tol + 4 * n * U64 * abs(kl) / n
    assert abs(r["top1_agreement"] * n - agree) <= ambiguous + 1e-9 * n
    assert r["delta_loss"] > 0  # random decoders: a worse model


def test_a_clt_that_is_the_mlps_is_the_model(corpus):
    """OPT's ReLU MLPs as a CLT (block l's encoder its MLP's first layer, its own decoder the second, the
    cross-layer decoders 0): every block explains its MLP output and the replacement is the real model."""
    from lenscope.models.dictionaries.clt import CrossLayerTranscoder

    lm = get_model("tiny:opt")
    A = lm.anatomy
    mlps = [layer.mlp for layer in A.layers]
    assert all(m.act == "relu" and not m.gated for m in mlps)
    L, (d, width) = len(mlps), mlps[0].W_in.shape
    W_dec = []
    for i, m in enumerate(mlps):
        w = torch.zeros(width, L - i, d)
        w[:, 0] = m.W_out.float()
        W_dec.append(w)
    C = CrossLayerTranscoder(W_enc=torch.stack([m.W_in.float() for m in mlps]),
                             b_enc=torch.stack([m.b_in.float() for m in mlps]), W_dec=W_dec,
                             b_dec=torch.stack([m.b_out.float() for m in mlps]), kind="jumprelu",
                             threshold=torch.zeros(L, width))
    ev = evaluate_dictionaries(lm, C, corpus, tokens=TOKENS, seq_len=SEQ, batch_size=BATCH)
    xs, ys = _captured(lm, corpus, L)
    for i, (s, m) in enumerate(zip(ev.dictionaries, mlps)):
        # the model's MLP and the CLT's block: two evaluations of relu(x W_in + b_in) W_out + b_out, each matmul
        # within matmul_rounding of the other's (the first one's carried through |W_out|)
        h = (xs[i] @ m.W_in.float() + m.b_in.float()).relu()
        delta = (matmul_rounding(h, m.W_out.float(), m.b_out.float())
                 + matmul_rounding(xs[i], m.W_in.float(), m.b_in.float()) @ m.W_out.float().abs()).double()
        _, tol = _ev_and_tol(ys[i], ys[i], delta)
        assert abs(s.explained_variance - 1) <= tol, (s.explained_variance, tol)
        assert s.beats_baseline is True  # a ReLU MLP is not linear
    r = ev.replacement
    assert r["top1_agreement"] == 1.0
    assert abs(r["delta_loss"]) <= 1e-5 * r["ce_clean"]  # as test_evaluate's perfect per-layer transcoders
    big = float(run(lm, heldout_ids(lm, corpus)).logits.abs().max())
    assert abs(r["kl"]) <= 2 * kl_tol(A.vocab_size, big)  # two float32 distributions equal up to rounding


def test_no_cross_layer_decoders_scores_as_per_layer_transcoders(corpus):
    lm = tiny_with_layers("llama", 3)
    C = _clt(lm, "topk", seed=5)
    for w in C.W_dec:
        w[:, 1:] = 0  # each block writes its own MLP output only
    blocks = [C.block(i) for i in range(C.n_layers)]
    kw = dict(tokens=TOKENS, seq_len=SEQ, batch_size=BATCH, splice_tokens=SEQ)
    a = evaluate_dictionaries(lm, C, corpus, **kw)
    b = evaluate_dictionaries(lm, blocks, corpus, **kw)
    xs, ys = _captured(lm, corpus, C.n_layers)
    for i, (sa, sb) in enumerate(zip(a.dictionaries, b.dictionaries)):
        assert sa.site == sb.site and (sa.role, sb.role) == ("clt", "transcoder")
        assert_same_ints(sa.fired, sb.fired)  # the same encoder on the same captured rows
        # the two reconstructions are the same sum (plus products with zero decoders): within two evaluations'
        # rounding of z @ W_dec + b
        z = C.encode(xs[i], i)
        delta = matmul_rounding(z, blocks[i].W_dec, blocks[i].b_dec).double()
        _, tol = _ev_and_tol(ys[i], blocks[i](xs[i]).double(), delta)
        assert abs(sa.explained_variance - sb.explained_variance) <= tol
        assert abs(sa.baselines["linear"]["explained_variance"] - sb.baselines["linear"]["explained_variance"]) \
            <= 8 * ys[i].numel() * U64  # the same least-squares fit and sums, the same operations
    assert b.replacement["cross_layer"] is False and b.replacement["blocks"] == 3


def test_memory_estimate_counts_every_blocks_latents(corpus):
    lm = tiny_with_layers("llama", 3)
    C = _clt(lm, "jumprelu")
    T = BATCH * SEQ
    m = eval_memory(lm, [C], seq_len=SEQ, batch_size=BATCH)
    assert_same_ints(m["latents"], T * (4 * C.width * 3 + 5 * C.width + 24 * C.d_out))
    assert_same_ints(m["splice_latents"], 4 * T * C.width * 3)
    assert_same_ints(m["captures"], 4 * T * lm.anatomy.d_model * 6)  # every block's MLP input and output
    one = eval_memory(lm, [C], seq_len=SEQ, batch_size=1)["total"]
    with pytest.raises(InputError) as e:
        evaluate_dictionaries(lm, C, corpus, tokens=60, seq_len=SEQ, batch_size=BATCH, max_memory=one)
    assert "\n" not in str(e.value) and "use --batch-size 1," in str(e.value)


def test_bad_input_is_one_line(corpus):
    lm = get_model("tiny:llama")
    other = get_model("tiny:gpt2")
    C = _clt(lm, named=True)
    C.model, C.fingerprint = other.name, fingerprint(other.anatomy)
    with pytest.raises(InputError, match="trained on 'tiny:gpt2'"):
        evaluate_dictionaries(lm, C, corpus, tokens=10, seq_len=SEQ)
    with pytest.raises(InputError, match="covers 3 blocks"):
        evaluate_dictionaries(lm, _random(L=3, d=lm.anatomy.d_model), corpus, tokens=10, seq_len=SEQ)
    with pytest.raises(InputError, match="on its own"):
        evaluate_dictionaries(lm, [_clt(lm), _clt(lm).block(0)], corpus, tokens=10, seq_len=SEQ)


runner = CliRunner()


def _cli(*args):
    return runner.invoke(app, ["dict", "eval", "--model", "tiny:llama", "--seq-len", "32",
                               *[str(a) for a in args]])


def test_cli_on_a_clt_folder(tmp_path, corpus):
    lm = get_model("tiny:llama")
    C = _clt(lm, named=True)
    folder = C.save(tmp_path / "clt")
    r = _cli("--dict", folder, "--data", corpus, "--tokens", 60, "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert [x["site"] for x in d["dictionaries"]] == ["mlp_out.0", "mlp_out.1"]
    for x in d["dictionaries"]:
        assert FIELDS <= set(x) and x["role"] == "clt" and x["delta_loss"] is None
        assert set(x["baselines"]) == {"linear"}
    assert {"top1_agreement", "delta_loss", "kl"} <= set(d["replacement"]) and d["replacement"]["cross_layer"]
    assert abs(d["explained_variance"] - sum(x["explained_variance"] for x in d["dictionaries"]) / 2) <= 4 * U64
    # circuit-tracer's layout, and the text
    save_circuit_tracer_clt(C, tmp_path / "ct")
    r = _cli("--dict", tmp_path / "ct", "--data", corpus, "--tokens", 60, "--no-baselines")
    assert r.exit_code == 0, r.output
    assert "cross-layer transcoder (2 blocks)" in r.stdout and "mlp_out.1 (clt, jumprelu" in r.stdout
    assert "replacement model (a cross-layer transcoder, 2 blocks): top-1 agreement" in r.stdout
    # a CLT made for another model: one line, exit 2
    other = get_model("tiny:gpt2")
    C.model, C.fingerprint = other.name, fingerprint(other.anatomy)
    C.save(tmp_path / "other")
    r = _cli("--dict", tmp_path / "other", "--data", corpus, "--tokens", 60)
    assert r.exit_code == 2 and len(r.stderr.strip().splitlines()) == 1 and "trained on 'tiny:gpt2'" in r.stderr
