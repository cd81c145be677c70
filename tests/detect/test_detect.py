"""Prompt-injection detection: the labelled set, the features against the lenses computed directly, AUROC and its
bootstrap interval by hand, detectors on synthetic features, results, the CLI."""

import json

import numpy as np
import pytest
import torch
from sklearn.metrics import roc_auc_score
from typer.testing import CliRunner

from lenscope.cli import app
from lenscope.detect import (
    DETECTORS,
    INJECTION_TEMPLATES,
    DetectionFeatures,
    DetectionResult,
    MahalanobisDetector,
    answer_token_ids,
    auroc,
    auroc_interval,
    bootstrap_aurocs,
    build_labelled_set,
    detection_features,
    detokenize,
    evaluate_detectors,
    load_sst2,
    make_detector,
    prompt_ids,
    read_labelled_set,
    sst2_path,
    write_labelled_set,
)
from lenscope.errors import InputError, NotApplicableError
from lenscope.lenses import LogitLens, TunedLens, decode
from lenscope.lenses.trajectory import prediction_trajectory
from lenscope.models.runtime.trace import residual_states
from tests.conftest import get_model
from tests.lenses.test_trajectory import perturbed_tuned_lens
from tests.tolerances import assert_same_computation

EXAMPLES = [("a fine film .", 1), ("a dull mess and far too long .", 0), ("warm and funny .", 1),
            ("it 's a bad , bad movie .", 0), ("great fun", 1), ("meh , it was long", 0), ("lovely work .", 1),
            ("flat and stale .", 0)]
runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def mini_tsv(tmp_path, rows=EXAMPLES):
    path = tmp_path / "dev.tsv"
    path.write_text("sentence\tlabel\n" + "".join(f"{s} \t{y}\n" for s, y in rows))
    return path


# ------------------------------------------------------------------------------------------ labelled set


def test_labelled_set_is_seeded_and_reproducible(tmp_path):
    a = write_labelled_set(build_labelled_set(EXAMPLES, seed=3), tmp_path / "a.jsonl")
    b = write_labelled_set(build_labelled_set(EXAMPLES, seed=3), tmp_path / "b.jsonl")
    c = write_labelled_set(build_labelled_set(EXAMPLES, seed=4), tmp_path / "c.jsonl")
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()
    rows = read_labelled_set(a)
    assert rows == build_labelled_set(EXAMPLES, seed=3)
    clean = [r for r in rows if not r["injected"]]
    inj = [r for r in rows if r["injected"]]
    assert len(clean) == len(inj) == 4
    assert not {r["index"] for r in clean} & {r["index"] for r in inj}  # different sentences
    for r in clean:
        assert r["template"] is None and r["target"] is None
        assert not any(t.split("{")[0][:20] in r["review"] for t in INJECTION_TEMPLATES)
    for r in inj:
        instruction = INJECTION_TEMPLATES[r["template"]].format(target=r["target"])
        assert instruction in r["review"] and r["placement"] in ("end", "start", "middle")
        assert r["sentiment"] == EXAMPLES[r["index"]][1]
        if r["placement"] == "end":
            assert r["review"].endswith(instruction)
    assert detokenize("it 's a bad , bad movie -lrb- really -rrb- .") == "it's a bad, bad movie (really)."
    # --limit caps each class
    assert len(build_labelled_set(EXAMPLES, 2, seed=3)) == 4
    with pytest.raises(InputError, match="at least 1"):
        build_labelled_set(EXAMPLES, 0)
    with pytest.raises(InputError, match="at least 2 examples"):
        build_labelled_set(EXAMPLES[:1])


@pytest.mark.skipif(sst2_path() is None, reason="SST-2 dev (shared data) is not available")
def test_sst2_labelled_set(tmp_path):
    examples = load_sst2()
    assert len(examples) == 872 and {y for _, y in examples} == {0, 1}
    rows = build_labelled_set(examples, 50, seed=0)
    assert len(rows) == 100 and sum(r["injected"] for r in rows) == 50
    p1 = write_labelled_set(rows, tmp_path / "1.jsonl")
    p2 = write_labelled_set(build_labelled_set(load_sst2(), 50, seed=0), tmp_path / "2.jsonl")
    assert p1.read_bytes() == p2.read_bytes()
    assert len(build_labelled_set(examples, seed=0)) == 872  # default: all sentences, half per class


