"""Direct logit attribution: a decoder's logit written as an exact sum of what each part wrote.

The final residual state is ``resid = embed (+ pos) + sum_l attn_write[l] + mlp_write[l]``. With the
final norm's per-token scale ``s`` taken from the trace, the norm is affine, so the logit of token
``t`` (minus foil ``f``) at one position is

    logit = sum_c  u . (w * s * center(c))  +  u . b_norm  +  b_U[t] - b_U[f],   u = W_U[:, t] - W_U[:, f]

A mixture of experts' write splits into its chosen experts (``L{l}.E{e}.mlp``): with the routing read from the trace,
the block's output is the sum of the experts' weighted outputs (:meth:`lenscope.models.weights.moe.MoE.expert_outputs`).
Each attention write splits further into its heads and its output bias through the one head-write function
(:func:`lenscope.models.weights.algebra.head_writes` with the ``"rest"`` bias convention, on the heads' outputs
recomputed
with the attention weights from the trace; through Gemma's sandwich norm, affine given its traced scale, and times
Granite's residual multiplier); the final
norm, the biases and the soft-cap are read through :class:`lenscope.models.weights.readout.Readout`. The parts sum to
the model's logit up to float error; ``completeness_error`` reports how far.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..errors import NotApplicableError
from ..models.loading.load import LoadedModel, require_decoder, target_fields
from ..models.runtime.request import Request, position_in
from ..models.runtime.sites import display_name
from ..models.runtime.trace import Trace, trace
from ..models.weights.algebra import f32, head_outputs, head_writes
from ..models.weights.readout import Readout, traced_pullbacks
from ..results import Result


@dataclass(repr=False)
class LogitTarget:
    """The logit an exact decomposition writes as a sum: the logit of ``target`` (minus ``foil``; None: no foil,
    ``foil_id`` None too) at ``position`` of ``tokens``, in ``model``. The first fields of
    :class:`ComponentAttribution` and :class:`lenscope.features.dictionaries.attribution.FeatureAttribution`."""

    model: str
    tokens: list[str]
    position: int
    target: str
    target_id: int
    foil: str | None
    foil_id: int | None

    def target_dict(self) -> dict:
        """These fields, first in a decomposition's ``to_dict``."""
        return {"model": self.model, "tokens": self.tokens, "position": self.position, "target": self.target,
                "target_id": self.target_id, "foil": self.foil, "foil_id": self.foil_id}

    def target_label(self) -> str:
        """``'target' - 'foil'`` (or ``'target'``), for a ``repr``."""
        return repr(self.target) + (f" - {self.foil!r}" if self.foil is not None else "")


@dataclass(repr=False)
class ComponentAttribution(LogitTarget, Result):
    """Components of one logit. ``values (component,)``; ``names``, ``layers``, ``heads`` per component
    (``layer``/``head`` are -1 where they do not apply); ``experts``: per component the expert of a mixture of
    experts (-1 elsewhere), empty unless the experts were split. The first fields say which logit:
    :class:`LogitTarget`."""

    VIEW = "components"  # its view: drawn by viz/views/components/components.js (lenscope.viz.views)

    names: list[str]
    layers: list[int]
    heads: list[int]
    values: Tensor
    logit: float
    completeness_error: float
    by_head: bool = False
    experts: list[int] = field(default_factory=list)

    @property
    def total(self) -> float:
        return float(self.values.sum())

    def to_records(self) -> list[dict]:
        recs = [
            {"name": n, "layer": None if l < 0 else l, "head": None if h < 0 else h, "value": float(v)}
            for n, l, h, v in zip(self.names, self.layers, self.heads, self.values.tolist())
        ]
        for r, e in zip(recs, self.experts):
            r["expert"] = None if e < 0 else e
        return recs

    def to_dict(self) -> dict:
        return {**self.target_dict(), "components": self.to_records(), "logit": self.logit, "sum": self.total,
                "completeness_error": self.completeness_error}

    def to_frame(self):
        import pandas as pd

        return pd.DataFrame(self.to_records())

    def top(self, k: int = 10) -> list[dict]:
        recs = self.to_records()
        return sorted(recs, key=lambda r: -abs(r["value"]))[:k]

    def plot(self, ax=None, top: int | None = None):
        from ..viz.plots import plot_components

        return plot_components(self, ax=ax, top=top)

    def _repr_html_(self) -> str:
        """In a notebook: the report's direct logit attribution view of this result, drawn by the report's own
        script (:func:`lenscope.viz.notebook.view`; ``lenscope.show(result)`` opens it in a browser)."""
        from ..viz.notebook import view

        return str(view(self))

    def __repr__(self) -> str:
        return (f"ComponentAttribution({self.target_label()} at position {self.position}, "
                f"{len(self.names)} components, logit={self.logit:.4f}, "
                f"completeness_error={self.completeness_error:.1e})")


def traced_head_writes(A, tr: Trace, l: int, p: int, which: str = "attn") -> tuple[Tensor, Tensor]:
    """What each head of layer ``l`` adds to the residual stream at position ``p``, ``(head, d_model)``, and the
    part no head writes (the output bias; for a sandwich block, through the post-attention norm with its traced
    scale, plus that norm's bias; times a residual multiplier), ``(d_model,)``:
    :func:`lenscope.models.weights.algebra.head_writes` with the ``"rest"`` bias convention, on the heads' outputs read
    from
    the trace. ``which="cross"``: an encoder-decoder block's cross-attention heads."""
    pattern = tr.cross_pattern if which == "cross" else tr.pattern
    rows = torch.tensor([p], device=pattern[l].device)
    z = head_outputs(A, tr, l, rows, which=which)  # (1, head, d_head)
    post_in = None if which == "cross" or A.layers[l].ln_attn_out is None else f32(tr.attn_out[l][rows])
    heads, rest = head_writes(A.layers[l], z, "rest", post_in, dtype=torch.float32, which=which)
    return heads[0], rest[0]


