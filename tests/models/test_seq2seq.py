"""Encoder-decoder families as lenscope loads them (issues 31, 47; docs/encoder-decoder.md): every tiny
encoder-decoder model (BART, Marian, mBART, M2M-100, Pegasus, T5, gated T5) loads, verifies (API and CLI, with
``--source``), and is listed by ``lenscope models``; direct logit attribution with cross-attention components is
complete on each (through the Post-LN BART and Marian blocks too, each write read along the direction carried back
to it); translation tokenizers' language codes start the target prefix; every method that does not read them yet
refuses with one line.

Float32 models: a decomposition's sum differs from the model's logit by float32 rounding of the terms summed
(``SUMS * U32`` times their sizes), while a part left out or read along the wrong direction is off by a part.
"""

import json

import pytest
import torch
from typer.testing import CliRunner

import lenscope
from lenscope.attribution.dla import direct_logit_attribution
from lenscope.cli import app
from lenscope.errors import NotApplicableError
from lenscope.models.runtime.verify import verify
from tests.conftest import SEQ2SEQ, get_model
from tests.tolerances import U32, assert_same_computation, assert_same_ints

SOURCE = "das Haus ist klein und alt"
PREFIX = "the house is"
SUMS = 64  # float32 roundings on the way to each component and through the sum (a few dozen terms)


def test_the_encoder_decoder_families_are_registered():
    assert SEQ2SEQ == ["bart", "m2m100", "marian", "mbart", "pegasus", "t5", "t5-gated"]
    r = CliRunner().invoke(app, ["models", "--json"])
    fams = {f["family"]: f for f in json.loads(r.stdout) if f["kind"] == "family"}
    for name, types in (("bart", ["bart", "marian", "mbart", "m2m_100", "pegasus"]), ("t5", ["t5"])):
        f = fams[name]
        assert f["architecture"] == "encoder-decoder" and f["model_types"] == types
        assert "cross-attention" in f["attention"] and f["description"].startswith("encoder-decoder family")
    assert fams["bart"]["block"] == ["post", "pre"] and fams["t5"]["block"] == ["pre"]  # BART / mBART
    assert "relative position bias" in fams["t5"]["attention"] and "learned positions" in fams["bart"]["attention"]


@pytest.mark.parametrize("name", SEQ2SEQ)
def test_verify_checks_both_stacks(name):
    lm = get_model(f"tiny:{name}")
    rep = verify(lm, PREFIX, source=SOURCE)
    assert rep.ok and len(rep.layers) == 2 and len(rep.encoder["layers"]) == 2
    assert all("cross_out" in r and "cross_pattern" in r for r in rep.layers)
    again = verify(lm, PREFIX)  # without a source the text is both
    assert again.ok and again.encoder is not None and again.n_tokens == rep.n_tokens


