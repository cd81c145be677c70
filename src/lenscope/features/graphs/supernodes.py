"""Automatic supernodes: the feature nodes of a pruned attribution graph grouped by what they read and what they
write, each group kept as a supernode (:meth:`~lenscope.features.graphs.graph.AttributionGraph.group`, exported
as circuit-tracer's ``qParams.supernodes``), and every grouping checked by ablation in the real model.

**The profiles.** Over the nodes :func:`~lenscope.features.graphs.prune.prune` keeps, a feature node ``i``:

- *reads* its row of the adjacency over the kept sources (features, errors, tokens): ``A[i, s]``, signed;
- *writes* its column over the kept targets (features, logits), each target's entry divided by that target's
  summed absolute input and multiplied by its influence on the logits plus its logit weight:
  ``A[t, i] / sum_s |A[t, s]| * (influence_t + w_t)``, signed (circuit-tracer's edge score, its sign kept), so that
  an edge into a node that matters for the prediction counts more than one into a node that barely does.

The similarity of two feature nodes is the mean of the cosines of their reads and of their writes (in [-1, 1]; a
node without kept sources or targets has cosine 0 on that side), plus ``label_weight`` times the agreement of their
labels when labels are given (``{site: [label of each feature]}``, as
:func:`~lenscope.features.graphs.export.node_label` reads them; 1 for equal labels, else the share of the parts of
``"'token' → 'promoted'"`` labels that match): a bonus that tips close calls, never enough to join nodes whose
edges disagree.

**The grouping.** Average-linkage agglomerative clustering, deterministic: the pair of clusters with the largest
average pairwise similarity is merged first (ties: the lowest indices, the nodes in graph order), until ``n_groups``
clusters are left (singletons counted) or no allowed pair has an average similarity above ``threshold`` (default
0: nodes whose edges disagree more than they agree are never joined). Clusters of two or more nodes become
supernodes; singletons do not.

Two clusters may only merge when their nodes share **one position** and span at most ``layer_span`` consecutive
blocks (default ``ceil(n_layers / 6)``: 5 of SmolLM2's 30). Why a band and a position rather than free grouping: a
supernode is drawn as one box and read as one step of the path from the tokens to the logit; features many blocks
apart, or at different tokens, are different steps even when their edges look alike (a feature and the later one it
feeds both read the token and write the logit), and joining them hides the very path the graph is drawn to show.
The band also keeps the check meaningful: the members of a narrow band interact little through the nodes between
them, which the graph's direct prediction leaves out.

**The check.** :func:`check_supernodes` ablates each supernode (``factor`` 0, or any factor) in the real model
through the latent sites (:func:`~lenscope.features.graphs.check.intervene`, one real run per group) and compares the
change of the first logit node's input (the target's demeaned logit) with the graph's prediction (``direct``, or
``frozen_total``, exact in the frozen model only with every active feature a node); it reports both beside the real
change, the Spearman correlation over the groups (:func:`lenscope.stats.spearman`) and flags the groups whose
ablation disagrees with the graph: opposite signs, or sizes more than ``ratio`` apart (a change below ``floor`` of
the largest over the groups counts as none: two such changes agree).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ...errors import InputError
from ...results import Result, finite_json
from ...stats import spearman
from .graph import AttributionGraph, node_id

PREDICTIONS = ("direct", "frozen_total")


def _agreement(a: str | None, b: str | None) -> float:
    """How far two feature labels agree: 1 equal, else the share of their ``" → "`` parts that match; 0 without."""
    if not a or not b:
        return 0.0
    if a == b:
        return 1.0
    pa, pb = a.split(" → "), b.split(" → ")
    if len(pa) != len(pb) or len(pa) < 2:
        return 0.0
    return sum(x == y for x, y in zip(pa, pb)) / len(pa)


def _cos(X: Tensor) -> Tensor:
    n = X.norm(dim=1, keepdim=True)
    Xn = torch.where(n > 0, X / n.clamp_min(1e-300), torch.zeros_like(X))
    return Xn @ Xn.T


def feature_similarity(g: AttributionGraph, node_threshold: float = 0.8, edge_threshold: float = 0.98,
                       labels: dict | None = None, label_weight: float = 0.1) -> tuple[Tensor, Tensor]:
    """``(feats, S)``: the feature nodes of the pruned graph (node indices, graph order) and their pairwise
    similarity ``(n, n)`` float64 (see the module's docstring)."""
    from .export import node_label
    from .prune import logit_weights, node_influence, prune

    pr = prune(g, node_threshold, edge_threshold)
    o = g.offsets()
    kept = pr.node_mask.nonzero()[:, 0]
    feats = kept[kept < o["error"]]
    sources = kept[kept < o["logit"]]
    targets = torch.cat([feats, kept[kept >= o["logit"]]])
    A = g.adjacency
    reads = A[feats[:, None], sources[None, :]].double()
    weight = node_influence(g) + logit_weights(g)
    rowsum = A[targets].abs().double().sum(1)
    writes = (A[targets[:, None], feats[None, :]].double() / rowsum.clamp_min(1e-30)[:, None]
              * weight[targets][:, None]).T
    S = 0.5 * (_cos(reads) + _cos(writes))
    if labels and label_weight:
        lab = [node_label(g, g.node(int(i)), labels) for i in feats]
        agree = torch.tensor([[_agreement(a, b) for b in lab] for a in lab], dtype=torch.float64)
        S = S + label_weight * agree.reshape(S.shape)
    return feats, S


def agglomerate(S: Tensor, *, n_groups: int | None = None, threshold: float = 0.0, position: Tensor | None = None,
                layer: Tensor | None = None, layer_span: int | None = None) -> list[list[int]]:
    """Average-linkage agglomerative clustering of ``n`` items with similarity ``S (n, n)``: the clusters (lists of
    item indices, each sorted, ordered by their first item), every item in exactly one. Merges the allowed pair of
    clusters of largest average similarity (ties: lowest indices) while it is above ``threshold`` and more than
    ``n_groups`` clusters are left (None: no count). Allowed: every item of both at one ``position`` (when given)
    and their ``layer`` s within ``layer_span`` consecutive values (when given)."""
    n = S.shape[0]
    if S.shape != (n, n):
        raise InputError(f"a similarity matrix must be square; got {tuple(S.shape)}")
    if n_groups is not None and n_groups < 1:
        raise InputError(f"n_groups must be at least 1; got {n_groups}")
    if layer_span is not None and layer_span < 1:
        raise InputError(f"layer_span must be at least 1; got {layer_span}")
    avg = S.double().clone()
    size = torch.ones(n, dtype=torch.float64)
    alive = torch.ones(n, dtype=torch.bool)
    pos = torch.zeros(n, dtype=torch.long) if position is None else position.long().clone()
    lo = torch.zeros(n, dtype=torch.long) if layer is None else layer.long().clone()
    hi = lo.clone()
    span = None if layer is None else layer_span

    def allowed_with(a: int) -> Tensor:
        ok = alive & (pos == pos[a])
        if span is not None:
            ok &= (torch.maximum(hi, hi[a]) - torch.minimum(lo, lo[a])) < span
        ok[a] = False
        return ok

    allowed = torch.stack([allowed_with(a) for a in range(n)]) if n else torch.zeros(0, 0, dtype=torch.bool)
    upper = torch.ones(n, n, dtype=torch.bool).triu(1)
    members = [[i] for i in range(n)]
    left = n
    while left > 1 and (n_groups is None or left > n_groups):
        cand = torch.where(allowed & upper, avg, torch.full_like(avg, -math.inf))
        best = int(cand.flatten().argmax())  # the first of equal maxima: the lowest (a, b)
        a, b = divmod(best, n)
        if not float(cand[a, b]) > threshold:
            break
        na, nb = size[a], size[b]
        avg[a] = (na * avg[a] + nb * avg[b]) / (na + nb)
        avg[:, a] = avg[a]
        size[a] = na + nb
        lo[a], hi[a] = min(lo[a], lo[b]), max(hi[a], hi[b])
        alive[b] = False
        members[a] = sorted(members[a] + members[b])
        members[b] = []
        allowed[b] = False
        allowed[:, b] = False
        allowed[a] = allowed_with(a)
        allowed[:, a] = allowed[a]
        left -= 1
    return sorted((m for m in members if m), key=lambda m: m[0])


def _group_label(g: AttributionGraph, idx: list[int], labels: dict | None, influence: Tensor) -> str:
    """``"<label> · L3-5 @4 ' Dallas'"``: the members' most common label (ties: the most influential member's),
    where labels are given, then the block range and the position."""
    from .export import node_label

    layers = [int(g.feature_layer[i]) for i in idx]
    p = int(g.feature_pos[idx[0]])
    lo, hi = min(layers), max(layers)
    where = f"L{lo}" + (f"-{hi}" if hi > lo else "") + f" @{p} {g.tokens[p]!r}"
    if not labels:
        return where
    lab = [node_label(g, g.node(i), labels) for i in sorted(idx, key=lambda i: -float(influence[i]))]
    lab = [x for x in lab if x]
    if not lab:
        return where
    top = max(lab, key=lambda x: (lab.count(x), -lab.index(x)))
    return f"{top} · {where}"


def auto_supernodes(g: AttributionGraph, *, n_groups: int | None = None, threshold: float = 0.0,
                    layer_span: int | None = None, labels: dict | None = None, label_weight: float = 0.1,
                    node_threshold: float = 0.8, edge_threshold: float = 0.98) -> list[list]:
    """Group the feature nodes of ``g`` pruned with ``node_threshold`` and ``edge_threshold`` (see the module's
    docstring) and add each group of two or more as a supernode (``g.group``); returns the new supernodes
    (``[label, id, ...]``, the ids in graph order). ``n_groups``: the clusters (singletons counted) to merge down to;
    ``threshold``: the least average similarity a merge needs; ``layer_span``: the most consecutive blocks a group
    spans (default ``ceil(n_layers / 6)``)."""
    from .prune import node_influence

    if not math.isfinite(threshold) or not math.isfinite(label_weight) or label_weight < 0:
        raise InputError(f"threshold must be a finite number and label_weight at least 0; got {threshold}, "
                         f"{label_weight}")
    span = max(1, math.ceil(g.n_layers / 6)) if layer_span is None else layer_span
    feats, S = feature_similarity(g, node_threshold, edge_threshold, labels, label_weight)
    groups = agglomerate(S, n_groups=n_groups, threshold=threshold, position=g.feature_pos[feats],
                         layer=g.feature_layer[feats], layer_span=span)
    inf = node_influence(g)
    taken = {sn[0] for sn in g.supernodes}
    out = []
    for grp in groups:
        if len(grp) < 2:
            continue
        idx = [int(feats[i]) for i in grp]
        label = base = _group_label(g, idx, labels, inf)
        k = 2
        while label in taken:
            label, k = f"{base} ({k})", k + 1
        taken.add(label)
        out.append(g.group(label, [node_id(g, i) for i in idx]))
    return out


@dataclass(repr=False)
class SupernodeCheck(Result):
    """Each supernode of a graph ablated (``factor``) in the real model: the change of the first logit node's input
    (``logit_token``; ``real``) beside the graph's ``direct`` and ``frozen_total`` predictions, ``(group,)`` float64
    each, in the order of ``labels`` (``nodes``: each group's feature node ids); ``prediction``: the one compared;
    ``spearman_direct``, ``spearman_frozen_total``: the rank correlations over the groups (NaN with fewer than two
    groups or a constant side); ``flags``: per group ``""`` or why it disagrees (``"sign"``, ``"size"``: more than
    ``ratio`` apart; below ``floor`` of the largest change a change counts as none); ``skipped``: the supernodes
    without a feature node, not ablated; ``missing_features``: the active features that are not nodes, whose
    responses ``frozen_total`` leaves out."""

    model: str
    tokens: list[str]
    logit_token: str
    labels: list[str]
    nodes: list[list[str]]
    factor: float
    prediction: str
    ratio: float
    floor: float
    real: Tensor
    direct: Tensor
    frozen_total: Tensor
    spearman_direct: float
    spearman_frozen_total: float
    flags: list[str]
    skipped: list[str]
    missing_features: int

    @property
    def predicted(self) -> Tensor:
        return getattr(self, self.prediction)

    @property
    def spearman(self) -> float:
        """The rank correlation of the real changes with the compared prediction."""
        return getattr(self, f"spearman_{self.prediction}")

    @property
    def flagged(self) -> list[dict]:
        return [{"label": la, "reason": f, "real": float(r), "predicted": float(p)}
                for la, f, r, p in zip(self.labels, self.flags, self.real, self.predicted) if f]

    def to_frame(self):
        """One row per supernode: its label, size, the real change, both predictions and its flag."""
        import pandas as pd

        return pd.DataFrame({"label": self.labels, "n_features": [len(x) for x in self.nodes],
                             "real": self.real.tolist(), "direct": self.direct.tolist(),
                             "frozen_total": self.frozen_total.tolist(), "predicted": self.predicted.tolist(),
                             "flag": self.flags})

    def to_dict(self) -> dict:
        rows = self.to_frame().to_dict(orient="records")
        for r, ids in zip(rows, self.nodes):
            r["nodes"] = list(ids)
        return finite_json({
            "model": self.model, "logit_token": self.logit_token, "factor": self.factor,
            "prediction": self.prediction, "spearman": self.spearman, "spearman_direct": self.spearman_direct,
            "spearman_frozen_total": self.spearman_frozen_total, "ratio": self.ratio, "floor": self.floor,
            "flagged": self.flagged, "groups": rows, "skipped": self.skipped,
            "missing_features": self.missing_features})

    def __repr__(self) -> str:
        return (f"SupernodeCheck({len(self.labels)} supernodes x {self.factor:g}, Spearman {self.spearman:.3f} "
                f"against {self.prediction}, {len(self.flagged)} flagged)")


def disagreements(real: Tensor, predicted: Tensor, ratio: float = 2.0, floor: float = 0.01) -> list[str]:
    """Per pair ``""`` or why the real change and the prediction disagree: ``"sign"`` (opposite signs) or ``"size"``
    (more than ``ratio`` apart); a value below ``floor`` times the largest ``|value|`` of both counts as 0 (two
    such agree; one such against a larger other: ``"size"`` when that is more than ``ratio`` times the floor)."""
    r, p = real.double(), predicted.double()
    big = float(torch.cat([r.abs(), p.abs()]).max()) if r.numel() else 0.0
    eps = floor * big
    out = []
    for a, b in zip(r.tolist(), p.tolist()):
        sa, sb = abs(a) > eps, abs(b) > eps
        if sa and sb and (a > 0) != (b > 0):
            out.append("sign")
        elif max(abs(a), abs(b)) > ratio * max(min(abs(a), abs(b)), eps) and (sa or sb):
            out.append("size")
        else:
            out.append("")
    return out


def check_supernodes(lm, g: AttributionGraph, dictionaries, *, factor: float = 0.0, supernodes: list | None = None,
                     prediction: str = "direct", ratio: float = 2.0, floor: float = 0.01) -> SupernodeCheck:
    """Ablate (``factor`` 0; any factor allowed) each supernode of ``g`` (default ``g.supernodes``; their feature
    nodes, other ids left out) in the real model through the latent sites
    (:func:`~lenscope.features.graphs.check.intervene`, one run each) and compare the change of the first logit
    node's input with the graph's ``prediction`` (``"direct"`` or ``"frozen_total"``); see the module's
    docstring. ``dictionaries``: the transcoders ``g`` was built with."""
    from .check import intervene

    if prediction not in PREDICTIONS:
        raise InputError(f"prediction must be one of {', '.join(PREDICTIONS)}; got {prediction!r}")
    if not (math.isfinite(ratio) and ratio >= 1) or not (math.isfinite(floor) and 0 <= floor < 1):
        raise InputError(f"ratio must be at least 1 and floor in [0, 1); got {ratio}, {floor}")
    sns = g.supernodes if supernodes is None else supernodes
    if not sns:
        raise InputError("the graph has no supernodes to check; group some first (auto_supernodes, g.group, "
                         "or --supernodes N)")
    feature_ids = {node_id(g, i) for i in range(g.n_features)}
    labels, nodes, skipped, rows = [], [], [], []
    for sn in sns:
        ids = [x for x in sn[1:] if x in feature_ids]
        if not ids:
            skipped.append(str(sn[0]))
            continue
        res = intervene(lm, g, dictionaries, ids, factor=factor)
        labels.append(str(sn[0]))
        nodes.append(res.nodes)
        rows.append((float(res.real[0]), float(res.direct[0]), float(res.frozen_total[0])))
    if not rows:
        raise InputError(f"no supernode holds a feature node of the graph (skipped: {skipped[:5]})")
    real, direct, total = torch.tensor(rows, dtype=torch.float64).T.contiguous()
    chosen = direct if prediction == "direct" else total
    return SupernodeCheck(
        model=g.model, tokens=list(g.tokens), logit_token=g.logit_tokens[0], labels=labels, nodes=nodes,
        factor=float(factor), prediction=prediction, ratio=float(ratio), floor=float(floor), real=real,
        direct=direct, frozen_total=total, spearman_direct=spearman(real, direct) if len(rows) > 1 else math.nan,
        spearman_frozen_total=spearman(real, total) if len(rows) > 1 else math.nan,
        flags=disagreements(real, chosen, ratio, floor), skipped=skipped,
        missing_features=int(g.n_active - g.n_features))


def pooled_spearman(checks: list[SupernodeCheck], prediction: str | None = None) -> float:
    """The Spearman correlation of the real changes with the prediction over every group of several checks (several
    prompts); ``prediction`` default each check's."""
    if not checks:
        raise InputError("pooled_spearman needs at least one check")
    real = torch.cat([c.real for c in checks])
    pred = torch.cat([getattr(c, prediction) if prediction else c.predicted for c in checks])
    return spearman(real, pred) if real.numel() > 1 else math.nan


__all__ = ["PREDICTIONS", "SupernodeCheck", "agglomerate", "auto_supernodes", "check_supernodes", "disagreements",
           "feature_similarity", "pooled_spearman"]
