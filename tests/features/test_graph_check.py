"""Checking what an attribution graph claims (features/graphs/check.py): in the frozen replacement model the graph's
predictions are exact (``frozen_total``: every downstream feature responding linearly, recomputed block by block;
``direct``: every other node held); in the real model, a feature of the last block at the last position moves the
logits by ``direct`` up to the change of the norms' scales after it, which the test computes from the two runs; a
factor of 1 changes nothing; bad input is a one-line error."""

from __future__ import annotations

import pytest
import torch

from lenscope.errors import InputError
from lenscope.features.graphs.check import GraphIntervention, intervene
from lenscope.features.graphs.graph import attribution_graph, node_id
from lenscope.features.graphs.replacement import Frozen, transcoders_by_layer
from lenscope.models.runtime.engine import run
from lenscope.models.runtime.sites import Edit
from lenscope.models.runtime.trace import trace
from lenscope.models.weights.readout import Readout
from tests.conftest import get_model
from tests.features.test_graph import TEXT, _transcoders
from tests.models.test_dictionary import _random
from tests.tolerances import assert_same_computation, assert_same_ints

EPS = torch.finfo(torch.float32).eps
FAMILIES = ["gpt2", "llama", "gemma3", "qwen2"]  # LayerNorm, RMSNorm, sandwich norms, biases on q/k/v
_graphs: dict = {}


def _graph(family: str):
    if family not in _graphs:
        lm = get_model(f"tiny:{family}")
        ds = _transcoders(lm)
        _graphs[family] = (lm, ds, attribution_graph(lm, TEXT, ds))
    return _graphs[family]


def _supernode(g) -> list[int]:
    """Three feature nodes: a path ``s -> t -> logit`` with the largest product of its two edges (a chosen feature
    downstream of another chosen one, whose response reaches the logit directly) and the feature with the strongest
    direct edge to the first logit."""
    o = g.offsets()
    A_ff = g.adjacency[: o["error"], : o["error"]].abs()
    to_logit = g.adjacency[o["logit"], : o["error"]].abs()
    t, s = divmod(int((A_ff * to_logit[:, None]).argmax()), g.n_features)
    assert float(A_ff[t, s] * to_logit[t]) > 0 and int(g.feature_layer[s]) < int(g.feature_layer[t])
    return sorted({s, t, int(to_logit.argmax())})


@pytest.mark.parametrize("family", FAMILIES)
def test_in_the_frozen_model_the_predictions_are_exact(family):
    lm, ds, g = _graph(family)
    assert g.n_features == g.n_active
    tr = trace(lm, TEXT)
    fz = Frozen(lm, tr, transcoders_by_layer(lm, ds))
    assert_same_ints(fz.layer, g.feature_layer)
    assert_same_ints(fz.pos, g.feature_pos)
    assert_same_ints(fz.feature, g.feature_index)
    last = g.n_pos - 1
    chosen = torch.tensor(_supernode(g))
    mask = torch.zeros(fz.n_active, dtype=torch.bool)
    mask[chosen] = True

    def propagated(factor):
        """The frozen model with every feature's activation recomputed as its pre-activation, block by block (the
        chosen ones times ``factor``, as the engine's scale edit multiplies what arrives)."""
        acts = fz.acts.clone()
        for L in sorted(fz.dicts):
            m, _ = fz.forward(fz.emb, acts, fz.errs)
            sel = (fz.layer == L).nonzero()[:, 0]
            pre = fz.pre_of(m, sel)
            acts[sel] = torch.where(mask[sel], factor * pre, pre)
        return fz.logit_inputs(fz.forward(fz.emb, acts, fz.errs)[1], last, g.logit_ids)

    def held(factor):
        """Only the chosen features' activations changed, every other node held at its value."""
        acts = fz.acts.clone()
        acts[chosen] *= factor
        return fz.logit_inputs(fz.forward(fz.emb, acts, fz.errs)[1], last, g.logit_ids)

    o = g.offsets()
    base = propagated(1.0)
    for factor in (0.0, 2.0, -1.0):
        res = intervene(lm, g, ds, [node_id(g, int(i)) for i in chosen], factor=factor)
        assert isinstance(res, GraphIntervention) and res.missing_features == 0
        total = propagated(factor) - base
        direct = held(factor) - held(1.0)
        # float32 frozen model against the float64 solve over float32 edges: rounding relative to the largest term
        scale = max(1.0, float(g.adjacency[o["logit"]:].abs().max()) * (1 + abs(factor)), float(base.abs().max()))
        tol = 256 * EPS * scale
        assert float((total.double() - res.frozen_total).abs().max()) <= tol, (family, factor)
        assert float((direct.double() - res.direct).abs().max()) <= tol, (family, factor)
        # the downstream responses matter here: the two predictions differ by more than the rounding
        # the downstream responses matter here: the two predictions differ by more than the rounding
        assert float((res.frozen_total - res.direct).abs().max()) > 10 * tol, (family, factor)


