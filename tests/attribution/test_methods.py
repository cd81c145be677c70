"""The method table (``lenscope.attribution.methods``): a method registered in a test, with no other edit, is run by
``lenscope.explain``, explained per token by ``lenscope.generate``, shown in the report's attribution view and
answered by ``lenscope serve``'s ``/api/token``; the built-in table keeps its names, order and needs."""

from __future__ import annotations

import pytest
import torch
from starlette.testclient import TestClient

import lenscope
from lenscope.attribution import Explanation, Method, methods, register, unregister
from lenscope.errors import InputError
from lenscope.models.load import resolve_token, token_ids

from ..conftest import get_model
from ..tolerances import assert_same_computation

COPIED = "the dummy method's small integers, copied"

NAME = "position-count"  # scores source j with j + 1 up to the explained position, 0 after it
TEXT = "the cat sat on the mat"


def _scores(rows: torch.Tensor, n: int) -> torch.Tensor:
    j = torch.arange(n, dtype=torch.float64)
    return torch.where(j[None] <= rows[:, None], j[None] + 1, torch.zeros(()))


def _explain(lm, text, target, foil=None, *, position=-1, **options):
    assert not options, options
    ids = token_ids(lm, text)
    n = len(ids)
    p = position % n
    t_id = resolve_token(lm, target)
    f_id = None if foil is None else resolve_token(lm, foil)
    return Explanation(model=lm.name, method=NAME, tokens=lm.tokenizer.batch_decode([[int(i)] for i in ids]),
                       position=p, target=lm.tokenizer.decode([t_id]), target_id=t_id,
                       foil=None if f_id is None else lm.tokenizer.decode([f_id]), foil_id=f_id,
                       scores=_scores(torch.tensor([p]), n)[0])


def _rows(job):
    return _scores(job.rows, len(job.ids)), torch.full((len(job.rows),), float("nan"), dtype=torch.float64)


@pytest.fixture
def dummy():
    register(Method(NAME, _explain, _rows))
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

    # the report's attribution view: last in view order, with its scores
    rep = build_report(lm, TEXT, "#5", sections=["attribution"])
    (sec,) = [s for s in rep.sections if s["key"] == "attribution"]
    assert list(sec["data"]["methods"])[-1] == dummy
    assert_same_computation(sec["data"]["methods"][dummy]["scores"], list(range(1, n + 1)), why=COPIED)
    assert dummy not in sec["data"]["layers"]  # no per-layer attention update

    # lenscope serve's /api/token
    with TestClient(create_app(["tiny:llama"], loader=get_model)) as c:
        d = c.post("/api/token", json={"model": "tiny:llama", "text": TEXT, "position": 3}).json()
    assert_same_computation(d["methods"][dummy]["scores"], [1, 2, 3, 4] + [0] * (n - 4), why=COPIED)
    assert list(d["methods"])[-1] == dummy


def test_after_unregistering_it_is_gone():
    lm = get_model("tiny:llama")
    with pytest.raises(InputError, match=f"unknown method '{NAME}'"):
        lenscope.explain(lm, TEXT, "#5", method=NAME)
    with pytest.raises(InputError, match=f"unknown method '{NAME}'"):
        lenscope.generate(lm, TEXT, max_new_tokens=1, explain=[NAME])


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
    from lenscope.data.datasets import Example
    from lenscope.evaluate.alignment import check_methods, evaluate_example
    from lenscope.evaluate.metrics import alignment
    from lenscope.evaluate.summary import timers

    def texts(job):
        k, n = job.ids.shape
        return _scores(torch.full((k,), n - 1), n), [{"position_count": n}] * k

    lm = get_model("tiny:gpt2")
    ex = Example(id="x/0", dataset="x", prefix="The keys to the cabinet", target="are", foil="is", evidence=("keys",))
    register(Method(NAME, _explain, texts=texts))
    try:
        assert check_methods(None)[-3:] == [NAME, "first", "recent"] and timers()[-2:] == (NAME, "forward")
        r = evaluate_example(lm, ex, ["logit", NAME])
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