def test_load_sst2_errors(tmp_path):
    with pytest.raises(InputError, match="not found"):
        load_sst2(tmp_path / "missing.tsv")
    bad = tmp_path / "bad.tsv"
    bad.write_text("text\tlabel\nfoo\t1\n")
    with pytest.raises(InputError, match="header"):
        load_sst2(bad)
    bad.write_text("sentence\tlabel\nfoo\t7\nbar\t1\nbaz\t0\nqux\t1\n")
    with pytest.raises(InputError, match=":2 "):
        load_sst2(bad)
    assert load_sst2(mini_tsv(tmp_path)) == [(s, y) for s, y in EXAMPLES]


# ---------------------------------------------------------------------------------------------- features


def test_features_equal_the_lenses_computed_directly():
    lm = get_model("tiny:llama")
    rows = build_labelled_set(EXAMPLES, seed=1)
    tuned = perturbed_tuned_lens(lm)
    lenses = {"tuned": tuned, "logit": LogitLens(lm.anatomy, model_name=lm.name)}
    f = detection_features(lm, rows, lenses, batch_size=3, progress=False)
    N, S, d = len(rows), lm.anatomy.n_layers + 1, lm.anatomy.d_model
    classes = list(answer_token_ids(lm.tokenizer).values())
    assert f.stat_names == ["logp_positive", "logp_negative", "logp_other", "entropy", "kl_to_final"]
    assert f.trajectory.shape == (2, N, S, 5) and f.final_state.shape == (N, d) and f.final_probs.shape == (N, 4)
    sets = f.feature_sets()
    assert {k: v.shape for k, v in sets.items()} == {"tuned": (N, S * 5), "logit": (N, S * 5), "final-state": (N, d),
                                                     "final-probs": (N, 4), "prompt-length": (N, 1)}
    assert f.n_tokens.tolist() == [len(prompt_ids(lm, r["review"])) for r in rows]
    assert f.injected.tolist() == [int(r["injected"]) for r in rows]
    for i, r in enumerate(rows):
        ids = torch.tensor(prompt_ids(lm, r["review"]))
        cap = residual_states(lm, ids[None])  # this prompt alone, no padding
        final_logp = torch.log_softmax(cap["logits"][0, -1].double(), -1)
        assert torch.allclose(f.final_state[i], cap["states"][-1, 0, -1], atol=1e-5)
        assert int(f.top_id[i]) == int(final_logp.argmax())
        for li, lens in enumerate(lenses.values()):
            traj = prediction_trajectory(lm, lm.tokenizer.decode(ids), lens)
            assert traj.n_pos == ids.numel()
            assert torch.allclose(f.trajectory[li, i, :, 3], traj.entropy[:, -1], atol=1e-4)
            assert torch.allclose(f.trajectory[li, i, :, 4], traj.kl[:, -1], atol=1e-4)
            for s in range(S):
                h = cap["states"][s, 0, -1]
                if s < lm.anatomy.n_layers and lens is tuned:
                    h = h + h @ tuned.A[s].detach() + tuned.b[s].detach()
                logq = torch.log_softmax(decode(lm.anatomy, h).double(), -1)
                want = [logq[c].logsumexp(0) for c in classes]
                rest = torch.ones_like(logq, dtype=torch.bool)
                rest[[t for c in classes for t in c]] = False
                want.append(torch.log1p(-logq[~rest].exp().sum()))
                assert torch.allclose(f.trajectory[li, i, s, :3].double(), torch.stack(want), atol=1e-4)
                # log p(other) keeps its relative precision where the answers are unlikely (no float32 rounding)
                assert torch.allclose(f.trajectory[li, i, s, 2].double(), want[2], rtol=1e-3, atol=1e-12)
        want = [final_logp[c].logsumexp(0) for c in classes]
        assert torch.allclose(f.final_probs[i, :2].double(), torch.stack(want), atol=1e-4)
    # the output state reads the same for every lens, and batching changes nothing
    assert torch.allclose(f.trajectory[0, :, -1], f.trajectory[1, :, -1])
    one = detection_features(lm, rows, lenses, batch_size=1, progress=False)
    assert torch.allclose(one.trajectory, f.trajectory, atol=1e-5)
    assert torch.allclose(one.final_state, f.final_state, atol=1e-5)


