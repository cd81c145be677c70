"""Prediction depth: hand-made agreement patterns, the exact bfloat16 top-1, depths against trajectories,
corpus statistics (Spearman with the loss, never-settled tokens), results, plots and the CLI."""

import json

import pytest
import torch
from typer.testing import CliRunner

from lenscope.cli import app
from lenscope.lenses import LogitLens, TunedLens, token_sequences
from lenscope.lenses.depth import (
    NEVER,
    DepthStats,
    TokenDepths,
    corpus_depths,
    depths_from_agreement,
    lens_top1,
    read_texts,
    text_depths,
    token_depths,
    trajectory_depth,
)
from lenscope.lenses.trajectory import prediction_trajectory
from lenscope.models.runtime.trace import residual_states
from tests.conftest import get_model, tiny_with_layers
from tests.tolerances import assert_same_computation, assert_same_ints

TEXT = "When Mary and John went to the store, John gave a drink to Mary. The capital of France is"
CORPUS = ("When Mary and John went to the store, John gave a drink to Mary.\n"
          "The capital of France is Paris. The keys to the cabinet are on the table.\n") * 40


def perturbed_lens(lm, seed=0, scale=0.3):
    lens = TunedLens(lm.anatomy, model_name=lm.name)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        lens.A.copy_(torch.randn(lens.A.shape, generator=g) * scale / lens.d_model**0.5)
        lens.b.copy_(torch.randn(lens.b.shape, generator=g) * scale)
    return lens


def test_depth_of_hand_made_agreement_patterns():
    T, F = True, False
    cols = {
        "settles at 2": [F, F, T, T, T],
        "agrees from the start": [T, T, T, T, T],
        "never settles (wrong at the last state)": [T, T, T, T, F],
        "right at 1, flips back, settles at 3": [F, T, F, T, T],
        "right early, wrong, right again": [T, T, F, T, T],
        "only the last state": [F, F, F, F, T],
        "never right": [F, F, F, F, F],
    }
    agree = torch.tensor(list(cols.values())).T  # (state, tokens)
    got = depths_from_agreement(agree).tolist()
    assert got == [2, 0, NEVER, 3, 3, 4, NEVER]


def test_depth_brute_force_on_random_patterns():
    g = torch.Generator().manual_seed(0)
    agree = torch.rand(6, 200, generator=g) > 0.3
    got = depths_from_agreement(agree)
    for t in range(agree.shape[1]):
        col = agree[:, t].tolist()
        want = NEVER
        for s in range(len(col)):
            if all(col[s:]):
                want = s
                break
        assert int(got[t]) == want


@pytest.mark.parametrize("name", ["tiny:llama", "tiny:gpt2", "tiny:gemma3", "tiny:bert", "tiny:opt"])
def test_bf16_top1_is_the_float32_argmax(name):
    lm = get_model(name)
    ids = token_sequences(lm, CORPUS, 32, max_tokens=128)
    states = residual_states(lm, ids)["states"]
    lens = perturbed_lens(lm)
    for layer in range(lm.anatomy.n_layers + 1):
        h = states[layer].flatten(0, 1)
        exact = lens.logits(h, layer).argmax(-1)
        assert_same_ints(lens_top1(lm, lens, h, layer), exact)
        assert_same_ints(lens_top1(lm, lens, h, layer, exact=True), exact)
        # without the candidate shortcut every row goes through the float32 check
        assert_same_ints(lens_top1(lm, lens, h, layer, candidates=1), exact)


def test_top1_ties_go_to_the_lowest_token_id():
    lm = get_model("tiny:llama")
    W = lm.anatomy.unembed.W_U
    saved = W.clone()
    try:
        with torch.no_grad():
            W[:, 7] = W[:, 3]  # tokens 3 and 7 always tie
        h = torch.randn(64, lm.anatomy.d_model)
        lens = LogitLens(lm.anatomy)
        exact = lens.logits(h, 0).argmax(-1)
        assert (exact != 7).all()
        assert_same_ints(lens_top1(lm, lens, h, 0), exact)
    finally:
        with torch.no_grad():
            W.copy_(saved)


