"""Attribution graphs (Ameisen et al. 2025, circuit-tracer): one prediction explained as a graph of transcoder
features, exact, on a CPU.

The model's MLPs are replaced by transcoders and everything non-linear is frozen at the real run
(:mod:`lenscope.features.graphs.replacement`), so each node's input is an exact affine function of the nodes before it:

    input_t = sum_s A[t, s] + bias_t

Nodes (circuit-tracer's order): the selected transcoder **features** (active latents: ``(layer, position,
latent)``; input: the pre-activation, output: the activation, equal under the frozen active set), the **error**
nodes (one per block and position: the MLP output minus its transcoder's; a block without a transcoder: its whole
MLP output), the **token** nodes (one per position: the embedding, position embeddings and scale included) and the
**logit** nodes (the target, or the most probable next tokens up to cumulative probability 0.95, at most 10;
input: the logit minus the mean logit over the vocabulary, before any soft-cap). ``A[t, s]`` is the direct effect of
``s``'s output on ``t``'s input through the frozen model, computed with batched backward passes (one pass per
batch of targets, each row of the batch one target). ``bias_t`` holds everything constant (biases, the first
position's MLP outputs when the prompt opens with a special token, the features left out by
``max_feature_nodes``: :attr:`AttributionGraph.dropped`).

Checked on every call (:class:`~lenscope.errors.InvariantError` beyond the bound): every target's input equals
the sum of its incoming edges plus its bias terms to float32's rounding of the sum of its terms' sizes
(:func:`~lenscope.features.graphs.replacement.parts_rounding`; the frozen model runs in float32 whatever the model's
dtype), and the frozen model reproduces the real run's pre-activations and logits to the model dtype's rounding
(:func:`~lenscope.models.runtime.verify.completeness_tolerance`, relative to the node's largest term).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ...errors import InputError, InvariantError
from ...models.loading.load import LoadedModel, encode, require_decoder
from ...models.runtime.request import Request, token_texts
from ...models.runtime.stop import checkpoint
from ...models.runtime.trace import trace
from ...models.runtime.verify import completeness_tolerance
from ...results import Result, axis_size
from ...viz.notebook import ReportView
from .memory import fit_memory
from .prune import CHUNK
from .replacement import Frozen, active_counts, check_parts, node_logits, transcoders_by_layer

KINDS = ("feature", "error", "token", "logit")


@dataclass(repr=False)
class AttributionGraph(ReportView, Result):
    """An attribution graph (see the module's docstring). Nodes in circuit-tracer's order: ``n_features`` features
    (``feature_layer``, ``feature_pos``, ``feature_index``, ``feature_act``), ``n_layers * n_pos`` error nodes
    (block-major), ``n_pos`` token nodes, the logit nodes (``logit_ids``, ``logit_probs``, ``logit_tokens``; with a
    ``foil_id``, one contrastive node: the target's logit minus the foil's, labelled ``"'target' − 'foil'"``).
    ``adjacency (node, node)``: ``A[target, source]``; ``inputs (node,)``: each feature's pre-activation and each
    logit's demeaned logit as the frozen model computes them (0 for errors and tokens); ``biases (node,)``: their
    bias terms; ``dropped (node,)``: what the features left out by ``max_feature_nodes`` add (part of the bias terms);
    ``exactness_error``: the largest ``|input - sum(A row) - bias|`` relative to the sum of the sizes of the node's
    terms (at most ``parts_rounding(n_layers)``); ``real_error``: the frozen model against the real run, relative to
    the node's largest term (at most ``tolerance``, the model dtype's bound)."""

    VIEW = "graph"  # its view: drawn by viz/views/graph/graph.js (lenscope.viz.views)

    model: str
    tokens: list[str]
    input_ids: list[int]
    sites: list[str]
    n_layers: int
    feature_layer: Tensor
    feature_pos: Tensor
    feature_index: Tensor
    feature_act: Tensor
    error_norm: Tensor
    logit_ids: Tensor
    logit_probs: Tensor
    logit_tokens: list[str]
    adjacency: Tensor
    inputs: Tensor
    biases: Tensor
    dropped: Tensor
    n_active: int
    exactness_error: float
    real_error: float
    tolerance: float
    seconds: float
    skip_first: bool = False
    supernodes: list = field(default_factory=list)
    head_edges: Tensor | None = None  # (n, 2) [target, source]: the edges split over heads (set_heads)
    head_parts: Tensor | None = None  # (n, layer, head)
    head_residual: Tensor | None = None  # (n,)
    head_error: float | None = None
    foil_id: int | None = None  # a contrastive graph: its one logit node reads logit(target) - logit(foil)

    def set_heads(self, eh) -> None:
        """Keep the head split of edges (:func:`lenscope.features.graphs.heads.edge_heads`) in the graph (its file,
        the links of :meth:`to_dict`)."""
        self.head_edges, self.head_parts, self.head_residual, self.head_error = (eh.edges, eh.heads, eh.residual,
                                                                                 eh.error)

    def heads_of(self, target: int, source: int, top: int = 8, share: float = 0.05) -> list[dict] | None:
        """The heads carrying edge ``source -> target`` (node indices), largest first: ``{layer, head, weight}``
        for the parts of at least ``share`` of the largest part, at most ``top``, plus ``{"residual": weight}``
        (the part without attention) when not zero; None when the edge's split was not computed."""
        if self.head_edges is None:
            return None
        hit = ((self.head_edges[:, 0] == target) & (self.head_edges[:, 1] == source)).nonzero()
        if not hit.numel():
            return None
        parts = self.head_parts[int(hit[0, 0])]
        flat = parts.flatten()
        big = float(flat.abs().max()) if flat.numel() else 0.0
        order = flat.abs().argsort(descending=True)[:top]
        H = parts.shape[1]
        out = [{"layer": int(i) // H, "head": int(i) % H, "weight": float(flat[i])} for i in order.tolist()
               if big > 0 and abs(float(flat[i])) >= share * big]
        r = float(self.head_residual[int(hit[0, 0])])
        return out + ([{"residual": r}] if r != 0.0 else [])

    # -- node bookkeeping ------------------------------------------------------------------------------------------

    @property
    def n_pos(self) -> int:
        return len(self.tokens)

    n_features = axis_size("feature_layer", 0)
    n_logits = axis_size("logit_ids", 0)
    n_nodes = axis_size("adjacency", 0)

    def offsets(self) -> dict[str, int]:
        """Where each kind's nodes start: ``feature``, ``error``, ``token``, ``logit`` (and ``end``)."""
        f = self.n_features
        e = f + self.n_layers * self.n_pos
        t = e + self.n_pos
        return {"feature": 0, "error": f, "token": e, "logit": t, "end": t + self.n_logits}

    def kinds(self) -> list[str]:
        o = self.offsets()
        return [k for k, a, b in zip(KINDS, [o[k] for k in KINDS], [o[k] for k in KINDS[1:]] + [o["end"]])
                for _ in range(b - a)]

    def node(self, i: int) -> dict:
        """Node ``i`` as ``{id, kind, layer, position, feature, activation, token}`` (``id``: lenscope's node name,
        circuit-tracer's ``node_id``: :func:`node_id`)."""
        o = self.offsets()
        if i < o["error"]:
            L, p, f = int(self.feature_layer[i]), int(self.feature_pos[i]), int(self.feature_index[i])
            rec = {"kind": "feature", "layer": L, "position": p, "feature": f, "activation": float(self.feature_act[i])}
        elif i < o["token"]:
            L, p = divmod(i - o["error"], self.n_pos)
            rec = {"kind": "error", "layer": L, "position": p, "feature": None,
                   "activation": float(self.error_norm[L, p])}
        elif i < o["logit"]:
            p = i - o["token"]
            rec = {"kind": "token", "layer": None, "position": p, "feature": None, "activation": None}
        else:
            k = i - o["logit"]
            rec = {"kind": "logit", "layer": self.n_layers, "position": self.n_pos - 1,
                   "feature": int(self.logit_ids[k]), "activation": float(self.logit_probs[k])}
        rec["token"] = self.tokens[rec["position"]]
        rec["id"] = node_id(self, i, rec)
        return rec

    def group(self, label: str, ids: list[str]) -> list:
        """Group nodes (their ids, :func:`node_id`) into a supernode named ``label``, kept in the graph's file and
        exported to circuit-tracer's ``qParams.supernodes`` as ``[label, id, ...]``; returns it."""
        known = {node_id(self, i) for i in range(self.n_nodes)}
        missing = [i for i in ids if i not in known]
        if not label or not ids or missing:
            raise InputError(f"a supernode needs a label and node ids of this graph; unknown: {missing[:5]}")
        sn = [str(label), *map(str, ids)]
        self.supernodes.append(sn)
        return sn

    def nodes(self) -> list[dict]:
        return [self.node(i) for i in range(self.n_nodes)]

    def to_frame(self):
        """The nodes, one row each, with their input, bias terms and influence on the logits."""
        import pandas as pd

        from .prune import node_influence

        inf = node_influence(self)
        rows = [{**self.node(i), "input": float(self.inputs[i]), "bias": float(self.biases[i]),
                 "influence": float(inf[i])} for i in range(self.n_nodes)]
        return pd.DataFrame(rows, columns=["id", "kind", "layer", "position", "token", "feature", "activation",
                                           "input", "bias", "influence"])

    def edges_frame(self, min_abs: float = 0.0):
        """The edges (``source``, ``target``, ``weight``) with ``|weight| > min_abs``."""
        import pandas as pd

        t, s = (self.adjacency.abs() > min_abs).nonzero(as_tuple=True)
        ids = [node_id(self, i) for i in range(self.n_nodes)]
        return pd.DataFrame({"source": [ids[i] for i in s.tolist()], "target": [ids[i] for i in t.tolist()],
                             "weight": self.adjacency[t, s].tolist()})

    def to_dict(self, node_threshold: float = 0.8, edge_threshold: float = 0.98, labels: dict | None = None) -> dict:
        """The pruned graph as the CLI's JSON (``nodes``, ``links``, scores, checks, ``first_position_share``: see
        :func:`.prune.first_position_share`); with ``labels`` (``{site: [label of each feature]}``) each feature node's
        ``label`` (None where its site has none)."""
        from .export import node_label
        from .prune import first_position_share, graph_scores, prune

        pr = prune(self, node_threshold, edge_threshold)
        keep = pr.node_mask.nonzero()[:, 0].tolist()
        nodes = []
        for i in keep:
            rec = self.node(i)
            rec["influence"] = float(pr.influence[i])
            nodes.append({**rec, "label": node_label(self, rec, labels)} if labels and rec["kind"] == "feature"
                         else rec)
        ids = {i: node_id(self, i) for i in keep}
        t, s = pr.edge_mask.nonzero(as_tuple=True)
        links = [{"source": ids[b], "target": ids[a], "weight": float(self.adjacency[a, b])}
                 for a, b in zip(t.tolist(), s.tolist()) if a in ids and b in ids]
        if self.head_edges is not None:
            for link, (a, b) in zip(links, [(a, b) for a, b in zip(t.tolist(), s.tolist()) if a in ids and b in ids]):
                heads = self.heads_of(a, b)
                if heads is not None:
                    link["heads"] = heads
        rep, comp, first = *graph_scores(self), first_position_share(self)
        return {"model": self.model, "tokens": self.tokens, "sites": self.sites, "nodes": nodes, "links": links,
                "replacement_score": rep, "completeness_score": comp, "max_exactness_error": self.exactness_error,
                "real_error": self.real_error, "tolerance": self.tolerance, "n_active_features": self.n_active,
                "n_feature_nodes": self.n_features, "node_threshold": node_threshold, "edge_threshold": edge_threshold,
                "seconds": self.seconds, "supernodes": self.supernodes, "head_error": self.head_error,
                "foil_id": self.foil_id, "skip_first": self.skip_first, "first_position_share": first}

    def __repr__(self) -> str:
        return (f"AttributionGraph({self.n_pos} tokens, {self.n_features} of {self.n_active} active features, "
                f"{self.n_logits} logits, {self.n_nodes} nodes, exactness_error={self.exactness_error:.1e})")


def node_id(g: AttributionGraph, i: int, rec: dict | None = None) -> str:
    """circuit-tracer's node id: ``"{layer}_{latent}_{pos}"`` (feature), ``"{layer}_-1_{pos}"`` (error; circuit-tracer
    0.5 writes ``"0_{layer}_{pos}"``, which is also the id of the layer-0 feature ``{layer}`` at ``{pos}``),
    ``"E_{token id}_{pos}"`` (token), ``"{n_layers + 1}_{token id}_{pos}"`` (logit; circuit-tracer numbers the
    logits' layer one past the embedding's)."""
    rec = rec or g.node(i)
    k, p = rec["kind"], rec["position"]
    if k == "feature":
        return f"{rec['layer']}_{rec['feature']}_{p}"
    if k == "error":
        return f"{rec['layer']}_-1_{p}"
    if k == "token":
        return f"E_{g.input_ids[p]}_{p}"
    return f"{g.n_layers + 1}_{rec['feature']}_{p}"


def _logit_labels(lm: LoadedModel, ids: Tensor, foil: int | None) -> list[str]:
    """The logit nodes' labels: each token's text, or ``"target − foil"`` for a contrastive node."""
    texts = token_texts(lm, ids)
    return texts if foil is None else [f"{t!r} − {token_texts(lm, [foil])[0]!r}" for t in texts]


def _logit_nodes(lm: LoadedModel, logits: Tensor, target, max_logits: int, logit_prob: float) -> Tensor:
    if target is not None:
        return torch.tensor([Request.of(lm, target).target])
    if max_logits < 1 or not 0 < logit_prob <= 1:
        raise InputError("max_logits must be at least 1 and logit_prob in (0, 1]")
    probs = logits.float().softmax(-1)
    top_p, top_i = probs.topk(min(max_logits, probs.numel()))
    n = int(torch.searchsorted(top_p.cumsum(0), torch.tensor(logit_prob))) + 1
    return top_i[: min(n, top_i.numel())]


class Rows:
    """Rows of the adjacency over every source (all active features, errors, tokens), by batched backward passes
    through the frozen model's one forward graph."""

    def __init__(self, fz: Frozen, last: int, batch_size: int):
        self.fz, self.last, self.batch = fz, last, batch_size
        # leaves per block (a block's slice of the activations, its error nodes): no gather in the backward
        self.emb = fz.emb.clone().requires_grad_()
        self.acts = {L: a.clone().requires_grad_() for L, a in fz.split(fz.acts).items()}
        self.errs = [e.clone().requires_grad_() for e in fz.errs.unbind(0)]
        self.keep: dict = {}
        self.mlp_in, self.final = fz.forward(self.emb, self.acts, self.errs, keep=self.keep)

    def _edges(self, out: Tensor, G: Tensor) -> Tensor:
        fz, B = self.fz, G.shape[0]
        layers = sorted(self.acts)
        ins = [self.emb] + [self.acts[L] for L in layers] + self.errs
        g = torch.autograd.grad(out, ins, G, retain_graph=True, allow_unused=True, is_grads_batched=True)
        g = [torch.zeros((B,) + x.shape, dtype=x.dtype) if gi is None else gi for gi, x in zip(g, ins)]
        tok = (g[0] * fz.emb).sum(-1)
        feat = torch.cat([g[1 + k] * self.acts[L].detach() for k, L in enumerate(layers)], 1) if layers else \
            torch.zeros(B, 0, dtype=fz.dtype)
        err = (torch.stack(g[1 + len(layers):], 1) * fz.errs).sum(-1).reshape(B, -1)
        return torch.cat([feat, err, tok], 1)

    def features(self, which: Tensor) -> Tensor:
        """Rows ``(len(which), n_sources)`` of active features ``which``."""
        fz = self.fz
        out = torch.empty(which.numel(), fz.n_active + fz.errs.shape[0] * fz.P + fz.P, dtype=fz.dtype)
        for L in fz.layer[which].unique().tolist():
            sel = (fz.layer[which] == L).nonzero()[:, 0]
            d = fz.dicts[L]
            for a in range(0, sel.numel(), self.batch):
                checkpoint()
                rows = sel[a: a + self.batch]
                idx = which[rows]
                G = torch.zeros(rows.numel(), fz.P, self.mlp_in[L].shape[-1], dtype=fz.dtype)
                G[torch.arange(rows.numel()), fz.pos[idx]] = d.W_enc[:, fz.feature[idx]].T
                out[rows] = self._edges(self.mlp_in[L], G)
        return out

    def logits(self, ids: Tensor, foil: int | None = None) -> Tensor:
        fz = self.fz
        G = torch.zeros(ids.numel(), fz.P, self.final.shape[-1], dtype=fz.dtype)
        G[:, self.last] = fz.logit_pullbacks(self.last, ids, foil)
        return self._edges(self.final, G)


def _partial_influence(rows_f: Tensor, row_nodes: Tensor, rows_l: Tensor, probs: Tensor, n_src: int,
                       iters: int = 128) -> Tensor:
    """circuit-tracer's influence estimate over the rows computed so far: ``w M + w M^2 + ...`` with ``M`` the
    computed rows normalised by their absolute sums, ``w`` the logit probabilities; ``(n_src,)``."""
    def norm(M):
        M = M.abs()
        return M / M.sum(1, keepdim=True).clamp_min(1e-8)

    Mf, Ml = norm(rows_f), norm(rows_l)
    cur = probs.to(Ml) @ Ml
    total = cur.clone()
    for _ in range(iters):
        if not rows_f.shape[0]:
            break
        cur = cur[row_nodes] @ Mf
        if not bool(cur.any()):
            break
        total += cur
    return total[:n_src] if total.numel() >= n_src else total


def attribution_graph(lm: LoadedModel, text, dictionaries, *, target=None, foil=None, max_logits: int = 10,
                      logit_prob: float = 0.95, max_feature_nodes: int | None = None, batch_size: int = 256,
                      zero_bos: bool = True, max_memory: int | str | None = None,
                      progress: bool = False) -> AttributionGraph:
    """The attribution graph of the next-token prediction after ``text`` (a string or token ids), with
    ``dictionaries`` (transcoders, at most one per block; blocks without one: their MLP output is an error node).
    ``target``: one token (text, ``"#ID"`` or id) as the only logit node; default the most probable tokens up to
    ``logit_prob``, at most ``max_logits``. ``foil`` (with ``target``): one contrastive logit node, the target's
    logit minus the foil's (IOI's `` Mary`` vs `` John``), whose edges are the target's minus the foil's.
    ``max_feature_nodes``: compute the rows of at most that many features,
    chosen by their influence on the logits as the rows come in (circuit-tracer's order); the others' effects stay
    in the bias terms. ``zero_bos``: a first token that is a special token (BOS) gets no feature nodes.
    ``max_memory``: the memory budget (bytes or a size such as ``"8GB"``; default: :func:`lenscope.memory.budget`'s,
    a safe share of the memory available at the call): once the active features are known, the peak is estimated
    (:class:`~.memory.GraphMemory`); over the budget, ``batch_size`` is lowered as far as needed, and where even one
    row a pass does not fit, an :class:`~lenscope.errors.InputError` names the most feature nodes that do."""
    from ...memory import budget

    t0 = time.perf_counter()
    limit = budget(max_memory)
    require_decoder(lm, "an attribution graph", causal=True, instead="use a causal decoder (e.g. smollm2)")
    dicts = transcoders_by_layer(lm, list(dictionaries))
    if not dicts:
        raise InputError("no transcoder given (--dict): an attribution graph needs at least one")
    if batch_size < 1 or (max_feature_nodes is not None and max_feature_nodes < 0):
        raise InputError("batch_size must be at least 1 and max_feature_nodes at least 0")
    ids = encode(lm, text) if isinstance(text, str) else torch.as_tensor(text).long().flatten()
    tr = trace(lm, ids)
    P, last = len(tr.tokens), len(tr.tokens) - 1
    special = set(getattr(lm.tokenizer, "all_special_ids", []) or [])
    skip_first = bool(zero_bos and P > 1 and int(ids[0]) in special)
    log = (lambda m: print(m, file=sys.stderr, flush=True)) if progress else (lambda m: None)
    foil_id = None if foil is None else Request.of(lm, target, foil, distinct=True).foil
    logit_ids = _logit_nodes(lm, tr.logits[last], target, max_logits, logit_prob)
    probs = tr.logits[last].float().softmax(-1)[logit_ids]
    # the memory it will take, from the active features' counts, before the frozen model holds anything
    batch = fit_memory(lm, tr, dicts, active_counts(tr, dicts, skip_first=skip_first), max_feature_nodes,
                       logit_ids.numel(), batch_size, limit, log)
    fz = Frozen(lm, tr, dicts, skip_first=skip_first)
    cap = fz.n_active if max_feature_nodes is None else min(max_feature_nodes, fz.n_active)
    rows = Rows(fz, last, batch)
    n_err, n_src = fz.n_layers * P, fz.n_active + fz.n_layers * P + P
    log(f"attribution graph: {P} tokens, {fz.n_active} active features, {logit_ids.numel()} logits")
    R_logit = rows.logits(logit_ids, foil_id)

    if cap == fz.n_active:
        chosen = torch.arange(fz.n_active)
        R_feat = rows.features(chosen) if cap else torch.zeros(0, n_src)
    else:  # rows in order of influence on the logits, estimated from the rows computed so far
        chosen, parts = torch.zeros(0, dtype=torch.long), []
        R_feat = torch.zeros(0, n_src)
        while chosen.numel() < cap:
            inf = _partial_influence(R_feat, chosen, R_logit, probs, n_src)[: fz.n_active].clone()
            inf[chosen] = -1
            n = min(cap - chosen.numel(), batch_size * 4)
            pick = inf.topk(n).indices
            parts.append(rows.features(pick))
            chosen = torch.cat([chosen, pick])
            R_feat = torch.cat(parts)
            parts = [R_feat]  # one copy of the rows so far (GraphMemory's ``rows``, twice while they grow)
            log(f"  {chosen.numel()} of {cap} feature rows")
        del parts
        order = chosen.argsort()
        chosen, R_feat = chosen[order], R_feat[order]

    # inputs from the frozen model at the real node values, and bias terms from it with every node at zero
    with torch.no_grad():
        in_f = fz.pre_of([m.detach() for m in rows.mlp_in], chosen)
        in_l = fz.logit_inputs(rows.final.detach(), last, logit_ids, foil_id)
        m0, h0 = fz.forward(torch.zeros_like(fz.emb), torch.zeros_like(fz.acts), torch.zeros_like(fz.errs))
        b_f, b_l = fz.pre_of(m0, chosen), fz.logit_inputs(h0, last, logit_ids, foil_id)
    real_l = node_logits(fz.readout.uncap(tr.logits[last].float()), logit_ids, foil_id)
    real_f = fz.pre[chosen]

    # the graph: the chosen features' columns, the others' edges into the bias terms
    keep_cols = torch.cat([chosen, torch.arange(fz.n_active, n_src)])
    n_f, n_l = chosen.numel(), logit_ids.numel()
    N = n_f + n_err + P + n_l
    adj = torch.zeros(N, N, dtype=torch.float32)
    src = slice(0, n_f + n_err + P)
    other = torch.ones(fz.n_active, dtype=torch.bool)
    other[chosen] = False
    dropped = torch.zeros(N)
    for a in range(0, n_f, CHUNK):  # a chunk of rows at a time: no copy of every row (GraphMemory's ``check``)
        b = min(a + CHUNK, n_f)
        adj[a:b, src] = R_feat[a:b, keep_cols]
        dropped[a:b] = R_feat[a:b, : fz.n_active][:, other].sum(1)
    adj[N - n_l:, src] = R_logit[:, keep_cols]
    dropped[N - n_l:] = R_logit[:, : fz.n_active][:, other].sum(1)
    inputs, biases, real = torch.zeros(N), torch.zeros(N), torch.zeros(N)
    for vec, f_part, l_part in ((inputs, in_f, in_l), (biases, b_f, b_l), (real, real_f, real_l)):
        vec[:n_f], vec[N - n_l:] = f_part, l_part
    biases = biases + dropped

    # every target's input = its edges + its bias terms, to float32's rounding of the sizes of its terms (every
    # source's, the dropped features' included: replacement.parts_rounding), whatever the model's dtype; the frozen
    # model against the real run: to the model dtype's rounding (completeness_tolerance)
    targets = torch.cat([torch.arange(n_f), torch.arange(N - n_l, N)])
    # the sizes of every target's terms: all its sources' edges (the dropped features' too) and its bias terms
    rows_abs = [R_feat[a: a + CHUNK].double().abs().sum(1) for a in range(0, n_f, CHUNK)]
    size = torch.cat([*rows_abs, R_logit.double().abs().sum(1)]) + torch.cat([b_f, b_l]).double().abs()
    ratios, reals = [], []
    for a in range(0, targets.numel(), CHUNK):
        t = targets[a: a + CHUNK]
        A_t = adj[t].double()
        gap = inputs[t].double() - A_t.sum(1) - biases[t].double()
        ratios.append(check_parts("attribution graph: a node's edges and bias terms miss its input", gap,
                                  size[a: a + CHUNK], fz.n_layers))
        scale = torch.maximum(A_t.abs().amax(1), biases[t].double().abs()).clamp_min(1.0)
        reals.append(((inputs[t] - real[t]).double().abs() / scale).max())
    exact, real_err = max(ratios), float(torch.stack(reals).max())  # a NaN stays NaN (check_parts raises on one)
    tol = completeness_tolerance(lm)
    if not real_err <= tol:
        raise InvariantError(f"attribution graph: the frozen replacement model misses the real run by {real_err:.2e}"
                             f" (relative; limit {tol:.1e}); run `lenscope verify --model {lm.name}`")
    toks = list(tr.tokens)
    seconds = time.perf_counter() - t0
    log(f"attribution graph: {N} nodes in {seconds:.1f} s, exactness error {exact:.1e}")
    return AttributionGraph(
        model=lm.name, tokens=toks, input_ids=[int(i) for i in ids], sites=dicts.sites,
        n_layers=fz.n_layers, feature_layer=fz.layer[chosen], feature_pos=fz.pos[chosen],
        feature_index=fz.feature[chosen], feature_act=fz.acts[chosen].float(),
        error_norm=fz.errs.norm(dim=-1).float(), logit_ids=logit_ids, logit_probs=probs,
        logit_tokens=_logit_labels(lm, logit_ids, foil_id), adjacency=adj, inputs=inputs, biases=biases,
        dropped=dropped,
        n_active=fz.n_active, exactness_error=exact, real_error=real_err, tolerance=tol, seconds=seconds,
        skip_first=skip_first, foil_id=foil_id)


__all__ = ["AttributionGraph", "attribution_graph", "node_id"]