def _expert_writes(A, tr: Trace, l: int, p: int) -> list[tuple[int, Tensor]]:
    """``(expert, what it adds to the residual stream at p (d_model,))`` for the experts of mixture-of-experts block
    ``l`` that position ``p`` uses, with the routing read from the trace; they add up to ``tr.mlp_write[l][p]``."""
    w = tr.routing_weights[l][p]
    out = A.layers[l].mlp.expert_outputs(tr.mlp_in[l][p:p + 1], w[None])[0]  # (expert, d_model)
    if A.layers[l].ln_mlp_out is not None:
        raise NotApplicableError("splitting a mixture of experts followed by a sandwich norm is not supported; "
                                 "use by_expert=False")
    out = out * A.layers[l].residual_scale  # (Layer.write without a sandwich norm)
    return [(e, out[e]) for e in w.nonzero()[:, 0].tolist()]


@torch.no_grad()
def direct_logit_attribution(
    lm: LoadedModel,
    text: str,
    target: str | int,
    foil: str | int | None = None,
    *,
    by_head: bool = False,
    by_expert: bool | None = None,
    position: int = -1,
    tr: Trace | None = None,
    source=None,
) -> ComponentAttribution:
    """Decompose the logit of ``target`` (minus ``foil``) at ``position`` (default: the last token).

    ``target``/``foil`` are a token's text (``" Paris"``), ``"#ID"`` or an int id. ``by_head``: each attention
    write as its heads and output bias; ``by_expert`` (default: as ``by_head``): each mixture-of-experts write as
    the experts chosen at ``position`` (components ``L{l}.E{e}.mlp``). ``source``: an encoder-decoder model's
    source text (``text`` is then the target prefix): its decoder blocks' cross-attention writes are components too
    (``L{l}.cross``; by head ``L{l}.cross.H{h}``), and through Post-LN blocks (BART, Marian) each write is read along
    the direction carried back to it through the norms after it (the norms' biases join ``bias``).
    """
    require_decoder(lm, "direct logit attribution", sum_of_blocks=True, encoder_decoder=True,
                    instead="use a decoder model (e.g. smollm2) for this view")
    A = lm.anatomy
    req = Request.of(lm, target, foil, need="direct logit attribution")
    t_id, f_id = req.target, req.foil
    tr = tr if tr is not None else trace(lm, text, source=source)
    p = position_in(position, len(tr.tokens))

    readout = Readout.from_anatomy(A)
    u = readout.direction(t_id, f_id)  # float32 from bf16/fp16 weights
    # Post-LN blocks (BART, Marian; no final norm): each write read along the direction carried back to it
    layer_dirs, embed_dir, norm_const = traced_pullbacks(A, tr, torch.tensor([p]), u[None])
    post = layer_dirs is not None
    if not post:
        s = readout.scale(tr.site("ln_final.in")[p])
    names: list[str] = []
    layers: list[int] = []
    heads: list[int] = []
    experts: list[int] = []
    parts: list[Tensor] = []
    dirs: list[Tensor] = []
    by_expert = by_head if by_expert is None else by_expert

    def add(name, layer, head, vec, expert=-1, which=None):
        names.append(name)
        layers.append(layer)
        heads.append(head)
        experts.append(expert)
        parts.append(vec)
        if post:
            dirs.append(embed_dir[0] if which is None else layer_dirs[layer][which][0])

    if A.embed.norm is None:
        emb = A.embed.parts(tr.input_ids[p : p + 1].to(tr.positions.device), tr.positions[p : p + 1])
        for k, v in emb.items():
            add({"tok": "embed", "pos": "pos_embed", "type": "type_embed"}[k], -1, -1, v[0])
    else:
        add("embed", -1, -1, tr.embed[p])

    for i, layer in enumerate(A.layers):
        for which in ("attn", "cross") if layer.cross is not None else ("attn",):
            if by_head:
                head_out, bias = traced_head_writes(A, tr, i, p, which)
                for h in range(head_out.shape[0]):
                    add(display_name("dla.head" if which == "attn" else "dla.cross_head", i, h), i, h, head_out[h],
                        which=which)
                add(display_name(f"dla.{which}_bias", i), i, -1, bias, which=which)
            else:
                add(display_name(which, i), i, -1,
                    getattr(tr, f"{which}_write")[i][p], which=which)
        if by_expert and tr.routing_weights is not None:
            for e, vec in _expert_writes(A, tr, i, p):
                add(display_name("mlp", i, expert=e), i, -1, vec, e, which="mlp")
        else:
            add(display_name("mlp", i), i, -1, tr.mlp_write[i][p], which="mlp")

    if post:
        values = (torch.stack([f32(v) for v in parts]) * torch.stack(dirs)).sum(-1)
    else:
        values = readout.part_logits(torch.stack(parts), s, u)
    if readout.has_bias or post:
        names.append("bias")
        layers.append(-1)
        heads.append(-1)
        experts.append(-1)
        values = torch.cat([values, values.new_tensor([readout.constant(t_id, f_id) + float(norm_const[0])])])

    logit = readout.traced_logit(tr.logits[p], t_id, f_id)  # the logit before soft-capping
    return ComponentAttribution(
        model=lm.name, tokens=tr.tokens, position=p, **target_fields(lm, t_id, f_id), names=names, layers=layers,
        heads=heads,
        values=values.float().cpu(), logit=logit, completeness_error=abs(float(values.double().sum()) - logit),
        by_head=by_head, experts=experts if any(e >= 0 for e in experts) else [],
    )
