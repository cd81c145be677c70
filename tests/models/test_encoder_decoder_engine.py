"""The engine on encoder-decoder models (issue 31; docs/encoder-decoder.md): ``run(lm, target_prefix, source=)``
captures both stacks (the encoder's sites with the prefix ``enc.``, positions over the source) and the decoder's
cross-attention, each capture equal to what the real model computed (read by plain hooks, independent of the
engine's), and edits any of them as it edits a decoder-only model's sites.

Float64 models; the captures are the model's own tensors, and the plain run is called as the engine calls the
model (:func:`_plain`: an all-ones source mask, no cache), so they equal the plain hooks' exactly; the Anatomy's
recomputation (float32 softmax) within the tolerance of ``test_encoder_decoder.py``.
"""

import pytest
import torch

from lenscope.errors import InputError, NotApplicableError
from lenscope.models.loading.load import LoadedModel
from lenscope.models.runtime.engine import Edit, run
from lenscope.models.runtime.trace import trace
from lenscope.models.runtime.verify import verify
from tests.conftest import get_model
from tests.models.test_encoder_decoder import KINDS, Capture, _close, _model, _reader
from tests.tolerances import U32, assert_same_computation, assert_same_ints

SRC = torch.tensor([[5, 17, 33, 8, 60, 2], [7, 7, 41, 90, 3, 2]])
TGT = torch.tensor([[2, 40, 9, 71, 12], [2, 11, 80, 5, 30]])
ENGINE_CALL = "one forward pass, the model called as the engine calls it (_call)"


def _lm(kind):
    model = _model(kind)
    return LoadedModel(model, None, _reader(kind).read(model), kind)


def _call(model, src, tgt):
    """The real model's logits called as the engine calls it (``engine.forward_kwargs``): an all-ones source
    mask and no key/value cache. The same operations as the engine's run: with the model's default
    ``use_cache=True`` the decoder's self-attention reads its keys and values through the cache, another
    layout of the same numbers, which some CPUs' kernels round differently (2e-16..2e-14 here in float64)."""
    return model(input_ids=src, attention_mask=torch.ones_like(src), decoder_input_ids=tgt, use_cache=False).logits


def _plain(model, rows: int = 2):
    """The real model's activations by plain hooks (not the engine's), and its logits, on the first ``rows`` rows
    (the same batch as the engine's run: the kernels may depend on the batch size)."""
    cap = Capture(model)
    with torch.no_grad():
        logits = _call(model, SRC[:rows], TGT[:rows])
    return cap, logits


@pytest.mark.parametrize("kind", KINDS)
def test_captures_of_both_stacks_are_the_models(kind):
    lm = _lm(kind)
    A = lm.anatomy
    cap, logits = _plain(lm.model)
    sites = ["enc.resid_pre.0", "enc.resid_post.1", "enc.pattern.1", "enc.attn_out.0", "enc.resid_mid.1",
             "resid_pre.0", "resid_post.1", "pattern.1", "resid_mid.1", "cross_pattern.0", "cross_pattern.1",
             "cross_out.1", "cross_head.1", "cross_q.0", "cross_k.1", "cross_v.1", "ln_cross.out.1",
             "ln_cross.scale.1", "logits"]
    if A.encoder.final_norm is not None:
        sites.append("enc.ln_final.out")
    r = run(lm, TGT, capture=sites, source=SRC)
    c = r.captured
    assert_same_computation(r.logits, logits, why=ENGINE_CALL)
    assert_same_computation(c["logits"], logits, why=ENGINE_CALL)
    assert_same_computation(c["enc.resid_pre.0"], cap[("enc", "block", 0, "in")], why=ENGINE_CALL)
    assert_same_computation(c["enc.resid_post.1"], cap[("enc", "block", 1, "out")], why=ENGINE_CALL)
    assert_same_computation(c["resid_pre.0"], cap[("dec", "block", 0, "in")], why=ENGINE_CALL)
    assert_same_computation(c["resid_post.1"], cap[("dec", "block", 1, "out")], why=ENGINE_CALL)
    probs = cap.probs_at
    assert_same_computation(c["enc.pattern.1"], cap[("enc", "attn", 1, "out")][probs], why=ENGINE_CALL)
    assert_same_computation(c["pattern.1"], cap[("dec", "attn", 1, "out")][probs], why=ENGINE_CALL)
    assert_same_computation(c["cross_pattern.1"], cap[("dec", "cross", 1, "out")][probs], why=ENGINE_CALL)
    assert_same_computation(c["cross_out.1"], cap[("dec", "cross", 1, "out")][0], why=ENGINE_CALL)
    B, P, S = TGT.shape + (SRC.shape[1],)
    H, dh = A.layers[1].cross.n_heads, A.layers[1].cross.d_head
    assert c["cross_pattern.0"].shape == (B, H, P, S) and c["enc.pattern.1"].shape == (B, H, S, S)
    assert c["cross_head.1"].shape == (B, P, H, dh) and c["cross_q.0"].shape == (B, P, H, dh)
    assert c["cross_k.1"].shape == c["cross_v.1"].shape == (B, S, H, dh)
    assert c["ln_cross.scale.1"].shape == (B, P) and c["enc.resid_mid.1"].shape == (B, S, A.d_model)
    memory = cap[("enc", "final", "out")]
    if A.encoder.final_norm is not None:
        assert_same_computation(c["enc.ln_final.out"], memory, why=ENGINE_CALL)
    # the Anatomy's recomputation of each block from the captured input agrees with the captures
    for b in range(B):
        e = A.encoder.layers[1].forward(cap[("enc", "block", 1, "in")][b], torch.arange(S))
        _close(c["enc.resid_mid.1"][b], e["resid_mid"], "enc resid_mid")
        d = A.layers[1].forward(cap[("dec", "block", 1, "in")][b], torch.arange(P), memory=memory[b])
        _close(c["resid_mid.1"][b], d["resid_mid"], "dec resid_mid")
        cross = A.layers[1].cross
        b_O = 0 if cross.b_O is None else cross.b_O
        _close(c["cross_head.1"][b].flatten(-2) @ cross.W_O.flatten(0, 1) + b_O, d["cross_out"],
               "cross heads through the output projection")
        ln = A.layers[1].ln_cross
        _close(c["ln_cross.out.1"][b], d["resid_cross"] if A.layers[1].placement == "post" else d["cross_in"],
               "ln_cross out")
        _close(c["ln_cross.scale.1"][b], ln.scale(_ln_cross_in(A.layers[1], d)), "ln_cross scale")