@pytest.mark.parametrize("name", ["tiny:llama", "tiny:gpt-neox", "tiny:bert"])
def test_text_depths_agree_with_the_trajectory(name):
    lm = tiny_with_layers(name.split(":")[1], 4)
    lens = perturbed_lens(lm)
    res = text_depths(lm, TEXT, {"tuned": lens, "logit": LogitLens(lm.anatomy)})
    for lname, ln in (("tuned", lens), ("logit", LogitLens(lm.anatomy))):
        traj = prediction_trajectory(lm, TEXT, ln)
        r = res[lname]
        assert r.to_dict()["depth"] == trajectory_depth(traj)
        assert r.tokens == traj.tokens
        # by definition: top-1 equals the output's from the depth on, and not at the state before it
        top = traj.top_ids
        for p, d in enumerate(r.to_dict()["depth"]):
            L = lm.anatomy.n_layers
            if d is None:
                assert top[L - 1, p] != top[L, p]
            else:
                assert (top[d:L, p] == top[L, p]).all()
                assert d == 0 or top[d - 1, p] != top[L, p]


def test_loss_is_the_models_cross_entropy():
    lm = get_model("tiny:llama")
    ids = token_sequences(lm, CORPUS, 16, max_tokens=32)
    _, loss, top = token_depths(lm, {"logit": LogitLens(lm.anatomy)}, ids)
    logits = lm.model(input_ids=ids).logits.detach()
    want = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
    assert torch.allclose(loss[:, :-1].flatten(), want, atol=1e-4)
    assert torch.isnan(loss[:, -1]).all()
    assert_same_ints(top, logits.argmax(-1))


def test_corpus_stats_spearman_and_never_settled():
    from lenscope.stats import spearman

    lm = tiny_with_layers("llama", 4)
    ids = token_sequences(lm, CORPUS, 32, max_tokens=256)
    stats = corpus_depths(lm, ids, {"tuned": perturbed_lens(lm), "logit": LogitLens(lm.anatomy)}, name="corpus")
    s = stats["logit"]
    assert s.n_tokens == ids.shape[0] * (ids.shape[1] - 1)
    ranked = torch.where(s.depth == NEVER, torch.full_like(s.depth, 4), s.depth)
    assert s.spearman_with_loss == pytest.approx(spearman(ranked.double(), s.loss.double()))
    assert s.never_settled == pytest.approx(float((s.depth == NEVER).double().mean()))
    if (s.depth != NEVER).any():
        assert s.mean_depth == pytest.approx(float(s.depth[s.depth != NEVER].double().mean()))
    assert sum(s.histogram()) == s.n_tokens and len(s.histogram()) == 5
    d = s.to_dict()
    assert {"mean_depth", "spearman_with_loss", "never_settled", "histogram", "n_tokens"} <= set(d)
    json.dumps(d)
    # texts of different lengths give the same numbers as running each on its own
    texts = ["The capital of France is Paris.", "John gave a drink to Mary.", "The keys are on the table."]
    many = corpus_depths(lm, texts, LogitLens(lm.anatomy))["logit"]
    one = [corpus_depths(lm, [t], LogitLens(lm.anatomy))["logit"] for t in texts]
    assert sorted(many.depth.tolist()) == sorted(x for o in one for x in o.depth.tolist())


def test_results_roundtrip_and_plots(tmp_path):
    lm = tiny_with_layers("llama", 4)
    res = text_depths(lm, TEXT)["logit"]
    assert isinstance(res, TokenDepths)
    back = TokenDepths.load(res.save(tmp_path / "d.safetensors"))
    assert_same_computation(back.to_dict(), res.to_dict(), why="saved and read back")
    assert list(res.to_frame().columns) == ["token", "prediction", "depth", "loss"]
    assert res.plot().axes
    ids = token_sequences(lm, CORPUS, 32, max_tokens=64)
    st = corpus_depths(lm, ids, {"tuned": perturbed_lens(lm), "logit": LogitLens(lm.anatomy)})
    back = DepthStats.load(st["tuned"].save(tmp_path / "s.safetensors"))
    assert_same_computation(back.to_dict(), st["tuned"].to_dict(), why="saved and read back")
    assert st["tuned"].plot([st["logit"]]).axes


