"""lenscope.generate with a source (issue 47; docs/encoder-decoder.md, "Generation"): on every tiny encoder-decoder
model the tokens are the greedy ones of transformers' model (an independent loop: the argmax of the model's logits
given the source and the decoder's sequence so far), and every step's explanation, from one teacher-forced trace, is
``lenscope.explain`` on that step's target prefix with the same source; the result labels source and target tokens,
saves and loads (old files without a source too); the CLI prints the source's fields and refuses what a source does
not support yet in one line.
"""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from typer.testing import CliRunner

import lenscope
from lenscope.attribution import methods as table
from lenscope.cli import app
from lenscope.errors import InputError, NotApplicableError
from lenscope.generation import Generation, generate
from lenscope.lenses.depth import depths_from_agreement
from lenscope.models.loading.load import target_prefix_ids
from lenscope.models.runtime.trace import source_ids, trace
from lenscope.models.weights.readout import Readout
from tests.conftest import SEQ2SEQ, get_model
from tests.tolerances import U32, assert_same_computation, assert_same_ints

SOURCE = "das Haus ist klein"
PREFIX = "the house"
MODELS = [f"tiny:{n}" for n in SEQ2SEQ]
READERS = table.source_readers()  # the methods that read a source (logit, alti-logit, and those added since)
TRACE_READERS = ("logit", "alti-logit")  # one trace's algebra, compared with explain on each prefix below
runner = CliRunner()


def _greedy(lm, src: torch.Tensor, dec: torch.Tensor, n: int) -> list[int]:
    """Greedy decoding by its definition: each next token is the argmax of the model's last logits given the source
    and the decoder's sequence so far (no cache, no logits processor), stopping after the end-of-sequence token."""
    eos = lm.model.generation_config.eos_token_id
    out = dec.tolist()
    with torch.no_grad():
        for _ in range(n):
            logits = lm.model(input_ids=src[None], decoder_input_ids=torch.tensor([out])).logits[0, -1]
            out.append(int(logits.argmax()))
            if out[-1] == eos:
                break
    return out


@pytest.mark.parametrize("prefix", ["", PREFIX])
@pytest.mark.parametrize("name", MODELS)
def test_tokens_are_the_greedy_ones_of_the_model(name, prefix):
    lm = get_model(name)
    g = generate(lm, prefix, 5, source=SOURCE, explain=())
    src = torch.tensor(lm.tokenizer(SOURCE)["input_ids"])
    dec = target_prefix_ids(lm, prefix)
    assert g.ids.tolist() == _greedy(lm, src, dec, 5)
    assert g.prompt_len == len(dec) and g.ids[: g.prompt_len].tolist() == dec.tolist()
    assert g.source == SOURCE and g.source_ids.tolist() == src.tolist() and g.n_source == len(src)
    assert g.source_tokens == [lm.tokenizer.decode([int(i)]) for i in src]
    if name == "tiny:marian":  # its config forces the end token last: not applied (the loop above never does)
        assert any("forced_eos_token_id" in n for n in g.notes)
    # the same generation from the decoder's ids and the source's ids
    h = generate(lm, dec, 5, source=src, explain=())
    assert h.ids.tolist() == g.ids.tolist() and h.n_source == g.n_source


