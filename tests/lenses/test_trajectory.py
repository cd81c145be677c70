"""Prediction trajectories: values by hand, lenses, mid-layer states, results, plots and the HTML page."""

import dataclasses
import json
import re

import pytest
import torch

import lenscope
from lenscope.lenses import LensEvaluation, LogitLens, TunedLens, decode
from lenscope.lenses.trajectory import PredictionTrajectory, prediction_trajectory
from lenscope.models.loading.load import LoadedModel, encode
from lenscope.models.runtime.trace import residual_states
from lenscope.viz.html import script_json, trajectory_html
from lenscope.viz.lens_plots import plot_lens_evaluation, plot_trajectories, plot_trajectory, show_token
from lenscope.viz.plots import save_figure
from tests.conftest import get_model
from tests.tolerances import assert_same_computation, assert_same_ints, kl_tol

TEXT = "When Mary and John went to the store, John gave a drink to"
FAMILIES = ["tiny:llama", "tiny:gpt2", "tiny:gemma3", "tiny:gpt-neox", "tiny:bert"]


def perturbed_tuned_lens(lm, seed: int = 0, scale: float = 0.3) -> TunedLens:
    lens = TunedLens(lm.anatomy, model_name=lm.name)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        lens.A.copy_(torch.randn(lens.A.shape, generator=g) * scale / lens.d_model**0.5)
        lens.b.copy_(torch.randn(lens.b.shape, generator=g) * scale)
    return lens


def by_hand(lm, h, final_logits):
    """Probabilities, entropy and KL(final || lens) of one decoded state ``h (pos, d)``, in float64."""
    logq = torch.log_softmax(decode(lm.anatomy, h).double(), -1)
    logp = torch.log_softmax(final_logits.double(), -1)
    q = logq.exp()
    return q, -(q * logq).sum(-1), (logp.exp() * (logp - logq)).sum(-1)


@pytest.mark.parametrize("name", FAMILIES)
def test_output_state_is_the_model(name):
    lm = get_model(name)
    traj = prediction_trajectory(lm, TEXT)
    tr = lenscope.trace(lm, TEXT)
    probs = torch.softmax(tr.logits.double(), -1)
    assert traj.kl[-1].abs().max() < 1e-5
    assert_same_ints(traj.top_ids[-1], tr.logits.argmax(-1))
    assert torch.allclose(traj.top_prob[-1].double(), probs.max(-1).values, atol=1e-5)
    assert torch.allclose(traj.entropy[-1].double(), -(probs * probs.log()).sum(-1), atol=1e-4)
    assert traj.tokens == tr.tokens
    assert traj.causal == lm.anatomy.causal
    # earlier states are not the output: their distributions differ from the final one
    assert traj.kl[0].min() > 1e-5


@pytest.mark.parametrize("name", ["tiny:llama", "tiny:bert"])
def test_every_cell_by_hand(name):
    lm = get_model(name)
    lens = perturbed_tuned_lens(lm)
    traj = prediction_trajectory(lm, TEXT, lens, k=4)
    cap = residual_states(lm, encode(lm, TEXT)[None])
    final = cap["logits"][0]
    for layer in range(lm.anatomy.n_layers + 1):
        h = cap["states"][layer, 0]
        if layer < lm.anatomy.n_layers:
            h = h + h @ lens.A[layer].detach() + lens.b[layer].detach()
        q, ent, kl = by_hand(lm, h, final)
        top_p, top_i = q.topk(4, dim=-1)
        assert_same_ints(traj.topk_ids[layer], top_i)
        assert_same_ints(traj.top_ids[layer], top_i[:, 0])
        assert torch.allclose(traj.topk_prob[layer].double(), top_p, atol=1e-6)
        assert torch.allclose(traj.top_prob[layer].double(), top_p[:, 0], atol=1e-6)
        assert torch.allclose(traj.entropy[layer].double(), ent, atol=1e-4)
        assert torch.allclose(traj.kl[layer].double(), kl.clamp_min(0), atol=1e-4)
    # one cell spelled out: state 1, position 3, softmax written out
    logits = decode(lm.anatomy, cap["states"][1, 0, 3] + cap["states"][1, 0, 3] @ lens.A[1].detach()
                    + lens.b[1].detach()).double()
    e = (logits - logits.max()).exp()
    p = e / e.sum()
    assert float(traj.top_prob[1, 3]) == pytest.approx(float(p.max()), abs=1e-6)
    assert float(traj.entropy[1, 3]) == pytest.approx(float(-(p * p.log()).sum()), abs=1e-4)
    assert traj.top_tokens[1][3] == lm.tokenizer.decode([int(p.argmax())])