def _last_block_feature(g) -> int:
    o = g.offsets()
    cand = ((g.feature_layer == g.n_layers - 1) & (g.feature_pos == g.n_pos - 1)).nonzero()[:, 0]
    return int(cand[g.adjacency[o["logit"], cand].abs().argmax()])


@pytest.mark.parametrize("family", FAMILIES)
def test_in_the_real_model_the_last_block_moves_the_logits_by_direct_up_to_the_norm_scales(family):
    """A feature of the last block at the last position reaches the logits only through the final norm (and the
    block's sandwich norm on the MLP's output, where there is one). With every norm's scale frozen the change is
    ``direct`` exactly; the real norms rescale: with ``r = s'/s`` the final norm's scale ratio at the last position,
    ``P`` the frozen readout of a residual state (the demeaned logit minus its bias constants) and ``h`` the unedited
    final residual, the real change is ``r (P(h) + direct + P(x)) - P(h)``, where ``x = rs (1 - 1/r_mlp)(o' - b)`` is
    what the sandwich norm's scale change adds (``r_mlp`` its scale ratio, ``o'`` its edited output, ``b`` its bias,
    ``rs`` the residual scale; 0 without one). The test computes ``r``, ``r_mlp``, ``o'`` from the two real runs."""
    lm, ds, g = _graph(family)
    A = lm.anatomy
    last, L = g.n_pos - 1, g.n_layers - 1
    layer = A.layers[L]
    assert layer.placement != "post" and L in {d.layer for d in ds}
    i = _last_block_feature(g)
    ids = torch.tensor(g.input_ids)
    fz = Frozen(lm, trace(lm, ids), transcoders_by_layer(lm, ds))
    u, c = fz.logit_dirs(g.logit_ids)
    readout = Readout.from_anatomy(A)
    sandwich = layer.ln_mlp_out
    capture = [("ln_final.in", None), ("ln_final.scale", None)]
    capture += [("ln_mlp_out.scale", L), ("ln_mlp_out.out", L)] if sandwich is not None else []

    def demeaned(logits):
        z = readout.uncap(logits[0, -1].float()).double()
        return z[g.logit_ids] - z.mean()

    base = run(lm, ids, capture=capture, last_only=True)
    P_h = demeaned(base.logits) - c.double()
    s = float(base.captured[("ln_final.scale", None)][0, last])
    for factor in (0.0, 2.0):
        res = intervene(lm, g, ds, [node_id(g, i)], factor=factor)
        # nothing downstream of the last block's features but the logits: the two predictions agree
        assert torch.allclose(res.frozen_total, res.direct, rtol=0, atol=1e-12 * (1 + res.direct.abs().max()))
        f = torch.ones(1, ds[-1].width)
        f[0, g.feature_index[i]] = factor
        ed = run(lm, ids, [Edit("mlp_out.latents", L, torch.tensor([0]), torch.tensor([last]), f, mode="scale")],
                 capture=capture, dictionaries=ds, last_only=True)
        # the same runs as intervene's
        assert_same_computation(demeaned(ed.logits) - demeaned(base.logits), res.real,
                                why="the same runs as intervene's, differenced the same way")
        r = float(ed.captured[("ln_final.scale", None)][0, last]) / s
        x = torch.zeros(A.d_model)
        if sandwich is not None:
            r_mlp = float(ed.captured[("ln_mlp_out.scale", L)][0, last] / base.captured[("ln_mlp_out.scale", L)][0,
                                                                                                             last])
            o = ed.captured[("ln_mlp_out.out", L)][0, last].float()
            b = sandwich.bias.float() if sandwich.bias is not None else 0.0
            x = layer.residual_scale * (1 - 1 / r_mlp) * (o - b)
        P_x = readout.part_logits(x, fz.final_scale[last], u.T).double()
        want = r * (P_h + res.direct + P_x) - P_h
        # float32 runs against float64 sums of their outputs: rounding relative to the largest term of the sum
        # (|P(h)|, |direct|, |P(x)|, times r)
        scale = max(1.0, r) * max(1.0, float(P_h.abs().max()), float(res.direct.abs().max()),
                                  float(P_x.abs().max()))
        gap = float((res.real - res.direct).abs().max())
        assert float((res.real - want).abs().max()) <= 256 * EPS * scale, (family, factor, gap, res.scale)
        # the gap to direct is the norms' rescaling, not noise: without it the real change is direct
        assert gap > 1e-3 * res.scale, (family, factor, gap)

    # a factor of 1: the engine's edit with the error kept leaves the run as it was, bit for bit
    same = intervene(lm, g, ds, [node_id(g, i)], factor=1.0)
    assert_same_computation(same.real, torch.zeros_like(same.real),
                            why="a factor of 1 leaves the run as it was: the same operations")
    assert not same.direct.any() and not same.frozen_total.any()