@pytest.mark.parametrize("foil", ["runner-up", None])
@pytest.mark.parametrize("name", MODELS)
def test_every_step_equals_explain_on_its_prefix(name, foil):
    """Both compute the same logit parts (and ALTI+ contributions) from a trace of the same source and decoder
    tokens, one of the whole sequence, one cut after the step's prefix: the causal decoder's states agree up to the
    float32 rounding of the longer matmuls, so a score may differ by a few units of float32 roundoff per block of
    both stacks (:func:`tests.tolerances.pass_rounding`'s 16 u per block) times the size of what is summed into it
    (the scores' absolute sum and the logit difference; at least 1). Measured: at most 6e-7 on sums of 2..25."""
    lm = get_model(name)
    g = generate(lm, PREFIX, 4, source=SOURCE, explain=TRACE_READERS, foil=foil)
    assert g.methods == list(TRACE_READERS)
    S = g.n_source
    assert g.scores.shape == (len(TRACE_READERS), g.n_steps, S + len(g.tokens) - 1)
    A = lm.anatomy
    rounding = 16 * U32 * (A.n_layers + A.encoder.n_layers + 1)
    for i, p in enumerate(g.positions):
        tok = int(g.ids[p])
        for k, m in enumerate(g.methods):
            f = None if foil is None else int(g.foil_ids[i])
            ex = lenscope.explain(lm, g.ids[:p], tok, f, method=m, source=SOURCE)
            assert ex.n_source == S and ex.tokens == g.context_tokens[: S + p]
            got = g.scores[k, i]
            assert torch.all(got[S + p:] == 0), (m, i)  # nothing at or after the step's position
            scale = max(1.0, float(ex.scores.abs().sum()) + abs(ex.info["logit"]))
            err = float((got[: S + p] - ex.scores).abs().max())
            assert err <= rounding * scale, (name, m, i, err, scale)
            assert 0 <= float(g.invariant_error[k, i]) <= 1e-3


@pytest.mark.parametrize("name", MODELS)
def test_statistics_and_depth_from_the_model(name):
    lm = get_model(name)
    g = generate(lm, PREFIX, 4, source=SOURCE, explain=())
    rows = torch.arange(g.prompt_len - 1, len(g.ids) - 1)
    with torch.no_grad():  # the model's own pass, not lenscope's trace
        logits = lm.model(input_ids=g.source_ids[None], decoder_input_ids=g.ids[None]).logits[0, rows].double()
    p = logits.softmax(-1)
    # one float32 softmax of logits of size O(1..10): a few u relative
    assert torch.allclose(g.prob.double(), p[torch.arange(g.n_steps), g.ids[g.prompt_len:]], atol=1e-5)
    ent = -(p * p.clamp_min(1e-300).log()).sum(-1)
    assert torch.allclose(g.entropy.double(), ent, atol=1e-4)
    assert_same_ints(g.runner_up, logits.topk(2, -1).indices[:, 1])  # greedy: the generated token is the top-1
    # the depth reads the decoder's residual states through the logit lens: the readout at the final state gives the
    # model's prediction, and the depth is the first state from which the lens's top-1 stays the model's
    tr = trace(lm, g.ids, source=g.source_ids)
    ro = Readout.from_anatomy(lm.anatomy)
    final_top = logits.argmax(-1)
    assert_same_ints(ro.logits(tr.final_resid[rows].float()).argmax(-1), final_top)
    agree = torch.stack([ro.logits(tr.resid_pre[l][rows].float()).argmax(-1) == final_top
                         for l in range(lm.anatomy.n_layers)])
    assert g.depth.tolist() == depths_from_agreement(agree).tolist()


def test_refusals_are_one_line():
    t5, llama = get_model("tiny:t5"), get_model("tiny:llama")
    cases = [
        (lambda: generate(t5, PREFIX, 2), InputError, "source"),
        (lambda: generate(llama, PREFIX, 2, source=SOURCE), InputError, "encoder-decoder"),
        (lambda: generate(t5, PREFIX, 2, source=SOURCE, sample=True), NotApplicableError, "greedy"),
        (lambda: generate(t5, PREFIX, 2, source=SOURCE, chat=True), NotApplicableError, "chat"),
        (lambda: generate(t5, PREFIX, 2, source=SOURCE, edits=lambda a, b: []), NotApplicableError, "edits"),
        (lambda: generate(t5, PREFIX, 2, source=SOURCE, lens="somewhere"), NotApplicableError, "lens"),
        (lambda: generate(t5, PREFIX, 2, source=[]), InputError, "source"),
    ]
    others = [m for m in table.names() if m not in READERS]
    cases += [(lambda m=m: generate(t5, PREFIX, 2, source=SOURCE, explain=(m,)), NotApplicableError,
               ", ".join(READERS)) for m in others]
    for call, err, word in cases:
        with pytest.raises(err) as e:
            call()
        assert "\n" not in str(e.value) and word in str(e.value), str(e.value)