def test_logit_and_tuned_lens_differ_below_the_output():
    lm = get_model("tiny:gpt2")
    logit = prediction_trajectory(lm, TEXT)
    tuned = prediction_trajectory(lm, TEXT, perturbed_tuned_lens(lm))
    assert logit.lens == "logit" and tuned.lens == "tuned"
    L = lm.anatomy.n_layers
    for s in range(L):
        assert (logit.kl[s] - tuned.kl[s]).abs().max() > 1e-3
        assert (logit.entropy[s] - tuned.entropy[s]).abs().max() > 1e-5  # tiny models are near-uniform
    assert bool((logit.topk_ids[:L] != tuned.topk_ids[:L]).any())
    # the output state is never translated
    assert_same_ints(logit.top_ids[L], tuned.top_ids[L])
    assert torch.allclose(logit.kl[L], tuned.kl[L])
    # an identity tuned lens is the logit lens
    same = prediction_trajectory(lm, TEXT, TunedLens(lm.anatomy), name="identity")
    assert same.lens == "identity"
    assert_same_ints(same.top_ids, logit.top_ids)
    assert torch.allclose(same.kl, logit.kl, atol=1e-6)


def test_shapes_labels_and_strings():
    lm = get_model("tiny:llama")
    traj = prediction_trajectory(lm, TEXT, k=3)
    L, P = lm.anatomy.n_layers, encode(lm, TEXT).numel()
    assert traj.top_ids.shape == traj.top_prob.shape == traj.entropy.shape == traj.kl.shape == (L + 1, P)
    assert traj.topk_ids.shape == traj.topk_prob.shape == (L + 1, P, 3)
    assert (traj.n_states, traj.n_pos, traj.k, traj.n_layers, traj.has_mid) == (L + 1, P, 3, L, False)
    assert traj.state_labels == [str(i) for i in range(L + 1)]
    assert len(traj.tokens) == P and "".join(traj.tokens) == TEXT
    assert [len(r) for r in traj.top_tokens] == [P] * (L + 1)
    decode_one = lambda i: lm.tokenizer.decode([i])
    assert traj.top_tokens == [[decode_one(i) for i in row] for row in traj.top_ids.tolist()]
    assert traj.topk_tokens == [[[decode_one(i) for i in cell] for cell in row] for row in traj.topk_ids.tolist()]
    assert torch.all(traj.topk_prob[..., :-1] >= traj.topk_prob[..., 1:])  # most likely first
    cap = residual_states(lm, encode(lm, TEXT)[None])
    for layer in range(L + 1):  # the logit lens's entropy, recomputed in float64 (a float32 log-softmax over 512)
        _, ent, _ = by_hand(lm, cap["states"][layer, 0], cap["logits"][0])
        assert torch.allclose(traj.entropy[layer].double(), ent, atol=1e-4), layer
    assert traj.top_ids.dtype == torch.long and traj.kl.dtype == torch.float32
    assert "logit" in repr(traj) and "tiny:llama" in repr(traj)


