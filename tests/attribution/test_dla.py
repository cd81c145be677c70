"""Direct logit attribution: completeness on every decoder family, heads, foils, errors, results."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lenscope
from lenscope.attribution.dla import ComponentAttribution
from lenscope.models.weights.readout import Readout
from tests.conftest import DECODERS, get_model
from tests.tolerances import assert_same_computation

TEXT = "When Mary and John went to the store, John gave a drink to"


def test_completeness_every_decoder(tiny_decoder):
    lm = tiny_decoder
    for by_head in (False, True):
        res = lenscope.direct_logit_attribution(lm, TEXT, " Mary", by_head=by_head)
        tr = lenscope.trace(lm, TEXT)
        logits = Readout.from_anatomy(lm.anatomy).uncap(tr.logits[-1])  # the logit before a soft-cap (Gemma 2)
        assert res.logit == pytest.approx(float(logits[res.target_id]), abs=1e-6)
        assert res.completeness_error < 1e-4, res
        assert abs(res.total - res.logit) < 1e-4


def test_heads_sum_to_their_layer(tiny_decoder):
    lm = tiny_decoder
    whole = lenscope.direct_logit_attribution(lm, TEXT, " Mary")
    heads = lenscope.direct_logit_attribution(lm, TEXT, " Mary", by_head=True)
    df_w, df_h = whole.to_frame(), heads.to_frame()
    n_heads = lm.anatomy.layers[0].attn.n_heads
    for layer in range(lm.anatomy.n_layers):
        w = float(df_w[df_w.name == f"L{layer}.attn"].value.iloc[0])
        parts = df_h[(df_h.layer == layer) & ~df_h.name.str.endswith(".mlp")]
        assert len(parts) == n_heads + 1  # heads plus the output bias
        assert w == pytest.approx(float(parts.value.sum()), abs=1e-4)


def test_foil_is_a_difference(tiny_decoder):
    lm = tiny_decoder
    a = lenscope.direct_logit_attribution(lm, TEXT, " Mary")
    b = lenscope.direct_logit_attribution(lm, TEXT, " John")
    ab = lenscope.direct_logit_attribution(lm, TEXT, " Mary", " John")
    assert torch.allclose(ab.values, a.values - b.values, atol=1e-5)
    assert ab.logit == pytest.approx(a.logit - b.logit, abs=1e-5)
    assert ab.foil == " John"


def test_by_hand_on_a_one_layer_view():
    """The embedding's component equals the logit lens of the embedding alone, through the traced scale."""
    lm = get_model("tiny:llama")
    res = lenscope.direct_logit_attribution(lm, TEXT, " Mary")
    tr = lenscope.trace(lm, TEXT)
    A = lm.anatomy
    s = A.final_norm.scale(tr.site("ln_final.in")[-1])
    u = A.unembed.W_U[:, res.target_id]
    expected = float((tr.embed[-1] * s * A.final_norm.weight) @ u)
    assert res.values[0].item() == pytest.approx(expected, rel=1e-5)
    assert res.names[0] == "embed"


def test_positional_embedding_component():
    res = lenscope.direct_logit_attribution(get_model("tiny:gpt2"), TEXT, " Mary")
    assert res.names[:2] == ["embed", "pos_embed"] and res.names[-1] == "bias"


def test_encoder_is_refused_clearly(tiny_encoder):
    with pytest.raises(lenscope.NotApplicableError, match="Post-LN encoder"):
        lenscope.direct_logit_attribution(tiny_encoder, TEXT, " Mary")


def test_position_and_errors():
    lm = get_model("tiny:gpt2")
    res = lenscope.direct_logit_attribution(lm, TEXT, " Mary", position=2)
    assert res.position == 2 and res.completeness_error < 1e-4
    with pytest.raises(lenscope.InputError, match="outside"):
        lenscope.direct_logit_attribution(lm, TEXT, " Mary", position=500)
    with pytest.raises(lenscope.InputError, match="not exactly one token"):
        lenscope.direct_logit_attribution(lm, TEXT, " Paris")


