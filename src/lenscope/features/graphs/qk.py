"""QK attribution of an attention edge in an attribution graph: which query-side and key-side nodes set one head's
attention score from a query position to a key position, exactly.

With the norms' scales frozen at the real run (the pre-attention norm and any query/key norms), a head's query at
position ``q`` and key at position ``k`` are affine in the graph's nodes (rotary embeddings are linear given the
positions): ``q = sum_i Q_i + Q_0``, ``k = sum_j K_j + K_0``, each node's part from one batched backward pass per
component. The score before the soft-max is bilinear in them:

    score = scale * (sum_i Q_i + Q_0) . (sum_j K_j + K_0)

so it splits exactly into query-side parts ``scale * Q_i . k`` (plus ``scale * Q_0 . k``) and, the other way, into
key-side parts ``scale * q . K_j``, and into pairs ``scale * Q_i . K_j``. ALiBi and relative-position biases add a
constant; a soft-capped score (Gemma 2) is split before its cap. Checked on every call: the query and key equal the
sum of their parts, and the score reproduces the real run's attention probability through the Anatomy's soft-max.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from ...errors import InputError, InvariantError
from ...models.loading.load import LoadedModel
from ...models.runtime.trace import trace
from ...models.runtime.verify import completeness_tolerance
from ...results import Result
from .graph import Rows
from .replacement import Frozen, FrozenNorm, check_parts, transcoders_by_layer


class _Recorder:
    """A norm that records its per-token scale (to freeze it) as it computes."""

    def __init__(self, norm):
        self.norm, self.s = norm, None

    def __call__(self, x: Tensor) -> Tensor:
        self.s = self.norm.scale(x)
        return self.norm(x)


@dataclass(repr=False)
class QKAttribution(Result):
    """Head ``head`` of block ``layer``: the score from ``query_pos`` to ``key_pos`` split over the nodes.
    ``names`` (circuit-tracer ids of every source node: features, errors, tokens); ``query_vectors (node, d_head)``,
    ``query_const (d_head,)``: each node's part of the query and the constant part (``q = sum_i Q_i + Q_0``);
    ``key_vectors``, ``key_const`` the same for the key; ``scale`` the head's score scale. The splits of the
    score: ``query_parts (node,)`` (``scale * Q_i . k``) with ``query_bias`` (``scale * Q_0 . k``), ``key_parts``
    (``scale * q . K_j``) with ``key_bias``, and the pairs (:meth:`pairs`, :meth:`top_pairs`: ``scale * Q_i .
    K_j``, the constant parts included), each summing to ``score`` (before any soft-cap, without ALiBi); ``prob``
    the real run's attention probability, ``error`` the largest gap of the checks (relative to the sizes of the
    parts; the probability's absolute)."""

    model: str
    tokens: list[str]
    layer: int
    head: int
    query_pos: int
    key_pos: int
    names: list[str]
    query_parts: Tensor
    key_parts: Tensor
    query_bias: float
    key_bias: float
    score: float
    prob: float
    error: float
    query_vectors: Tensor
    key_vectors: Tensor
    query_const: Tensor
    key_const: Tensor
    scale: float

    def _index(self, nodes) -> Tensor:
        if nodes is None:
            return torch.arange(len(self.names))
        where = {n: i for i, n in enumerate(self.names)}
        out, bad = [], []
        for n in ([nodes] if isinstance(nodes, (str, int)) else list(nodes)):
            if isinstance(n, str) and n in where:
                out.append(where[n])
            elif isinstance(n, int) and not isinstance(n, bool) and 0 <= n < len(self.names):
                out.append(n)
            else:
                bad.append(n)
        if bad:
            raise InputError(f"not nodes of this QK attribution: {bad[:5]}; give node ids (r.names) or indices")
        return torch.tensor(out, dtype=torch.long)

    def pairs(self, query=None, key=None, *, constant: bool = True) -> Tensor:
        """The pair parts ``scale * Q_i . K_j`` for the query-side nodes ``query`` (rows) and the key-side nodes
        ``key`` (columns): node ids or indices, default every node (``(node, node)``: choose some for a large
        graph). With ``constant`` a last row and column hold the constant parts' pairs (``scale * Q_0 . K_j``,
        ``scale * Q_i . K_0``, ``scale * Q_0 . K_0``): over every node the whole matrix sums to ``score``, its rows
        to the query parts (the last row to ``query_bias``) and its columns to the key parts."""
        Q, K = self.query_vectors[self._index(query)].double(), self.key_vectors[self._index(key)].double()
        if constant:
            Q = torch.cat([Q, self.query_const.double()[None]])
            K = torch.cat([K, self.key_const.double()[None]])
        return (Q @ K.T * self.scale).float()

    def top_pairs(self, k: int = 20, block: int = 1024) -> list[tuple[str, str, float]]:
        """The ``k`` largest pairs by size, ``(query node id, key node id, part)``, over every pair of nodes and
        the constant parts (named ``"const"``), computed a block of query nodes at a time."""
        names = [*self.names, "const"]
        Q = torch.cat([self.query_vectors, self.query_const[None]]).double()
        K = torch.cat([self.key_vectors, self.key_const[None]]).double()
        best_v, best_i = torch.zeros(0, dtype=torch.float64), torch.zeros(0, dtype=torch.long)
        for a in range(0, Q.shape[0], block):
            P = (Q[a: a + block] @ K.T * self.scale).flatten()
            v, i = P.abs().topk(min(k, P.numel()))
            best_v = torch.cat([best_v, v])
            best_i = torch.cat([best_i, i + a * K.shape[0]])
            keep = best_v.topk(min(k, best_v.numel())).indices
            best_v, best_i = best_v[keep], best_i[keep]
        out = []
        for flat in best_i[best_v.argsort(descending=True)].tolist():
            i, j = divmod(flat, K.shape[0])
            out.append((names[i], names[j], float(Q[i] @ K[j] * self.scale)))
        return out

    def top(self, k: int = 10, side: str = "query") -> list[tuple[str, float]]:
        v = self.query_parts if side == "query" else self.key_parts
        order = v.abs().argsort(descending=True)[:k]
        return [(self.names[i], float(v[i])) for i in order.tolist()]

    def to_dict(self) -> dict:
        return {"model": self.model, "layer": self.layer, "head": self.head, "query_pos": self.query_pos,
                "key_pos": self.key_pos, "score": self.score, "prob": self.prob, "error": self.error,
                "query_bias": self.query_bias, "key_bias": self.key_bias,
                "query": [{"id": n, "part": p} for n, p in self.top(20, "query")],
                "key": [{"id": n, "part": p} for n, p in self.top(20, "key")],
                "pairs": [{"query": a, "key": b, "part": p} for a, b, p in self.top_pairs(20)]}

    def to_frame(self):
        import pandas as pd

        return pd.DataFrame({"id": self.names, "query_part": self.query_parts.tolist(),
                             "key_part": self.key_parts.tolist()})

    def __repr__(self) -> str:
        return (f"QKAttribution(L{self.layer}H{self.head}, {self.query_pos} -> {self.key_pos}: score "
                f"{self.score:.4f}, p={self.prob:.3f}, error={self.error:.1e})")