def test_logp_other_keeps_precision():
    from lenscope.detect.features import _distribution_stats

    logits = torch.zeros(2, 1000)
    logits[0, :2] = -25.0  # answers unlikely: p(other) = 1 - ~2.8e-14, log p(other) ~ -2.8e-14
    logits[1, :2] = 25.0  # answers likely: p(other) ~ 998 e^-25
    logq = torch.log_softmax(logits, -1)
    st = _distribution_stats(logq, [[0], [1]], None).double()
    p = torch.softmax(logits.double(), -1)
    assert torch.allclose(st[:, 2], torch.log1p(-p[:, :2].sum(-1)), rtol=1e-4, atol=0)
    assert torch.allclose(st[:, 3], -(p * p.log()).sum(-1), atol=1e-4)


def test_feature_errors():
    rows = build_labelled_set(EXAMPLES, seed=0)
    with pytest.raises(NotApplicableError, match="causal"):
        detection_features(get_model("tiny:bert"), rows, progress=False)
    lm = get_model("tiny:llama")
    with pytest.raises(InputError, match="layers"):
        detection_features(lm, rows, {"tuned": TunedLens(get_model("tiny:gemma3").anatomy)}, progress=False)
    mid = TunedLens(lm.anatomy, mid=True)
    with pytest.raises(InputError, match="mid-layer"):
        detection_features(lm, rows, {"tuned": mid}, progress=False)
    with pytest.raises(InputError, match="empty"):
        detection_features(lm, [], progress=False)
    with pytest.raises(InputError, match="context"):
        detection_features(lm, [{"review": "word " * 400, "injected": False}], progress=False)
    with pytest.raises(InputError, match="no token of their own"):
        answer_token_ids(lm.tokenizer, {"a": ("same",), "b": ("same",)})


# ------------------------------------------------------------------------------------------ AUROC, bootstrap


PAIRS = "a count of ordered pairs (ties one half) over their number: 3 / 4, exact"


def test_auroc_by_hand():
    # positives 0.35, 0.8 vs negatives 0.1, 0.4: pairs (0.35>0.1) (0.35<0.4) (0.8>0.1) (0.8>0.4) -> 3/4
    assert_same_computation(auroc([0, 0, 1, 1], [0.1, 0.4, 0.35, 0.8]), 0.75, why=PAIRS)
    # a tie counts one half: positive 0.4 vs negatives 0.4, 0.1 -> (0.5 + 1) / 2
    assert_same_computation(auroc([1, 0, 0], [0.4, 0.4, 0.1]), 0.75, why=PAIRS)
    assert auroc([1, 1, 0, 0], [2, 3, 0, 1]) == 1.0 and auroc([1, 1, 0, 0], [0, 1, 2, 3]) == 0.0
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 200)
    s = rng.normal(size=200) + y + np.round(rng.normal(size=200))  # with ties
    assert abs(auroc(y, s) - roc_auc_score(y, s)) < 1e-12
    with pytest.raises(InputError, match="at least one positive"):
        auroc([0, 0], [1, 2])
    with pytest.raises(InputError, match="NaN"):
        auroc([0, 1], [0.0, float("nan")])


