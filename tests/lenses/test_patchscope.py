"""The Patchscope lens: exact against the brute force on every decoder family, batched, wired into the lenses'
evaluation, trajectories, prediction depth, the CLI and the report."""

import json

import pytest
import torch
from typer.testing import CliRunner

import lenscope.lenses.patchscope as patchscope_module
from lenscope.cli import app
from lenscope.errors import InputError, NotApplicableError
from lenscope.lenses import LogitLens, PatchscopeLens, evaluate_lenses, prediction_trajectory, token_sequences
from lenscope.lenses.depth import text_depths
from lenscope.models.runtime.engine import Edit, run
from lenscope.models.runtime.trace import residual_states
from tests.conftest import ENCODERS, get_model, tiny_with_layers
from tests.tolerances import assert_same_computation, assert_same_ints

TEXT = ("When Mary and John went to the store, John gave a drink to Mary. The capital of France is Paris. "
        "The keys to the cabinet are on the table. ") * 4


def brute_force(lm, lens: PatchscopeLens, h, block):
    """The real model on the whole identity prompt, one row per state, with the residual entering ``block`` at
    the last position set to ``h``; the last position's logits."""
    n, P = h.shape[0], lens.n_prompt
    edit = Edit("resid_pre", block, torch.arange(n), torch.full((n,), P - 1), h)
    return run(lm, lens.ids[None].repeat(n, 1), edits=[edit], last_only=True).logits[:, -1].float()


def states_of(lm, n=4):
    """Real residual states of a text: ``(state, n, d_model)``."""
    ids = token_sequences(lm, TEXT, 16)[:1]
    return residual_states(lm, ids)["states"][:, 0, :n]


def pairs(L):
    """(state, l*) pairs: the default l* = l at the first, second and last block, and l* != l both ways."""
    return sorted({(0, 0), (1, 1), (L - 1, L - 1), (0, L - 1), (L - 1, 0), (L, 1), (1, 0)})


def test_patchscope_equals_the_brute_force_on_every_decoder(tiny_decoder):
    lm = tiny_decoder
    L = lm.anatomy.n_layers
    states = states_of(lm)
    torch.manual_seed(0)
    noise = torch.randn(2, lm.anatomy.d_model) * 3  # states the model never made
    lens = PatchscopeLens(lm)
    assert lens.n_prompt > 10 and lens.kind == "patchscope"
    for state, block in pairs(L):
        ps = lens if block == state else PatchscopeLens(lm, target_layer=block)
        h = torch.cat([states[state], noise])
        ref = brute_force(lm, ps, h, block)
        got = ps.logits(h, state)
        assert (got - ref).abs().max() < 1e-4, (state, block)
        # the patched position's distribution depends on the patched state (not the prompt's own "?" token)
        assert not torch.allclose(got[0], got[-1], atol=1e-2)


@pytest.mark.parametrize("family", ["llama", "gpt2", "bloom"])  # rotary, learned positions, ALiBi
def test_deeper_models_every_state_and_a_target_function(family):
    lm = tiny_with_layers(family, 5)
    L = lm.anatomy.n_layers
    states = states_of(lm, n=3)
    shift = PatchscopeLens(lm, target_layer=lambda l: min(l + 1, L))  # l* = l + 1: l* != l at every state
    own = PatchscopeLens(lm)
    for state in range(L):
        for ps in (own, shift):
            block = ps.target(state)
            got = ps.logits(states[state], state)
            ref = brute_force(lm, ps, states[state], block) if block < L else LogitLens(lm.anatomy).logits(
                states[state], L)
            assert (got - ref).abs().max() < 1e-4, (state, block)


def test_output_state_is_the_readout_and_equals_the_model(tiny_decoder):
    lm = tiny_decoder
    L = lm.anatomy.n_layers
    ids = token_sequences(lm, TEXT, 16)[:1]
    cap = residual_states(lm, ids)
    lens = PatchscopeLens(lm)
    assert lens.target(L) == L
    out = lens.logits(cap["states"][L, 0], L)
    assert_same_computation(out, LogitLens(lm.anatomy).logits(cap["states"][L, 0], L),
                            why="at the output state the patchscope lens is the logit lens")
    assert (out - cap["logits"][0].float()).abs().max() < 1e-4