@pytest.mark.parametrize("name", ["bart", "t5"])
def test_verify_cli_with_a_source(name):
    r = CliRunner().invoke(app, ["verify", "--model", f"tiny:{name}", "--text", PREFIX, "--source", SOURCE, "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["ok"] is True and d["family"] == name and len(d["encoder"]["layers"]) == 2
    assert d["n_tokens"] == len(lm_prefix(name))


def lm_prefix(name):
    from lenscope.models.loading.load import encode

    return encode(get_model(f"tiny:{name}"), PREFIX).tolist()


def _tol(res) -> float:
    return SUMS * U32 * (float(res.values.abs().sum()) + abs(res.logit))


@pytest.mark.parametrize("name", SEQ2SEQ)
def test_direct_logit_attribution_is_complete_with_cross_attention(name):
    lm = get_model(f"tiny:{name}")
    whole = direct_logit_attribution(lm, PREFIX, " the", " a", source=SOURCE)
    heads = direct_logit_attribution(lm, PREFIX, " the", " a", source=SOURCE, by_head=True)
    for res in (whole, heads):
        assert res.completeness_error <= _tol(res), res
    assert [n for n in whole.names if n.startswith("L1.")] == ["L1.attn", "L1.cross", "L1.mlp"]
    v = dict(zip(whole.names, whole.values.tolist()))
    hv = dict(zip(heads.names, heads.values.tolist()))
    for l in range(2):  # each layer's heads and output bias add up to its write, self- and cross-attention alike
        for kind, head, bias in (("attn", "H", "attn_bias"), ("cross", "cross.H", "cross_bias")):
            split = sum(hv[f"L{l}.{head}{h}"] for h in range(4)) + hv[f"L{l}.{bias}"]
            assert abs(split - v[f"L{l}.{kind}"]) <= _tol(heads), (l, kind)
    # the logit is the model's own (its logits at the last target-prefix position)
    from lenscope.models.loading.load import encode
    from lenscope.models.runtime.trace import source_ids

    lm_ids = encode(lm, PREFIX)
    with torch.no_grad():
        out = lm.model(input_ids=source_ids(lm, SOURCE)[None], decoder_input_ids=lm_ids[None]).logits[0, -1]
    t, f = heads.target_id, heads.foil_id
    assert abs(float(out[t] - out[f]) - heads.logit) <= 8 * U32 * float(out.abs().max())


def test_post_ln_writes_are_read_along_their_own_directions():
    """BART's blocks normalise the whole stream after each sub-layer: reading every write along the final direction
    (as for a Pre-LN model) does not add up to the logit; along the pulled-back directions it does."""
    from lenscope.models.runtime.trace import trace
    from lenscope.models.weights.readout import Readout

    lm = get_model("tiny:bart")
    res = direct_logit_attribution(lm, PREFIX, " the", " a", source=SOURCE)
    tr = trace(lm, PREFIX, source=SOURCE)
    u = Readout.from_anatomy(lm.anatomy).direction(res.target_id, res.foil_id)
    flat = float(sum((tr.attn_write[l][-1] + tr.cross_write[l][-1] + tr.mlp_write[l][-1]) @ u for l in range(2)))
    flat += float(tr.embed[-1] @ u)
    assert abs(flat - res.logit) > 100 * _tol(res) and res.completeness_error <= _tol(res)


def test_the_cli_components_takes_a_source():
    r = CliRunner().invoke(app, ["components", PREFIX, "--model", "tiny:marian", "--source", SOURCE, "--target",
                                 " the", "--by-head", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    names = [c["name"] for c in d["components"]]
    assert "L0.cross.H3" in names and "L1.cross_bias" in names and "pos_embed" in names
    assert abs(d["sum"] - d["logit"]) == pytest.approx(d["completeness_error"], abs=1e-6)


@pytest.mark.parametrize("args", [
    ["components", PREFIX, "--target", " the"],  # no source
    ["explain", PREFIX, "--method", "alti-logit", "--target", " the"],  # no source
    ["mixing", PREFIX],
    ["patch", PREFIX, "the mouse is", "--target", " the", "--foil", " a"],
    ["neurons", PREFIX, "--target", " the"],
    ["generate", PREFIX, "-n", "2"],
])
def test_what_does_not_read_encoder_decoder_models_says_so_in_one_line(args):
    r = CliRunner().invoke(app, args + ["--model", "tiny:t5"])
    err = r.stderr.strip().splitlines()
    assert r.exit_code == 2 and len(err) >= 1 and err[-1].startswith("error: "), r.output
    assert "encoder-decoder" in err[-1] and "Traceback" not in r.output


def test_a_method_refuses_an_encoder_decoder_model_given_a_trace():
    """What does not read encoder-decoder models refuses one even with a trace holding the source; the rollouts,
    which read one, explain the trace as they explain the source."""
    from lenscope.attribution import methods as table
    from lenscope.mixing.maps import context_mixing
    from lenscope.models.runtime.trace import trace

    lm = get_model("tiny:bart")
    tr = trace(lm, PREFIX, source=SOURCE)
    for method in ("alti", "value-zeroing"):
        got, want = lenscope.explain(lm, tr=tr, method=method), lenscope.explain(lm, PREFIX, method=method,
                                                                                   source=SOURCE)
        assert got.n_source == want.n_source
        assert_same_computation(got.scores, want.scores, why="the same trace of the same texts, the same operations")
    with pytest.raises(NotApplicableError, match="context-mixing maps .* would leave out the source"):
        context_mixing(lm, tr=tr)
    one = table.register(table.Method("one-stack", table.get("alti").explain))  # a method that reads no source
    try:
        with pytest.raises(NotApplicableError, match="--method one-stack does not read encoder-decoder models yet.*"
                                                     "logit, alti-logit, alti, grad-norm"):
            lenscope.explain(lm, PREFIX, method=one.name, source=SOURCE)
    finally:
        table.unregister(one.name)


@pytest.mark.parametrize("name", SEQ2SEQ)
def test_the_logit_explanation_splits_into_source_and_target_prefix(name):
    """Logit (Ferrando et al. 2023, Eq. 8-9) of an encoder-decoder model: one score per source token (through the
    cross-attention) and per target-prefix token (through the self-attention); per layer the scores and the
    remainder add up to the attention updates, and the updates, MLP updates, embedding and constant to the model's
    logit difference; each head's source and prefix parts equal its direct logit attribution (cross and self)."""
    from lenscope.models.runtime.trace import source_ids

    lm = get_model(f"tiny:{name}")
    e = lenscope.explain(lm, PREFIX, " the", " a", method="logit", source=SOURCE, position=-2)
    n_src = len(source_ids(lm, SOURCE))
    n_tgt = len(lm_prefix(name))
    assert e.n_source == n_src and len(e.tokens) == n_src + n_tgt and e.position == n_src + n_tgt - 2
    assert e.scores.shape == (n_src + n_tgt,) and e.head_scores.shape == (2, 4, n_src + n_tgt)
    assert float(e.target_scores[-1:].abs().max()) == 0.0  # causal: the prediction at -2 reads no later token
    size = float(e.head_scores.abs().sum()) + float(e.attention_update.abs().sum()) + abs(e.info["logit"])
    tol = SUMS * U32 * size
    assert e.invariant_error <= 1e-5 and e.info["completeness_error"] <= tol
    gap = e.layer_scores.sum(-1) + e.remainder - e.attention_update
    assert float(gap.abs().max()) <= tol
    heads = direct_logit_attribution(lm, PREFIX, " the", " a", source=SOURCE, by_head=True, position=-2)
    hv = dict(zip(heads.names, heads.values.tolist()))
    for l in range(2):
        for h in range(4):
            assert abs(float(e.head_scores[l, h, :n_src].sum()) - hv[f"L{l}.cross.H{h}"]) <= tol, (l, h)
            assert abs(float(e.head_scores[l, h, n_src:].sum()) - hv[f"L{l}.H{h}"]) <= tol, (l, h)
    assert abs(e.info["logit"] - heads.logit) <= tol
    df = e.to_frame()
    assert list(df["part"]) == ["source"] * n_src + ["target"] * n_tgt
    assert e.to_dict()["n_source"] == n_src


def test_a_seq2seq_explanation_saves_and_loads(tmp_path):
    lm = get_model("tiny:t5")
    e = lenscope.explain(lm, PREFIX, " the", method="logit", source=SOURCE)
    e.save(tmp_path / "e.safetensors")
    back = type(e).load(tmp_path / "e.safetensors")
    assert back.n_source == e.n_source and back.tokens == e.tokens
    assert_same_computation(back.scores, e.scores, why="saved and read back")
    assert_same_computation(back.source_scores, e.source_scores, why="saved and read back")


def test_the_cli_explains_with_a_source():
    r = CliRunner().invoke(app, ["explain", PREFIX, "--model", "tiny:bart", "--source", SOURCE, "--method", "logit",
                                 "--target", " the", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["n_source"] > 0 and len(d["scores"]) == len(d["tokens"]) and d["method"] == "logit"
    r = CliRunner().invoke(app, ["explain", PREFIX, "--model", "tiny:llama", "--source", SOURCE, "--method", "logit",
                                 "--target", " the"])
    assert r.exit_code == 2 and "has none" in r.stderr


def _variant(name: str):
    """Encoder-decoder models of other shapes than the tiny ones: stacks of different depths, heads and widths
    (T5's ``d_kv`` apart from ``d_model / heads``), T5 v1.1 (gated, untied), BART without embedding scale and with
    ReLU, Marian with separate embeddings; the Pre-LN layouts: mBART untied with ReLU and no embedding scale,
    M2M-100 whose padding token is not id 1 (its positions start at ``padding_idx + 1``: here row 5, not BART's 2),
    Pegasus with GELU and a deeper encoder."""
    from transformers import BartConfig, M2M100Config, MarianConfig, MBartConfig, PegasusConfig, T5Config

    from lenscope.models.families import family_for
    from lenscope.models.loading.load import LoadedModel, random_model
    from lenscope.models.loading.tokenizer import tiny_special_ids, tiny_tokenizer

    tok = tiny_special_ids()
    ids = dict(vocab_size=tok["vocab_size"], pad_token_id=tok["pad"], eos_token_id=tok["eos"])
    cfg = {
        "t5-deep-encoder": lambda: T5Config(**ids, d_model=48, d_kv=8, d_ff=96, num_layers=3, num_decoder_layers=1,
                                            num_heads=3, relative_attention_num_buckets=16,
                                            relative_attention_max_distance=32, decoder_start_token_id=tok["pad"]),
        "t5-v1.1": lambda: T5Config(**ids, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_decoder_layers=3,
                                    num_heads=6, feed_forward_proj="gated-gelu", tie_word_embeddings=False,
                                    decoder_start_token_id=tok["pad"]),
        "bart-relu": lambda: BartConfig(**ids, d_model=48, encoder_layers=3, decoder_layers=1,
                                        encoder_attention_heads=6, decoder_attention_heads=2, encoder_ffn_dim=64,
                                        decoder_ffn_dim=80, max_position_embeddings=64, bos_token_id=tok["bos"],
                                        decoder_start_token_id=tok["eos"], forced_eos_token_id=None,
                                        activation_function="relu", scale_embedding=False),
        "marian-untied": lambda: MarianConfig(**ids, d_model=32, encoder_layers=1, decoder_layers=3,
                                              encoder_attention_heads=4, decoder_attention_heads=2,
                                              encoder_ffn_dim=48, decoder_ffn_dim=64, max_position_embeddings=64,
                                              decoder_start_token_id=tok["pad"], tie_word_embeddings=False,
                                              share_encoder_decoder_embeddings=False),
        "mbart-relu-untied": lambda: MBartConfig(**ids, d_model=48, encoder_layers=1, decoder_layers=3,
                                                 encoder_attention_heads=3, decoder_attention_heads=6,
                                                 encoder_ffn_dim=64, decoder_ffn_dim=80, max_position_embeddings=64,
                                                 decoder_start_token_id=tok["eos"], forced_eos_token_id=None,
                                                 activation_function="relu", scale_embedding=False,
                                                 tie_word_embeddings=False),
        "m2m100-padding-4": lambda: M2M100Config(**(ids | {"pad_token_id": 4}), d_model=32, encoder_layers=2,
                                                 decoder_layers=2, encoder_attention_heads=2,
                                                 decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48,
                                                 max_position_embeddings=64, decoder_start_token_id=tok["eos"],
                                                 activation_function="gelu"),
        "pegasus-deep-encoder": lambda: PegasusConfig(**ids, d_model=32, encoder_layers=3, decoder_layers=1,
                                                      encoder_attention_heads=4, decoder_attention_heads=2,
                                                      encoder_ffn_dim=64, decoder_ffn_dim=48,
                                                      max_position_embeddings=64, scale_embedding=True,
                                                      decoder_start_token_id=tok["pad"], forced_eos_token_id=None),
    }[name]()
    model = random_model(cfg, kind="encoder-decoder").eval()
    return LoadedModel(model=model, tokenizer=tiny_tokenizer(kind="encoder-decoder"),
                       anatomy=family_for(model).read(model), name=name)


@pytest.mark.parametrize("name", ["t5-deep-encoder", "t5-v1.1", "bart-relu", "marian-untied", "mbart-relu-untied",
                                  "m2m100-padding-4", "pegasus-deep-encoder"])
def test_other_shapes_verify_and_decompose_exactly(name):
    lm = _variant(name)
    assert verify(lm, PREFIX, source=SOURCE).ok
    d = direct_logit_attribution(lm, PREFIX, " the", " a", source=SOURCE, by_head=True)
    assert d.completeness_error <= _tol(d)
    heads = lm.anatomy.layers[0].cross.n_heads
    assert sum(n.startswith("L0.cross.H") for n in d.names) == heads
    e = lenscope.explain(lm, PREFIX, " the", " a", method="logit", source=SOURCE)
    size = float(e.head_scores.abs().sum()) + float(e.attention_update.abs().sum()) + abs(e.info["logit"])
    assert e.invariant_error <= 1e-5 and e.info["completeness_error"] <= SUMS * U32 * size
    assert e.head_scores.shape[:2] == (lm.anatomy.n_layers, heads)


@pytest.mark.parametrize("kind", ["prophetnet", "bart-pre-ln"])
def test_an_encoder_decoder_model_lenscope_does_not_read_is_refused_in_one_line(tmp_path, kind):
    """A saved folder of an encoder-decoder type no family reads (ProphetNet), and a BART config asking for Pre-LN
    blocks (``normalize_before``, which transformers' BART does not run: an mBART model is the Pre-LN layout)."""
    from transformers import AutoModelForSeq2SeqLM, BartConfig, ProphetNetConfig

    from lenscope.errors import UnsupportedModelError
    from lenscope.models.loading.tokenizer import tiny_special_ids, tiny_tokenizer

    tok = tiny_special_ids()
    if kind == "prophetnet":
        cfg = ProphetNetConfig(vocab_size=tok["vocab_size"], hidden_size=16, encoder_ffn_dim=32, decoder_ffn_dim=32,
                               num_encoder_layers=1, num_decoder_layers=1, num_encoder_attention_heads=2,
                               num_decoder_attention_heads=2)
    else:
        cfg = BartConfig(vocab_size=tok["vocab_size"], d_model=16, encoder_layers=1, decoder_layers=1,
                         encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                         decoder_ffn_dim=32, normalize_before=True)
    AutoModelForSeq2SeqLM.from_config(cfg).save_pretrained(tmp_path)
    tiny_tokenizer(kind="encoder-decoder").save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError) as e:
        lenscope.load(str(tmp_path))
    msg = str(e.value)
    assert len(msg.splitlines()) == 1
    assert ("model type 'prophetnet'" in msg if kind == "prophetnet" else "normalize_before=True" in msg), msg


def _lang_tokenizer(kind: str):
    """A transformers translation tokenizer with language codes (its own class, a character vocabulary): NLLB's
    (``[<src_lang>] text </s>``, targets ``[<tgt_lang>] text </s>``), mBART-50's (the same form) or mBART-cc25's
    (``text </s> [<lang>]``)."""
    from transformers import MBart50Tokenizer, MBartTokenizer, NllbTokenizer

    chars = sorted(set(SOURCE + PREFIX) - {" "})
    if kind == "nllb":
        vocab = {t: i for i, t in enumerate(["<s>", "<pad>", "</s>", "<unk>", "▁", *chars])}
        return NllbTokenizer(vocab=vocab, merges=[], src_lang="deu_Latn", tgt_lang="eng_Latn"), "eng_Latn"
    vocab = [(t, 0.0) for t in ["<s>", "<pad>", "</s>", "<unk>"]] + [(t, -1.0) for t in ["▁", *chars]]
    if kind == "mbart-50":
        return MBart50Tokenizer(vocab=vocab, src_lang="de_DE", tgt_lang="en_XX"), "en_XX"
    return MBartTokenizer(vocab=vocab, src_lang="de_DE", tgt_lang="en_XX"), "en_XX"


@pytest.mark.parametrize("kind", ["nllb", "mbart-50", "mbart-cc25"])
def test_language_codes_start_the_target_prefix(tmp_path, kind):
    """A folder of an M2M-100 (NLLB) or mBART model with its tokenizer's languages: the source starts with (cc25:
    ends with) the source language's code, the decoder reads its start token then the target language's code before
    the prefix (mBART-cc25: the code alone first, mBART's shift of its ``text </s> <lang>`` labels), an empty
    prefix too; verify and the Logit explanation run on it, the code one of the target-prefix tokens."""
    from transformers import M2M100Config, MBartConfig

    from lenscope.models.loading.load import encode, random_model
    from lenscope.models.runtime.trace import source_ids

    tok, lang = _lang_tokenizer(kind)
    code = tok.convert_tokens_to_ids(lang)
    ids = dict(vocab_size=len(tok), bos_token_id=0, pad_token_id=1, eos_token_id=2, decoder_start_token_id=2,
               d_model=32, encoder_layers=1, decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
               encoder_ffn_dim=48, decoder_ffn_dim=48, max_position_embeddings=64)
    cfg = M2M100Config(**ids) if kind == "nllb" else MBartConfig(**ids, forced_eos_token_id=None)
    random_model(cfg, kind="encoder-decoder").save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    lm = lenscope.load(str(tmp_path))
    body = tok(PREFIX, add_special_tokens=False)["input_ids"]
    want = [code] + body if kind == "mbart-cc25" else [2, code] + body
    assert_same_ints(encode(lm, PREFIX), want)
    assert_same_ints(encode(lm, ""), want[: len(want) - len(body)])
    src = source_ids(lm, SOURCE).tolist()
    src_code = tok.convert_tokens_to_ids("deu_Latn" if kind == "nllb" else "de_DE")
    assert (src[-1] if kind == "mbart-cc25" else src[0]) == src_code and 2 in src
    assert verify(lm, PREFIX, source=SOURCE).ok
    e = lenscope.explain(lm, PREFIX, tok.convert_tokens_to_ids("h"), method="logit", source=SOURCE)
    assert e.tokens[e.n_source + want.index(code)] == lang
    size = float(e.head_scores.abs().sum()) + float(e.attention_update.abs().sum()) + abs(e.info["logit"])
    assert e.invariant_error <= 1e-5 and e.info["completeness_error"] <= SUMS * U32 * size
