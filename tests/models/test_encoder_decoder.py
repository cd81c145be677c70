"""Encoder-decoder models (issues 31, 47; docs/encoder-decoder.md): the readers' Anatomy of every tiny
encoder-decoder model (BART, Marian, mBART, M2M-100, Pegasus, T5, gated T5) recomputes every block of the real
model, encoder and decoder (self-attention, cross-attention over the encoder's output, MLP, the norms, the final
norms; T5's relative position bias), the embeddings and the logits.

The models run in float64 and so does lenscope's math, except its attention softmax, which lenscope takes in
float32 (``Attention.probs``): the two evaluations then differ by the float32 rounding of the probabilities, a few
units ``u = 2^-24`` relative to each activation's size (everything else rounds in float64, 1e-16), while any mistake
in reading the model (a bias, a norm, a scale, an offset; the random weights below make every one of them matter)
moves the results by 1e-3 or more. The bound used, 16 u relative to each activation's largest entry (measured: at
most a few u), lies between the two.
"""

import pytest
import torch

from lenscope.models.families import bart, tiny_names
from tests.conftest import SEQ2SEQ
from tests.tolerances import U32, assert_same_computation, assert_same_ints

TOK = {"vocab_size": 96, "bos": 0, "pad": 1, "eos": 2}
REL = 16 * U32


KINDS = SEQ2SEQ  # every registered encoder-decoder tiny model


def _reader(kind: str):
    """The family of a tiny name (its ``read``, ``hooks`` and ``tiny`` configs)."""
    return tiny_names()[kind]


def _model(kind: str):
    from transformers import AutoModelForSeq2SeqLM

    torch.manual_seed(0)
    cfg = _reader(kind).tiny[kind](TOK)
    model = AutoModelForSeq2SeqLM.from_config(cfg, attn_implementation="eager").double().eval()
    with torch.no_grad():  # every norm, bias and the logits' bias away from their initial 1 / 0
        g = torch.Generator().manual_seed(1)
        for name, p in model.named_parameters():
            if "layer_norm" in name or "layernorm" in name or name.endswith("bias"):
                base = 1.0 if name.endswith("weight") else 0.0
                p.copy_(base + 0.2 * torch.randn(p.shape, generator=g, dtype=p.dtype))
            if "relative_attention_bias" in name:  # T5's bias per bucket and head: large enough to matter
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype))
        if hasattr(model, "final_logits_bias"):
            model.final_logits_bias.copy_(torch.randn(model.final_logits_bias.shape, generator=g,
                                                      dtype=torch.float64))
    return model


def _close(got, want, what):
    err = float((got - want).abs().max())
    scale = float(want.abs().max())
    assert err <= REL * scale, f"{what}: max error {err:.3g}, scale {scale:.3g}"


def _modules(model, side: str):
    """``(block, self-attention, cross-attention or None)`` of each block of one stack, the index of the attention
    probabilities in an attention module's output, and the module whose output is the stack's output."""
    stack = model.get_encoder() if side == "enc" else model.get_decoder()
    if hasattr(stack, "block"):  # T5
        return ([(b, b.layer[0].SelfAttention, b.layer[1].EncDecAttention if side == "dec" else None)
                 for b in stack.block], 2, stack.final_layer_norm)
    final = getattr(stack, "layer_norm", None)  # the Pre-LN stacks' final norm (mBART, M2M-100, Pegasus)
    return ([(b, b.self_attn, getattr(b, "encoder_attn", None)) for b in stack.layers], 1,
            stack.layers[-1] if final is None else final)


class Capture:
    """Each block's input and output, each attention module's output and probabilities, each stack's output, by
    forward hooks."""

    def __init__(self, model):
        self.seen = {}
        for side in ("enc", "dec"):
            blocks, self.probs_at, last = _modules(model, side)
            self._hook(last, (side, "final"))
            for i, (blk, attn, cross) in enumerate(blocks):
                self._hook(blk, (side, "block", i))
                self._hook(attn, (side, "attn", i))
                if cross is not None:
                    self._hook(cross, (side, "cross", i))

    def _hook(self, mod, key):
        def pre(m, args, kwargs):
            self.seen[key + ("in",)] = args[0] if args else kwargs["hidden_states"]

        def post(m, args, kwargs, out):
            self.seen[key + ("out",)] = out

        mod.register_forward_pre_hook(pre, with_kwargs=True)
        mod.register_forward_hook(post, with_kwargs=True)

    def __getitem__(self, key):
        out = self.seen[key]
        return out[0] if isinstance(out, tuple) and key[1] == "block" and key[-1] == "out" else out