def _ln_cross_in(layer, r):
    """The input of a block's cross-attention norm, from the block's recomputation."""
    if layer.placement == "post":
        return r["resid_mid"] + r["cross_write"]
    return r["resid_mid"]


@pytest.mark.parametrize("kind", ["bart", "t5"])
def test_edits_on_both_stacks_change_the_run_as_a_hook_would(kind):
    """An edit of an encoder site, of a cross-attention head and of cross-attention's keys gives the logits of the
    real model with that change made by a plain hook."""
    lm = _lm(kind)
    model = lm.model
    g = torch.Generator().manual_seed(3)
    d, H = lm.anatomy.d_model, lm.anatomy.layers[0].cross.n_heads
    dh = lm.anatomy.layers[0].cross.d_head
    add = torch.randn(d, generator=g, dtype=torch.float64)
    head_v = torch.randn(dh, generator=g, dtype=torch.float64)
    edits = [Edit("enc.resid_post", 0, torch.tensor([1]), torch.tensor([2]), add[None], mode="add"),
             Edit("cross_head", 1, torch.tensor([0]), torch.tensor([3]), head_v[None], head=torch.tensor([2])),
             Edit("cross_k", 0, torch.tensor([0, 1]), torch.tensor([4, 0]), torch.tensor(0.5),
                  head=torch.tensor([1, 3]), mode="scale")]
    got = run(lm, TGT, edits, source=SRC).logits

    H_ = _reader(kind).hooks(model)
    handles = []

    def enc_post(mod, args, out):
        x = (out[0] if isinstance(out, tuple) else out).clone()
        x[1, 2] += add
        return (x,) + tuple(out[1:]) if isinstance(out, tuple) else x

    def head_pre(mod, args):
        x = args[0].clone().view(2, 5, H, dh)
        x[0, 3, 2] = head_v
        return (x.view(args[0].shape),) + tuple(args[1:])

    def k_post(mod, args, out):
        x = out.clone().view(2, SRC.shape[1], H, dh)
        x[0, 4, 1] *= 0.5
        x[1, 0, 3] *= 0.5
        return x.view(out.shape)

    handles.append(H_.encoder.layers[0].block.register_forward_hook(enc_post))
    handles.append(H_.layers[1].cross_out.register_forward_pre_hook(head_pre))
    handles.append(H_.layers[0].cross_k.register_forward_hook(k_post))
    try:
        with torch.no_grad():
            want = _call(model, SRC, TGT)
    finally:
        for h in handles:
            h.remove()
    plain = run(lm, TGT, source=SRC).logits
    assert_same_computation(got, want, why="the same edits on one forward, by the engine's hooks and by plain ones")
    assert float((got - plain).abs().max()) > 1e-3  # the edits changed the run


