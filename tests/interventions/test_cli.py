"""``lenscope patch`` and ``lenscope causal-trace``: JSON fields, files, token ids, one-line errors (exit 2)."""

import json

import pytest
from typer.testing import CliRunner

from lenscope.cli import app
from lenscope.interventions import activation_patching
from lenscope.models.loading.load import encode, resolve_token

from ..conftest import get_model
from ..tolerances import assert_same_computation, logit_diff_scale, pass_rounding

runner = CliRunner()
CLEAN, CORRUPT = "The capital of France is", "The capital in France is"


def run(*args):
    return runner.invoke(app, list(args))


@pytest.mark.parametrize("what", ["resid", "attn", "mlp", "heads"])
def test_patch_json(what):
    r = run("patch", CLEAN, CORRUPT, "--model", "tiny:gpt2", "--target", " capital", "--foil", " of", "--what", what,
            "--batch-size", "3", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    for k in ("tokens", "what", "clean_metric", "corrupted_metric", "values"):
        assert k in d
    assert d["what"] == what and d["direction"] == "denoising"
    L, C = len(d["values"]), len(d["values"][0])
    assert L == 2 and C == (4 if what == "heads" else len(d["tokens"]))
    lm = get_model("tiny:gpt2")
    ref = activation_patching(lm, CLEAN, CORRUPT, " capital", " of", what=what)
    import torch

    # the same numbers but for float32 rounding (another batch size): every metric of either run is within
    # pass_rounding x its scale (tests/tolerances.py); a share (m - m_corr) / (m_clean - m_corr) of at most 1 then
    # moves by 4x that over |m_clean - m_corr|
    ids = [encode(lm, t) for t in (CLEAN, CORRUPT)]
    tid, fid = resolve_token(lm, " capital"), resolve_token(lm, " of")
    tol = 4 * pass_rounding(lm) * max(logit_diff_scale(lm, i, tid, fid) for i in ids)
    atol = tol / abs(ref.clean_metric - ref.corrupted_metric)
    assert torch.allclose(torch.tensor(d["values"]), ref.values, atol=atol)


def test_patch_noising_ids_png_save_table(tmp_path):
    lm = get_model("tiny:llama")
    tid = lm.tokenizer(" capital", add_special_tokens=False)["input_ids"][0]
    png, save = tmp_path / "p.png", tmp_path / "p.safetensors"
    r = run("patch", CLEAN, CORRUPT, "--model", "tiny:llama", "--target", f"#{tid}", "--foil", " of", "--noising",
            "--png", str(png), "--save", str(save))
    assert r.exit_code == 0, r.output
    assert "noising" in r.stdout and "layer" in r.stdout
    assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 5000
    from lenscope.interventions import PatchingResult

    back = PatchingResult.load(save)
    assert back.noising and back.target_id == tid


@pytest.mark.parametrize("args,msg", [
    (["patch", CLEAN, "The capital of the Republic of France is", "--target", " capital", "--foil", " of"],
     "same number of tokens"),
    (["patch", CLEAN, CORRUPT, "--target", " capital city", "--foil", " of"], "not exactly one token"),
    (["patch", CLEAN, CORRUPT, "--target", " capital", "--foil", " of", "--what", "neurons"], "unknown --what"),
    (["causal-trace", CLEAN, "--subject", "Germany", "--target", " capital"], "does not occur"),
    (["causal-trace", CLEAN, "--subject", "France", "--target", " capital city"], "not exactly one token"),
])
def test_errors_one_line_exit_2(args, msg):
    r = run(*args, "--model", "tiny:gpt2", "--json")
    assert r.exit_code == 2, r.output
    assert msg in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_unknown_model_exit_2():
    r = run("patch", CLEAN, CORRUPT, "--model", "no-such-model", "--target", " capital", "--foil", " of")
    assert r.exit_code == 2 and r.stderr.startswith("error:")


def test_causal_trace_json_png(tmp_path):
    png = tmp_path / "t.png"
    r = run("causal-trace", CLEAN, "--subject", "France", "--target", " capital", "--model", "tiny:qwen2",
            "--samples", "2", "--window", "2", "--json", "--png", str(png))
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    for k in ("tokens", "subject_positions", "p_clean", "p_corrupted", "resid", "mlp", "attn"):
        assert k in d
    assert d["subject_positions"] == [3, 4, 5] and len(d["resid"]) == 2 and len(d["resid"][0]) == len(d["tokens"])
    assert png.read_bytes()[:4] == b"\x89PNG"
    r2 = run("causal-trace", CLEAN, "--subject", "France", "--model", "tiny:qwen2", "--samples", "2")
    assert r2.exit_code == 0, r2.output
    assert "p_clean" in r2.stdout and "largest AIE" in r2.stdout


def test_neurons_json_and_table(tmp_path):
    r = run("neurons", CLEAN, "--target", " capital", "--model", "tiny:gemma3", "--steps", "4", "--json",
            "--png", str(tmp_path / "n.png"))
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["target"] == " capital" and len(d["neurons"]) > 0
    # the same neurons and probabilities as the library call (tests/interventions/test_neurons.py checks those
    # against hooks on the real model)
    from lenscope.interventions.neurons import knowledge_neurons

    ref = knowledge_neurons(get_model("tiny:gemma3"), CLEAN, " capital", steps=4)
    assert [[n["layer"], n["index"]] for n in d["neurons"]] == ref.neurons.tolist()
    assert d["control"] == ref.control.tolist()
    for k in ("p_base", "p_suppressed", "p_amplified", "p_control_suppressed", "p_control_amplified"):
        assert d[k] == pytest.approx(getattr(ref, k), rel=1e-6), k
    assert {"layer", "index", "score"} <= set(d["neurons"][0])
    rc = d["random_control"]
    assert_same_computation((d["suppress"], d["amplify"], rc["before"], rc["after"]),
                            ({"before": d["p_base"], "after": d["p_suppressed"]},
                             {"before": d["p_base"], "after": d["p_amplified"]},
                             d["p_base"], d["p_control_suppressed"]),
                            why="the same probabilities, copied into each block")
    assert (tmp_path / "n.png").stat().st_size > 5000
    r2 = run("neurons", CLEAN, "--model", "tiny:gemma3", "--steps", "2", "--max-neurons", "2")
    assert r2.exit_code == 0, r2.output
    assert "knowledge neurons" in r2.stdout
    r3 = run("neurons", CLEAN, "--model", "tiny:gemma3", "--target", " capital city")
    assert r3.exit_code == 2 and "not exactly one token" in r3.stderr


def test_path_patch_json():
    r = run("path-patch", CLEAN, CORRUPT, "--target", " capital", "--foil", " of", "--model", "tiny:llama",
            "--receiver", "1.2.q", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["receiver"] == [1, 2, "q"] and d["values"][1] == [None] * 4 and None not in d["values"][0]
    r2 = run("path-patch", CLEAN, CORRUPT, "--target", " capital", "--foil", " of", "--model", "tiny:llama",
             "--receiver", "1.2")
    assert r2.exit_code == 2 and "--receiver" in r2.stderr
    r3 = run("path-patch", CLEAN, CORRUPT, "--target", " capital", "--foil", " of", "--model", "tiny:llama",
             "--senders", "mlp")
    assert r3.exit_code == 0, r3.output