def test_read_texts(tmp_path):
    from lenscope.errors import InputError

    p = tmp_path / "b.jsonl"
    p.write_text('{"sentence_good": "A b.", "sentence_bad": "B a."}\n\n{"text": "C d."}\n{"sentence_good": "E."}\n')
    assert read_texts(p) == ["A b.", "C d.", "E."]
    assert read_texts(p, limit=2) == ["A b.", "C d."]
    (tmp_path / "bad.jsonl").write_text('{"other": 1}\n')
    with pytest.raises(InputError, match="sentence_good"):
        read_texts(tmp_path / "bad.jsonl")


runner = CliRunner()


def test_cli_depth_text_data_and_show(tmp_path):
    r = runner.invoke(app, ["lens", "depth", TEXT, "--model", "tiny:llama", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert len(d["tokens"]) == len(d["depth"]) == len(d["loss"])
    assert d["lens"] == "logit"
    assert d["depth"] == text_depths(get_model("tiny:llama"), TEXT)["logit"].to_dict()["depth"]  # the API's numbers
    corpus = tmp_path / "c.txt"
    corpus.write_text(CORPUS)
    lens_dir = tmp_path / "lens"
    perturbed_lens(get_model("tiny:llama")).save(lens_dir)
    r = runner.invoke(app, ["lens", "depth", "--data", str(corpus), "--model", "tiny:llama", "--lens", str(lens_dir),
                            "--lens", "logit", "--seq-len", "32", "--tokens", "128", "--json", "--png",
                            str(tmp_path / "d.png")])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert {"mean_depth", "spearman_with_loss", "n_tokens"} <= set(d) and d["lens"] == "tuned"
    assert set(d["lenses"]) == {"tuned", "logit"} and (tmp_path / "d.png").read_bytes()[:4] == b"\x89PNG"
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("\n".join(json.dumps({"sentence_good": s}) for s in ["The cat sleeps.", "Dogs bark loudly."]))
    b.write_text("\n".join(json.dumps({"sentence_good": s}) for s in ["Who did Mary see?", "It rains."]))
    r = runner.invoke(app, ["lens", "depth", "--data", str(a), "--data", str(b), "--model", "tiny:llama", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert [x["data"] for x in d["datasets"]] == ["a", "b"]
    assert d["n_tokens"] == sum(x["logit"]["n_tokens"] for x in d["datasets"])
    r = runner.invoke(app, ["lens", "depth", "--data", str(a), "--model", "tiny:llama"])
    assert r.exit_code == 0 and "mean depth" in r.stdout
    r = runner.invoke(app, ["lens", "depth", TEXT, "--model", "tiny:llama"])
    assert r.exit_code == 0 and "depth" in r.stdout
    r = runner.invoke(app, ["lens", "depth", "--model", "tiny:llama"])
    assert r.exit_code == 2 and "either a TEXT or --data" in r.stderr
    # lens show carries the depth too
    r = runner.invoke(app, ["lens", "show", "The capital of France is", "--model", "tiny:llama", "--json"])
    assert r.exit_code == 0, r.output
    traj = json.loads(r.stdout)[0]
    assert len(traj["depth"]) == len(traj["tokens"])
    r2 = runner.invoke(app, ["lens", "depth", "The capital of France is", "--model", "tiny:llama", "--json"])
    assert json.loads(r2.stdout)["depth"] == traj["depth"]
    r = runner.invoke(app, ["lens", "show", "The capital of France is", "--model", "tiny:llama"])
    assert r.exit_code == 0 and "depth" in r.stdout


@pytest.mark.slow
def test_smollm2_depth(smollm2):
    res = text_depths(smollm2, "The capital of France is Paris, and the capital of Germany is")["logit"]
    d = res.to_dict()
    assert len(d["depth"]) == len(d["tokens"])
    assert all(x is None or 0 <= x < 30 for x in d["depth"])
    h = residual_states(smollm2, token_sequences(smollm2, CORPUS, 64, max_tokens=128))["states"][20].flatten(0, 1)
    lens = LogitLens(smollm2.anatomy)
    assert_same_ints(lens_top1(smollm2, lens, h, 20), lens.logits(h, 20).argmax(-1))
