"""A feature's card against brute force on a tiny model: the top contexts are the true maxima over the held-out
tokens (special tokens excluded), the density is a direct count, the histogram counts every active token, and the
promoted / suppressed tokens are a direct matmul through the final norm's weight and the unembedding."""

from __future__ import annotations

import pytest
import torch

from lenscope.data.corpus import token_batches
from lenscope.errors import InputError
from lenscope.features.dictionaries.cards import FeatureCard, decoder_logits, feature_card, feature_cards
from lenscope.models.runtime.engine import capture
from tests.conftest import get_model
from tests.models.test_dictionary import _random as random_dict  # noqa: F401 (used here and by the view tests)
from tests.tolerances import assert_same_computation, assert_same_ints

WORDS = ("river stone light house garden winter market paper music window forest letter "
         "engine silver morning bridge painter harbour candle").split()


def corpus(tmp_path, n_docs=60):
    """Documents separated by end-of-text lines (every 20th is held out: 3 held-out documents)."""
    g = torch.Generator().manual_seed(0)
    docs = []
    for i in range(n_docs):
        w = torch.randint(0, len(WORDS), (40,), generator=g).tolist()
        docs.append(f"Document {i}. " + " ".join(WORDS[j] for j in w) + ".")
    p = tmp_path / "corpus.txt"
    p.write_text("\n<|endoftext|>\n".join(docs) + "\n")
    return p