def test_save_load_frame_plot(tmp_path):
    lm = get_model("tiny:qwen2")
    res = lenscope.direct_logit_attribution(lm, TEXT, " Mary", " John", by_head=True)
    path = res.save(tmp_path / "dla.safetensors")
    back = ComponentAttribution.load(path)
    assert_same_computation(back.values, res.values, why="saved and read back")
    assert back.names == res.names and back.foil == res.foil
    assert_same_computation(back.to_dict(), res.to_dict(), why="saved and read back")
    df = res.to_frame()
    assert list(df.columns) == ["name", "layer", "head", "value"]
    fig = res.plot(top=5)
    assert len(fig.axes[0].patches) == 5
    (tmp_path / "bad.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(lenscope.InputError, match="not a lenscope result"):
        ComponentAttribution.load(tmp_path / "bad.safetensors")


@settings(max_examples=20, deadline=None)
@given(family=st.sampled_from(DECODERS), ids=st.lists(st.integers(5, 511), min_size=1, max_size=40),
       target=st.integers(0, 511), by_head=st.booleans())
def test_completeness_fuzz(family, ids, target, by_head):
    lm = get_model(f"tiny:{family}")
    res = lenscope.direct_logit_attribution(lm, ids, target, by_head=by_head)
    assert res.completeness_error < 1e-4 * max(1.0, abs(res.logit))


@pytest.mark.slow
@pytest.mark.parametrize("name,target", [("smollm2", " Paris"), ("gemma3-270m", " Paris")])
def test_completeness_embedded(name, target):
    lm = get_model(name)
    res = lenscope.direct_logit_attribution(lm, "The capital of France is", target, by_head=True)
    assert res.completeness_error < 1e-3
    n_heads = lm.anatomy.layers[0].attn.n_heads
    assert len(res.names) == 1 + lm.anatomy.n_layers * (n_heads + 2)


MOE = [n for n in DECODERS if get_model(f"tiny:{n}").anatomy.layers[0].mlp.__class__.__name__ == "MoE"]


@pytest.mark.parametrize("family", MOE)
def test_experts_sum_to_their_layer(family, tmp_path):
    """DLA by expert: at each MoE block the chosen experts' components add up to the block's, each one equal to the
    readout of that expert's weighted output as the engine captures it (the real model's routing)."""
    from lenscope.models.runtime.engine import capture
    from lenscope.models.weights.readout import Readout

    lm = get_model(f"tiny:{family}")
    whole = lenscope.direct_logit_attribution(lm, TEXT, " Mary")
    split = lenscope.direct_logit_attribution(lm, TEXT, " Mary", by_expert=True)
    assert split.completeness_error < 1e-4 and not split.by_head
    tr = lenscope.trace(lm, TEXT)
    ids = tr.input_ids[None]
    L = lm.anatomy.n_layers
    cap = capture(lm, ids, [("expert_out", i) for i in range(L)] + [("routing_weights", i) for i in range(L)])
    readout = Readout.from_anatomy(lm.anatomy)
    u, s = readout.direction(split.target_id, None), readout.scale(tr.site("ln_final.in")[-1])
    recs = split.to_records()
    for layer in range(L):
        w = float(whole.values[whole.names.index(f"L{layer}.mlp")])
        mine = [r for r in recs if r["layer"] == layer and r["expert"] is not None]
        chosen = cap["routing_weights", layer][0, -1].nonzero()[:, 0].tolist()
        assert [r["expert"] for r in mine] == chosen and len(chosen) == lm.anatomy.layers[layer].mlp.top_k
        assert all(r["name"] == f"L{layer}.E{r['expert']}.mlp" for r in mine)
        assert w == pytest.approx(sum(r["value"] for r in mine), abs=1e-5)
        want = readout.part_logits(cap["expert_out", layer][0, -1, chosen], s, u)
        torch.testing.assert_close(torch.tensor([r["value"] for r in mine]), want.float(), atol=1e-5, rtol=1e-4)
    both = lenscope.direct_logit_attribution(lm, TEXT, " Mary", by_head=True)  # by_expert follows by_head
    assert any(".E" in n for n in both.names) and both.completeness_error < 1e-4
    assert len(both.experts) == len(both.names)
    assert ComponentAttribution.load(split.save(tmp_path / "dla.safetensors")).experts == split.experts
