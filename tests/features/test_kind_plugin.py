"""The table of sparse-dictionary kinds (``lenscope.models.dictionaries.kinds``): a kind declared in this one file and
registered, with no other edit, is listed by ``lenscope dict train``'s choices and help, encodes and decodes as a
:class:`~lenscope.models.dictionaries.dictionary.Dictionary`, trains (by the CLI, on an activations file), saves and
loads (its
SAELens architecture and lenscope's record), and runs as the engine's latent sites. The built-in table keeps its
names and order, and no module outside the kinds' files branches on a kind's name."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import typer
from safetensors.torch import save_file
from typer.testing import CliRunner

from lenscope.errors import InputError
from lenscope.models.dictionaries import kinds as kinds
from lenscope.models.dictionaries.dictionary import Dictionary, load_dictionaries
from lenscope.models.loading.summary import fingerprint
from lenscope.models.runtime.engine import run
from tests.conftest import get_model
from tests.tolerances import assert_same_computation

NAME = "relu-l1"
L1 = 0.01


class ReLUL1(kinds.Kind):
    """The dummy kind: a plain ReLU (no threshold, no k at inference; SAELens's ``standard``), trained with an L1
    penalty on the latents (Bricken et al. 2023's objective)."""

    name = NAME
    help = "a ReLU trained with an L1 penalty (the plug-in test's kind)"
    k_help = "unused"
    architecture = "standard"
    threshold = False

    def activate(self, D, pre):
        return pre.relu()

    def train_forward(self, m, xc, n, dist, stats):
        pre = m.mm(xc, m.W_enc) + m.b_enc
        z = pre.relu()
        yhat = m.mm(z, m.W_dec) + m.b_dec
        on = z.detach() > 0
        stats["l0"] = float(on.sum(-1).float().mean())
        return pre, yhat, on.any(0), z

    def penalty(self, m, loss, xc, pre, dead, err, extra):
        return loss + L1 * extra.abs().sum(-1).mean()


@pytest.fixture
def dummy():
    kinds.register(ReLUL1())
    try:
        yield NAME
    finally:
        kinds.unregister(NAME)
    assert NAME not in kinds.names()


def test_builtin_table():
    assert kinds.names() == ("topk", "batchtopk", "jumprelu")
    assert kinds.DEFAULT in kinds.names()
    assert [k.architecture for k in kinds.kinds()] == ["topk", "jumprelu", "jumprelu"]
    assert kinds.circuit_tracer_kinds() == "batchtopk or jumprelu"
    with pytest.raises(InputError, match="unknown dictionary kind 'nope'; kinds: topk, batchtopk, jumprelu"):
        kinds.get("nope")
    with pytest.raises(ValueError, match="already registered"):
        kinds.register(type(kinds.get("topk"))())


def test_no_module_outside_the_kinds_branches_on_a_kind_name():
    src = Path(kinds.__file__).parents[2]
    own = Path(kinds.__file__).parent
    names = "|".join(map(re.escape, kinds.names()))
    pattern = re.compile(rf"""kind\s*(==|!=|in)\s*\(?["']({names})["']""")
    found = [f"{p.relative_to(src)}: {m.group(0)}" for p in sorted(src.rglob("*.py")) if own not in p.parents
             for m in pattern.finditer(p.read_text(encoding="utf-8"))]
    assert not found, found


def test_the_cli_lists_it(dummy):
    from lenscope.cli import dict_train

    assert NAME in kinds.names() and NAME in kinds.kind_help() and "relu-l1: unused" in kinds.k_help()
    app = typer.Typer()  # the help is built from the table when the app is built
    dict_train.register(app)
    app.command("noop")(lambda: None)  # (two commands: typer keeps the subcommand's name)
    r = CliRunner().invoke(app, ["train", "--help"], terminal_width=400)
    assert r.exit_code == 0, r.output
    helped = " ".join(re.sub("[│╭╮╰╯─]", " ", r.output).split())  # (rich's boxes and wrapped lines joined)
    assert "relu-l1: a ReLU trained with an L1 penalty (the plug-in test's kind)" in helped
    assert "topk: the k largest pre-activations of each token" in helped


def test_it_encodes_decodes_and_is_refused_once_unregistered(dummy):
    D = Dictionary.init(8, 12, kind=NAME, seed=1)
    assert D.threshold is None and D.kind == NAME and repr(D).startswith(f"Dictionary(sae, {NAME}, site=")
    D.b_enc = torch.linspace(-0.5, 0.5, 12)
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(0))
    pre = (x - D.b_dec) @ D.W_enc + D.b_enc
    assert_same_computation(D.encode(x), pre.relu(), why="the kind's activation on the same pre-activations")
    assert bool((D.encode(x) == 0).any()) and bool((D.encode(x) > 0).any())
    assert_same_computation(D(x), pre.relu() @ D.W_dec + D.b_dec, why="the decoder on the same latents")
    kinds.unregister(NAME)
    with pytest.raises(InputError, match=f"unknown dictionary kind '{NAME}'"):
        Dictionary.init(8, 12, kind=NAME)
    kinds.register(ReLUL1())


def test_it_trains_saves_loads_and_runs_as_latent_sites(dummy, tmp_path):
    from lenscope.cli import app

    lm = get_model("tiny:gpt2")
    d = lm.anatomy.d_model
    ids = lm.tokenizer("The cat sat on the mat because it was warm", return_tensors="pt").input_ids[:, :8]
    acts = run(lm, ids, capture=["resid_post.1"]).captured["resid_post.1"].float().reshape(-1, d)
    x = acts.repeat(64, 1) + 0.1 * torch.randn(64 * len(acts), d, generator=torch.Generator().manual_seed(0))
    save_file({"activations": x.contiguous()}, str(tmp_path / "a.safetensors"))
    r = CliRunner().invoke(app, ["dict", "train", "--activations", str(tmp_path / "a.safetensors"), "--kind", NAME,
                                 "--width", "48", "--k", "4", "--tokens", "2048", "--batch-size", "128",
                                 "--precision", "fp32", "--out", str(tmp_path / "d"), "--json"])
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["kind"] == NAME and summary["tokens"] == 2048
    (D,) = load_dictionaries(tmp_path / "d")
    cfg = json.loads((tmp_path / "d" / "cfg.json").read_text())
    assert cfg["architecture"] == "standard" and cfg["metadata"]["lenscope"]["kind"] == NAME and "k" not in cfg
    assert D.kind == NAME and D.threshold is None and D.info["training"]["kind"] == NAME
    hist = D.info["training"]["history"]
    assert hist[-1][3] > hist[0][3]  # the explained variance rose: it trained
    # on the model: its latents are the engine's site, an unedited run is the real run
    D.site, D.fingerprint = "resid_post.1", fingerprint(lm.anatomy)
    plain = run(lm, ids, capture=["resid_post.1"])
    with_d = run(lm, ids, capture=["resid_post.latents.1"], dictionaries=[D])
    assert_same_computation(with_d.logits, plain.logits, why="no edit: the dictionary's hooks leave the run as it is")
    z = with_d.captured["resid_post.latents.1"]
    ref = D.encode(plain.captured["resid_post.1"].float())
    assert z.shape == (1, ids.shape[1], 48) and bool((ref > 0).any())
    assert torch.allclose(z, ref, atol=1e-5 * (1 + float(ref.abs().max())))
    sp = run(lm, ids, capture=["resid_post.1"], dictionaries=[D], splice=True)
    rec = D(plain.captured["resid_post.1"].float())
    assert torch.allclose(sp.captured["resid_post.1"].float(), rec, atol=1e-5 * (1 + float(rec.abs().max())))
