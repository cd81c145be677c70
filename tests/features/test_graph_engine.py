"""The attribution graph against the real model: the model itself is frozen at the real run through the engine (its
own modules run; call edits fix every norm's scale, give every head the real run's attention pattern over the values
of this pass, and replace each MLP by its transcoder with the real run's activations plus the error), a source node
is injected (a token's embedding, an error node or a feature set to zero), and every feature's pre-activation and
every logit moves by exactly minus its adjacency entry, on every decoder family."""

from __future__ import annotations

import pytest
import torch

from lenscope.features.graphs.graph import attribution_graph
from lenscope.features.graphs.replacement import Frozen, transcoders_by_layer
from lenscope.models.loading.load import encode
from lenscope.models.runtime.engine import Edit, run
from lenscope.models.runtime.trace import trace
from lenscope.models.weights.readout import Readout
from tests.conftest import DECODERS, get_model
from tests.features.test_graph import TEXT, _transcoders

EPS = torch.finfo(torch.float32).eps


def _call(site, layer, fn):
    return Edit(site, layer, rows=None, pos=None, values=fn, mode="call")


def frozen_run(lm, tr, fz: Frozen, acts: torch.Tensor, errs: torch.Tensor, emb_zero: int | None = None):
    """The real model through the engine, frozen at the trace ``tr``: each block's MLP input as this pass computed
    it, and the demeaned logits before any soft-cap at the last position."""
    A = lm.anatomy
    rec: dict = {}
    per = fz.split(acts)

    def keep(key):
        def fn(x):
            rec[key] = x.float()
            return x
        return fn

    def frozen(norm, s, key):
        def fn(x):
            y = norm.linear(rec[key + ".in"], s)
            y = y + norm.bias if norm.bias is not None else y
            rec[key + ".out"] = y
            return y.to(x)
        return fn

    def heads(L, attn):
        probs = tr.site("pattern", L).float()[None]  # (1, head, pos, src): the real run's

        def fn(x):
            v = rec[f"v.{L}"]  # (1, pos, kv_head, d_head): this pass's values
            v = v.repeat_interleave(attn.n_heads // v.shape[2], dim=2)
            return torch.einsum("bhqk,bkhe->bqhe", probs, v).to(x)
        return fn

    def mlp(L):
        def fn(x):
            out = errs[L].clone()
            if L in fz.tc.writes:  # the blocks' latents writing block L, its bias and skip path
                for s, _ in fz.tc.writes[L]:
                    out = out + fz._place[s] @ (per[s][:, None] * fz._dec[s, L])
                out = out + fz.tc.b_dec[L]
                if L in fz.tc.skips:
                    out = out + rec[f"ln_mlp.{L}.out"][0] @ fz.tc.skips[L].T
            return out[None].to(x)
        return fn

    edits = []
    for L, layer in enumerate(A.layers):
        for slot, norm in layer.norms().items():
            key = f"{slot}.{L}"
            if norm.kind == "identity":
                edits.append(_call(f"{slot}.out", L, keep(key + ".out")))
                continue
            s = norm.scale(tr.site(f"{slot}.in", L).float())[None]
            edits += [_call(f"{slot}.in", L, keep(key + ".in")),
                      _call(f"{slot}.out", L, frozen(norm.to(torch.float32), s, key))]
        edits += [_call("v", L, keep(f"v.{L}")), _call("head", L, heads(L, layer.attn)), _call("mlp_out", L, mlp(L))]
    s = A.final_norm.scale(tr.site("ln_final.in").float())[None]
    edits += [_call("ln_final.in", None, keep("ln_final.in")),
              _call("ln_final.out", None, frozen(A.final_norm.to(torch.float32), s, "ln_final"))]
    if emb_zero is not None:
        edits.append(Edit("resid_pre", 0, rows=torch.tensor([0]), pos=torch.tensor([emb_zero]),
                          values=torch.zeros(1, A.d_model)))
    out = run(lm, encode(lm, TEXT)[None], edits=edits)
    z = Readout.from_anatomy(A).uncap(out.logits[0, -1].float())
    return [rec[f"ln_mlp.{L}.out"][0] for L in range(A.n_layers)], z - z.mean()


@pytest.mark.parametrize("family", DECODERS)
def test_injections_into_the_frozen_real_model_move_targets_by_their_edges(family):
    lm = get_model(f"tiny:{family}")
    if lm.anatomy.placement == "post":
        pytest.skip("no Post-LN decoder among the tiny families")
    ds = _transcoders(lm)
    g = attribution_graph(lm, TEXT, ds)
    o = g.offsets()
    tr = trace(lm, TEXT)
    fz = Frozen(lm, tr, transcoders_by_layer(lm, ds))
    feats = torch.arange(fz.n_active)
    ids = g.logit_ids

    def targets(mlp_in, z):
        return torch.cat([fz.pre_of(mlp_in, feats), z[ids]])

    base = targets(*frozen_run(lm, tr, fz, fz.acts, fz.errs))
    # the frozen real model reproduces the graph's inputs (the real run)
    rows = torch.cat([torch.arange(o["error"]), torch.arange(o["logit"], o["end"])])
    scale = max(1.0, float(g.adjacency[rows].abs().max()), float(base.abs().max()))
    assert float((base - g.inputs[rows]).abs().max()) <= 1e-4 * scale, family
    gen = torch.Generator().manual_seed(0)
    last = g.n_pos - 1
    picks = [("token", 0), ("token", last), ("error", 0), ("error", o["token"] - o["error"] - 1)]
    picks += [("feature", int(i)) for i in torch.randperm(fz.n_active, generator=gen)[:2]]
    for kind, j in picks:
        acts, errs, emb_zero = fz.acts.clone(), fz.errs.clone(), None
        if kind == "token":
            emb_zero, col = j, o["token"] + j
        elif kind == "error":
            L, p = divmod(j, g.n_pos)
            errs[L, p] = 0
            col = o["error"] + j
        else:
            acts[j] = 0
            col = j
        change = targets(*frozen_run(lm, tr, fz, acts, errs, emb_zero)) - base
        want = -g.adjacency[rows, col]
        # float32 precision: the two passes each round at a few eps of the largest term; 64 eps leaves room
        assert float((change - want).abs().max()) <= 64 * EPS * scale, (family, kind, j)