@pytest.mark.parametrize("kind", ["marian", "t5-gated"])
def test_gradients_reach_the_encoder_and_cross_attention_captures(kind):
    lm = _lm(kind)
    r = run(lm, TGT, capture=["enc.resid_pre.0", "cross_out.1"], source=SRC, grad=True)
    enc, cross = (r.captured[k] for k in ("enc.resid_pre.0", "cross_out.1"))
    g_enc, g_cross = torch.autograd.grad(r.logits[0, -1, 7], [enc, cross])
    assert float(g_enc[0].abs().min(-1).values.min()) > 0  # every source position of row 0 reaches the logit
    assert float(g_enc[1].abs().max()) == 0 and float(g_cross[1].abs().max()) == 0  # row 1 does not
    # the last block's cross-attention reaches the logit at its own position only
    assert float(g_cross[0, -1].abs().sum()) > 0 and float(g_cross[0, :-1].abs().max()) == 0


@pytest.mark.parametrize("kind", KINDS)
def test_the_trace_holds_both_stacks(kind):
    """``trace(lm, target_prefix, source=)``: the decoder's Trace with its cross-attention, and the encoder's Trace
    (``Trace.encoder``), each field the real model's (plain hooks), the memory what cross-attention read."""
    lm = _lm(kind)
    A = lm.anatomy
    cap, logits = _plain(lm.model, rows=1)
    tr = trace(lm, TGT[0], source=SRC[0])
    enc = tr.encoder
    assert enc is not None and enc.encoder is None and tr.memory is not None and enc.memory is None
    assert enc.tokens == [f"#{i}" for i in SRC[0].tolist()]
    assert_same_ints(enc.input_ids, SRC[0])
    assert "encoder=Trace(pos=6, layers=2" in repr(tr)
    probs = cap.probs_at
    for i in range(2):
        assert_same_computation(enc.resid_pre[i], cap[("enc", "block", i, "in")][0], why=ENGINE_CALL)
        assert_same_computation(enc.resid_post[i], cap[("enc", "block", i, "out")][0], why=ENGINE_CALL)
        assert_same_computation(enc.pattern[i], cap[("enc", "attn", i, "out")][probs][0], why=ENGINE_CALL)
        assert_same_computation(tr.resid_pre[i], cap[("dec", "block", i, "in")][0], why=ENGINE_CALL)
        assert_same_computation(tr.pattern[i], cap[("dec", "attn", i, "out")][probs][0], why=ENGINE_CALL)
        assert_same_computation(tr.cross_pattern[i], cap[("dec", "cross", i, "out")][probs][0], why=ENGINE_CALL)
        assert_same_computation(tr.cross_out[i], cap[("dec", "cross", i, "out")][0][0], why=ENGINE_CALL)
    assert_same_computation(tr.memory, cap[("enc", "final", "out")][0], why=ENGINE_CALL)
    # one row against a two-row batch: the kernels may differ with the batch size, so not bit for bit
    _close(tr.logits, logits[0], "logits")
    assert enc.logits is None
    assert_same_computation(tr.cross_write, tr.cross_out,
                            why="cross_out copied: no sandwich norm, no residual multiplier")
    assert_same_computation(tr.site("enc.resid_post", 1), enc.resid_post[1],
                            why="the same tensor, looked up by its name")
    assert_same_computation(tr.site("cross_pattern.0"), tr.cross_pattern[0],
                            why="the same tensor, looked up by its name")
    if A.placement == "pre":  # T5: the residual stream is the sum of the three writes
        torch.testing.assert_close(tr.resid_post, tr.resid_pre + tr.attn_write + tr.cross_write + tr.mlp_write,
                                   rtol=0, atol=1e-12)
    else:  # BART, Marian (Post-LN): the MLP's norm reads the state after cross-attention
        assert_same_computation(tr.site("ln_mlp.in"), tr.site("ln_cross.out") + tr.mlp_out,
                                why="one elementwise addition of the same two tensors, as the model's residual")