def test_bootstrap_by_hand():
    # one positive (score 1) and negatives 0 (a win) and 2 (a loss): a resample of the two negatives holds
    # 0, 1 or 2 wins with probabilities 1/4, 1/2, 1/4, so its AUROC is 0, 1/2 or 1 with those probabilities
    reps = bootstrap_aurocs([1, 0, 0], [1.0, 0.0, 2.0], n=8000, seed=0)
    assert set(np.unique(reps)) <= {0.0, 0.5, 1.0}
    for v, p in ((0.0, 0.25), (0.5, 0.5), (1.0, 0.25)):
        assert abs((reps == v).mean() - p) < 0.02
    assert auroc_interval(reps) == (0.0, 1.0)
    # separated classes: every resample is separated
    reps = bootstrap_aurocs([0, 0, 0, 1, 1], [0, 1, 2, 5, 6], n=200)
    assert (reps == 1.0).all() and auroc_interval(reps) == (1.0, 1.0)
    # the closed form equals resampling the scores themselves (same draws)
    rng = np.random.default_rng(1)
    y = np.array([0] * 30 + [1] * 20)
    s = rng.normal(size=50) + 0.8 * y
    reps = bootstrap_aurocs(y, s, n=50, seed=7)
    draw = np.random.default_rng(7)
    ip, ineg = draw.integers(0, 20, (50, 20)), draw.integers(0, 30, (50, 30))
    pos, neg = s[y == 1], s[y == 0]
    loop = [roc_auc_score([1] * 20 + [0] * 30, np.concatenate([pos[ip[b]], neg[ineg[b]]])) for b in range(50)]
    assert np.allclose(reps, loop, atol=1e-12)
    lo, hi = auroc_interval(reps, 0.9)
    assert lo <= auroc(y, s) <= hi and np.allclose((lo, hi), np.quantile(loop, [0.05, 0.95]), atol=1e-12)
    with pytest.raises(InputError):
        bootstrap_aurocs(y, s, n=0)
    with pytest.raises(InputError):
        auroc_interval(reps, 1.5)


# ------------------------------------------------------------------------------------------------ detectors


def synthetic_features(shift: float, n: int = 80, dim: int = 6, seed: int = 0) -> DetectionFeatures:
    """Clean examples ~ N(0, I); injected ones ~ N(shift, I), in every feature set."""
    g = torch.Generator().manual_seed(seed)
    inj = torch.tensor([0] * n + [1] * n)
    traj = torch.randn(1, 2 * n, 3, 5, generator=g) + shift * inj[None, :, None, None]
    state = torch.randn(2 * n, dim, generator=g) + shift * inj[:, None]
    probs = torch.randn(2 * n, 4, generator=g) + shift * inj[:, None]
    z = torch.zeros(2 * n, dtype=torch.long)
    length = torch.randint(20, 40, (2 * n,), generator=g)
    return DetectionFeatures(model="synthetic", lens_names=["tuned"], stat_names=["a", "b", "c", "d", "e"],
                             classes=["positive", "negative"], ids=[str(i) for i in range(2 * n)],
                             top_tokens=["x"] * (2 * n), trajectory=traj, final_state=state, final_probs=probs,
                             injected=inj, sentiment=z, top_id=z.clone(), predicted=z.clone(), followed=inj.clone(),
                             n_tokens=length)


def test_detectors_separate_clearly_injected_examples():
    res = evaluate_detectors(synthetic_features(shift=6.0), splits=2, n_bootstrap=200)
    assert res.features == ["tuned", "final-state", "final-probs", "prompt-length"]
    assert res.detectors == list(DETECTORS) and res.feature_dims == [15, 6, 4, 1]
    assert res.auroc.shape == (4, 3) and res.split_auroc.shape == (2, 4, 3) and res.replicates.shape == (4, 3, 400)
    assert (res.auroc[:3] > 0.99).all() and (res.auroc_low[:3] > 0.97).all()
    assert ((res.auroc_low[3] < 0.5) & (res.auroc_high[3] > 0.5)).all()  # the length carries no signal here
    # paired differences: same resamples for every feature set
    d = res.difference("tuned", "prompt-length", "lof")
    want = (res.replicates[0, 1] - res.replicates[3, 1]).numpy()
    assert np.allclose(d["diff_ci"], np.quantile(want, [0.025, 0.975]))
    assert d["auroc_diff"] == pytest.approx(float(res.auroc[0, 1] - res.auroc[3, 1])) and d["diff_ci"][0] > 0.3
    assert [x["detector"] for x in res.differences()] == list(DETECTORS)
    with pytest.raises(InputError, match="not among"):
        res.difference("nope")
    assert res.n_clean == 80 and res.n_injected == 80 and res.n_clean_train == 40 and res.n_clean_test == 40
    # no signal: the intervals straddle chance
    null = evaluate_detectors(synthetic_features(shift=0.0, seed=1), splits=2, n_bootstrap=200)
    assert ((null.auroc_low < 0.5) & (null.auroc_high > 0.5)).all()
    assert (null.auroc_low <= null.auroc).all() and (null.auroc <= null.auroc_high).all()