def brute(lm, D, data, feats, seq_len, tokens):
    """Every held-out token's latents from a plain capture and the dictionary applied by hand (float64)."""
    special = set(lm.tokenizer.all_special_ids)
    ids = torch.cat(list(token_batches(lm.tokenizer, data, seq_len=seq_len, batch_size=3, part="heldout",
                                       max_sequences=-(-tokens // seq_len))))
    x = capture(lm, ids, [D.input_site])[D.input_site].double()
    z = D.to(torch.float64).encode(x)[..., feats]  # (n, p, F)
    mask = torch.tensor([[int(t) not in special for t in row] for row in ids.tolist()])
    return ids, z, mask


@pytest.mark.parametrize("role,kind,site", [("sae", "topk", "resid_post.1"), ("transcoder", "jumprelu", "mlp_out.0")])
def test_card_against_brute_force(tmp_path, role, kind, site):
    lm = get_model("tiny:llama")
    d = lm.anatomy.d_model
    D = random_dict(d, 3 * d, kind=kind, role=role, site=site, seed=3)
    data = corpus(tmp_path)
    seq_len, tokens, top, before, after = 24, 10_000, 5, 3, 2
    ids, z, mask = brute(lm, D, data, list(range(D.width)), seq_len, tokens)
    counts = ((z > 0) & mask[..., None]).sum((0, 1))
    feats = [int(counts.argmax()), int((counts > 0).nonzero()[0]), int(counts.argmin())]
    feats = list(dict.fromkeys(feats))
    cards = feature_cards(lm, D, feats, data, tokens=tokens, top=top, context=(before, after), seq_len=seq_len,
                          batch_size=2, bins=7)
    n_tokens = int(mask.sum())
    logits = decoder_logits(lm, D, feats)
    for card, f in zip(cards, feats):
        zf = torch.where(mask, z[..., f], torch.zeros(()))
        assert card.tokens_seen == n_tokens
        assert card.active == int((zf > 0).sum())
        assert card.density == pytest.approx(card.active / n_tokens)
        vals = zf[zf > 0]
        scale = float(zf.abs().max()) or 1.0
        # the top contexts: the largest activations over every held-out token, largest first
        want = vals.sort(descending=True).values[:top]
        assert card.context_max.shape[0] == min(top, vals.numel())
        assert torch.allclose(card.context_max.double(), want, atol=1e-5 * scale)
        for c in card.contexts():
            s, p = c["sequence"], c["position"]
            assert abs(float(zf[s, p]) - c["max"]) <= 1e-5 * scale
            for w, (tok, v) in enumerate(zip(c["tokens"], c["values"])):
                q = p - before + w
                if 0 <= q < seq_len:
                    assert tok == lm.tokenizer.decode([int(ids[s, q])])
                    assert abs(float(zf[s, q]) - v) <= 1e-5 * scale
                else:
                    assert tok is None and v == 0
            assert c["tokens"][c["center"]] is not None
        # the histogram counts every active token once; its edges span 0 .. the maximum
        assert int(card.hist_counts.sum()) == card.active
        if card.active:
            assert float(card.hist_edges[-1]) == pytest.approx(float(vals.max()), rel=1e-5)
            assert card.max_activation == pytest.approx(float(vals.max()), rel=1e-5)
            assert card.mean_activation == pytest.approx(float(vals.mean()), rel=1e-4)
    # the promoted tokens: W_dec[f] through the MLP's write (a transcoder), the final norm's weight, W_U
    A = lm.anatomy
    v = D.W_dec[feats].double()
    if role != "sae":
        v = v * A.layers[0].residual_scale
    direct = (v * A.final_norm.weight.double()) @ A.unembed.W_U.double()
    assert torch.allclose(logits.double(), direct, atol=1e-5 * float(direct.abs().max()))
    for card, row in zip(cards, direct):
        top_ids = row.topk(10).indices
        assert card.promoted_ids.tolist() == top_ids.tolist()
        assert card.suppressed_ids.tolist() == (-row).topk(10).indices.tolist()
        assert card.promoted == [lm.tokenizer.decode([int(i)]) for i in top_ids]
        assert torch.allclose(card.promoted_values.double(), row[top_ids], atol=1e-5 * float(row.abs().max()))


def test_one_card_save_load_and_frame(tmp_path):
    lm = get_model("tiny:llama")
    D = random_dict(lm.anatomy.d_model, 40, site="resid_post.0", seed=5)
    data = corpus(tmp_path)
    c = feature_card(lm, D, 7, data, tokens=2000, top=4, seq_len=32)
    again = feature_cards(lm, D, [3, 7], data, tokens=2000, top=4, seq_len=32)[1]
    assert_same_computation(c.context_max, again.context_max, why="the same latents; one feature picked from them")
    assert c.context_tokens == again.context_tokens
    path = c.save(tmp_path / "card.safetensors")
    back = FeatureCard.load(path)
    assert back.context_tokens == c.context_tokens
    assert_same_ints(back.hist_counts, c.hist_counts)
    assert_same_computation(back.to_dict(), c.to_dict(), why="saved and read back")
    df = c.to_frame()
    assert len(df) == c.context_max.shape[0]
    d = c.to_dict()
    assert {"contexts", "histogram", "density", "promoted", "suppressed", "tokens"} <= set(d)
    assert "FeatureCard(resid_post.0 #7" in repr(c)
    fig = c.plot()
    assert len(fig.axes) == 2 and len(fig.axes[1].patches) == 20  # 10 promoted, 10 suppressed


def test_card_refuses_bad_input(tmp_path):
    lm = get_model("tiny:llama")
    D = random_dict(lm.anatomy.d_model, 40, site="resid_post.0")
    data = corpus(tmp_path)
    with pytest.raises(InputError, match="outside the dictionary's 40 latents"):
        feature_card(lm, D, 40, data)
    with pytest.raises(InputError, match="data file not found"):
        feature_card(lm, D, 1, tmp_path / "missing.txt")
    with pytest.raises(InputError, match="twice"):
        feature_cards(lm, D, [1, 1], data)
    other = random_dict(lm.anatomy.d_model + 1, 40, site="resid_post.0")
    with pytest.raises(InputError, match="d_model"):
        feature_card(lm, other, 1, data)


@pytest.mark.parametrize("family", ["gpt2", "granite", "cohere"])
@pytest.mark.parametrize("role,site", [("sae", "resid_post.1"), ("transcoder", "mlp_out.1")])
def test_decoder_logits_written_out(family, role, site):
    """The direct path by hand in float64: LayerNorm's centring (GPT-2), the residual multiplier and the logit
    scale (Granite, Cohere), the final norm's weight, the unembedding."""
    lm = get_model(f"tiny:{family}")
    A = lm.anatomy
    D = random_dict(A.d_model, 20, role=role, site=site, seed=9)
    feats = [0, 7, 19]
    v = D.W_dec[feats].double()
    if role != "sae":
        assert A.layers[1].ln_mlp_out is None
        v = v * A.layers[1].residual_scale
    if A.final_norm.kind == "layernorm":
        v = v - v.mean(-1, keepdim=True)
    want = (v * A.final_norm.weight.double()) @ (A.unembed.W_U.double() * A.unembed.logit_scale)
    got = decoder_logits(lm, D, feats).double()
    assert torch.allclose(got, want, atol=1e-5 * float(want.abs().max()))