@pytest.mark.parametrize("kind", KINDS)
def test_the_anatomy_recomputes_every_block_of_the_real_model(kind):
    model = _model(kind)
    A = _reader(kind).read(model)
    assert A.is_encoder_decoder and not A.encoder.is_encoder_decoder and A.encoder.is_encoder and A.causal
    assert A.n_layers == 2 and A.encoder.n_layers == 2 and all(L.cross is not None for L in A.layers)
    assert all(L.cross is None for L in A.encoder.layers)
    text = repr(A)
    assert "causal" in text.splitlines()[0] and "cross=Attention(heads=4" in text and "\n  encoder: Anatomy(" in text
    assert "bidirectional" in text.split("encoder:")[1].splitlines()[0]
    src = torch.tensor([[5, 17, 33, 8, 60, 2]])
    tgt = torch.tensor([[2, 40, 9, 71, 12]])
    cap = Capture(model)
    with torch.no_grad():
        out = model(input_ids=src, decoder_input_ids=tgt)
    for side, ids, anat in (("enc", src, A.encoder), ("dec", tgt, A)):
        pos = torch.arange(ids.shape[1])
        _close(anat.embed(ids[0], pos), cap[(side, "block", 0, "in")][0], f"{side} embedding")
    memory = cap[("enc", "final", "out")][0]
    if A.encoder.final_norm is not None:
        _close(A.encoder.final_norm(cap[("enc", "block", 1, "out")][0]), memory, "encoder final norm")
    for side, anat in (("enc", A.encoder), ("dec", A)):
        for i, L in enumerate(anat.layers):
            h = cap[(side, "block", i, "in")][0]
            r = L.forward(h, torch.arange(h.shape[0]), memory=memory if side == "dec" else None)
            attn = cap[(side, "attn", i, "out")]
            attn_out, attn_probs = attn[0], attn[cap.probs_at]
            _close(r["pattern"], attn_probs[0], f"{side} {i} pattern")
            _close(r["attn_out"], attn_out[0], f"{side} {i} attn_out")
            if side == "dec":
                cross = cap[(side, "cross", i, "out")]
                cross_out, cross_probs = cross[0], cross[cap.probs_at]
                assert r["cross_pattern"].shape == (4, 5, 6)  # (head, target pos, source pos)
                _close(r["cross_pattern"], cross_probs[0], f"dec {i} cross_pattern")
                _close(r["cross_out"], cross_out[0], f"dec {i} cross_out")
            _close(r["resid_post"], cap[(side, "block", i, "out")][0], f"{side} {i} resid_post")
    # the decoder is causal, the encoder and the cross-attention see every source
    assert float(r["pattern"].triu(1).abs().max()) == 0.0 and float(r["cross_pattern"].min()) > 0
    logits = A.logits(cap[("dec", "block", 1, "out")][0])
    _close(logits, out.logits[0], "logits")


def test_a_block_with_cross_attention_needs_the_encoder_output():
    from lenscope.errors import UnsupportedModelError

    A = bart.read(_model("bart"))
    h = torch.randn(3, 64, dtype=torch.float64)
    with pytest.raises(UnsupportedModelError, match="needs the encoder's output"):
        A.layers[0].forward(h, torch.arange(3))
    with pytest.raises(UnsupportedModelError, match="only such a block takes one"):
        A.encoder.layers[0].forward(h, torch.arange(3), memory=h)


