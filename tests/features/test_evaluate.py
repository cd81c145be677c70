"""Dictionary evaluation on held-out text: every statistic against a brute-force computation on tiny models, a
dictionary that reconstructs perfectly scores perfectly, the baselines are the PCA and least-squares fits, the
replacement model of perfect transcoders is the real model, and only the held-out part is read."""

from __future__ import annotations

import dataclasses
import json
import math
import random

import pytest
import torch
import torch.nn.functional as F

from lenscope.data.corpus import token_batches
from lenscope.errors import InputError
from lenscope.features.dictionaries.evaluate import (
    DEAD_TOKENS,
    DictionaryEvaluation,
    eval_memory,
    evaluate_dictionaries,
    fit_linear,
    fit_pca,
    reconstruction,
)
from lenscope.models.dictionaries.dictionary import Dictionary
from lenscope.models.runtime.engine import Edit, capture, run
from tests.conftest import get_model
from tests.tolerances import assert_same_computation, assert_same_ints

SEQ, BATCH, TOKENS = 32, 3, 200
TRAIN_WORDS = ("river stone maple window copper lantern harbor meadow violin orchard pencil thunder").split()
HELD_WORDS = ("zebra quokka axolotl jaguar walrus kiwi").split()
COUNTS = "means of counts: the integer sums are exact in any order or chunks"


def write_corpus(path, n_docs=40, words=120, seed=0):
    """``n_docs`` documents separated by ``<|endoftext|>`` lines; the held-out ones (every 20th) use other words."""
    rng = random.Random(seed)
    docs = []
    for i in range(n_docs):
        vocab = HELD_WORDS if i % 20 == 19 else TRAIN_WORDS
        docs.append(" ".join(rng.choice(vocab) for _ in range(words)))
    path.write_text("\n<|endoftext|>\n".join(docs) + "\n")
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus") / "docs.txt")