def test_all_pairs_batched_equal_one_state_at_a_time_and_chunking_changes_nothing():
    lm = tiny_with_layers("opt", 4)
    L = lm.anatomy.n_layers
    h = states_of(lm, n=5)  # (L + 1, 5, d)
    lens = PatchscopeLens(lm)
    one_by_one = torch.stack([lens.transform(h[i], i) for i in range(L + 1)])
    batched = lens.transform_all(h)
    assert torch.allclose(batched, one_by_one, atol=1e-5)
    assert_same_computation(batched[L], h[L],
                            why="the output state, copied")  # the output state is not run through any block
    tiny_chunks = PatchscopeLens(lm, memory_mb=1e-3)  # one row per chunk
    assert tiny_chunks._rows_per_chunk() == 1
    assert torch.allclose(tiny_chunks.transform_all(h), batched, atol=1e-5)
    # mixed targets in one batch: rows sorted by block, each row back in its place
    targets = torch.tensor([3, 0, 4, 1, 0, 2])
    rows = h[torch.tensor([0, 1, 2, 3, 4, 1]), torch.arange(6) % 5]
    got = lens.run(rows, targets)
    for r in range(6):
        ref = PatchscopeLens(lm, target_layer=int(targets[r])).transform(rows[r : r + 1], 0)
        assert torch.allclose(got[r : r + 1], ref, atol=1e-5)


def test_the_last_query_alone_equals_every_query_row(tiny_decoder):
    """Without ALiBi or a short window the last query's attention row is computed alone; the same as the rows of
    the whole prompt (the path ALiBi and windowed models take)."""
    lm = tiny_decoder
    L = lm.anatomy.n_layers
    fast = PatchscopeLens(lm)
    full = PatchscopeLens(lm)
    full._unmasked = [None] * L
    uses_fast = [fast._last_row_attention(j) is not None for j in range(L)]
    A = lm.anatomy.layers
    assert uses_fast == [a.attn.alibi is None and (a.attn.window or 10**9) >= fast.n_prompt for a in A]
    h = states_of(lm)
    assert torch.allclose(fast.transform_all(h), full.transform_all(h), atol=1e-5)


def test_the_prefix_is_computed_once(monkeypatch):
    lm = get_model("tiny:llama")
    calls = []
    real = patchscope_module.capture
    monkeypatch.setattr(patchscope_module, "capture", lambda *a, **k: calls.append(1) or real(*a, **k))
    lens = PatchscopeLens(lm)
    h = states_of(lm)
    for state in range(lm.anatomy.n_layers + 1):
        lens.logits(h[state], state)
    lens.transform_all(h)
    assert len(calls) == 1
    q, k, v = lens.prefix()[0]
    A = lm.anatomy.layers[0].attn
    assert q.shape == k.shape == v.shape == (A.n_heads, lens.n_prompt - 1, A.d_head)


def test_bad_settings_and_models_without_a_next_token():
    lm = get_model("tiny:gpt2")
    L = lm.anatomy.n_layers
    for bad in (-1, L + 1, 1.5, True, "2"):
        with pytest.raises(InputError, match="target_layer"):
            PatchscopeLens(lm, target_layer=bad)
    with pytest.raises(InputError, match="target_layer gives 9 for state 0"):
        PatchscopeLens(lm, target_layer=lambda l: 9)
    lens = PatchscopeLens(lm)
    with pytest.raises(InputError, match="outside"):
        lens.logits(torch.zeros(1, lm.anatomy.d_model), L + 1)
    with pytest.raises(NotApplicableError, match="mid-layer"):
        lens.transform_mid(torch.zeros(1, lm.anatomy.d_model), 0)
    for name in ENCODERS:
        with pytest.raises(NotApplicableError, match="causal decoder"):
            PatchscopeLens(get_model(f"tiny:{name}"))


def test_evaluation_gives_kl_and_precision_at_1_for_every_lens():
    lm = tiny_with_layers("llama", 4)
    L = lm.anatomy.n_layers
    seqs = token_sequences(lm, TEXT, 16)[:2]
    lens = PatchscopeLens(lm)
    evs = evaluate_lenses(lm, {"logit": LogitLens(lm.anatomy), "patchscope": lens}, seqs, progress=False)
    ev = evs["patchscope"]
    d = ev.to_dict()
    assert d["lens"] == "patchscope" and len(d["layers"]) == L + 1
    assert {"kl", "precision_at_1", "top1_agreement"} <= set(d["layers"][0])
    for name in ("logit", "patchscope"):
        layers = evs[name].to_dict()["layers"]
        assert layers[-1]["precision_at_1"] == 1.0 and layers[-1]["kl"] < 1e-5
    # precision@1 and KL by hand at one state
    cap = residual_states(lm, seqs)
    h, final = cap["states"][1, :, :-1].reshape(-1, lm.anatomy.d_model), cap["logits"][:, :-1].reshape(
        -1, lm.anatomy.vocab_size)
    z = lens.logits(h, 1)
    assert d["layers"][1]["precision_at_1"] == pytest.approx(
        float((z.argmax(-1) == final.argmax(-1)).double().mean()), abs=1e-6)
    kl = torch.nn.functional.kl_div(torch.log_softmax(z, -1), torch.log_softmax(final, -1), log_target=True,
                                    reduction="batchmean")
    assert d["layers"][1]["kl"] == pytest.approx(float(kl), rel=1e-4)
    assert d["mean_kl"] == pytest.approx(sum(r["kl"] for r in d["layers"][:-1]) / L, rel=1e-5)
    assert d["layers"][1]["kl"] != pytest.approx(evs["logit"].to_dict()["layers"][1]["kl"], rel=1e-3)
    with pytest.raises(NotApplicableError, match="mid-layer"):
        evaluate_lenses(lm, {"patchscope": lens}, seqs, progress=False, mid=True)


