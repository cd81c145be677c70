"""Information-flow routes (Ferrando & Voita, 2024): per prediction, the graph of (token, layer) nodes whose edges
carry more than a threshold ``tau`` of each node's state, built top-down from the predicted token's last node.

Every block update is a sum of vectors, read from one :class:`~lenscope.models.runtime.trace.Trace` with the
decomposition algebra of :mod:`lenscope.models.weights.algebra` (``"sources"`` bias convention, as ALTI):

- after attention, ``x_i^mid = x_i^l + sum_h sum_j c_{h, j->i} + b``, where ``c_{h, j->i} = A_h[i, j] (LN(x_j)
  W_V^h + b_V^h) W_O^h`` is head ``h``'s write from token ``j`` and ``b`` the output bias (a term of the sum,
  no edge);
- after the FF block, ``x_i^{l+1} = x_i^mid + f_i``.

The importance of a term ``z`` of a sum ``y`` is its proximity ``max(0, ||y||_1 - ||y - z||_1)``
(:func:`lenscope.mixing.alti.proximity`, ALTI's formula) over the sum of every term's proximity, so the
importances at a node add up to one (a node where no term has a positive proximity gives its residual term
importance 1 and is counted in ``degenerate``). Edges: ``(l, i, resid) -> (l, i, mid)`` via ``"resid"``, ``(l, j,
resid) -> (l, i, mid)`` via head ``"L{l}H{h}"`` (or all heads summed per source, ``"L{l}.attn"``, with
``per_head=False``), ``(l, i, mid) -> (l + 1, i, resid)`` via ``"resid"`` and via ``"L{l}.mlp"``. An edge is kept
when its importance exceeds ``tau``; starting from the last-layer node of the predicted position, only the nodes
reached backwards through kept edges are expanded (so only their sums are computed).

Node ``(layer, token, kind)``: kind ``"resid"`` is ``x^layer``, the residual stream entering block ``layer``
(``layer = n_layers``: the last block's output, what the final norm reads); kind ``"mid"`` is ``x^mid`` of block
``layer``.

Families:

- pre-norm, sequential residual (GPT-2, OPT, BLOOM, Llama, Qwen2): the paper's case.
- sandwich norms (Gemma 3): a sub-layer's write is its output through a norm whose per-token scale is taken from
  the trace, so the write is linear in the head contributions (:func:`~lenscope.models.weights.algebra.write_step`):
  each head term is the normed contribution, the bias term is the normed output bias plus the norm's bias; the FF term
  is the normed MLP output (``tr.mlp_write``). A residual multiplier (Granite) scales every term of the write.
- parallel residual (GPT-NeoX): attention and the FF block both read ``x^l``, so a block is one sum,
  ``x_i^{l+1} = x_i^l + sum_h sum_j c_{h, j->i} + b + f_i``, and there are no ``mid`` nodes: every edge of the
  block goes from ``(l, ., resid)`` to ``(l + 1, i, resid)`` (the FF edge from ``(l, i, resid)``).
- encoders (Post-LN, bidirectional) are refused with :class:`~lenscope.errors.NotApplicableError`: the method
  explains a next-token prediction.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..errors import InputError, InvariantError, NotApplicableError
from ..mixing.alti import proximity, row_chunks
from ..models.loading.load import LoadedModel, require_decoder, token_str
from ..models.runtime.sites import display_name
from ..models.runtime.trace import Trace, prefix_trace, trace
from ..models.runtime.verify import TOLERANCE, completeness_tolerance
from ..models.weights.algebra import activation_scale, attention_write_parts, f32, relative_gap
from ..models.weights.anatomy import Anatomy
from ..results import Result

KINDS = ("resid", "mid")  # node kinds, coded 0 and 1
RESID, MLP, ATTN = -1, -2, -3  # codes of ``via[:, 1]`` that are not a head
DTYPE = torch.float64  # a proximity is a difference of two L1 norms: it cancels badly in float32 (see ALTI)


def via_name(layer: int, code: int) -> str:
    """``"L{layer}H{head}"`` (``code`` >= 0), ``"L{layer}.mlp"``, ``"L{layer}.attn"`` or ``"resid"``."""
    if code >= 0:
        return display_name("head", layer, code)
    return "resid" if code == RESID else display_name({MLP: "mlp", ATTN: "attn"}[code], layer)


@dataclass(repr=False)
class InformationFlowRoutes(Result):
    """The kept edges of one prediction's information-flow graph.

    - ``src, dst (edge, 3)``: nodes as ``(layer, token, kind)`` with kind 0 = ``"resid"`` (``x^layer``), 1 =
      ``"mid"`` (after block ``layer``'s attention)
    - ``via (edge, 2)``: ``(layer, code)``, code a head (>= 0), -1 the residual, -2 the FF block, -3 all heads
      (:func:`via_name`)
    - ``importance (edge,)``: the edge's share of its ``dst`` node's sum (> ``tau``)
    - ``nodes (node, 3)``: every node reached (the top node first); ``node_bias (node,)``: the importance of the
      output-bias term in the node's sum (0 where the sum has none; NaN for the bottom nodes, which are no sum)
    - ``tokens``: the text up to the predicted ``position``; ``prediction``: the model's top token there
    - ``completeness_error``: the largest relative gap between a node's terms and its traced state;
      ``degenerate``: nodes where no term had a positive proximity (their residual term got importance 1)
    """

    model: str
    tokens: list[str]
    position: int
    prediction: str
    layers: int
    heads: int
    tau: float
    per_head: bool
    placement: str
    src: Tensor
    dst: Tensor
    via: Tensor
    importance: Tensor
    nodes: Tensor
    node_bias: Tensor
    completeness_error: float
    degenerate: int = 0
    info: dict = field(default_factory=dict)

    def via_names(self) -> list[str]:
        """The component of every edge, in edge order."""
        return [via_name(int(a), int(b)) for a, b in self.via.tolist()]

    def edge_list(self) -> list[dict]:
        """``[{src: [layer, token, kind], dst, via, importance}]`` with kind ``"resid"`` / ``"mid"``."""
        def node(t):
            return [int(t[0]), int(t[1]), KINDS[int(t[2])]]

        return [{"src": node(s), "dst": node(d), "via": v, "importance": float(w)}
                for s, d, v, w in zip(self.src.tolist(), self.dst.tolist(), self.via_names(), self.importance.tolist())]

    def components(self) -> set[str]:
        """The components kept edges pass through, in lenscope's node names (``L{layer}H{head}``, ``L{layer}.mlp``;
        ``L{layer}.attn`` for routes with ``per_head=False``), plus ``embed`` when a kept edge leaves the bottom
        layer."""
        out = {v for v in self.via_names() if v != "resid"}
        if bool(((self.src[:, 0] == 0) & (self.src[:, 2] == 0)).any()):
            out.add("embed")
        return out

    def to_dict(self) -> dict:
        nodes = [{"node": [int(n[0]), int(n[1]), KINDS[int(n[2])]], "bias": None if b != b else float(b)}
                 for n, b in zip(self.nodes.tolist(), self.node_bias.tolist())]
        return {"method": "information-flow-routes", "model": self.model, "tokens": self.tokens,
                "position": self.position, "prediction": self.prediction, "layers": self.layers, "heads": self.heads,
                "tau": self.tau, "per_head": self.per_head, "placement": self.placement,
                "completeness_error": self.completeness_error, "degenerate": self.degenerate,
                "components": sorted(self.components()), "nodes": nodes, "edges": self.edge_list()}

    def to_frame(self):
        """One row per kept edge: ``src_layer, src_token, src_kind, dst_layer, dst_token, dst_kind, via,
        importance``."""
        import pandas as pd

        s, d = self.src.tolist(), self.dst.tolist()
        return pd.DataFrame({
            "src_layer": [a[0] for a in s], "src_token": [a[1] for a in s], "src_kind": [KINDS[a[2]] for a in s],
            "dst_layer": [a[0] for a in d], "dst_token": [a[1] for a in d], "dst_kind": [KINDS[a[2]] for a in d],
            "via": self.via_names(), "importance": self.importance.tolist()})

    def plot(self, **kw):
        from ..viz.circuit_plots import plot_routes

        return plot_routes(self, **kw)

    def __repr__(self) -> str:
        return (f"InformationFlowRoutes({self.model!r}, position={self.position}, prediction={self.prediction!r}, "
                f"tau={self.tau:g}, edges={len(self.importance)}, nodes={len(self.nodes)}, "
                f"completeness_error={self.completeness_error:.1e})")


# ------------------------------------------------------------------------------------------------ the sums


def attention_terms(A: Anatomy, tr: Trace, l: int, rows: Tensor, per_head: bool = True,
                    dtype: torch.dtype = DTYPE) -> tuple[Tensor, Tensor]:
    """The sum that ends block ``l``'s attention part at positions ``rows`` (sorted): ``terms (row, k, d_model)``
    and the traced state they add up to ``y (row, d_model)``.

    Columns: ``0`` the residual ``x_i^l``; then head ``h``'s write from source ``j`` at ``1 + h * n_src + j``
    (``per_head``; else all heads per source at ``1 + j``), with ``n_src = rows.max() + 1`` (a causal model's rows
    read no later source); then the bias term; for a parallel block, the FF write last (``y`` is then the block's
    output, else ``x^mid``)."""
    rows = rows.to(tr.resid_pre.device)
    b = int(rows.max()) + 1
    sub = prefix_trace(tr, b)
    dec = attention_write_parts(A, sub, l, rows, "sources", dtype=dtype, factored=True)
    if per_head:  # (row, head * src, d): head h's write from source j, scaled by the sandwich norm
        heads = (dec.scale[:, None, None, None] * dec.alpha.transpose(0, 1)[..., None] * dec.V[None]).flatten(1, 2)
    else:
        heads = dec.dense().parts  # (row, src, d), every head summed (no residual added yet: ``diag`` is zero)
    cols = [f32(sub.resid_pre[l][rows], dtype)[:, None], heads, dec.rest[:, None]]
    parallel = A.layers[l].placement == "parallel"
    if parallel:
        cols.append(f32(sub.mlp_write[l][rows], dtype)[:, None])
    y = f32((sub.resid_post if parallel else sub.resid_mid)[l][rows], dtype)
    return torch.cat(cols, 1), y


def ff_terms(tr: Trace, l: int, rows: Tensor, dtype: torch.dtype = DTYPE) -> tuple[Tensor, Tensor]:
    """The sum after block ``l``'s FF part (sequential residual): ``terms (row, 2, d_model)`` = ``[x_i^mid, f_i]``
    and ``y = x_i^{l+1} (row, d_model)``."""
    rows = rows.to(tr.resid_pre.device)
    terms = torch.stack([f32(tr.resid_mid[l][rows], dtype), f32(tr.mlp_write[l][rows], dtype)], 1)
    return terms, f32(tr.resid_post[l][rows], dtype)


def term_importance(terms: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    """``imp(z_k) = prox(z_k, y) / sum_k' prox(z_k', y)`` for ``terms (..., k, d)`` of ``y (..., d)``: (..., k), and
    the boolean mask (...) of degenerate sums (no positive proximity: term 0, the residual, gets importance 1)."""
    p = proximity(terms, y)
    s = p.sum(-1, keepdim=True)
    bad = s[..., 0] <= 0
    imp = p / s.clamp_min(1e-300)
    if bool(bad.any()):
        own = torch.zeros_like(imp)
        own[..., 0] = 1
        imp = torch.where(bad[..., None], own, imp)
    return imp, bad


@dataclass
class _Edges:
    """Kept edges into the nodes of some sums: ``src, dst (edge, 3)``, ``via (edge, 2)``, ``importance (edge,)``."""

    src: Tensor
    dst: Tensor
    via: Tensor
    importance: Tensor


def _cat(parts: list[_Edges]) -> _Edges:
    if not parts:
        z = torch.zeros(0, 3, dtype=torch.long)
        return _Edges(z, z.clone(), torch.zeros(0, 2, dtype=torch.long), torch.zeros(0))
    return _Edges(*(torch.cat([getattr(p, k) for p in parts]) for k in ("src", "dst", "via", "importance")))


def _attention_edges(imp: Tensor, rows: Tensor, l: int, heads: int, per_head: bool, parallel: bool,
                     tau: float) -> tuple[_Edges, Tensor]:
    """Kept edges of :func:`attention_terms`' importances ``imp (row, k)`` and the bias column ``(row,)``."""
    k = imp.shape[1]
    n_src = (k - 2 - parallel) // (heads if per_head else 1)
    bias_col = k - 1 - parallel
    keep = imp > tau
    keep[:, bias_col] = False
    r, c = keep.nonzero(as_tuple=True)
    i = rows.cpu()[r]
    src_tok = i.clone()
    code = torch.full_like(c, RESID)
    head = (c >= 1) & (c < bias_col)
    hc = c[head] - 1
    src_tok[head] = hc % n_src
    code[head] = hc // n_src if per_head else ATTN
    code[c == bias_col + 1] = MLP
    zero, lay = torch.zeros_like(i), torch.full_like(i, l)
    src = torch.stack([lay, src_tok, zero], 1)
    dst = torch.stack([lay + 1, i, zero] if parallel else [lay, i, zero + 1], 1)
    return _Edges(src, dst, torch.stack([lay, code], 1), imp[r, c].float().cpu()), imp[:, bias_col].float().cpu()


