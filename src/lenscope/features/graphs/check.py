"""Checking what an attribution graph claims: intervene on its features in the real model and compare the change
of the logits with what the graph predicts.

An attribution graph (:mod:`lenscope.features.graphs.graph`) is exact for the frozen replacement model: attention
patterns,
norm scales and the transcoders' active sets fixed at the real run. :func:`intervene` multiplies a set of its feature
nodes (one feature, or a supernode's features) by ``factor`` in the **real** model, through the engine (one run with
the transcoders attached, an ``Edit`` scaling those latents at their positions, the reconstruction error kept, no
splice), and reads each logit node's input (the logit minus the mean logit, before any soft-cap) against the
unedited run. Beside that real change it reports the graph's two predictions:

- ``direct``: ``(factor - 1) * sum_n A[logit, n]`` over the chosen nodes ``n``, the direct edges; exact in the frozen
  model when every other node is held at its value;
- ``frozen_total``: the total effect through the frozen model with every downstream feature responding linearly
  (its activation = its pre-activation under the frozen active set). An edge ``A[t, s]`` is the effect of ``s`` at
  its activation, so with ``rho`` the relative change of each feature node's activation,
  ``rho = D (A_ff rho) / act + c`` (``c``: ``factor - 1`` at the chosen nodes, 0 elsewhere; ``D``: ``factor`` at
  the chosen nodes, 1 elsewhere, because the engine's scale edit multiplies a chosen latent's activation as it
  arrives, so a chosen feature downstream of another chosen one responds ``factor`` times), solved by iteration (the
  graph is acyclic: an edge goes from an earlier block to a later one, so it ends after as many steps as there are
  blocks) and read on the logit rows: ``A_lf rho``.

Both are exact in the frozen model and approximate in the real one, where attention patterns, norm scales and the
active sets change with the intervention. ``frozen_total`` needs every active feature as a node
(``g.n_features == g.n_active``); with ``max_feature_nodes`` the dropped features' responses are left out
(:attr:`GraphIntervention.missing_features` says how many features that is).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ...errors import InputError
from ...models.loading.load import LoadedModel
from ...models.runtime.engine import run
from ...models.runtime.sites import Edit
from ...models.runtime.verify import completeness_tolerance
from ...models.weights.readout import Readout
from ...results import Result
from .graph import AttributionGraph, node_id
from .replacement import node_logits, transcoders_by_layer


@dataclass(repr=False)
class GraphIntervention(Result):
    """The change of each logit node's input (the demeaned logit before any soft-cap) when the feature ``nodes`` of a
    graph are multiplied by ``factor`` in the real model (``real``), beside the graph's predictions ``direct`` and
    ``frozen_total`` (see the module's docstring); ``(n_logits,)`` each, float64. ``direct_error``,
    ``total_error``: the largest ``|real - prediction|`` over the logit nodes; ``scale``: the largest ``|real|``.
    ``missing_features``: the active features that are not nodes of the graph, whose responses ``frozen_total``
    leaves out (0: exact in the frozen model)."""

    model: str
    tokens: list[str]
    nodes: list[str]
    factor: float
    logit_ids: Tensor
    logit_tokens: list[str]
    real: Tensor
    direct: Tensor
    frozen_total: Tensor
    missing_features: int
    direct_error: float
    total_error: float
    scale: float

    def to_frame(self):
        """One row per logit node: its token, the real change and the two predictions."""
        import pandas as pd

        return pd.DataFrame({"token": self.logit_tokens, "token_id": self.logit_ids.tolist(),
                             "real": self.real.tolist(), "direct": self.direct.tolist(),
                             "frozen_total": self.frozen_total.tolist()})

    def to_dict(self) -> dict:
        rows = self.to_frame().to_dict(orient="records")
        note = (f"frozen_total leaves out the responses of {self.missing_features} active features that are not "
                "nodes of the graph (max_feature_nodes)") if self.missing_features else None
        return {"model": self.model, "nodes": self.nodes, "factor": self.factor, "logits": rows,
                "direct_error": self.direct_error, "total_error": self.total_error, "scale": self.scale,
                "missing_features": self.missing_features, "note": note}

    def __repr__(self) -> str:
        miss = f", {self.missing_features} features left out of frozen_total" if self.missing_features else ""
        return (f"GraphIntervention({len(self.nodes)} feature nodes x {self.factor:g}, {self.real.numel()} logits, "
                f"largest real change {self.scale:.3g}, direct off by {self.direct_error:.3g}, frozen_total off by "
                f"{self.total_error:.3g}{miss})")


def _feature_nodes(g: AttributionGraph, nodes) -> Tensor:
    """The indices of the feature nodes named by ``nodes`` (node ids, :func:`node_id`, or node indices)."""
    if isinstance(nodes, (str, int)):
        nodes = [nodes]
    nodes = list(nodes)
    if not nodes:
        raise InputError("intervene needs at least one feature node of the graph (an id like '3_12_5')")
    ids = {node_id(g, i): i for i in range(g.n_features)}
    out, bad = [], []
    for n in nodes:
        if isinstance(n, str) and n in ids:
            out.append(ids[n])
        elif isinstance(n, int) and not isinstance(n, bool) and 0 <= n < g.n_features:
            out.append(n)
        else:
            bad.append(n)
    if bad:
        raise InputError(f"not feature nodes of this graph: {bad[:5]}; give feature ids '<layer>_<latent>_<pos>' "
                         "(g.to_frame() lists them; error, token and logit nodes cannot be scaled)")
    return torch.tensor(sorted(set(out)), dtype=torch.long)


def _predictions(g: AttributionGraph, idx: Tensor, factor: float) -> tuple[Tensor, Tensor]:
    """``direct`` and ``frozen_total`` ``(n_logits,)`` (float64) for the feature nodes ``idx`` scaled by ``factor``.

    An edge ``A[t, s]`` is the effect of source ``s`` at its activation ``act_s``, so a relative change ``rho_s``
    of ``s``'s activation changes ``t``'s input by ``A[t, s] rho_s``. A downstream feature's activation follows its
    pre-activation: ``rho_t = (A rho)_t / act_t``; a chosen one is also multiplied by ``factor``:
    ``rho_t = (factor - 1) + factor (A rho)_t / act_t``."""
    o = g.offsets()
    A_ff = g.adjacency[: o["error"], : o["error"]].double()
    A_lf = g.adjacency[o["logit"]:, : o["error"]].double()
    act = g.feature_act.double()
    c = torch.zeros(g.n_features, dtype=torch.float64)
    c[idx] = factor - 1
    D = torch.ones(g.n_features, dtype=torch.float64)
    D[idx] = factor
    rho = c
    for _ in range(g.n_layers + 1):  # an edge goes from an earlier block to a later one: nilpotent
        rho = D * (A_ff @ rho) / act + c
    return A_lf @ c, A_lf @ rho


def intervene(lm: LoadedModel, g: AttributionGraph, dictionaries, nodes, *, factor: float = 0.0) -> GraphIntervention:
    """Multiply the activations of the feature ``nodes`` of ``g`` (node ids,
    :func:`~lenscope.features.graphs.graph.node_id`;
    one feature, or a supernode's features: ``g.supernodes[k][1:]``) by ``factor`` (0: ablate, 2: steer up; negative
    allowed) in the real model, and compare the change of each logit node's input with the graph's predictions
    ``direct`` and ``frozen_total``. Both predictions are exact in the frozen replacement model and approximate in
    the real one (attention patterns, norm scales and active sets change); see the module's docstring.
    ``dictionaries``: the transcoders ``g`` was built with."""
    if not math.isfinite(factor):
        raise InputError(f"factor must be a finite number; got {factor}")
    idx = _feature_nodes(g, nodes)
    if g.model != lm.name:
        raise InputError(f"the graph is of model {g.model!r}, not {lm.name!r}; load the graph's model")
    dicts = transcoders_by_layer(lm, list(dictionaries))
    sites = [dicts[L].site for L in sorted(dicts)]
    if sites != list(g.sites):
        raise InputError(f"the dictionaries are for {sites}, the graph's for {list(g.sites)}; pass the transcoders "
                         "the graph was built with")
    ids = torch.tensor(g.input_ids, dtype=torch.long)
    layer, pos, feat = g.feature_layer[idx], g.feature_pos[idx], g.feature_index[idx]

    # one scale edit per block: a row of factors per position (1 except at the chosen latents)
    edits, capture = [], []
    for L in layer.unique().tolist():
        sel = layer == L
        ps, inv = pos[sel].unique(return_inverse=True)
        f = torch.ones(ps.numel(), dicts[L].width)
        f[inv, feat[sel]] = factor
        edits.append(Edit("mlp_out.latents", L, torch.zeros_like(ps), ps, f, mode="scale"))
        capture.append(("mlp_out.latents", L))
    base = run(lm, ids, capture=capture, dictionaries=dicts.attached, last_only=True)
    edited = run(lm, ids, edits=edits, dictionaries=dicts.attached, last_only=True)

    # the chosen latents in the unedited run are the graph's activations (else: other dictionaries, another prompt)
    got = torch.stack([base.captured[("mlp_out.latents", int(L))][0, int(p), int(f)].float()
                       for L, p, f in zip(layer, pos, feat)])
    want = g.feature_act[idx].float()
    tol = completeness_tolerance(lm)
    if not bool(((got - want).abs() <= tol * want.abs().clamp_min(1.0)).all()):
        raise InputError("the dictionaries' latents on the graph's prompt differ from the graph's feature "
                         "activations; pass the transcoders the graph was built with")

    readout = Readout.from_anatomy(lm.anatomy)

    def node_values(r) -> Tensor:
        return node_logits(readout.uncap(r.logits[0, -1].float()).double(), g.logit_ids, g.foil_id)

    real = node_values(edited) - node_values(base)
    direct, total = _predictions(g, idx, float(factor))
    return GraphIntervention(
        model=g.model, tokens=list(g.tokens), nodes=[node_id(g, int(i)) for i in idx], factor=float(factor),
        logit_ids=g.logit_ids.clone(), logit_tokens=list(g.logit_tokens), real=real, direct=direct,
        frozen_total=total, missing_features=int(g.n_active - g.n_features),
        direct_error=float((real - direct).abs().max()), total_error=float((real - total).abs().max()),
        scale=float(real.abs().max()))


__all__ = ["GraphIntervention", "intervene"]