@pytest.mark.parametrize("name", ["tiny:llama", "tiny:gpt-neox", "tiny:bert", "tiny:gemma3"])
def test_mid_states_interleave(name):
    lm = get_model(name)
    L = lm.anatomy.n_layers
    lens = perturbed_tuned_lens(lm)
    plain = prediction_trajectory(lm, TEXT, lens)
    traj = prediction_trajectory(lm, TEXT, lens, mid=True)
    expected = []
    for i in range(L):
        expected += [str(i), f"{i}.mid"]
    assert traj.state_labels == expected + [str(L)]
    assert traj.n_states == 2 * L + 1 and traj.has_mid and traj.n_layers == L
    regular = [traj.state_labels.index(str(i)) for i in range(L + 1)]
    assert_same_ints(traj.top_ids[regular], plain.top_ids)
    assert torch.allclose(traj.kl[regular], plain.kl, atol=1e-6)
    # mid states are read with the identity (no translator), even with a tuned lens
    cap = residual_states(lm, encode(lm, TEXT)[None], mid=True)
    for i in range(L):
        q, ent, kl = by_hand(lm, cap["mid"][i, 0], cap["logits"][0])
        row = traj.state_labels.index(f"{i}.mid")
        assert_same_ints(traj.top_ids[row], q.argmax(-1))
        assert torch.allclose(traj.entropy[row].double(), ent, atol=1e-4)
        assert torch.allclose(traj.kl[row].double(), kl.clamp_min(0), atol=1e-4)
    # a mid state is not its neighbours
    assert not torch.allclose(traj.kl[1], traj.kl[0])


def test_lens_trained_on_mid_states():
    lm = get_model("tiny:llama")
    lens = perturbed_tuned_lens(lm)
    lens.mid = True
    with pytest.raises(lenscope.InputError, match="mid=True"):
        prediction_trajectory(lm, TEXT, lens)
    traj = prediction_trajectory(lm, TEXT, lens, mid=True)
    logit = prediction_trajectory(lm, TEXT, mid=True)
    reg = [i for i, s in enumerate(traj.state_labels) if not s.endswith(".mid")]
    mids = [i for i, s in enumerate(traj.state_labels) if s.endswith(".mid")]
    assert torch.allclose(traj.kl[reg], logit.kl[reg], atol=1e-6)  # regular states: identity
    assert (traj.kl[mids] - logit.kl[mids]).abs().max() > 1e-3  # mid states: translated


def test_save_load_round_trip(tmp_path):
    lm = get_model("tiny:gpt2")
    traj = prediction_trajectory(lm, TEXT, perturbed_tuned_lens(lm), mid=True, k=2)
    path = traj.save(tmp_path / "traj.safetensors")
    back = PredictionTrajectory.load(path)
    for f in dataclasses.fields(traj):
        a, b = getattr(traj, f.name), getattr(back, f.name)
        if isinstance(a, torch.Tensor):
            assert_same_computation(a, b, why=f"saved and read back ({f.name})")
        else:
            assert a == b, f.name
    assert back.topk_tokens[3][5] == traj.topk_tokens[3][5] and len(back.topk_tokens[3][5]) == 2
    with pytest.raises(lenscope.InputError, match="LensEvaluation"):
        LensEvaluation.load(path)


def test_to_frame_and_to_dict():
    lm = get_model("tiny:llama")
    traj = prediction_trajectory(lm, TEXT, mid=True)
    df = traj.to_frame()
    assert list(df.columns) == ["state_index", "state", "pos", "token", "top_id", "top_token", "top_prob",
                                "entropy", "kl"]
    assert len(df) == traj.n_states * traj.n_pos
    row = df[(df.state == "1.mid") & (df.pos == 4)].iloc[0]
    s = traj.state_labels.index("1.mid")
    assert row.state_index == s and row.token == traj.tokens[4]
    assert row.top_id == int(traj.top_ids[s, 4]) and row.top_token == traj.top_tokens[s][4]
    assert row.top_prob == pytest.approx(float(traj.top_prob[s, 4]))
    assert row.entropy == pytest.approx(float(traj.entropy[s, 4]))
    assert row.kl == pytest.approx(float(traj.kl[s, 4]))
    d = json.loads(json.dumps(traj.to_dict()))
    assert d["state_labels"] == traj.state_labels and d["tokens"] == traj.tokens and d["k"] == 5
    assert d["topk_tokens"][s][4] == traj.topk_tokens[s][4]
    assert d["kl"][s][4] == pytest.approx(float(traj.kl[s, 4]))
    assert_same_computation(traj.to_dict(digits=2)["entropy"][0][0], round(float(traj.entropy[0, 0]), 2),
                            why="the same value rounded the same way")
    assert_same_computation(traj.values("prob"), traj.top_prob, why="the same tensor, by its name")
    with pytest.raises(lenscope.InputError, match="value must be"):
        traj.values("loss")