def heldout_ids(lm, path, tokens=TOKENS, part="heldout"):
    n_seq = -(-tokens // SEQ)
    return torch.cat(list(token_batches(lm.tokenizer, path, seq_len=SEQ, batch_size=BATCH, part=part,
                                        max_sequences=n_seq)))


def random_sae(d, width, site, *, kind="topk", k=4, seed=0):
    D = Dictionary.init(d, width, kind=kind, k=k if kind == "topk" else None, site=site, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    D.b_enc = torch.randn(width, generator=g) * 0.1
    D.b_dec = torch.randn(d, generator=g) * 0.1
    if D.threshold is not None:
        D.threshold = torch.rand(width, generator=g) * 0.5
    return D


def identity_sae(d, site):
    """``W_enc = [I, -I]``, ``W_dec = [I; -I]``, JumpReLU at 0: ``relu(x) - relu(-x) = x``, exactly."""
    eye = torch.eye(d)
    return Dictionary(W_enc=torch.cat([eye, -eye], 1), b_enc=torch.zeros(2 * d), W_dec=torch.cat([eye, -eye], 0),
                      b_dec=torch.zeros(d), kind="jumprelu", threshold=torch.zeros(2 * d), site=site)


def mlp_transcoder(lm, layer, role="transcoder"):
    """A transcoder that is block ``layer``'s ReLU MLP itself (OPT): ``relu(x W_in + b_in) W_out + b_out``. A skip
    transcoder: a random skip path ``x W_skip^T``, cancelled by ``2 d`` more latents ``relu(x), relu(-x)`` whose
    decoder rows are ``-W_skip^T, W_skip^T`` (``relu(x) - relu(-x) = x``), so the sum is still the MLP."""
    m = lm.anatomy.layers[layer].mlp
    assert m.act == "relu" and not m.gated
    d, width = m.W_in.shape
    W_enc, b_enc, W_dec = m.W_in.float().clone(), m.b_in.float().clone(), m.W_out.float().clone()
    W_skip = None
    if role == "skip":
        eye = torch.eye(d)
        W_skip = torch.randn(d, d, generator=torch.Generator().manual_seed(layer)) * 0.3
        W_enc = torch.cat([W_enc, eye, -eye], 1)
        b_enc = torch.cat([b_enc, torch.zeros(2 * d)])
        W_dec = torch.cat([W_dec, -W_skip.T, W_skip.T], 0)
        width += 2 * d
    return Dictionary(W_enc=W_enc, b_enc=b_enc, W_dec=W_dec, b_dec=m.b_out.float().clone(), kind="jumprelu",
                      role=role, threshold=torch.zeros(width), W_skip=W_skip, site=f"mlp_out.{layer}")


def ce_kl_top1(logits, clean, ids):
    """Brute force: next-token CE of ``logits``, KL(clean || logits), top-1 agreement, over every prediction of a
    token from the one before it (float64)."""
    lg, cl = logits[:, :-1].double(), clean[:, :-1].double()
    tgt = ids[:, 1:]
    ce = F.cross_entropy(lg.reshape(-1, lg.shape[-1]), tgt.reshape(-1))
    kl = F.kl_div(lg.log_softmax(-1), cl.log_softmax(-1), log_target=True, reduction="none").sum(-1).mean()
    top1 = (lg.argmax(-1) == cl.argmax(-1)).double().mean()
    return float(ce), float(kl), float(top1)


def whole(site, layer, values):
    B, P = values.shape[:2]
    return Edit(site, layer, torch.arange(B).repeat_interleave(P), torch.arange(P).repeat(B),
                values.reshape(B * P, -1), mode="set")


@pytest.mark.parametrize("kind", ["topk", "jumprelu"])
def test_statistics_against_brute_force(corpus, kind):
    lm = get_model("tiny:llama")
    d = lm.anatomy.d_model
    D = random_sae(d, 96, "resid_post.0", kind=kind, k=5, seed=2)
    ev = evaluate_dictionaries(lm, D, corpus, tokens=TOKENS, seq_len=SEQ, batch_size=BATCH)
    s = ev.dictionaries[0]

    ids = heldout_ids(lm, corpus)
    x = capture(lm, ids, ["resid_post.0"])[("resid_post", 0)].reshape(-1, d).double()
    z = D.encode(x.float()).double()
    xh = z @ D.W_dec.double() + D.b_dec.double()
    tol = 1e-5  # float32 reconstruction against float64 sums
    assert s.tokens == ev.tokens == x.shape[0] >= TOKENS
    assert math.isclose(s.explained_variance, float(1 - (x - xh).pow(2).sum() / (x - x.mean(0)).pow(2).sum()),
                        abs_tol=tol)
    assert math.isclose(s.l0, float((z != 0).sum(-1).double().mean()), rel_tol=1e-12)
    assert_same_ints(s.fired, (z != 0).sum(0))
    assert_same_computation(s.dead_fraction, float((z != 0).any(0).logical_not().double().mean()), why=COUNTS)
    assert s.dead_reliable is False and s.tokens < DEAD_TOKENS
    assert sum(s.density["counts"]) + s.density["dead"] == 96
    assert s.density["edges"][-1] == 0 and s.density["edges"][0] <= math.log10(1 / s.tokens)
    r = reconstruction(D, x.float(), chunk=7)  # the same sums on rows in hand, in uneven chunks
    assert r["rows"] == s.tokens
    assert_same_computation((r["l0"], r["dead_fraction"]), (s.l0, s.dead_fraction), why=COUNTS)
    assert math.isclose(r["explained_variance"], s.explained_variance, abs_tol=tol)

    # the splice, brute force: the site SET to the reconstruction by an engine edit (not the splice path)
    clean = run(lm, ids).logits
    spl = run(lm, ids, [whole("resid_post", 0, xh.float().reshape(ids.shape[0], SEQ, d))]).logits
    zero = run(lm, ids, [Edit("resid_post", 0, torch.arange(ids.shape[0])[:, None], torch.arange(SEQ)[None, :],
                              torch.tensor(0.0), mode="scale")]).logits
    ce0, _, _ = ce_kl_top1(clean, clean, ids)
    ce1, kl1, top1 = ce_kl_top1(spl, clean, ids)
    cez, _, _ = ce_kl_top1(zero, clean, ids)
    assert s.splice_tokens == ids.shape[0] * (SEQ - 1)
    assert math.isclose(s.ce_clean, ce0, rel_tol=1e-5)
    assert math.isclose(s.ce_spliced, ce1, rel_tol=1e-5)
    assert math.isclose(s.ce_zero, cez, rel_tol=1e-5)  # the zero-ablation (here by scaling by 0) by hand
    assert math.isclose(s.delta_loss, ce1 - ce0, abs_tol=1e-5 * ce0)
    assert math.isclose(s.loss_recovered, (cez - ce1) / (cez - ce0), abs_tol=1e-4)
    assert math.isclose(s.kl, kl1, rel_tol=1e-3, abs_tol=1e-6)
    assert math.isclose(s.top1_agreement, top1, abs_tol=1.5 / s.splice_tokens)

    # the PCA baseline: fitted on the train part, round(l0) components, spliced likewise
    b = s.baselines["pca"]
    k = round(s.l0)
    assert b["components"] == k and b["l0"] == k
    xt = capture(lm, heldout_ids(lm, corpus, part="train"), ["resid_post.0"])[("resid_post", 0)]
    xt = xt.reshape(-1, d).double()
    mu = xt.mean(0)
    U = torch.linalg.svd(xt - mu, full_matrices=False).Vh[:k].T
    xp = mu + (x - mu) @ U @ U.T
    assert math.isclose(b["explained_variance"], float(1 - (x - xp).pow(2).sum() / (x - x.mean(0)).pow(2).sum()),
                        abs_tol=tol)
    bl = run(lm, ids, [whole("resid_post", 0, xp.float().reshape(ids.shape[0], SEQ, d))]).logits
    ceb, klb, _ = ce_kl_top1(bl, clean, ids)
    assert math.isclose(b["delta_loss"], ceb - ce0, abs_tol=1e-5 * ce0)
    assert math.isclose(b["kl"], klb, rel_tol=1e-3, abs_tol=1e-6)
    # a random dictionary does not beat PCA, and says so
    assert s.explained_variance < b["explained_variance"] and s.beats_baseline is False
    assert any("does NOT beat its pca baseline" in line for line in ev.lines())


def test_perfect_dictionary_scores_perfectly(corpus):
    lm = get_model("tiny:llama")
    d = lm.anatomy.d_model
    ev = evaluate_dictionaries(lm, identity_sae(d, "resid_post.1"), corpus, tokens=TOKENS, seq_len=SEQ,
                               batch_size=BATCH)
    s = ev.dictionaries[0]
    assert s.explained_variance == pytest.approx(1.0, abs=1e-6)
    assert abs(s.delta_loss) <= 1e-5 * s.ce_clean
    assert s.kl == pytest.approx(0.0, abs=1e-7)
    assert s.loss_recovered == pytest.approx(1.0, abs=1e-4)
    assert s.top1_agreement == 1.0
    # zero-ablating the last residual stream by hand: the final RMSNorm of 0 is 0, the logits 0 (no bias):
    # the uniform distribution, cross-entropy log(vocab)
    assert s.ce_zero == pytest.approx(math.log(lm.anatomy.vocab_size), rel=1e-6)
    assert s.baselines["pca"]["components"] == round(s.l0)


@pytest.mark.parametrize("family", ["gpt2", "gemma2", "falcon", "olmo2", "mixtral"])
def test_perfect_sae_on_families(corpus, family):
    """Pre-norm, sandwich, parallel, MoE: the identity SAE spliced anywhere leaves the model as it is."""
    lm = get_model(f"tiny:{family}")
    site = f"resid_post.{lm.anatomy.n_layers - 2}"
    s = evaluate_dictionaries(lm, identity_sae(lm.anatomy.d_model, site), corpus, tokens=60, seq_len=SEQ,
                              batch_size=BATCH).dictionaries[0]
    assert s.explained_variance == pytest.approx(1.0, abs=1e-6)
    assert abs(s.delta_loss) <= 1e-5 * s.ce_clean and s.kl == pytest.approx(0.0, abs=1e-7)
    assert s.top1_agreement == 1.0 and s.loss_recovered == pytest.approx(1.0, abs=1e-3)


@pytest.mark.parametrize("role", ["transcoder", "skip"])
def test_perfect_transcoders_replacement_model_is_the_model(corpus, role):
    lm = get_model("tiny:opt")
    T = [mlp_transcoder(lm, layer, role) for layer in range(lm.anatomy.n_layers)]
    ev = evaluate_dictionaries(lm, T, corpus, tokens=TOKENS, seq_len=SEQ, batch_size=BATCH)
    for s in ev.dictionaries:
        assert s.role == role and "linear" in s.baselines and "pca" not in s.baselines
        assert s.explained_variance == pytest.approx(1.0, abs=1e-5)
        assert abs(s.delta_loss) <= 1e-5 * s.ce_clean and s.kl == pytest.approx(0.0, abs=1e-7)
        assert s.top1_agreement == 1.0
        lin = s.baselines["linear"]
        assert lin["explained_variance"] < s.explained_variance  # a ReLU MLP is not linear
        assert s.beats_baseline is True
    r = ev.replacement
    assert r["dictionaries"] == 2 and r["top1_agreement"] == 1.0
    assert abs(r["delta_loss"]) <= 1e-5 * r["ce_clean"] and r["kl"] == pytest.approx(0.0, abs=1e-7)
    out = ev.to_dict()
    assert set(out["replacement"]) >= {"top1_agreement", "delta_loss", "kl"}
    assert len(out["dictionaries"]) == 2 and "explained_variance" in out


def test_without_each_splice_only_the_replacement_is_spliced(corpus):
    lm = get_model("tiny:opt")
    T = [mlp_transcoder(lm, layer) for layer in range(lm.anatomy.n_layers)]
    ev = evaluate_dictionaries(lm, T, corpus, tokens=TOKENS, seq_len=SEQ, batch_size=BATCH, splice_each=False)
    for s in ev.dictionaries:
        assert s.role == "transcoder" and s.explained_variance == pytest.approx(1.0, abs=1e-5)
        assert s.delta_loss is None and s.kl is None and s.top1_agreement is None
        assert s.beats_baseline is True  # on explained variance alone, as a CLT block's
    r = ev.replacement
    assert r["dictionaries"] == 2 and r["top1_agreement"] == 1.0 and r["splice_tokens"] > 0
    assert abs(r["delta_loss"]) <= 1e-5 * r["ce_clean"] and r["kl"] == pytest.approx(0.0, abs=1e-7)


def test_linear_baseline_in_evaluation_is_least_squares(corpus):
    lm = get_model("tiny:llama")
    d = lm.anatomy.d_model
    T = Dictionary.init(d, 80, kind="topk", k=6, role="transcoder", site="mlp_out.1", seed=4)
    s = evaluate_dictionaries(lm, T, corpus, tokens=TOKENS, seq_len=SEQ, batch_size=BATCH).dictionaries[0]
    cap = capture(lm, heldout_ids(lm, corpus, part="train"), ["ln_mlp.out.1", "mlp_out.1"])
    xt, yt = (cap[k].reshape(-1, d).double() for k in (("ln_mlp.out", 1), ("mlp_out", 1)))
    ones = torch.ones(xt.shape[0], 1, dtype=torch.float64)
    B = torch.linalg.lstsq(torch.cat([xt, ones], 1), yt, driver="gelsd").solution
    cap = capture(lm, heldout_ids(lm, corpus), ["ln_mlp.out.1", "mlp_out.1"])
    x, y = (cap[k].reshape(-1, d).double() for k in (("ln_mlp.out", 1), ("mlp_out", 1)))
    yp = torch.cat([x, torch.ones(x.shape[0], 1, dtype=torch.float64)], 1) @ B
    ev_ref = float(1 - (y - yp).pow(2).sum() / (y - y.mean(0)).pow(2).sum())
    assert math.isclose(s.baselines["linear"]["explained_variance"], ev_ref, abs_tol=1e-4)


def test_pca_fit_equals_brute_force():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 12, generator=g, dtype=torch.float64) @ torch.randn(12, 12, generator=g,
                                                                            dtype=torch.float64) + 3.0
    p = fit_pca(x)
    mu = x.mean(0)
    _, S, Vh = torch.linalg.svd(x - mu, full_matrices=False)
    assert torch.allclose(p.mean, mu, atol=1e-12)
    assert torch.allclose(p.variances, S.pow(2) / x.shape[0], rtol=1e-9)
    for k in (1, 4, 12):
        U = Vh[:k].T
        assert torch.allclose(p.reconstruct(x, k), mu + (x - mu) @ U @ U.T, atol=1e-9)


def test_linear_fit_equals_lstsq_also_rank_deficient():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(200, 10, generator=g, dtype=torch.float64)
    y = torch.tanh(x @ torch.randn(10, 6, generator=g, dtype=torch.float64)) + 0.5
    X = torch.cat([x, torch.ones(200, 1, dtype=torch.float64)], 1)
    ref = X @ torch.linalg.lstsq(X, y, driver="gelsd").solution
    assert torch.allclose(fit_linear(x, y)(x), ref, atol=1e-9)
    # a LayerNorm-like input: centred rows plus a bias lie in a hyperplane, so [x, 1] is rank-deficient
    xc = x - x.mean(1, keepdim=True) + 0.3
    Xc = torch.cat([xc, torch.ones(200, 1, dtype=torch.float64)], 1)
    ref = Xc @ torch.linalg.lstsq(Xc, y, driver="gelsd").solution
    assert torch.allclose(fit_linear(xc, y)(xc), ref, atol=1e-7)


def test_only_heldout_documents_are_evaluated(tmp_path):
    """A matched-filter dictionary on the token embeddings (latent t fires exactly on token t) counts the tokens
    evaluated: they are the held-out stream's body tokens, never a train document's, never the BOS."""
    from tokenizers import processors

    from lenscope.models.loading.tokenizer import tiny_tokenizer

    base = get_model("tiny:llama")
    tok = tiny_tokenizer()
    bos = tok.convert_tokens_to_ids("<s>")
    tok._tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    lm = dataclasses.replace(base, tokenizer=tok)
    path = write_corpus(tmp_path / "docs.txt", seed=5)
    E = lm.anatomy.embed.W_E.float()
    V, d = E.shape
    En = E / E.norm(dim=1, keepdim=True).clamp_min(1e-6)  # the padding row is 0
    D = Dictionary(W_enc=En.T.clone(), b_enc=torch.zeros(V), W_dec=En.clone(), b_dec=torch.zeros(d), kind="topk",
                   k=1, site="resid_pre.0")
    s = evaluate_dictionaries(lm, D, path, tokens=TOKENS, seq_len=SEQ, batch_size=BATCH, baselines=False,
                              splice_tokens=SEQ).dictionaries[0]
    ids = heldout_ids(lm, path)
    assert bool((ids[:, 0] == bos).all())
    body = ids[:, 1:].reshape(-1)
    assert_same_ints(s.fired, torch.bincount(body, minlength=V))
    assert int(s.fired[bos]) == 0 and s.tokens == body.numel()
    train = set(heldout_ids(lm, path, tokens=2000, part="train").reshape(-1).tolist())
    held = set(body.tolist())
    only_train = sorted(train - held)
    assert only_train and all(int(s.fired[t]) == 0 for t in only_train)
    for row in ids[:, 1:]:  # the words of held-out documents only (a row's first and last may be cut)
        words = lm.tokenizer.decode(row).replace("<|endoftext|>", " ").split()[1:-1]
        assert words and set(words) <= set(HELD_WORDS), words
    # splice_tokens=32 body tokens: two sequences of 31; their predictions of a body token from a body token
    assert s.splice_tokens == 2 * (SEQ - 2)


def test_json_save_load_and_frame(corpus, tmp_path):
    lm = get_model("tiny:llama")
    d = lm.anatomy.d_model
    ev = evaluate_dictionaries(lm, random_sae(d, 64, "resid_post.0", k=3), corpus, tokens=60, seq_len=SEQ,
                               batch_size=BATCH)
    out = json.loads(ev.to_json())
    for f in ("explained_variance", "l0", "dead_fraction", "delta_loss", "loss_recovered", "kl", "tokens", "site",
              "kind", "role", "width", "beats_baseline", "dead_reliable", "density"):
        assert f in out, f
    assert set(out["baselines"]) == {"pca"}
    for f in ("explained_variance", "l0", "dead_fraction", "delta_loss", "loss_recovered", "kl", "tokens"):
        assert f in out["baselines"]["pca"], f
    back = DictionaryEvaluation.load(ev.save(tmp_path / "ev.json"))
    assert_same_computation(back.to_dict(), ev.to_dict(), why="saved and read back")
    assert_same_ints(back.dictionaries[0].fired, ev.dictionaries[0].fired)
    frame = ev.to_frame()
    assert list(frame["method"]) == ["dictionary", "pca"]
    assert frame.loc[0, "explained_variance"] == pytest.approx(ev.dictionaries[0].explained_variance)


def test_several_dictionaries_json_means(corpus):
    lm = get_model("tiny:llama")
    d = lm.anatomy.d_model
    ds = [random_sae(d, 64, "resid_post.0", k=3, seed=1), random_sae(d, 64, "resid_post.1", k=3, seed=2)]
    ev = evaluate_dictionaries(lm, ds, corpus, tokens=60, seq_len=SEQ, batch_size=BATCH)
    out = ev.to_dict()
    assert [x["site"] for x in out["dictionaries"]] == ["resid_post.0", "resid_post.1"]
    for f in ("explained_variance", "l0", "dead_fraction", "delta_loss", "loss_recovered", "kl"):
        assert out[f] == pytest.approx(sum(x[f] for x in out["dictionaries"]) / 2)
    assert "replacement" not in out  # SAEs, not transcoders


def test_bad_input(corpus):
    lm = get_model("tiny:llama")
    d = lm.anatomy.d_model
    D = random_sae(d, 64, "resid_post.0")
    with pytest.raises(InputError, match="tokens"):
        evaluate_dictionaries(lm, D, corpus, tokens=0)
    other = random_sae(d, 64, "resid_post.0")
    other.fingerprint, other.model = "0000", "tiny:gpt2"
    with pytest.raises(InputError, match="trained on"):
        evaluate_dictionaries(lm, other, corpus, tokens=10, seq_len=SEQ)
    with pytest.raises(InputError, match="two dictionaries"):
        evaluate_dictionaries(lm, [D, random_sae(d, 64, "resid_post.0", seed=3)], corpus, tokens=10, seq_len=SEQ)


def test_the_memory_estimate_counts_the_logits_and_a_small_budget_names_a_batch_that_fits(corpus):
    lm = get_model("tiny:llama")
    D = random_sae(lm.anatomy.d_model, 64, "resid_post.0")
    m = eval_memory(lm, [D], seq_len=SEQ, batch_size=BATCH)
    ids = heldout_ids(lm, corpus)[:BATCH, :SEQ]
    logits = run(lm, ids).logits.float()
    assert_same_ints(m["logits"], 7 * logits.numel() * logits.element_size())  # a pass's logits, seven times
    assert_same_ints(m["captures"], ids.numel() * lm.anatomy.d_model * 4)  # an SAE reads and writes one site
    one = eval_memory(lm, [D], seq_len=SEQ, batch_size=1)["total"]
    with pytest.raises(InputError) as e:
        evaluate_dictionaries(lm, D, corpus, tokens=60, seq_len=SEQ, batch_size=BATCH, max_memory=one)
    msg = str(e.value)
    assert "\n" not in msg and "--max-memory" in msg and "use --batch-size 1," in msg
    ev = evaluate_dictionaries(lm, D, corpus, tokens=60, seq_len=SEQ, batch_size=1, max_memory=one)
    assert_same_ints(ev.tokens, ev.dictionaries[0].tokens)
    with pytest.raises(InputError, match="even --batch-size 1 does not fit: lower --seq-len"):
        evaluate_dictionaries(lm, D, corpus, tokens=60, seq_len=SEQ, batch_size=BATCH, max_memory=one - 1)
