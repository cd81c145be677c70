"""The method table (``lenscope.attribution.methods``): a method registered in a test, with no other edit, is run by
``lenscope.explain``, explained per token by ``lenscope.generate``, shown in the report's attribution view and
answered by ``lenscope serve``'s ``/api/token``, listed and given its declared option (``--steps``) by ``lenscope
explain`` and ``lenscope generate``, and run (prepared once, summarised) by eval alignment; what it declares (its
completeness, its check of a prompt) reaches each of them; the built-in table keeps its names, order and needs."""

from __future__ import annotations

import re

import pytest
import torch
from starlette.testclient import TestClient

import lenscope
from lenscope.attribution import Explanation, Method, methods, register, unregister
from lenscope.errors import InputError
from lenscope.models.loading.load import resolve_token, token_ids

from ..conftest import get_model
from ..tolerances import assert_same_computation

COPIED = "the dummy method's small integers, copied"

NAME = "position-count"  # scores source j with j + 1 up to the explained position, 0 after it
TEXT = "the cat sat on the mat"


def help_text(output: str) -> str:
    """A ``--help`` page on one line, as written before it was wrapped (also at a hyphen)."""
    return " ".join(re.sub(r"-\n\s+", "-", output).split())


def _scores(rows: torch.Tensor, n: int) -> torch.Tensor:
    j = torch.arange(n, dtype=torch.float64)
    return torch.where(j[None] <= rows[:, None], j[None] + 1, torch.zeros(()))


def _explain(lm, text, target, foil=None, *, position=-1, steps=1, **options):
    """The dummy's scores times its one option, ``steps`` (a CLI flag of explain and generate)."""
    assert not options, options
    ids = token_ids(lm, text)
    n = len(ids)
    p = position % n
    t_id = resolve_token(lm, target)
    f_id = None if foil is None else resolve_token(lm, foil)
    return Explanation(model=lm.name, method=NAME, tokens=lm.tokenizer.batch_decode([[int(i)] for i in ids]),
                       position=p, target=lm.tokenizer.decode([t_id]), target_id=t_id,
                       foil=None if f_id is None else lm.tokenizer.decode([f_id]), foil_id=f_id,
                       scores=steps * _scores(torch.tensor([p]), n)[0], info={"completeness_error": 0.25})


def _rows(job):
    return (job.options.get("steps", 1) * _scores(job.rows, len(job.ids)),
            torch.full((len(job.rows),), float("nan"), dtype=torch.float64))


def _check_prompt(n: int, source: bool) -> None:
    if n < 3:
        raise InputError(f"{NAME} needs a prompt of at least 3 tokens")


def _dummy_method(**kw) -> Method:
    """The dummy with what a method declares: an option, a label, its completeness and a check of the prompt."""
    return Method(NAME, _explain, _rows, options=("steps",), explain_options=True, label="PC",
                  completeness="completeness error (the dummy's own)", check_prompt=_check_prompt, **kw)


@pytest.fixture
def dummy():
    register(_dummy_method())
    try:
        yield NAME
    finally:
        unregister(NAME)
    assert NAME not in methods.names()


def test_builtin_table():
    assert methods.names() == ("logit", "alti-logit", "alti", "grad-norm", "grad-x-input", "ig", "erasure",
                               "value-zeroing")
    assert methods.without_target() == ("alti", "value-zeroing")
    assert [m.name for m in methods.view_methods()] == ["alti-logit", "logit", "grad-x-input", "grad-norm", "ig",
                                                        "erasure", "alti", "value-zeroing"]
    assert [m.name for m in methods.view_methods(causal=False)] == ["grad-x-input", "grad-norm", "ig", "erasure",
                                                                    "alti", "value-zeroing"]
    assert [m.name for m in methods.view_methods(has_logits=False, causal=False)] == ["alti", "value-zeroing"]
    assert methods.generation_view_methods() == ("alti-logit", "logit", "alti")
    assert methods.eval_methods() == ("logit", "alti-logit", "grad-norm", "grad-x-input", "ig", "erasure")
    assert methods.eval_timers() == ("logit", "alti-logit", "gradients", "ig", "erasure")
    assert methods.option_methods() == {"batch_size": ("grad-norm", "grad-x-input", "ig", "erasure"),
                                        "steps": ("ig",), "baseline": ("ig",)}
    assert lenscope.attribution.METHODS == methods.names()
    with pytest.raises(ValueError, match="already registered"):
        register(Method("alti", _explain))
    with pytest.raises(InputError, match="unknown method 'nope'; choose one of logit, alti-logit"):
        methods.get("nope")