def test_targets():
    traj = prediction_trajectory(get_model("tiny:llama"), TEXT)
    assert traj.targets() == traj.tokens[1:] + [None]
    enc = prediction_trajectory(get_model("tiny:bert"), TEXT)
    assert enc.targets() == enc.tokens and not enc.causal


def test_errors():
    lm = get_model("tiny:llama")
    for bad in ("", "   "):
        with pytest.raises(lenscope.InputError, match="empty"):
            prediction_trajectory(lm, bad)
    for k in (0, -1, 1.5, True):
        with pytest.raises(lenscope.InputError, match="k must"):
            prediction_trajectory(lm, TEXT, k=k)
    other = get_model("tiny:gemma3")  # 3 layers, not 2
    with pytest.raises(lenscope.InputError, match="lens is for a model"):
        prediction_trajectory(lm, TEXT, TunedLens(other.anatomy))
    headless = LoadedModel(lm.model, lm.tokenizer, dataclasses.replace(lm.anatomy, unembed=None), "headless")
    with pytest.raises(lenscope.NotApplicableError, match="language-model head"):
        prediction_trajectory(headless, TEXT)
    # k larger than the vocabulary is cut to it
    assert prediction_trajectory(lm, "Mary", k=10_000).k == lm.anatomy.vocab_size


# ---------------------------------------------------------------------------------------------- plots


def test_plot_trajectory_png(tmp_path):
    lm = get_model("tiny:llama")
    traj = prediction_trajectory(lm, TEXT, mid=True)
    for value in ("entropy", "kl", "prob"):
        fig = traj.plot(value=value)
        ax = fig.axes[0]
        texts = [t.get_text() for t in ax.texts]
        assert len(texts) == traj.n_states * traj.n_pos
        assert texts[0] == show_token(traj.top_tokens[0][0], 7)
        img = ax.images[0].get_array()
        assert img.shape == (traj.n_states, traj.n_pos)
        assert torch.allclose(torch.as_tensor(img.data), traj.values(value))
        assert ax.images[0].origin == "lower"  # embeddings at the bottom
        assert [t.get_text() for t in ax.get_xticklabels()] == [show_token(t, 12) for t in traj.tokens]
        path = save_figure(fig, tmp_path / f"traj-{value}.png")
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    with pytest.raises(lenscope.InputError):
        plot_trajectory(traj, value="loss")


def test_plot_trajectories_side_by_side(tmp_path):
    lm = get_model("tiny:gpt2")
    a = prediction_trajectory(lm, TEXT, perturbed_tuned_lens(lm))
    b = prediction_trajectory(lm, TEXT)
    fig = plot_trajectories([a, b], value="kl")
    heat = [ax for ax in fig.axes if ax.images]
    assert len(heat) == 2
    assert [ax.get_title() for ax in heat] == ["tuned lens · tiny:gpt2", "logit lens · tiny:gpt2"]
    assert heat[0].images[0].norm.vmax == heat[1].images[0].norm.vmax == pytest.approx(
        float(torch.maximum(a.kl.max(), b.kl.max())))
    path = save_figure(fig, tmp_path / "both.png")
    assert path.stat().st_size > 10_000
    with pytest.raises(lenscope.InputError):
        plot_trajectories([])


def test_show_token():
    assert show_token(" Paris") == "␣Paris"
    assert show_token("a\nb\x1c") == "a↵b\\x1c"
    assert show_token("$x$") == r"\$x\$"
    assert show_token("abcdefghij", 5) == "abcd…"


PLOTTED = "the values drawn as given: a copy"