def test_trajectory_and_depth_read_the_lens():
    lm = tiny_with_layers("gpt-neox", 3)
    lens = PatchscopeLens(lm)
    text = "The capital of France is Paris."
    t = prediction_trajectory(lm, text, lens)
    assert t.lens == "patchscope" and t.n_states == lm.anatomy.n_layers + 1
    ids = lenscope_encode(lm, text)
    states = residual_states(lm, ids[None])["states"][:, 0]
    for layer in range(lm.anatomy.n_layers + 1):
        assert_same_ints(t.top_ids[layer], lens.logits(states[layer], layer).argmax(-1))
    deps = text_depths(lm, text, {"logit": LogitLens(lm.anatomy), "patchscope": lens})
    assert set(deps) == {"logit", "patchscope"}
    assert deps["patchscope"].depth.shape == deps["logit"].depth.shape


def lenscope_encode(lm, text):
    from lenscope.models.loading.load import encode

    return encode(lm, text)


def test_report_shows_the_patchscope_beside_the_logit_lens():
    from lenscope.report import build_report

    lm = get_model("tiny:llama")
    rep = build_report(lm, "The capital of France is", lens=PatchscopeLens(lm), sections=["trajectory"])
    sec = next(s for s in rep.sections if s["key"] == "trajectory")
    assert [t["lens"] for t in sec["data"]["trajectories"]] == ["patchscope", "logit"]
    assert rep.meta["lens"] == "patchscope"


runner = CliRunner()


def cli(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_cli_eval_show_depth(tmp_path):
    data = tmp_path / "corpus.txt"
    data.write_text(TEXT * 3)
    r = cli("lens", "eval", "--model", "tiny:gpt2", "--data", data, "--lens", "patchscope", "--tokens", 64,
            "--seq-len", 16, "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["lens"] == "patchscope" and isinstance(d["mean_kl"], float)
    assert all({"kl", "precision_at_1"} <= set(row) for row in d["layers"]) and len(d["layers"]) == 3
    r = cli("lens", "eval", "--model", "tiny:gpt2", "--data", data, "--lens", "logit", "--tokens", 64,
            "--seq-len", 16, "--json")
    assert r.exit_code == 0 and "precision_at_1" in json.loads(r.stdout)["layers"][0]
    r = cli("lens", "eval", "--model", "tiny:gpt2", "--data", data, "--lens", "patchscope", "--tokens", 64,
            "--seq-len", 16, "--mid")
    assert r.exit_code == 2 and "mid-layer" in r.stderr
    r = cli("lens", "eval", "--model", "tiny:bert", "--data", data, "--lens", "patchscope", "--seq-len", 16)
    assert r.exit_code == 2 and "causal decoder" in r.stderr
    r = cli("lens", "show", "The capital of France is", "--model", "tiny:gpt2", "--lens", "patchscope", "--json")
    assert r.exit_code == 0, r.output
    assert [t["lens"] for t in json.loads(r.stdout)] == ["patchscope", "logit"]
    r = cli("lens", "depth", "The capital of France is Paris.", "--model", "tiny:gpt2", "--lens", "logit",
            "--lens", "patchscope", "--json")
    assert r.exit_code == 0, r.output
    assert set(json.loads(r.stdout)["lenses"]) == {"logit", "patchscope"}


@pytest.mark.slow
def test_smollm2_equals_the_brute_force(smollm2):
    """A real model (grouped-query attention, rotary, 30 blocks): exact at the first, a middle and the last block,
    and with l* != l."""
    lm = smollm2
    L = lm.anatomy.n_layers
    states = states_of(lm, n=3)
    for state, block in ((0, 0), (15, 15), (L - 1, L - 1), (10, 20)):
        ps = PatchscopeLens(lm, target_layer=block)
        got = ps.logits(states[state], state)
        ref = brute_force(lm, ps, states[state], block)
        # float32 both ways through up to 30 blocks (lenscope's own math against the real model): a few eps32 of
        # the logits' scale per block, so 1e-5 (84 eps32) of the largest logit; measured at most 2.6e-6 of it
        # (7.5e-5 absolute) with the default and the AVX2 kernels
        assert (got - ref).abs().max() < 1e-5 * ref.abs().max(), (state, block)
        assert_same_ints(got.argmax(-1), ref.argmax(-1))