def test_a_registered_method_is_everywhere(dummy):
    from lenscope.report import build_report
    from lenscope.serve import create_app

    lm = get_model("tiny:llama")
    n = len(token_ids(lm, TEXT))
    assert dummy in lenscope.attribution.METHODS and dummy in methods.names()

    # explain
    e = lenscope.explain(lm, TEXT, "#5", method=dummy, position=2)
    assert e.method == dummy and e.target_id == 5
    assert_same_computation(e.scores.tolist(), [1, 2, 3] + [0] * (n - 3), why=COPIED)
    with pytest.raises(InputError, match=f"--method {dummy} explains a logit and needs a target"):
        lenscope.explain(lm, TEXT, method=dummy)
    assert dummy in lenscope.attribution.explain_all(lm, TEXT, "#5")

    # generate: every generated token's explanation
    g = lenscope.generate(lm, TEXT, max_new_tokens=3, explain=["alti", dummy])
    assert g.methods == ["alti", dummy] and g.n_steps == 3
    P = g.prompt_len
    for i in range(3):
        assert_same_computation(g.matrix(dummy)[i].tolist(),
                                [j + 1.0 if j < P + i else 0.0 for j in range(len(g.tokens) - 1)], why=COPIED)
    d = g.to_dict()["generated"]
    assert d[0]["foil"] is not None  # the dummy explains a logit: contrasted with the runner-up
    assert_same_computation(d[1]["explanations"][dummy]["scores"], [j + 1.0 for j in range(P + 1)], why=COPIED)
    assert dummy in g.seconds

    # its option and its check of the prompt, in generate
    g2 = lenscope.generate(lm, TEXT, max_new_tokens=1, explain=[dummy], steps=2)
    assert_same_computation(g2.matrix(dummy)[0].tolist(), [2.0 * (j + 1) for j in range(P)], why=COPIED)
    with pytest.raises(InputError, match=f"{dummy} needs a prompt of at least 3 tokens"):
        lenscope.generate(lm, "the", max_new_tokens=1, explain=[dummy])  # 2 tokens
    with pytest.raises(InputError, match="option 'baseline' applies to ig only"):
        lenscope.generate(lm, TEXT, max_new_tokens=1, explain=[dummy], baseline="zero")

    # the report's attribution view: last in view order, with its scores and its completeness (a check)
    rep = build_report(lm, TEXT, "#5", sections=["attribution"])
    (sec,) = [s for s in rep.sections if s["key"] == "attribution"]
    assert list(sec["data"]["methods"])[-1] == dummy
    assert_same_computation(sec["data"]["methods"][dummy]["scores"], list(range(1, n + 1)), why=COPIED)
    assert_same_computation(sec["data"]["methods"][dummy]["completeness_error"], 0.25, why=COPIED)
    assert "completeness_error" not in sec["data"]["methods"]["logit"]  # a method that reports none
    assert dummy not in sec["data"]["layers"]  # no per-layer attention update
    (check,) = [c for c in rep.checks if c["name"].startswith(f"{dummy}: ")]
    assert check["name"] == f"{dummy}: completeness error (the dummy's own)"
    assert_same_computation(check["value"], 0.25, why=COPIED)

    # lenscope serve's /api/token
    with TestClient(create_app(["tiny:llama"], loader=get_model)) as c:
        d = c.post("/api/token", json={"model": "tiny:llama", "text": TEXT, "position": 3}).json()
    assert_same_computation(d["methods"][dummy]["scores"], [1, 2, 3, 4] + [0] * (n - 4), why=COPIED)
    assert list(d["methods"])[-1] == dummy
    assert_same_computation(d["methods"][dummy]["completeness_error"], 0.25, why=COPIED)


def test_a_registered_method_is_in_the_command_line(dummy):
    """``lenscope explain`` and ``lenscope generate`` list it in their help, take it, pass it its declared option
    (``--steps``) and refuse the options it does not declare (``--baseline``), naming the methods that do."""
    import json

    from typer.testing import CliRunner

    from lenscope.cli import app

    run = CliRunner().invoke
    for cmd in ("explain", "generate"):
        r = run(app, [cmd, "--help"])
        assert r.exit_code == 0 and f"value-zeroing, {dummy}" in help_text(r.output).replace(" |", ","), r.output
    r = run(app, ["explain", TEXT, "--model", "tiny:llama", "--target", "#5", "--method", dummy, "--position", "2",
                  "--steps", "3", "--json"])
    assert r.exit_code == 0, r.output
    n = len(token_ids(get_model("tiny:llama"), TEXT))
    assert_same_computation(json.loads(r.stdout)["scores"], [3, 6, 9] + [0] * (n - 3), why=COPIED)
    r = run(app, ["explain", TEXT, "--model", "tiny:llama", "--target", "#5", "--method", dummy])
    assert r.exit_code == 0 and "PC completeness error 2.5e-01" in r.stdout, r.output
    r = run(app, ["explain", TEXT, "--model", "tiny:llama", "--target", "#5", "--method", dummy, "--baseline", "pad"])
    assert r.exit_code == 2 and r.stderr.strip() == "error: --baseline applies to --method ig only"
    r = run(app, ["explain", TEXT, "--model", "tiny:llama", "--target", "#5", "--method", "logit", "--steps", "3"])
    assert r.exit_code == 2 and r.stderr.strip() == f"error: --steps applies to --method ig or {dummy} only"

    r = run(app, ["generate", TEXT, "--model", "tiny:llama", "-n", "1", "--explain", dummy, "--steps", "2", "--json"])
    assert r.exit_code == 0, r.output
    (step,) = json.loads(r.stdout)["generated"]
    assert_same_computation(step["explanations"][dummy]["scores"], [2.0 * (j + 1) for j in range(n)], why=COPIED)
    r = run(app, ["generate", TEXT, "--model", "tiny:llama", "-n", "1", "--explain", "alti", "--steps", "2"])
    assert r.exit_code == 2 and r.stderr.strip() == f"error: --steps applies to the ig or {dummy} method only"