@pytest.mark.parametrize("kind", KINDS)
def test_a_saved_folder_of_each_kind_loads_and_verifies(tmp_path, kind):
    """A user's own folder (model and tokenizer, as save_pretrained writes them) loads as a sequence-to-sequence
    model with its Anatomy, and verify checks both stacks on a source and a target prefix."""
    import lenscope
    from lenscope.models.loading.tokenizer import tiny_tokenizer
    from lenscope.models.runtime.verify import verify

    _model(kind).save_pretrained(tmp_path)
    tiny_tokenizer(kind="encoder-decoder").save_pretrained(tmp_path)
    lm = lenscope.load(str(tmp_path))
    assert lm.anatomy.is_encoder_decoder and type(lm.model).__name__.endswith(("ConditionalGeneration", "MTModel"))
    rep = verify(lm, [2, 40, 9, 71], source=[5, 17, 33, 8, 60, 2])  # the test vocabulary's ids (TOK)
    assert rep.ok and len(rep.layers) == 2 and len(rep.encoder["layers"]) == 2


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize(("n_buckets", "max_distance"), [(8, 16), (32, 128), (6, 20)])
def test_relative_position_buckets_are_t5s(bidirectional, n_buckets, max_distance):
    """Every distance from -300 to 300 falls in the bucket transformers' T5 puts it in (its own function)."""
    from transformers.models.t5.modeling_t5 import T5Attention

    from lenscope.models.weights.anatomy import RelativeBias

    rel = torch.arange(-300, 301)[None, :]
    want = T5Attention._relative_position_bucket(rel, bidirectional=bidirectional, num_buckets=n_buckets,
                                                 max_distance=max_distance)
    got = RelativeBias(torch.zeros(n_buckets, 1), bidirectional, max_distance).buckets(rel)
    assert_same_ints(got, want)
    assert int(got.max()) == n_buckets - 1 and int(got.min()) == 0
    bias = RelativeBias(torch.randn(n_buckets, 3), bidirectional, max_distance)(torch.arange(5))
    assert bias.shape == (3, 5, 5)
    assert_same_computation(bias[:, 1, 3], bias[:, 2, 4], why="one distance, one bucket: the same bias, copied")


@pytest.mark.parametrize("kind", KINDS)
def test_the_hooks_name_the_modules_that_compute_each_site(kind):
    """The readers' ``hooks`` (for the engine, next step) find every module, and each computes what its site says:
    the cross-attention module's probabilities and output projection, the norms' outputs, the MLP's activation."""
    model = _model(kind)
    H = _reader(kind).hooks(model)
    A = _reader(kind).read(model)
    assert len(H.layers) == A.n_layers and len(H.encoder.layers) == A.encoder.n_layers and H.encoder.encoder is None
    assert all(lh.cross is not None and "ln_cross" in lh.norms for lh in H.layers)
    assert all(lh.cross is None and "ln_cross" not in lh.norms for lh in H.encoder.layers)
    assert (H.final_norm is None) == (A.final_norm is None)
    seen = {}

    def keep(name, index=None):
        def f(mod, args, out):
            seen[name] = (out if index is None else out[index])[0]
        return f

    lh = H.layers[1]
    lh.cross.register_forward_hook(keep("cross_pattern", -1))
    lh.cross_out.register_forward_hook(keep("cross_out"))
    lh.norms["ln_cross"].register_forward_hook(keep("ln_cross"))
    lh.mlp_out.register_forward_hook(keep("mlp_out"))
    src, tgt = torch.tensor([[5, 17, 33, 8, 60, 2]]), torch.tensor([[2, 40, 9, 71, 12]])
    cap = Capture(model)
    with torch.no_grad():
        model(input_ids=src, decoder_input_ids=tgt)
    r = A.layers[1].forward(cap[("dec", "block", 1, "in")][0], torch.arange(5), memory=cap[("enc", "final", "out")][0])
    _close(seen["cross_pattern"], r["cross_pattern"], "hooked cross pattern")
    _close(seen["cross_out"], r["cross_out"], "hooked cross out")
    _close(seen["mlp_out"], r["mlp_out"], "hooked mlp out")
    ln_cross_out = r["resid_cross"] if A.layers[1].placement == "post" else r["cross_in"]
    _close(seen["ln_cross"], ln_cross_out, "hooked ln_cross")