def _ff_edges(imp: Tensor, rows: Tensor, l: int, tau: float) -> _Edges:
    r, c = (imp > tau).nonzero(as_tuple=True)
    i = rows.cpu()[r]
    lay = torch.full_like(i, l)
    src = torch.stack([lay, i, torch.ones_like(i)], 1)
    dst = torch.stack([lay + 1, i, torch.zeros_like(i)], 1)
    return _Edges(src, dst, torch.stack([lay, torch.where(c == 0, RESID, MLP)], 1), imp[r, c].float().cpu())


class _Gap:
    """The largest completeness gap seen, relative to each layer's activation scale (as ALTI)."""

    def __init__(self):
        self.err, self.scales = 0.0, {}

    def add(self, key, terms: Tensor, y: Tensor, full: Tensor):
        if key not in self.scales:
            self.scales[key] = activation_scale(full)
        self.err = max(self.err, relative_gap(terms.sum(1), y, self.scales[key]))


def _per_row_bytes(A: Anatomy, l: int, n_src: int, per_head: bool) -> int:
    return (n_src * (A.layers[l].attn.n_heads if per_head else 1) + 3) * A.d_model * 8 * 3


def routes_from_trace(A: Anatomy, tr: Trace, *, tau: float = 0.04, per_head: bool = True, model: str = "",
                      prediction: str = "", tolerance: float | None = None) -> InformationFlowRoutes:
    """The routes of the last position of ``tr`` (a causal decoder's trace, cut to the predicted position with
    :func:`~lenscope.models.runtime.trace.prefix_trace`); see :func:`information_flow_routes`. Raises
    :class:`~lenscope.errors.InvariantError` when a sum's terms miss the traced state by more than ``tolerance``
    (default :data:`lenscope.models.runtime.verify.TOLERANCE`)."""
    if A.placement == "post" or not A.causal:
        raise NotApplicableError("information-flow routes explain a causal decoder's next-token prediction; use a "
                                 "pre-norm, sandwich or parallel decoder (GPT-2, Llama, Gemma 3, GPT-NeoX, ...)")
    L, H, n = A.n_layers, A.layers[0].attn.n_heads, len(tr.tokens)
    parallel = A.placement == "parallel"
    found, nodes, bias = [], [], []
    gap, degenerate = _Gap(), 0

    def reached(l: int, rows: Tensor, kind: int, b: Tensor):
        nodes.append(torch.stack([torch.full_like(rows, l), rows, torch.full_like(rows, kind)], 1))
        bias.append(b)

    def attention_step(l: int, rows: Tensor) -> Tensor:
        """Edges into the attention sums at ``rows``; the reached nodes recorded; the positions below."""
        nonlocal degenerate
        parts, biases = [], []
        for chunk in row_chunks(len(rows), _per_row_bytes(A, l, int(rows.max()) + 1, per_head)):
            sel = rows[chunk]
            terms, y = attention_terms(A, tr, l, sel, per_head)
            gap.add(("attn", l), terms, y, (tr.resid_post if parallel else tr.resid_mid)[l])
            imp, bad = term_importance(terms, y)
            degenerate += int(bad.sum())
            e, b = _attention_edges(imp, sel, l, H, per_head, parallel, tau)
            parts.append(e)
            biases.append(b)
        e = _cat(parts)
        found.append(e)
        reached(l + 1 if parallel else l, rows, 0 if parallel else 1, torch.cat(biases))
        return e.src[:, 1].unique()

    active = torch.tensor([n - 1])  # positions of the reached (l + 1, ., resid) nodes
    for l in reversed(range(L)):
        if parallel:
            below = attention_step(l, active)
        else:
            terms, y = ff_terms(tr, l, active)
            gap.add(("ff", l), terms, y, tr.resid_post[l])
            imp, bad = term_importance(terms, y)
            degenerate += int(bad.sum())
            e = _ff_edges(imp, active, l, tau)
            found.append(e)
            reached(l + 1, active, 0, torch.zeros(len(active)))
            mid = e.src[:, 1].unique()
            below = attention_step(l, mid) if len(mid) else mid
        active = below
        if len(active) == 0:
            break
    if len(active):  # the bottom layer: the embeddings, no sum
        reached(0, active, 0, torch.full((len(active),), float("nan")))
    edges = _cat(found)
    tol = TOLERANCE if tolerance is None else tolerance
    if gap.err > tol:
        raise InvariantError(f"the information-flow sums miss the traced states by {gap.err:.2e} (> {tol:g}): the "
                             "model is not the one the Anatomy describes; run `lenscope verify` on it")
    return InformationFlowRoutes(
        model=model, tokens=list(tr.tokens), position=n - 1, prediction=prediction, layers=L, heads=H, tau=float(tau),
        per_head=per_head, placement=A.placement, src=edges.src, dst=edges.dst, via=edges.via,
        importance=edges.importance, nodes=torch.cat(nodes), node_bias=torch.cat(bias).float(),
        completeness_error=gap.err, degenerate=degenerate)


