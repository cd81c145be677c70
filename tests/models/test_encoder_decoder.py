"""Encoder-decoder models (issue 31, draft; docs/encoder-decoder.md): the BART / Marian reader's Anatomy recomputes
every block of the real model, encoder and decoder (self-attention, cross-attention over the encoder's output, MLP,
the Post-LN norms), the embeddings and the logits.

The models run in float64 and so does lenscope's math, except its attention softmax, which lenscope takes in
float32 (``Attention.probs``): the two evaluations then differ by the float32 rounding of the probabilities, a few
units ``u = 2^-24`` relative to each activation's size (everything else rounds in float64, 1e-16), while any mistake
in reading the model (a bias, a norm, a scale, an offset; the random weights below make every one of them matter)
moves the results by 1e-3 or more. The bound used, 16 u relative to each activation's largest entry (measured: at
most a few u), lies between the two.
"""

import pytest
import torch

from lenscope.models.families import bart
from tests.tolerances import U32

TOK = {"vocab_size": 96, "bos": 0, "pad": 1, "eos": 2}
REL = 16 * U32


def _model(kind: str):
    from transformers import BartForConditionalGeneration, MarianMTModel

    torch.manual_seed(0)
    cls = {"bart": BartForConditionalGeneration, "marian": MarianMTModel}[kind]
    model = cls._from_config(bart.TINY[kind](TOK), attn_implementation="eager").double().eval()
    with torch.no_grad():  # every norm, bias and the logits' bias away from their initial 1 / 0
        g = torch.Generator().manual_seed(1)
        for name, p in model.named_parameters():
            if "layer_norm" in name or "layernorm" in name or name.endswith("bias"):
                base = 1.0 if name.endswith("weight") else 0.0
                p.copy_(base + 0.2 * torch.randn(p.shape, generator=g, dtype=p.dtype))
        model.final_logits_bias.copy_(torch.randn(model.final_logits_bias.shape, generator=g, dtype=torch.float64))
    return model


def _close(got, want, what):
    err = float((got - want).abs().max())
    scale = float(want.abs().max())
    assert err <= REL * scale, f"{what}: max error {err:.3g}, scale {scale:.3g}"


class Capture:
    """Each block's input and output, and each attention module's output and probabilities, by forward hooks."""

    def __init__(self, model):
        self.seen, self.handles = {}, []
        base = model.model
        for side, stack in (("enc", base.encoder), ("dec", base.decoder)):
            for i, blk in enumerate(stack.layers):
                self._hook(blk, (side, "block", i))
                self._hook(blk.self_attn, (side, "attn", i))
                if side == "dec":
                    self._hook(blk.encoder_attn, (side, "cross", i))

    def _hook(self, mod, key):
        def pre(m, args, kwargs):
            self.seen[key + ("in",)] = args[0] if args else kwargs["hidden_states"]

        def post(m, args, kwargs, out):
            self.seen[key + ("out",)] = out

        self.handles += [mod.register_forward_pre_hook(pre, with_kwargs=True),
                         mod.register_forward_hook(post, with_kwargs=True)]

    def __getitem__(self, key):
        return self.seen[key]


@pytest.mark.parametrize("kind", ["bart", "marian"])
def test_the_anatomy_recomputes_every_block_of_the_real_model(kind):
    model = _model(kind)
    A = bart.read(model)
    assert A.is_encoder_decoder and not A.encoder.is_encoder_decoder and A.encoder.is_encoder and A.causal
    assert A.n_layers == 2 and A.encoder.n_layers == 2 and all(L.cross is not None for L in A.layers)
    assert all(L.cross is None for L in A.encoder.layers)
    src = torch.tensor([[5, 17, 33, 8, 60, 2]])
    tgt = torch.tensor([[2, 40, 9, 71, 12]])
    cap = Capture(model)
    with torch.no_grad():
        out = model(input_ids=src, decoder_input_ids=tgt)
    for side, ids, anat in (("enc", src, A.encoder), ("dec", tgt, A)):
        pos = torch.arange(ids.shape[1])
        _close(anat.embed(ids[0], pos), cap[(side, "block", 0, "in")][0], f"{side} embedding")
    memory = cap[("enc", "block", 1, "out")][0]
    for side, anat in (("enc", A.encoder), ("dec", A)):
        for i, L in enumerate(anat.layers):
            h = cap[(side, "block", i, "in")][0]
            r = L.forward(h, torch.arange(h.shape[0]), memory=memory if side == "dec" else None)
            attn_out, attn_probs = cap[(side, "attn", i, "out")]
            _close(r["pattern"], attn_probs[0], f"{side} {i} pattern")
            _close(r["attn_out"], attn_out[0], f"{side} {i} attn_out")
            if side == "dec":
                cross_out, cross_probs = cap[(side, "cross", i, "out")]
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


def test_encoder_decoder_types_are_still_refused_by_load(tmp_path):
    """The reader is not registered as a family until the engine runs encoder-decoder models: load refuses."""
    import lenscope
    from lenscope.errors import UnsupportedModelError

    _model("bart").save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="model type 'bart'.* is not supported"):
        lenscope.load(str(tmp_path))