def test_dict_frame_views_and_file(tmp_path):
    lm = get_model("tiny:bart")
    g = generate(lm, PREFIX, 3, source=SOURCE, explain=TRACE_READERS)
    S = g.n_source
    d = g.to_dict()
    assert d["source"] == SOURCE and d["n_source"] == S and d["source_tokens"] == g.source_tokens
    for i, s in enumerate(d["generated"]):
        for k, m in enumerate(g.methods):
            assert s["explanations"][m]["scores"] == pytest.approx(g.scores[k, i, : S + s["position"]].tolist())
    df = g.to_frame()
    first = df[(df.step == 0) & (df.method == TRACE_READERS[0])]
    assert list(first["part"]) == ["source"] * S + ["target"] * g.prompt_len
    assert list(first["source_token"]) == g.source_tokens + g.tokens[: g.prompt_len]
    for draw in (g.plot, g.to_html):
        with pytest.raises(NotApplicableError):
            draw()
    assert "<table" in g._repr_html_()  # the fields, not the decoder's generation view
    assert "source" in repr(g)
    back = Generation.load(g.save(tmp_path / "g.safetensors"))
    assert_same_computation(back.to_dict(), d, why="saved and read back: the same numbers")
    assert back.n_source == S
    assert_same_ints(back.source_ids, g.source_ids)
    assert_same_ints(back.ids, g.ids)
    assert_same_computation(back.scores, g.scores, why="saved and read back: the same numbers")


def test_decoder_generations_and_old_files_load_without_a_source(tmp_path):
    g = generate(get_model("tiny:llama"), "the cat sat", 2, explain=("logit",))
    assert g.n_source == 0 and g.source is None and g.context_tokens == g.tokens
    d = g.to_dict()
    assert not {"source", "source_tokens", "n_source"} & set(d)  # a decoder's JSON as before
    path = g.save(tmp_path / "new.safetensors")
    with safe_open(str(path), framework="pt") as f:  # a file written before sources: no such fields
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    fields = json.loads(meta["fields"])
    for k in ("source", "source_tokens", "n_source"):
        fields.pop(k)
    assert "source_ids" not in tensors
    save_file(tensors, str(tmp_path / "old.safetensors"), metadata={**meta, "fields": json.dumps(fields)})
    old = Generation.load(tmp_path / "old.safetensors")
    assert old.n_source == 0 and old.source is None
    assert_same_computation(old.to_dict(), d, why="the same generation saved without the source fields")


def test_cli_json_has_the_source_fields():
    r = runner.invoke(app, ["generate", "", "--source", "das Haus", "--model", "tiny:marian", "--max-new-tokens", "4",
                            "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    lm = get_model("tiny:marian")
    src = source_ids(lm, "das Haus")
    assert d["source"] == "das Haus" and d["n_source"] == len(src) == len(d["source_tokens"])
    assert d["methods"] == [table.DEFAULT] and d["prompt_tokens"] == [lm.tokenizer.decode([int(i)])
                                                                      for i in target_prefix_ids(lm, "")]
    ref = generate(lm, "", 4, source="das Haus")
    assert [s["id"] for s in d["generated"]] == ref.ids[ref.prompt_len:].tolist()
    for s in d["generated"]:
        assert len(s["explanations"][table.DEFAULT]["scores"]) == d["n_source"] + s["position"]
    t = runner.invoke(app, ["generate", "the", "--source", "das Haus", "--model", "tiny:t5", "-n", "2", "--explain",
                            "logit"])
    assert t.exit_code == 0, t.output
    assert "source tokens" in t.stdout


@pytest.mark.parametrize("args, word", [
    (["--sample"], "--sample"), (["--chat"], "--chat"), (["--lens", "x"], "--lens"), (["--steer", "x:1"], "--steer"),
    (["--html", "x.html"], "--html"), (["--png", "x.png"], "--png"), (["--explain", "nope"], "nope")])
def test_cli_refusals_are_one_line(args, word):
    r = runner.invoke(app, ["generate", "the", "--source", "das Haus", "--model", "tiny:t5", "-n", "2", *args])
    assert r.exit_code == 2, r.output
    lines = [x for x in r.output.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and word in lines[0], r.output
