"""The frozen replacement model of one prompt: the model with its MLPs replaced by transcoders, and everything
non-linear fixed at the real run, so that it is an affine map of its nodes' outputs (Ameisen et al. 2025).

Fixed from the real run (one trace through the engine): every attention pattern, every norm's per-token scale
(a norm is then affine: :meth:`~lenscope.models.weights.anatomy.Norm.linear`), and each transcoder's set of active
latents (an active latent's activation then equals its pre-activation: TopK's ``relu`` and JumpReLU's threshold
only choose which latents are on). Each block's MLP output is replaced by

    mlp_out = sum_f a_f W_dec[f] + b_dec (+ mlp_in @ W_skip.T, a skip transcoder) + error

with ``error = mlp_out_real - transcoder(mlp_in_real)`` a constant node (a block without a transcoder: its whole
MLP output is the error node). With a cross-layer transcoder (Ameisen et al.'s CLT), the sum runs over the active
latents of this block and of every earlier one, each through its decoder to this block (``W_dec[source ->
target]``), and ``b_dec`` is the target block's: a feature node then writes several blocks' MLP outputs, and its
edges are the sum of those paths (nothing else changes: a latent's input is still its own block's MLP input).
With ``skip_first`` (the prompt opens with a special token, as circuit-tracer's ``zero_bos``), the first position
has no feature nodes, its error nodes are zero, and its MLP outputs are constants of the model (bias terms of every
node they reach). The block's other equations are the Anatomy's own
(:meth:`Layer.after_attention`, its norms replaced by their frozen affine maps), so placements, sandwich norms and
residual multipliers need nothing here.

:class:`Frozen` computes this model from its nodes' outputs: the token embeddings ``emb (pos, d_model)``, the
active latents' activations ``acts (n_active,)`` and the error vectors ``errs (layer, pos, d_model)``. With the
real values it reproduces the real run's MLP inputs, latents' pre-activations and logits (checked on every call by
:mod:`lenscope.features.graphs.graph`); with zeros it gives each node's bias terms.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
from torch import Tensor

from ...errors import InputError, InvariantError
from ...models.dictionaries.dictionary import Dictionary
from ...models.loading.load import LoadedModel
from ...models.runtime.sites import site_key
from ...models.runtime.trace import Trace
from ...models.weights.anatomy import Norm
from ...models.weights.readout import Readout
from ...models.weights.tensors import astype


class FrozenNorm:
    """A norm with its per-token scale ``s (pos,)`` fixed: ``linear(x, s) + bias``, affine in ``x``."""

    def __init__(self, norm: Norm, scale: Tensor):
        self.norm, self.s = norm, scale

    def __call__(self, x: Tensor) -> Tensor:
        y = self.norm.linear(x, self.s)
        return y + self.norm.bias if self.norm.bias is not None else y


class _MLP:
    """A block's MLP in the replacement model: its transcoder's active latents decoded (activations given), its
    decoder bias and skip path, plus the error node; ``W_in``: where it computes (what ``after_attention`` asks)."""

    def __init__(self, frozen: Frozen, layer: int, ref: Tensor):
        self.frozen, self.layer, self.W_in = frozen, layer, ref

    def __call__(self, x: Tensor) -> Tensor:
        return self.frozen.mlp(self.layer, x)


class Frozen:
    """The frozen replacement model of the prompt traced in ``tr`` (see the module's docstring), with the
    transcoders ``dicts`` (:class:`Transcoders`, held in float32). Node outputs at the real run: :attr:`emb`,
    :attr:`acts`, :attr:`errs`; the active latents: :attr:`layer`, :attr:`pos`, :attr:`feature` (``(n_active,)``
    each, ordered by layer, position, latent) and their real pre-activations :attr:`pre`. :attr:`dicts`: each
    block's encoder."""

    def __init__(self, lm: LoadedModel, tr: Trace, dicts: Transcoders, *, dtype=torch.float32,
                 skip_first: bool = False):
        A = lm.anatomy
        self.dtype, self.n_layers = dtype, A.n_layers
        P = len(tr.tokens)
        self.P = P
        self.tc = dicts.to(dtype)
        self.dicts = self.tc.encoders
        self.readout = Readout(astype(A.final_norm, dtype), A.unembed)
        self.final_scale = A.final_norm.scale(tr.site("ln_final.in").to(dtype))
        self.layers, self.probs = [], []
        for L, layer in enumerate(A.layers):
            base = astype(dataclasses.replace(layer, mlp=None), dtype)
            norms = {slot: FrozenNorm(n, n.scale(tr.site(f"{slot}.in", L).to(dtype)))
                     for slot, n in base.norms().items()}
            self.layers.append(dataclasses.replace(base, **norms, mlp=_MLP(self, L, base.attn.W_O)))
            self.probs.append(tr.site("pattern", L).to(dtype))
        self.emb = tr.embed.to(dtype)
        mlp_in = tr.mlp_in
        layers, pos, feats, acts, pres, zs = [], [], [], [], [], {}
        for L, d in sorted(self.dicts.items()):
            pre, z = _latents(d, mlp_in[L].to(dtype), skip_first)
            p, f = z.nonzero(as_tuple=True)
            layers.append(torch.full_like(p, L))
            pos.append(p)
            feats.append(f)
            acts.append(z[p, f])
            pres.append(pre[p, f])
            zs[L] = z
        errs = tr.mlp_out.to(dtype).clone()
        for t in self.tc.writes:  # the error: what the transcoders miss of each MLP output they write
            errs[t] = errs[t] - self.tc.decode(zs, mlp_in[t].to(dtype), t)
        cat = (lambda xs, dt: torch.cat(xs) if xs else torch.zeros(0, dtype=dt))
        self.layer, self.pos, self.feature = (cat(layers, torch.long), cat(pos, torch.long),
                                              cat(feats, torch.long))
        self.acts, self.pre = cat(acts, dtype), cat(pres, dtype)
        self.skip_first = skip_first
        if skip_first:  # the first position's MLP outputs are constants of the replacement model, not nodes
            self.first_out = tr.mlp_out[:, 0].to(dtype).clone()
            errs[:, 0] = 0
        self.errs = errs
        # per block: its latents' slice of the active list (ordered by block) and a (pos, n) one-hot matrix placing
        # them; per (source, target) pair: the source's active latents' decoder rows to the target. A decoded write
        # is then one matmul, cheap to differentiate in batches
        self._range, self._dec, self._place = {}, {}, {}
        for L in self.dicts:
            idx = (self.layer == L).nonzero()[:, 0]
            a, b = (int(idx[0]), int(idx[-1]) + 1) if idx.numel() else (0, 0)
            self._range[L] = (a, b)
            self._place[L] = torch.nn.functional.one_hot(self.pos[a:b], P).T.to(dtype)
        for t, pairs in self.tc.writes.items():
            for s, W in pairs:
                a, b = self._range[s]
                self._dec[s, t] = W[self.feature[a:b]]
        if skip_first:
            self._first_mask = torch.ones(P, 1, dtype=dtype)
            self._first_mask[0] = 0
        self._cur: tuple[list, list] | None = None

    @property
    def n_active(self) -> int:
        return int(self.acts.numel())

    def split(self, acts: Tensor) -> dict[int, Tensor]:
        """The activations ``(n_active,)`` as each block's slice."""
        return {L: acts[a:b] for L, (a, b) in self._range.items()}

    def mlp(self, L: int, x: Tensor) -> Tensor:
        """Block ``L``'s MLP output in the replacement model, from its input ``x (pos, d_model)``."""
        acts, errs = self._cur
        out = errs[L]
        if L in self.tc.writes:
            for s, _ in self.tc.writes[L]:
                out = out + self._place[s] @ (acts[s][:, None] * self._dec[s, L])
            out = out + self.tc.b_dec[L]
            if L in self.tc.skips:
                out = out + x @ self.tc.skips[L].T
        if self.skip_first:  # the first position's output: the real one, a constant
            out = out * self._first_mask
            out = out + torch.nn.functional.pad(self.first_out[L][None], (0, 0, 0, self.P - 1))
        return out

    def forward(self, emb: Tensor, acts, errs, *, keep: dict | None = None,
                cut_attention: bool = False) -> tuple[list[Tensor], Tensor]:
        """Each block's MLP input ``(pos, d_model)`` and the final residual state ``(pos, d_model)`` of the
        replacement model with node outputs ``emb``, ``acts`` (``(n_active,)``, or a dict of each block's slice:
        :meth:`split`), ``errs`` (``(layer, pos, d_model)`` or a list per block), affine in them.

        ``keep``: a dict that receives each block's attention input ``keep["attn_in"]``, per-head outputs
        ``keep["heads"]`` (``(head, pos, d_model)`` each, without ``b_O``) and attention outputs
        ``keep["attn_out"]``. ``cut_attention``: every attention output is a new leaf (its input detached), so
        gradients reach a node only along paths without an attention step."""
        self._cur = (acts if isinstance(acts, dict) else self.split(acts),
                     errs if isinstance(errs, (list, tuple)) else list(errs.unbind(0)))
        h, mlp_in = emb, []
        try:
            for L, layer in enumerate(self.layers):
                x = h.detach() if cut_attention else h
                a_in = x if layer.placement == "post" else layer.ln_attn(x)
                heads = layer.attn.head_outputs(self.probs[L], a_in)
                out = heads.sum(0)
                if layer.attn.b_O is not None:
                    out = out + layer.attn.b_O
                if cut_attention:  # a leaf: its gradient is what reaches it along attention-free paths
                    out = out.detach().requires_grad_()
                if keep is not None:
                    keep.setdefault("attn_in", []).append(a_in)
                    keep.setdefault("heads", []).append(heads)
                    keep.setdefault("attn_out", []).append(out)
                r = layer.after_attention(h, out)
                mlp_in.append(r["mlp_in"])
                h = r["resid_post"]
        finally:
            self._cur = None
        return mlp_in, h

    def pre_of(self, mlp_in: list[Tensor], which: Tensor) -> Tensor:
        """The pre-activations ``(n,)`` of active latents ``which`` (indices into the active list), read from the
        MLP inputs of :meth:`forward`."""
        res = torch.empty(which.numel(), dtype=self.dtype)
        layer = self.layer[which]
        for L, d in self.dicts.items():
            at = (layer == L).nonzero()[:, 0]  # rows of ``which`` in block L
            if at.numel():
                sel, f = which[at], self.feature[which[at]]
                res[at] = (mlp_in[L][self.pos[sel]] * d.W_enc[:, f].T).sum(-1) + d.b_enc[f]
        return res

    def logit_dirs(self, ids: Tensor, foil: int | None = None) -> tuple[Tensor, Tensor]:
        """Demeaned read-out directions ``(n, d_model)`` and constants ``(n,)`` of logits ``ids``: the logit of each
        minus the mean logit over the vocabulary (``foil``: minus the foil's logit, a contrast), before any
        soft-cap, is ``final_norm(h) . u + c`` (:func:`node_logits` of the model's logits)."""
        W = self.readout.W_U.to(self.dtype)
        zb = self.readout.bias_logits().to(self.dtype)
        if foil is not None:
            return W[:, ids].T - W[:, foil], zb[ids] - zb[foil]
        return W[:, ids].T - W.mean(1), zb[ids] - zb.mean()

    def logit_inputs(self, final: Tensor, pos: int, ids: Tensor, foil: int | None = None) -> Tensor:
        """The logit nodes' inputs ``(n,)`` (:meth:`logit_dirs`) at position ``pos`` from the final residual state."""
        u, c = self.logit_dirs(ids, foil)
        return self.readout.part_logits(final[pos], self.final_scale[pos], u.T) + c

    def logit_pullbacks(self, pos: int, ids: Tensor, foil: int | None = None) -> Tensor:
        """``(n, d_model)``: each logit node's direction (:meth:`logit_dirs`) on the final residual state at
        ``pos``."""
        u, _ = self.logit_dirs(ids, foil)
        return self.readout.pullback(u, self.final_scale[pos].expand(u.shape[0]))


def _latents(d: Dictionary, x: Tensor, skip_first: bool) -> tuple[Tensor, Tensor]:
    """A transcoder's pre-activations and latents ``(pos, width)`` on its MLP input ``x``; with ``skip_first`` (a
    special first token, BOS) none at the first position (its MLP output: a constant)."""
    pre = d.pre(x)
    z = d.activate(pre)
    if skip_first:
        z[0] = 0
    return pre, z


def active_counts(tr: Trace, dicts: Transcoders, *, dtype=torch.float32,
                  skip_first: bool = False) -> dict[int, int]:
    """How many latents of each block's transcoder are active on the prompt of ``tr``: the feature nodes
    :class:`Frozen` would hold (the same computation), known before it allocates anything."""
    mlp_in = tr.mlp_in
    return {L: int(_latents(d.to(dtype), mlp_in[L].to(dtype), skip_first)[1].count_nonzero())
            for L, d in sorted(dicts.items())}


def node_logits(z: Tensor, ids: Tensor, foil: int | None = None) -> Tensor:
    """What the logit nodes of tokens ``ids`` read from logits ``z (vocab,)`` (before any soft-cap): each logit minus
    the mean logit, or minus the ``foil``'s (a contrastive node)."""
    return z[ids] - (z[foil] if foil is not None else z.mean())


U32 = float(torch.finfo(torch.float32).eps) / 2  # float32's unit roundoff, 2^-24


def parts_rounding(n_layers: int) -> float:
    """How far float32 may leave a quantity of the frozen model from the sum of its parts, relative to the sizes of
    the parts (``|quantity - sum(parts)| <= parts_rounding(n_layers) * size``): a node's input and its edges plus
    bias terms (:mod:`~lenscope.features.graphs.graph`), an edge and its heads' parts
    (:mod:`~lenscope.features.graphs.heads`),
    a query or key and its nodes' parts (:mod:`~lenscope.features.graphs.qk`).

    The frozen model is linear in its nodes and runs in float32 whatever the model's dtype (a bfloat16 model's
    weights are read in float32), so both sides are float32 evaluations of one linear map, by different passes: the
    quantity by a forward pass, each part by a backward (or forward-mode) pass read against its source's value (the
    sides are then summed in float64, which adds nothing). A float32 pass rounds each block's matrix products to a
    few ``u = 2^-24`` of the sizes of what they multiply, and those sizes reach the quantity as its parts: we allow
    16 u per block plus 16 u for the embedding and the readout, per pass, for two passes: ``32 (n_layers + 1) u``,
    times ``size``, the sum of the parts' absolute values (and, where a part is itself a dot product, of its
    products' absolute values). The model's dtype does not enter: it only sets how far the frozen model is from the
    real run, which :func:`~lenscope.models.runtime.verify.completeness_tolerance` bounds. Measured on every tiny
    decoder
    family (2 or 3 blocks, bound 96 or 128 u): a graph's node sums at most 18.4 u (bloom), the head splits at most
    3.2 u, the queries' and keys' parts at most 2.1 u."""
    return 32 * U32 * (n_layers + 1)


def check_parts(what: str, gap: Tensor, size: Tensor, n_layers: int) -> float:
    """Raise :class:`~lenscope.errors.InvariantError` (naming ``what``) where ``|gap|`` (quantity minus the sum of
    its parts, elementwise) exceeds :func:`parts_rounding` times ``size`` (the sizes of its parts, elementwise; NaN
    never passes); return the largest ``|gap| / size`` (0 where both are 0)."""
    gap, size = gap.double().abs(), size.double()
    ok = gap <= parts_rounding(n_layers) * size
    if not bool(ok.all()):
        i = int((~ok).nonzero()[0, 0])
        raise InvariantError(f"{what} by {float(gap.flatten()[i]):.2e}, more than float32 allows "
                             f"({parts_rounding(n_layers):.1e} of its parts' size {float(size.flatten()[i]):.2e}); "
                             "please report it with the model and the prompt")
    ratio = torch.where(gap > 0, gap / size.clamp_min(torch.finfo(torch.float64).tiny), torch.zeros_like(gap))
    return float(ratio.max()) if ratio.numel() else 0.0


@dataclasses.dataclass
class Transcoders(Mapping):
    """The transcoders a graph replaces the MLPs with: per-layer transcoders (at most one per block) or one
    cross-layer transcoder (:class:`~lenscope.models.dictionaries.clt.CrossLayerTranscoder`), read through what the
    engine reads of them (``encoders()``, ``writers()``: one description of both). A mapping of block -> the encoder
    of its latents (a :class:`Dictionary`; a CLT's block view); ``writes[t]``: the ``(source block, decoder (width,
    d_model))`` pairs writing block ``t``'s MLP output (a per-layer transcoder: its own; a CLT: blocks ``0 .. t``),
    ``b_dec[t]`` its bias, ``skips[t]`` a skip transcoder's ``W_skip``; ``attached``: the objects themselves (what
    the engine takes)."""

    encoders: dict[int, Dictionary]
    writes: dict[int, list[tuple[int, Tensor]]]
    b_dec: dict[int, Tensor]
    skips: dict[int, Tensor]
    attached: list

    def __getitem__(self, layer: int) -> Dictionary:
        return self.encoders[layer]

    def __iter__(self):
        return iter(sorted(self.encoders))

    def __len__(self) -> int:
        return len(self.encoders)

    @property
    def sites(self) -> list[str]:
        return [self.encoders[L].site for L in self]

    def n_targets(self, source: int) -> int:
        """How many blocks' MLP outputs block ``source``'s latents write."""
        return sum(any(s == source for s, _ in pairs) for pairs in self.writes.values())

    def to(self, dtype) -> Transcoders:
        return Transcoders({L: d.to(dtype) for L, d in self.encoders.items()},
                           {t: [(s, W.to(dtype)) for s, W in pairs] for t, pairs in self.writes.items()},
                           {t: b.to(dtype) for t, b in self.b_dec.items()},
                           {t: W.to(dtype) for t, W in self.skips.items()}, self.attached)

    def decode(self, z: dict[int, Tensor], x: Tensor, target: int) -> Tensor:
        """Block ``target``'s MLP output as replaced, from the latents ``z[s] (pos, width)`` of the blocks writing
        it and its MLP input ``x`` (a skip path's)."""
        out = self.b_dec[target]
        for s, W in self.writes[target]:
            out = out + z[s].to(W.dtype) @ W
        if target in self.skips:
            out = out + x.to(self.skips[target].dtype) @ self.skips[target].T
        return out


def transcoders_by_layer(lm: LoadedModel, dictionaries) -> Transcoders:
    """The :class:`Transcoders` of ``dictionaries`` (per-layer transcoders or a cross-layer transcoder), checked:
    transcoders only (an SAE is not a replacement), at most one encoder and one writer per block, each for this
    model."""
    from ...models.dictionaries.clt import CrossLayerTranscoder

    tc = Transcoders({}, {}, {}, {}, list(dictionaries))
    for d in tc.attached:
        if not (isinstance(d, CrossLayerTranscoder) or d.transcoder):
            raise InputError(f"an attribution graph replaces MLPs with transcoders; the dictionary at {d.site} is an "
                             "SAE (train transcoders: lenscope dict train --transcoder --site 'mlp_out.*')")
        d.check(lm)
        for site, _, enc in d.encoders():
            L = site_key(site)[1]
            if L in tc.encoders:
                raise InputError(f"two transcoders for block {L}; give one per block")
            tc.encoders[L] = enc
        for site, (pairs, b) in d.writers().items():
            t = site_key(site)[1]
            if t in tc.writes:
                raise InputError(f"two transcoders write block {t}'s MLP output; give one per block")
            tc.writes[t] = [(site_key(s)[1], W) for s, W in pairs]
            tc.b_dec[t] = b
            if getattr(d, "W_skip", None) is not None:
                tc.skips[t] = d.W_skip
    return tc