def test_plot_lens_evaluation(tmp_path):
    def ev(name, kl):
        n = len(kl)
        return LensEvaluation(model="tiny:llama", lens=name, n_tokens=10, kl=torch.tensor(kl),
                              ce=torch.ones(n), entropy=torch.ones(n), top1=torch.ones(n), depth_hist=torch.ones(n + 1))

    tuned, logit = ev("tuned", [1.0, 0.5, 0.0]), ev("logit", [4.0, 2.0, 0.0])
    fig = plot_lens_evaluation(tuned, logit)
    ax = fig.axes[0]
    assert [t.get_text().split(" ")[0] for t in ax.get_legend().get_texts()] == ["tuned", "logit"]
    assert_same_computation([list(line.get_ydata()) for line in ax.lines], [[1.0, 0.5, 0.0], [4.0, 2.0, 0.0]],
                            why=PLOTTED)
    fig = tuned.plot(logit)  # LensEvaluation.plot goes through the same function
    assert len(fig.axes[0].lines) == 2
    fig = plot_lens_evaluation(tuned, logit, log=True)
    ax = fig.axes[0]
    assert ax.get_yscale() == "log"
    # the zero is left out
    assert_same_computation([list(line.get_ydata()) for line in ax.lines], [[1.0, 0.5], [4.0, 2.0]], why=PLOTTED)
    assert save_figure(fig, tmp_path / "ev.png").stat().st_size > 5_000
    with pytest.raises(lenscope.InputError, match="metric"):
        plot_lens_evaluation(tuned, metric="loss")
    patch = ev("patchscope", [2.0, 1.0, 0.0])
    fig = plot_lens_evaluation(tuned, [logit, patch])  # several others: one curve each, in order
    assert_same_computation([list(line.get_ydata()) for line in fig.axes[0].lines],
                            [[1.0, 0.5, 0.0], [4.0, 2.0, 0.0], [2.0, 1.0, 0.0]], why=PLOTTED)


# ---------------------------------------------------------------------------------------------- HTML

NASTY = ["</script><b>bold</b>", "http://example.invalid/x", "a & b", "<!--", "\u2028"]


def _data_block(page: str) -> dict:
    m = re.search(r'<script type="application/json" id="lenscope-data">(.*?)</script>', page, re.DOTALL)
    return json.loads(m.group(1))


def _section(page: str) -> dict:
    """The one section of a result's page (the report page holding just its view)."""
    data = _data_block(page)
    (sec,) = data["sections"]
    return {"meta": data["meta"], **sec}


def test_html_is_self_contained_and_escaped(tmp_path):
    from lenscope.viz.report import asset

    lm = get_model("tiny:gpt2")
    a = prediction_trajectory(lm, TEXT, perturbed_tuned_lens(lm), mid=True)
    b = prediction_trajectory(lm, TEXT)
    a.tokens[2] = NASTY[0]
    a.top_tokens[0][1] = NASTY[1]
    a.topk_tokens[1][1][1] = NASTY[2]
    a.model = NASTY[3] + NASTY[4]
    path = a.to_html(tmp_path / "t.html", [b], title="<i>IOI</i> & co")
    page = path.read_text(encoding="utf-8")
    assert page.startswith("<!doctype html>")
    # the report page with the trajectory view, drawn by the report's own scripts (inline: nothing fetched)
    assert asset("core.js") in page and asset("trajectory.js") in page and 'data-section="trajectory"' in page
    assert "https://" not in page and "//cdn" not in page
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "")  # the SVG namespace is a name
    assert "<b>bold" not in page and "<!--" not in page
    assert page.count("</script>") == 4  # the data block, core.js, trajectory.js, the start: nothing else closes one
    assert "<script src" not in page and "<link" not in page and "@import" not in page
    assert "<title>&lt;i&gt;IOI&lt;/i&gt; &amp; co</title>" in page
    assert "<h2>&lt;i&gt;IOI&lt;/i&gt; &amp; co</h2>" in page  # the view's heading
    sec = _section(page)
    assert sec["key"] == "trajectory" and sec["meta"]["model"] == NASTY[3] + NASTY[4]
    got = sec["data"]["trajectories"]
    assert [t["lens"] for t in got] == ["tuned", "logit"]
    assert got[0]["tokens"][2] == NASTY[0] and got[0]["top_tokens"][0][1] == NASTY[1]
    assert got[0]["topk_tokens"][1][1][1] == NASTY[2]
    assert got[0]["state_labels"] == a.state_labels
    # the page's numbers are the report's: 4 decimals (rounding moves a value by at most 5e-5)
    assert got[1]["entropy"][2][3] == pytest.approx(float(b.entropy[2, 3]), abs=5e-5 + 1e-7)
    assert got[1]["topk_prob"][2][3][0] == pytest.approx(float(b.topk_prob[2, 3, 0]), abs=5e-5 + 1e-7)
    # the controls and the tooltip fields exist
    for word in ('"entropy"', '"kl"', '"prob"', "topk_tokens", "textContent", "tip"):
        assert word in page
    assert "innerHTML" not in page  # the page never parses data as markup