def _names(fz: Frozen, g) -> list[str]:
    feats = [f"{int(a)}_{int(c)}_{int(b)}" for a, b, c in zip(fz.layer, fz.pos, fz.feature)]
    errs = [f"{L}_-1_{p}" for L in range(fz.n_layers) for p in range(fz.P)]
    toks = [f"E_{g.input_ids[p]}_{p}" for p in range(fz.P)]
    return feats + errs + toks


def qk_attribution(lm: LoadedModel, g, dictionaries, layer: int, head: int, query_pos: int,
                   key_pos: int) -> QKAttribution:
    """The score of head ``head`` of block ``layer`` from ``query_pos`` to ``key_pos`` in graph ``g``'s prompt, split
    over every node (all active features, errors, tokens; see the module's docstring)."""
    dicts = transcoders_by_layer(lm, list(dictionaries))
    if sorted(d.site for d in dicts.values()) != sorted(g.sites):
        raise InputError(f"the graph was built with transcoders at {', '.join(g.sites)}; give those")
    P = g.n_pos
    if not 0 <= layer < g.n_layers:
        raise InputError(f"block {layer} is outside the model's {g.n_layers} blocks")
    if not (0 <= key_pos <= query_pos < P):
        raise InputError(f"positions must satisfy 0 <= key_pos <= query_pos < {P}; got {query_pos} -> {key_pos}")
    tr = trace(lm, torch.tensor(g.input_ids))
    fz = Frozen(lm, tr, dicts, skip_first=g.skip_first)
    attn = fz.layers[layer].attn
    if not 0 <= head < attn.n_heads:
        raise InputError(f"head {head} is outside block {layer}'s {attn.n_heads} heads")
    if not bool(attn.mask(P, P)[query_pos, key_pos]):
        raise InputError(f"block {layer}'s attention does not let position {query_pos} see {key_pos} (its window is "
                         f"{attn.window}): no such attention edge")
    rows = Rows(fz, P - 1, 64)
    a_in = rows.keep["attn_in"][layer]
    positions = torch.arange(P)
    rec = {n: _Recorder(getattr(attn, n)) for n in ("q_norm", "k_norm") if getattr(attn, n) is not None}
    with torch.no_grad():
        q_real, k_real = dataclasses.replace(attn, **rec).queries_keys(a_in.detach(), positions)
    frozen = dataclasses.replace(attn, **{n: FrozenNorm(r.norm, r.s) for n, r in rec.items()})
    q, k = frozen.queries_keys(a_in, positions)
    qv, kv = q[head, query_pos], k[head, key_pos]
    eye = torch.eye(qv.shape[0], dtype=qv.dtype)
    Q, K = rows._edges(qv, eye).T, rows._edges(kv, eye).T  # (node, d_head): each node's part of the vector
    with torch.no_grad():
        z = fz.split(torch.zeros_like(fz.acts))
        keep: dict = {}
        fz.forward(torch.zeros_like(fz.emb), z, torch.zeros_like(fz.errs), keep=keep)
        q0, k0 = frozen.queries_keys(keep["attn_in"][layer], positions)
        q0, k0 = q0[head, query_pos], k0[head, key_pos]
    qv, kv = qv.detach(), kv.detach()
    # the checks: the query and the key are the sums of their parts, and so the pairs sum to the score, to float32's
    # rounding of the parts' sizes (replacement.parts_rounding: the frozen model runs in float32 whatever the
    # model's dtype); the score reproduces the real run's probability to the model dtype's rounding
    s = attn.scale
    n_layers = fz.n_layers
    Qd, Kd, q0d, k0d = Q.double(), K.double(), q0.double(), k0.double()
    q_size = (Qd.abs().sum(0) + q0d.abs()).max().expand(qv.shape[0])  # a vector's rounding: its largest part
    k_size = (Kd.abs().sum(0) + k0d.abs()).max().expand(kv.shape[0])
    q_gap, k_gap = qv.double() - Qd.sum(0) - q0d, kv.double() - Kd.sum(0) - k0d
    gaps = [check_parts("QK attribution: the parts miss the query", q_gap, q_size, n_layers),
            check_parts("QK attribution: the parts miss the key", k_gap, k_size, n_layers)]
    score = float(qv.double() @ kv.double()) * s
    pairs_total = float((Qd.sum(0) + q0d) @ (Kd.sum(0) + k0d)) * s  # = the sum of every pair, constants included
    pairs_size = float((Qd.abs().sum(0) + q0d.abs()) @ (Kd.abs().sum(0) + k0d.abs())) * abs(s)
    gaps.append(check_parts("QK attribution: the pairs miss the score", torch.tensor(score - pairs_total),
                            torch.tensor(pairs_size), n_layers))
    probs = attn.probs(q_real, k_real, positions)[head, query_pos, key_pos]
    real = float(tr.site("pattern", layer)[head, query_pos, key_pos])
    gaps.append(abs(float(probs) - real))
    err = max(gaps)
    tol = completeness_tolerance(lm)
    if not gaps[-1] <= tol:
        raise InvariantError(f"QK attribution: the frozen head's probability misses the real run's by {gaps[-1]:.2e}"
                             f" (limit {tol:.1e}); run `lenscope verify --model {lm.name}`")
    return QKAttribution(
        model=g.model, tokens=g.tokens, layer=layer, head=head, query_pos=query_pos, key_pos=key_pos,
        names=_names(fz, g), query_parts=(Q @ kv * s).float(), key_parts=(K @ qv * s).float(),
        query_bias=float(q0 @ kv) * s, key_bias=float(qv @ k0) * s, score=score, prob=real, error=err,
        query_vectors=Q.detach().float(), key_vectors=K.detach().float(), query_const=q0.float(),
        key_const=k0.float(), scale=float(s))


__all__ = ["QKAttribution", "qk_attribution"]
