"""The least-squares start of tuned-lens training (issue 22): the normal equations against a direct weighted
least-squares solve, the start against a brute-force fit on every family, its place in the training run."""

import pytest
import torch

import lenscope
from lenscope.lenses import LogitLens, TrainSettings, TunedLens, evaluate_lenses, token_sequences, train_tuned_lens
from lenscope.lenses.training.warmstart import NormalEquations, regression_start
from lenscope.models.runtime.trace import residual_states
from tests.conftest import DECODERS, get_model
from tests.tolerances import assert_same_computation

TEXT = ("When Mary and John went to the store, John gave a drink to Mary. The capital of France is Paris. "
        "The keys to the cabinet are on the table. A cat sat on the mat and looked at the dog. ") * 8
HELD_OUT = ("A dog ran to the park, and the children played with a red ball until the sun went down. "
            "Madrid is the capital of Spain. The book on the shelf is old. ") * 4


def _lstsq(X, Y, w, ridge_rows=None):
    """Weighted least squares by the textbook route: scale the rows by sqrt(w), append ridge rows, lstsq."""
    sw = w.sqrt()[:, None]
    Xa, Ya = X * sw, Y * sw
    if ridge_rows is not None:
        Xa = torch.cat([Xa, ridge_rows])
        Ya = torch.cat([Ya, torch.zeros(ridge_rows.shape[0], Y.shape[1], dtype=Y.dtype)])
    return torch.linalg.lstsq(Xa, Ya).solution


@pytest.mark.parametrize("ridge", [0.0, 0.05])
def test_normal_equations_match_a_direct_weighted_least_squares_solve(ridge):
    g = torch.Generator().manual_seed(0)
    n, T, d = 3, 200, 6
    states = torch.randn(n, T, d, generator=g)
    last = torch.randn(T, d, generator=g) * torch.linspace(0.5, 4.0, T)[:, None]  # tokens on different scales
    eq = NormalEquations(n, d)
    eq.add(states[:, :120], last[:120])  # in two batches: the sums add up
    eq.add(states[:, 120:], last[120:])
    assert eq.tokens == T
    A, b = eq.solve(ridge)
    w = 1.0 / last.double().pow(2).mean(-1)
    for i in range(n):
        X = torch.cat([states[i].double(), torch.ones(T, 1, dtype=torch.float64)], 1)
        rows = None
        if ridge:
            scale = (X * w[:, None]).mul(X).sum(0).mean()
            rows = (ridge * scale).sqrt() * torch.eye(d + 1, dtype=torch.float64)
        B = _lstsq(X, last.double() - states[i].double(), w, rows)
        assert torch.allclose(A[i].double(), B[:d], atol=1e-5), (i, float((A[i].double() - B[:d]).abs().max()))
        assert torch.allclose(b[i].double(), B[d], atol=1e-5)
    # a perfect affine relation is recovered exactly (ridge 0)
    M, c = torch.randn(d, d, generator=g), torch.randn(d, generator=g)
    eq2 = NormalEquations(1, d)
    eq2.add(states[:1], states[0] + states[0] @ M + c)
    A2, b2 = eq2.solve(0.0)
    assert torch.allclose(A2[0], M, atol=1e-4) and torch.allclose(b2[0], c, atol=1e-4)


# tiny:granite's blocks add 0.3 x their output onto a 6 x embedding, so the identity's KL is already ~1e-6 nats at
# every state (measured 1.6e-6, 9e-7; the start's 2.0e-6, 1.3e-6 on held-out ids): a fit on 4,096 random tokens has
# nothing left to beat, and the claim checked instead is that both lenses read the final distribution to 1e-5
NOTHING_TO_BEAT = {"granite": 1e-5}