@torch.no_grad()
def information_flow_routes(lm: LoadedModel, text_or_ids, *, position: int = -1, tau: float = 0.04,
                            per_head: bool = True) -> InformationFlowRoutes:
    """The information-flow routes of the prediction at ``position`` (Ferrando & Voita 2024): the edges that carry
    more than ``tau`` (paper: about 0.04) of their node's state, reached top-down from the last-layer node of
    ``position``; heads apart (``per_head``) or summed per layer (``L{l}.attn``). One forward pass (a
    :class:`~lenscope.models.runtime.trace.Trace`); a causal decoder of any placement but Post-LN (module docstring)."""
    require_decoder(lm, "information-flow routes", instead="use a causal decoder (GPT-2, Llama, Gemma 3, ...)",
                    causal=True)
    if not isinstance(tau, (int, float)) or not tau >= 0:
        raise InputError(f"tau must be a number >= 0 (an importance threshold; the paper uses 0.04), not {tau!r}")
    tr = trace(lm, text_or_ids)
    n = len(tr.tokens)
    pos = position + n if position < 0 else position
    if not 0 <= pos < n:
        raise InputError(f"position {position} is outside the text's {n} tokens; give -{n} .. {n - 1}")
    tr = prefix_trace(tr, pos + 1)
    pred = "" if tr.logits is None else token_str(lm, int(tr.logits[pos].argmax()))
    return routes_from_trace(lm.anatomy, tr, tau=tau, per_head=per_head, model=lm.name, prediction=pred,
                             tolerance=completeness_tolerance(lm))


def route_recovery(routes: InformationFlowRoutes, circuit_nodes: list[str]) -> dict:
    """How much of a node circuit (e.g. the top nodes of exact patching, names ``embed``, ``L{l}H{h}``,
    ``L{l}.mlp``) the routes recover: ``recall`` = found / circuit, ``precision`` = found / the routes' components,
    ``found`` and ``missed`` (sorted names). For routes with ``per_head=False`` a circuit head ``L{l}H{h}`` counts as
    ``L{l}.attn``. Empty sets give recall / precision NaN."""
    comps = routes.components()
    circuit = set()
    for name in circuit_nodes:
        head = re.match(r"L(\d+)H\d", name)
        if not routes.per_head and head:
            name = display_name("attn", int(head.group(1)))
        circuit.add(name)
    found = circuit & comps
    nan = float("nan")
    return {"recall": len(found) / len(circuit) if circuit else nan,
            "precision": len(found) / len(comps) if comps else nan,
            "found": sorted(found), "missed": sorted(circuit - comps)}