def test_detector_contract_and_errors():
    X = np.random.default_rng(0).normal(size=(50, 4))
    m = MahalanobisDetector().fit(X)
    assert "MahalanobisDetector" in repr(m) and m.get_params() == {"assume_centered": False}
    far = np.full((1, 4), 10.0)
    assert m.score_samples(far)[0] < m.score_samples(X).min() and m.predict(far)[0] == -1
    # plain squared Mahalanobis distance with the shrunk covariance
    from sklearn.covariance import LedoitWolf

    lw = LedoitWolf().fit(X)
    d = far - lw.location_
    assert np.isclose(-m.score_samples(far)[0], float((d @ np.linalg.inv(lw.covariance_) @ d.T).item()))
    for name in DETECTORS:
        pipe = make_detector(name, n_train=5).fit(X[:5])
        assert pipe.score_samples(X).shape == (50,)
        # a constant feature changes nothing
        padded = np.concatenate([X, np.full((50, 3), 7.0)], axis=1)
        same = make_detector(name, n_train=5).fit(padded[:5])
        assert np.allclose(same.score_samples(padded), pipe.score_samples(X))
    with pytest.raises(InputError, match="detector must be"):
        make_detector("svm")
    feats = synthetic_features(1.0, n=6)
    with pytest.raises(InputError, match="detector must be"):
        evaluate_detectors(feats, ["svm"])
    with pytest.raises(InputError, match="between 0 and 1"):
        evaluate_detectors(feats, train_fraction=1.0)
    with pytest.raises(InputError, match="too few"):
        evaluate_detectors(synthetic_features(1.0, n=2), splits=1)


def test_results_save_load_frame_plot(tmp_path):
    feats = synthetic_features(3.0, n=20)
    res = evaluate_detectors(feats, splits=2, n_bootstrap=100, seed=5)
    p = res.save(tmp_path / "r.safetensors")
    back = DetectionResult.load(p)
    assert_same_computation((back.to_dict(), back.split_auroc), (res.to_dict(), res.split_auroc),
                            why="saved and read back")
    d = res.to_dict()
    assert {"results", "n_clean", "n_injected"} <= set(d)
    assert set(d["results"][0]) == {"detector", "features", "auroc", "auroc_ci"}
    assert len(d["results"]) == 12
    assert_same_computation(json.loads(res.to_json()), d, why="written as JSON and read back")
    assert {"features", "baseline", "detector", "auroc_diff", "diff_ci"} == set(d["vs_final_state"][0])
    frame = res.to_frame()
    assert list(frame.columns) == ["detector", "features", "auroc", "ci_low", "ci_high"] and len(frame) == 12
    assert res.table().count("\n") == 5 and "final-state (6)" in res.table()
    fig = res.plot()
    assert len(fig.axes) == 1
    fp = feats.save(tmp_path / "f.safetensors")
    fb = DetectionFeatures.load(fp)
    assert_same_computation(fb.trajectory, feats.trajectory, why="saved and read back")
    assert fb.ids == feats.ids
    assert len(feats.to_frame()) == 40 * 3
    assert len(feats.plot("c").axes) == 1
    with pytest.raises(InputError, match="stat must be"):
        feats.plot("nope")
    with pytest.raises(InputError, match="holds a"):
        DetectionFeatures.load(p)