def test_after_unregistering_it_is_gone():
    from typer.testing import CliRunner

    from lenscope.cli import app

    lm = get_model("tiny:llama")
    with pytest.raises(InputError, match=f"unknown method '{NAME}'"):
        lenscope.explain(lm, TEXT, "#5", method=NAME)
    with pytest.raises(InputError, match=f"unknown method '{NAME}'"):
        lenscope.generate(lm, TEXT, max_new_tokens=1, explain=[NAME])
    assert NAME not in help_text(CliRunner().invoke(app, ["explain", "--help"]).output)


def test_a_method_without_a_many_row_form_runs_in_generate_once_per_token():
    """Without ``rows``, generate calls the method's ``explain`` on each generated token's prefix."""
    lm = get_model("tiny:llama")
    register(Method(NAME, _explain))
    try:
        g = lenscope.generate(lm, TEXT, max_new_tokens=3, explain=[NAME])
    finally:
        unregister(NAME)
    P = g.prompt_len
    for i in range(3):
        assert_same_computation(g.matrix(NAME)[i].tolist(),
                                [j + 1.0 if j < P + i else 0.0 for j in range(len(g.tokens) - 1)], why=COPIED)
    assert_same_computation(g.to_dict()["generated"][2]["explanations"][NAME]["scores"],
                            [j + 1.0 for j in range(P + 2)], why=COPIED)


def test_a_method_with_a_texts_form_runs_in_eval_alignment():
    """Its ``texts`` form scores the examples, with what its ``prepare`` made once per call; its ``summarize`` adds
    to each dataset's summary."""
    from typer.testing import CliRunner

    from lenscope.cli import app
    from lenscope.data.datasets import Example
    from lenscope.evaluate.alignment import check_methods, evaluate_example, evaluate_examples, summarise
    from lenscope.evaluate.metrics import alignment
    from lenscope.evaluate.summary import timers

    prepared = []

    def prepare(lm, options):
        prepared.append(lm.name)
        return {"offset": 1}

    def texts(job):
        k, n = job.ids.shape
        return _scores(torch.full((k,), n - 1), n), [{"position_count": n + job.options["offset"] - 1}] * k

    def summarize(records):
        return {"position_count": sorted(r["info"]["position_count"] for r in records)}

    lm = get_model("tiny:gpt2")
    ex = Example(id="x/0", dataset="x", prefix="The keys to the cabinet", target="are", foil="is", evidence=("keys",))
    ex2 = Example(id="x/1", dataset="x", prefix="The keys", target="are", foil="is", evidence=("keys",))
    register(Method(NAME, _explain, texts=texts, prepare=prepare, summarize=summarize))
    try:
        assert check_methods(None)[-3:] == [NAME, "first", "recent"] and timers()[-2:] == (NAME, "forward")
        page = help_text(CliRunner().invoke(app, ["eval", "alignment", "--help"]).output)
        assert f"erasure, {NAME}, and the positional rankings" in page and f"erasure,{NAME},first,recent]" in page
        r = evaluate_example(lm, ex, ["logit", NAME])
        assert prepared == [lm.name]
        recs = evaluate_examples(lm, [ex, ex2], ["logit", NAME])
        assert prepared == [lm.name] * 2  # once per call, not per example or batch
        s = summarise(lm.name, {"x": [ex, ex2]}, {q["id"]: q for q in recs}, ["logit", NAME])
        aligned = [q for q in recs if q["skip"] is None]
        assert len(aligned) == 2 and s.datasets["x"]["position_count"] == sorted(len(q["tokens"]) for q in aligned)
        assert "position_count" not in summarise(lm.name, {"x": [ex, ex2]}, {q["id"]: q for q in recs},
                                                 ["logit"]).datasets["x"]
    finally:
        unregister(NAME)
    n = len(r["tokens"])
    assert_same_computation(r["scores"][NAME], list(range(1, n + 1)), why=COPIED)
    assert r["info"] == {"position_count": n}
    assert_same_computation(r["metrics"][NAME], alignment(list(range(1, n + 1)), r["evidence"], r["rankable"]),
                            why="alignment() of the same scores")
    assert NAME in r["time"]
    with pytest.raises(InputError, match=f"unknown method '{NAME}' for eval alignment"):
        check_methods([NAME])