def test_max_feature_nodes_leaves_the_dropped_features_out_and_says_so():
    lm = get_model("tiny:gpt2")
    ds = _transcoders(lm)
    g = attribution_graph(lm, TEXT, ds, max_feature_nodes=30)
    res = intervene(lm, g, ds, [node_id(g, 0)], factor=0.0)
    assert res.missing_features == g.n_active - 30 > 0
    assert "left out" in repr(res) and "max_feature_nodes" in res.to_dict()["note"]
    frame = res.to_frame()
    assert list(frame.columns) == ["token", "token_id", "real", "direct", "frozen_total"]
    assert len(frame) == g.n_logits and frame["token"].tolist() == g.logit_tokens


def test_save_and_load_round_trip(tmp_path):
    lm, ds, g = _graph("llama")
    res = intervene(lm, g, ds, [node_id(g, _last_block_feature(g))], factor=0.0)
    back = GraphIntervention.load(res.save(tmp_path / "r.safetensors"))
    assert back.nodes == res.nodes
    assert_same_computation((back.real, back.to_dict()), (res.real, res.to_dict()), why="saved and read back")


def test_bad_input_is_a_one_line_error():
    lm, ds, g = _graph("llama")
    o = g.offsets()
    with pytest.raises(InputError, match="at least one"):
        intervene(lm, g, ds, [])
    for bad in ([node_id(g, o["error"])], [node_id(g, o["token"])], [node_id(g, o["logit"])], ["0_99999_0"],
                [g.n_features]):
        with pytest.raises(InputError, match="not feature nodes"):
            intervene(lm, g, ds, bad)
    with pytest.raises(InputError, match="built with"):
        intervene(lm, g, ds[:1], [node_id(g, 0)])
    other = [_random(lm.anatomy.d_model, 40, site=d.site, seed=99 + d.layer, kind="topk", role="transcoder", k=6)
             for d in ds]
    with pytest.raises(InputError, match="built with"):
        intervene(lm, g, other, [node_id(g, 0)])
    with pytest.raises(InputError, match="finite"):
        intervene(lm, g, ds, [node_id(g, 0)], factor=float("nan"))
    with pytest.raises(InputError, match="model"):
        intervene(get_model("tiny:qwen2"), g, ds, [node_id(g, 0)])
    with pytest.raises(InputError) as e:
        intervene(lm, g, ds, ["nope"])
    assert "\n" not in str(e.value)