def test_html_single_and_default_title(tmp_path):
    lm = get_model("tiny:llama")
    traj = prediction_trajectory(lm, TEXT)
    page = trajectory_html(traj, tmp_path / "sub" / "one.html").read_text(encoding="utf-8")
    assert "<title>Prediction trajectory · logit lens · tiny:llama</title>" in page
    assert len(_section(page)["data"]["trajectories"]) == 1
    # to_html, the notebook view and lenscope.show write one page: the same view with the same data
    from lenscope.viz import notebook

    assert_same_computation(_section(notebook.view(traj).page), _section(page), why="one view of the same data")
    with pytest.raises(lenscope.InputError):
        trajectory_html([], tmp_path / "none.html")


def test_script_json():
    obj = {"t": ["</script>", "<b>", "a//b", "&amp;", "\u2028"]}
    text = script_json(obj)
    assert not set("<>&\u2028") & set(text) and "//" not in text
    assert json.loads(text) == obj


def test_logit_lens_object_is_default():
    lm = get_model("tiny:opt")
    a = prediction_trajectory(lm, TEXT)
    b = prediction_trajectory(lm, TEXT, LogitLens(lm.anatomy))
    assert_same_ints(a.top_ids, b.top_ids)
    assert_same_computation(a.kl, b.kl, why="the logit lens either way: the same calls")


def test_trajectory_from_a_trace_equals_a_fresh_run():
    """``tr=``: the report's shared trace gives the same trajectory as running the model again."""
    for name in ("tiny:llama", "tiny:gpt2"):
        lm = get_model(name)
        text = "When Mary and John went to the store, John gave"
        a = prediction_trajectory(lm, text, k=3)
        b = prediction_trajectory(lm, lens=None, k=3, tr=lenscope.trace(lm, text))
        assert a.tokens == b.tokens and a.top_tokens == b.top_tokens
        for key in ("top_prob", "entropy", "kl", "topk_prob"):
            torch.testing.assert_close(getattr(a, key), getattr(b, key), atol=1e-5, rtol=1e-5)
        assert_same_ints(a.top_ids, b.top_ids)


def test_trajectory_in_small_chunks_equals_one_chunk(monkeypatch):
    """Rows are decoded in chunks of whole states (a memory bound for long texts): any chunk size, same result."""
    import lenscope.lenses.trajectory as T

    lm = get_model("tiny:llama")
    text = "When Mary and John went to the store, John gave"
    whole = prediction_trajectory(lm, text, k=3)
    monkeypatch.setattr(T, "CHUNK_BYTES", 1)  # one state per chunk
    parts = prediction_trajectory(lm, text, k=3)
    # the same float32 numbers but for rounding (another batch shape); an entropy or a KL is a difference of sums of
    # size ln V, each of the two within kl_tol of the exact value (tests/tolerances.py)
    z_max = float(lenscope.trace(lm, text).logits.abs().max())
    tol = {"entropy": 2 * kl_tol(lm.anatomy.vocab_size, z_max), "kl": 2 * kl_tol(lm.anatomy.vocab_size, z_max)}
    for key in ("top_prob", "entropy", "kl", "topk_prob"):
        torch.testing.assert_close(getattr(whole, key), getattr(parts, key), atol=tol.get(key, 1e-6), rtol=1e-6)
    assert_same_ints(whole.topk_ids, parts.topk_ids)