@pytest.mark.parametrize("kind", KINDS)
def test_verify_checks_both_stacks_and_cross_attention(kind):
    """``verify`` recomputes every block of both stacks, the decoder's cross-attention from what it read and the
    encoder's output, and the logits; a wrong reading of one cross-attention fails it."""
    lm = _lm(kind)
    rep = verify(lm, TGT[0], source=SRC[0])
    assert rep.ok, rep
    assert len(rep.layers) == 2 and len(rep.encoder["layers"]) == 2
    assert all("cross_out" in r and "cross_pattern" in r and "ln_cross" in r for r in rep.layers)
    assert not any("cross_out" in r for r in rep.encoder["layers"])
    assert (rep.encoder["final_norm"] is None) == (lm.anatomy.encoder.final_norm is None)
    # float64 models; T5's norms and lenscope's softmax round in float32 (test_encoder_decoder.py): a few float32
    # units relative to each tensor's size (RMS for the sub-layers, a logit's scale for the logits)
    logit_scale = float(run(lm, TGT[:1], source=SRC[:1]).logits.abs().max())
    assert rep.max_abs_logit_error <= 64 * U32 * logit_scale and rep.max_rel_sublayer_error <= 64 * U32
    cross = lm.anatomy.layers[1].cross
    cross.W_O = cross.W_O * 1.01  # a reading 1% off
    bad = verify(lm, TGT[0], source=SRC[0])
    assert not bad.ok and bad.layers[1]["cross_out"] > 1e-3 and bad.layers[0]["cross_out"] < 1e-5


def _seq2seq_tokenizer(template: str):
    """The tiny tokenizer writing each text as ``template`` (``"$A </s>"``: T5, Marian; ``"<s> $A </s>"``: BART)."""
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    from lenscope.models.loading.tokenizer import tiny_tokenizer

    tok = Tokenizer.from_str(tiny_tokenizer().backend_tokenizer.to_str())
    special = [(t, tok.token_to_id(t)) for t in ("<s>", "</s>") if t in template]
    tok.post_processor = processors.TemplateProcessing(single=template, special_tokens=special)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>", bos_token="<s>")


@pytest.mark.parametrize(("kind", "template"), [("t5", "$A </s>"), ("bart", "<s> $A </s>")])
def test_texts_become_the_source_and_the_decoders_shifted_target_prefix(kind, template):
    """A target prefix is the decoder's start token, then the target as the tokenizer writes a target, without its
    end token (transformers' labels shifted right); the source keeps its special tokens; an empty prefix is the
    start token and what the tokenizer puts before a target's text (BART's ``<s>``), as in the shifted labels (the
    first target token is then predicted)."""
    from lenscope.models.loading.load import encode
    from lenscope.models.runtime.trace import source_ids

    lm = _lm(kind)
    tok = _seq2seq_tokenizer(template)
    lm.tokenizer = tok
    start = lm.model.config.decoder_start_token_id
    body = tok("the house is small", add_special_tokens=False)["input_ids"]
    lead = [tok.bos_token_id] if template.startswith("<s>") else []
    assert_same_ints(encode(lm, "the house is small"), [start] + lead + body)
    assert_same_ints(encode(lm, ""), [start] + lead)
    assert_same_ints(source_ids(lm, "the house is small"), lead + body + [tok.eos_token_id])


def test_one_line_errors():
    lm = _lm("bart")
    with pytest.raises(InputError, match="encoder-decoder model: run it with the source"):
        run(lm, TGT)
    with pytest.raises(InputError, match="same 2 rows"):
        run(lm, TGT, source=SRC[:1])
    with pytest.raises(InputError, match="capture at block 2 of a 2-block encoder"):
        run(lm, TGT, capture=["enc.resid_post.2"], source=SRC)
    with pytest.raises(NotApplicableError, match="can be captured but not edited"):
        run(lm, TGT, [Edit("cross_pattern", 0, torch.tensor([0]), torch.tensor([0]), torch.zeros(1, 6))],
            source=SRC)
    with pytest.raises(InputError, match="unknown site 'enc.cross_out'"):
        run(lm, TGT, capture=["enc.cross_out.0"], source=SRC)
    with pytest.raises(NotApplicableError, match="no final norm .*'enc.ln_final'"):
        run(lm, TGT, capture=["enc.ln_final.out"], source=SRC)
    with pytest.raises(InputError, match="source token ids must lie in 0..95"):
        trace(lm, TGT[0], source=[3, 400])
    dec = get_model("tiny:llama")
    ids = torch.tensor([[1, 5, 9]])
    with pytest.raises(InputError, match="llama has none"):
        run(dec, ids, source=ids)
    with pytest.raises(InputError, match="llama has none"):
        trace(dec, ids[0], source=ids[0])
    with pytest.raises(NotApplicableError, match="exist only in encoder-decoder models"):
        run(dec, ids, capture=["enc.resid_post.0"])
    with pytest.raises(NotApplicableError, match="exists only in the decoder blocks of an encoder-decoder model"):
        run(dec, ids, capture=["cross_out.0"])