# --------------------------------------------------------------------------------------------------- CLI


def test_cli_json_fields_and_outputs(tmp_path):
    data = mini_tsv(tmp_path)
    lens_dir = perturbed_tuned_lens(get_model("tiny:llama")).save(tmp_path / "lens")
    out = tmp_path / "out"
    r = run("lens", "detect", "--model", "tiny:llama", "--data", data, "--lens", lens_dir, "--lens", "logit",
            "--limit", 3, "--splits", 2, "--bootstrap", 50, "--out", out, "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["n_clean"] == 3 and d["n_injected"] == 3 and d["n_clean_train"] == 2 and d["n_clean_test"] == 1
    assert d["lenses"] == ["tuned", "logit"]
    assert [x["features"] for x in d["results"][::3]] == ["tuned", "logit", "final-state", "final-probs",
                                                           "prompt-length"]
    for x in d["results"]:
        assert set(x) == {"detector", "features", "auroc", "auroc_ci"}
        assert 0 <= x["auroc_ci"][0] <= x["auroc"] <= x["auroc_ci"][1] <= 1
    for name in ("labelled_set.jsonl", "features.safetensors", "detect.safetensors", "detect.json", "detect.png",
                 "trajectories.png"):
        assert (out / name).exists(), name
    assert_same_computation(json.loads((out / "detect.json").read_text())["results"], d["results"],
                            why="one result, written to a file and printed")
    assert len(read_labelled_set(out / "labelled_set.jsonl")) == 6
    r = run("lens", "detect", "--model", "tiny:llama", "--data", data, "--limit", 3, "--splits", 1, "--bootstrap", 20)
    assert r.exit_code == 0, r.output
    assert "final-state" in r.stdout and "mahalanobis" in r.stdout


def test_cli_errors(tmp_path):
    data = mini_tsv(tmp_path)
    r = run("lens", "detect", "--model", "tiny:llama", "--data", tmp_path / "missing.tsv")
    assert r.exit_code == 2 and "data file not found" in r.stderr
    r = run("lens", "detect", "--model", "tiny:llama", "--data", data, "--limit", 0)
    assert r.exit_code == 2 and "--limit" in r.stderr
    r = run("lens", "detect", "--model", "tiny:bert", "--data", data)
    assert r.exit_code == 2 and "causal" in r.stderr
    r = run("lens", "detect", "--model", "tiny:llama", "--data", data, "--limit", 1)
    assert r.exit_code == 2 and "too few examples" in r.stderr
    r = run("lens", "detect", "--model", "tiny:llama", "--data", data, "--lens", tmp_path / "nolens")
    assert r.exit_code == 2 and "not found" in r.stderr


# --------------------------------------------------------------------------------------------- real model


@pytest.mark.slow
@pytest.mark.skipif(sst2_path() is None, reason="SST-2 dev (shared data) is not available")
def test_smollm2_small_run(smollm2):
    rows = build_labelled_set(load_sst2(), 6, seed=0)
    ids = prompt_ids(smollm2, rows[0]["review"])
    assert smollm2.tokenizer.decode(ids).endswith("<|im_start|>assistant\n")  # the answer comes next
    f = detection_features(smollm2, rows, batch_size=6, progress=False)
    assert f.trajectory.shape == (1, 12, 31, 5)
    assert f.trajectory[0, :, -1, 4].abs().max() < 1e-3  # the output state is the model's own distribution
    res = evaluate_detectors(f, splits=1, n_bootstrap=50)
    assert res.n_clean == 6 and res.n_injected == 6 and len(res.records()) == 12


def test_docs_example_runs(tmp_path, monkeypatch):
    import re
    from pathlib import Path

    monkeypatch.chdir(tmp_path)
    page = Path(__file__).resolve().parents[2] / "docs" / "lens-detect.md"
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.DOTALL)
    assert blocks
    for code in blocks:
        exec(compile(code, "lens-detect.md", "exec"), {})
