"""Attribution graphs through a cross-layer transcoder (CLT): on every decoder family the graph is exact (each node's
input is the sum of its edges and bias terms, injections move targets by their edges); in the frozen model a
feature of block ``s`` writes block ``t``'s MLP output through the CLT's decoder ``s -> t`` and nothing else (the
equation, independently of the graph code); a CLT whose cross-layer decoders are zero gives the graph of its blocks
as per-layer transcoders; the real model's latents are the graph's; the CLI reads a CLT folder."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from lenscope.cli import app
from lenscope.errors import InputError
from lenscope.features.graphs.check import intervene
from lenscope.features.graphs.graph import attribution_graph, node_id
from lenscope.features.graphs.replacement import Frozen, parts_rounding, transcoders_by_layer
from lenscope.models.runtime.trace import trace
from tests.conftest import DECODERS, get_model
from tests.features.test_graph import TEXT, _transcoders, check_graph_exact_and_injections
from tests.models.test_clt import _random
from tests.tolerances import assert_same_ints

U = torch.finfo(torch.float32).eps / 2


def _clt(lm, kind="topk", seed=3):
    A = lm.anatomy
    return _random(L=A.n_layers, d=A.d_model, width=40, kind=kind, seed=seed, k=6)


@pytest.mark.parametrize("family", DECODERS)
def test_a_clt_graph_is_exact_on_every_family(family):
    lm = get_model(f"tiny:{family}")
    C = _clt(lm)
    g = attribution_graph(lm, TEXT, [C])
    check_graph_exact_and_injections(lm, g, [C], family)
    assert g.sites == [f"mlp_out.{i}" for i in range(lm.anatomy.n_layers)]


@pytest.mark.parametrize("kind", ["topk", "jumprelu"])
def test_a_feature_writes_every_later_block_through_its_decoder(kind):
    lm = get_model("tiny:llama")
    C = _clt(lm, kind)
    if C.threshold is not None:
        C.threshold = C.threshold * 0.1
    fz = Frozen(lm, trace(lm, TEXT), transcoders_by_layer(lm, [C]))
    assert fz.n_active > 0
    outs: dict = {}
    frozen_mlp = fz.mlp
    fz.mlp = lambda L, x: outs.setdefault(L, frozen_mlp(L, x))  # what each block's MLP writes
    fz.forward(fz.emb, fz.acts, fz.errs)
    base = dict(outs)
    for s in range(C.n_layers):  # one active feature of each block, removed
        j = int((fz.layer == s).nonzero()[0, 0])
        p, f, a = int(fz.pos[j]), int(fz.feature[j]), fz.acts[j]
        acts = fz.acts.clone()
        acts[j] = 0
        outs.clear()
        fz.forward(fz.emb, acts, fz.errs)
        for t in range(C.n_layers):
            change = outs[t] - base[t]
            want = torch.zeros_like(change)
            if t >= s:
                want[p] = -a * C.decoder(s, t)[f]
            # the frozen MLP output is linear in the activations: the change is one decoded row, up to the rounding
            # of the sums it was added into (about 4 terms of the output's size per block)
            size = float(base[t].abs().max() + want.abs().max())
            assert float((change - want).abs().max()) <= 16 * C.n_layers * U * size, (kind, s, t)


def test_own_block_decoders_only_give_the_per_layer_graph():
    lm = get_model("tiny:gpt2")
    C = _clt(lm)
    for s in range(C.n_layers):
        C.W_dec[s][:, 1:] = 0
    blocks = [C.block(i) for i in range(C.n_layers)]
    g, ref = attribution_graph(lm, TEXT, [C]), attribution_graph(lm, TEXT, blocks)
    assert_same_ints(g.feature_layer, ref.feature_layer)
    assert_same_ints(g.feature_index, ref.feature_index)
    assert_same_ints(g.feature_pos, ref.feature_pos)
    # the same linear map by another path (its zero writes added): equal to float32's rounding of each row's terms
    size = ref.adjacency.double().abs().sum(1, keepdim=True) + ref.biases.double().abs()[:, None]
    bound = parts_rounding(g.n_layers)
    assert bool(((g.adjacency.double() - ref.adjacency.double()).abs() <= bound * size).all())
    assert bool(((g.biases.double() - ref.biases.double()).abs() <= bound * size[:, 0]).all())


def test_intervene_reads_the_clts_latents_and_a_factor_of_one_changes_nothing():
    lm = get_model("tiny:llama")
    C = _clt(lm)
    g = attribution_graph(lm, TEXT, [C])
    nodes = [node_id(g, i) for i in range(min(3, g.n_features))]
    res = intervene(lm, g, [C], nodes, factor=1.0)  # raises if the engine's latents are not the graph's
    assert float(res.real.abs().max()) <= 64 * U * max(1.0, res.scale) and len(res.nodes) == len(nodes)
    res0 = intervene(lm, g, [C], nodes, factor=0.0)
    assert res0.real.shape == res0.direct.shape and bool(torch.isfinite(res0.real).all())
    with pytest.raises(InputError, match="two transcoders"):
        attribution_graph(lm, TEXT, [C, _transcoders(lm)[0]])


def test_the_cli_reads_a_clt_folder(tmp_path):
    lm = get_model("tiny:llama")
    C = _clt(lm)
    C.save(tmp_path / "clt")
    r = CliRunner().invoke(app, ["graph", TEXT, "--model", "tiny:llama", "--dict", str(tmp_path / "clt"), "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    ref = attribution_graph(lm, TEXT, [C])
    assert out["sites"] == ref.sites and out["n_active_features"] == ref.n_active


def test_head_splits_and_qk_attribution_through_a_clt():
    from lenscope.features.graphs.heads import edge_heads
    from lenscope.features.graphs.qk import qk_attribution

    lm = get_model("tiny:qwen2")
    C = _clt(lm)
    g = attribution_graph(lm, TEXT, [C])
    # each split is checked against its edge on every call (an InvariantError beyond parts_rounding)
    eh = edge_heads(lm, g, [C], edges=(g.adjacency != 0).nonzero())
    assert eh.edges.shape[0] > 0 and eh.error <= parts_rounding(g.n_layers)
    A = g.adjacency[eh.edges[:, 0], eh.edges[:, 1]].double()
    total = eh.heads.double().sum((1, 2)) + eh.residual.double()
    scale = torch.maximum(eh.heads.abs().amax((1, 2)), eh.residual.abs()).double().clamp_min(1e-6)
    assert float(((A - total).abs() / scale).max()) <= g.tolerance
    r = qk_attribution(lm, g, [C], lm.anatomy.n_layers - 1, 0, g.n_pos - 1, g.n_pos - 2)
    Qa = r.query_vectors.double().abs().sum(0) + r.query_const.double().abs()
    Ka = r.key_vectors.double().abs().sum(0) + r.key_const.double().abs()
    tol = parts_rounding(lm.anatomy.n_layers) * float(Qa @ Ka) * abs(r.scale)
    assert abs(float(r.query_parts.double().sum()) + r.query_bias - r.score) <= tol
    assert abs(float(r.key_parts.double().sum()) + r.key_bias - r.score) <= tol