@pytest.mark.parametrize("family", DECODERS)
def test_start_is_the_least_squares_fit_on_every_family(family):
    lm = get_model(f"tiny:{family}")
    seqs = token_sequences(lm, TEXT, 16)
    lens = TunedLens(lm.anatomy, mid_translators=True)
    ridge = 1e-4  # a little, so that the tiny models' nearly rank-deficient fits are well-posed in float32
    rec = regression_start(lm, lens, seqs, tokens=10**6, ridge=ridge)  # every sequence
    assert rec["tokens"] == seqs.numel() and rec["method"] == "least-squares"
    cap = residual_states(lm, seqs, mid=True)
    L = lm.anatomy.n_layers
    last = cap["states"][L].flatten(0, 1).double()
    w = 1.0 / last.pow(2).mean(-1)
    d = lm.anatomy.d_model
    pairs = (("state", cap["states"][:L], lens.A, lens.b), ("mid", cap["mid"], lens.A_mid, lens.b_mid))
    for name, h_all, A, b in pairs:
        for layer in (0, L - 1):
            h = h_all[layer].flatten(0, 1).double()
            X = torch.cat([h, torch.ones(len(h), 1, dtype=torch.float64)], 1)
            scale = (X * w[:, None]).mul(X).sum(0).mean()
            B = _lstsq(X, last - h, w, (ridge * scale).sqrt() * torch.eye(d + 1, dtype=torch.float64))
            pred = h + h @ A[layer].double() + b[layer].double()  # the start's translated state
            direct = X @ B + h
            # compare the fits by what they predict (the coefficients of a rank-deficient tiny model are not unique)
            assert torch.allclose(pred, direct, atol=1e-3 * float(last.abs().max())), (family, name, layer)
    # the start is a better lens than the identity at every state on sequences it never saw: fitted with the
    # default ridge on 4,096 tokens of random ids (a random tiny model reads those as well as any text; the 528
    # tokens of TEXT repeat one paragraph, too few for 65 coefficients per output), evaluated on other random ids
    # and on a text of other sentences (measured: at most 0.87 of the identity's KL, llama's state 0)
    V = lm.anatomy.vocab_size
    fit = torch.randint(0, V, (256, 16), generator=torch.Generator().manual_seed(0))
    start = TunedLens(lm.anatomy)
    regression_start(lm, start, fit, tokens=fit.numel(), ridge=TrainSettings().init_ridge)
    held_ids = torch.randint(0, V, (32, 16), generator=torch.Generator().manual_seed(1))
    for held in (held_ids, token_sequences(lm, HELD_OUT, 16)):
        assert not (held[:, None, :] == fit[None]).all(-1).any()  # no held-out sequence was fitted
        ev = evaluate_lenses(lm, {"logit": LogitLens(lm.anatomy), "start": start}, held, progress=False)
        kl_id = [r["kl"] for r in ev["logit"].layers()][:L]
        kl_start = [r["kl"] for r in ev["start"].layers()][:L]
        if family in NOTHING_TO_BEAT:  # both lenses already read the final distribution (see NOTHING_TO_BEAT)
            assert max(kl_id + kl_start) < NOTHING_TO_BEAT[family], (family, kl_id, kl_start)
        else:
            assert all(s < i for s, i in zip(kl_start, kl_id)), (family, kl_id, kl_start)


def test_start_stops_at_its_deadline():
    lm = get_model("tiny:llama")
    seqs = token_sequences(lm, TEXT, 16)
    ticks = iter(range(1000))
    lens = TunedLens(lm.anatomy)
    rec = regression_start(lm, lens, seqs, tokens=10**6, ridge=1e-3, batch_size=2, clock=lambda: next(ticks) * 10.0,
                           deadline=25.0)
    assert rec["tokens"] == 3 * 2 * 16  # batches end at t = 10, 20, 30: the third one is past the deadline
    assert float(lens.A.detach().abs().sum()) > 0


def test_training_keeps_the_start_only_where_it_beats_the_identity(monkeypatch):
    lm = get_model("tiny:llama")
    seqs = token_sequences(lm, TEXT * 2, 16)
    L = lm.anatomy.n_layers
    real = regression_start

    def spoiled(lm_, lens, *a, **k):  # a start that is bad at state 1
        rec = real(lm_, lens, *a, **k)
        with torch.no_grad():
            lens.A[1] = 5.0
        return rec

    import lenscope.lenses.training.train as T

    monkeypatch.setattr(T, "regression_start", spoiled)
    s = TrainSettings(tokens=32, seq_len=16, batch_size=2, lr=1e-12, validation_tokens=32)
    lens = train_tuned_lens(lm, seqs, s, progress=False)
    sel = lens.training_info["selection"]
    start, ident = sel["validation_kl_start"], sel["validation_kl_identity"]
    assert start[1] > ident[1] and all(start[i] < ident[i] for i in range(L) if i != 1)
    assert float(lens.A[1].detach().abs().max()) < 1e-6  # state 1 went back to the identity (lr 1e-12)
    assert float(lens.A[0].detach().abs().max()) > 1e-3  # the others kept the start
    assert lens.training_info["init"]["tokens"] > 0
    assert sel["validation_kl"] == pytest.approx([min(a, b) for a, b in zip(start, ident)], rel=1e-3)


def test_identity_start_and_settings_checks():
    lm = get_model("tiny:gpt2")
    seqs = token_sequences(lm, TEXT, 16)
    s = TrainSettings(tokens=32, seq_len=16, batch_size=2, init="identity", keep_best=False, lr=1e-12)
    lens = train_tuned_lens(lm, seqs, s, progress=False)
    assert "init" not in lens.training_info and float(lens.A.detach().abs().max()) < 1e-6
    for bad in ({"init": "zeros"}, {"init_tokens": 0}, {"init_ridge": -1.0}, {"init_max_fraction": 1.0}):
        with pytest.raises(lenscope.InputError):
            TrainSettings(**bad).check()


def test_selection_record_survives_a_checkpoint(tmp_path):
    lm = get_model("tiny:llama")
    seqs = token_sequences(lm, TEXT * 2, 16)
    s = TrainSettings(tokens=6 * 32, seq_len=16, batch_size=2, checkpoint_every=2, validation_tokens=32)
    straight = train_tuned_lens(lm, seqs, s, progress=False)
    train_tuned_lens(lm, seqs, s, out=tmp_path, progress=False, max_steps=3)
    resumed = train_tuned_lens(lm, seqs, s, out=tmp_path, resume=True, progress=False)
    assert torch.allclose(resumed.A, straight.A, atol=1e-6)
    a, b = straight.training_info, resumed.training_info
    assert_same_computation(a["selection"]["validation_kl_start"], b["selection"]["validation_kl_start"],
                            why="the start's KL: computed before any step, kept through the checkpoint")
    assert b["init"] == {**a["init"], "seconds": b["init"]["seconds"]}
