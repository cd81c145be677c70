"""The Trace: one forward pass of the real model with what the methods need captured.

A Trace is a view on the engine (:mod:`lenscope.models.engine`): the sites of :func:`trace_sites`, captured in one
pass. All tensors are for a single sequence (no batch axis).

Devices and dtypes: a model split across devices (accelerate's ``device_map``) runs as placed; each capture
arrives on the device its block ran on and is copied into one ``(layer, ...)`` tensor on the trace's device
(``trace(..., device=)``; by default the ``math_device`` the model was loaded with, else the device of the first
block's capture, i.e. the model's own device for a model on one device). Captures of bfloat16 / float16 models are
stored in float32 (exact), the dtype the Anatomy computes in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from .devices import compute_dtype
from .engine import run
from .load import LoadedModel, token_ids


@dataclass(repr=False)
class Trace:
    """Captured activations of one forward pass (shapes use named axes).

    - ``input_ids (pos,)``, ``tokens`` (strings), ``positions (pos,)``
    - ``embed (pos, d_model)``: the residual stream entering layer 0
    - ``resid_pre, resid_mid, resid_post (layer, pos, d_model)``: before the block, after its attention
      part (for parallel blocks ``resid_pre + attn_write``, which the model never materialises), after it
    - ``attn_out, mlp_out (layer, pos, d_model)``: what each sub-layer computed (with output biases)
    - ``attn_write, mlp_write (layer, pos, d_model)``: what it added to the residual stream (after the
      sandwich norms of Gemma; equal to ``*_out`` elsewhere)
    - ``attn_probs (layer, head, pos, src)``
    - ``mlp_pre (layer, pos, d_mlp)``: pre-activation of the activated branch; ``mlp_up``: the linear
      branch of gated MLPs (else None)
    - ``norm_in[slot], norm_out[slot] (layer, pos, d_model)`` for every norm slot of the blocks
    - ``final_in, final_out (pos, d_model)``: the final norm's input and output (None for encoders)
    - ``logits (pos, vocab)`` (None for a model without a language-model head)
    """

    input_ids: Tensor
    tokens: list[str]
    positions: Tensor
    embed: Tensor
    resid_pre: Tensor
    resid_mid: Tensor
    resid_post: Tensor
    attn_out: Tensor
    attn_write: Tensor
    mlp_out: Tensor
    mlp_write: Tensor
    attn_probs: Tensor
    mlp_pre: Tensor
    mlp_up: Tensor | None
    norm_in: dict[str, Tensor]
    norm_out: dict[str, Tensor]
    final_in: Tensor | None
    final_out: Tensor | None
    logits: Tensor | None
    placement: str
    extras: dict = field(default_factory=dict)

    @property
    def n_layers(self) -> int:
        return self.resid_pre.shape[0]

    @property
    def attn_in(self) -> Tensor:
        """What each attention sub-layer read (layer, pos, d_model)."""
        return self.resid_pre if self.placement == "post" else self.norm_out["ln_attn"]

    @property
    def mlp_in(self) -> Tensor:
        """What each MLP read (layer, pos, d_model)."""
        return self.resid_mid if self.placement == "post" else self.norm_out["ln_mlp"]

    @property
    def final_resid(self) -> Tensor:
        """The last residual state (pos, d_model): input of the final norm, or the encoder's output."""
        return self.final_in if self.final_in is not None else self.resid_post[-1]

    def __repr__(self) -> str:
        return f"Trace(pos={len(self.tokens)}, layers={self.n_layers}, placement={self.placement!r})"


def trace_sites(lm: LoadedModel) -> list[tuple]:
    """The engine's sites a :class:`Trace` holds, for every block (see :mod:`lenscope.models.engine`)."""
    A = lm.anatomy
    names = ["resid_pre", "resid_mid", "resid_post", "pattern", "attn_out", "mlp_out", "mlp_pre"]
    if A.layers[0].mlp.gated:
        names.append("mlp_up")
    names += [f"{slot}.{w}" for slot in A.layers[0].norms() for w in ("in", "out")]
    sites = [(n, i) for n in names for i in range(A.n_layers)]
    if A.final_norm is not None:
        sites += [("ln_final.in", None), ("ln_final.out", None)]
    return sites


def _view(lm: LoadedModel, cap, ids: Tensor, row: int, logits: Tensor | None) -> Trace:
    """Row ``row`` of a batch captured with :func:`trace_sites` as a :class:`Trace` (views, no copies)."""
    A = lm.anatomy
    slots = list(A.layers[0].norms())

    def per_layer(name):
        return cap.stacked(name)[:, row]

    norm_in = {s: per_layer(f"{s}.in") for s in slots}
    norm_out = {s: per_layer(f"{s}.out") for s in slots}
    resid_pre, attn_out, mlp_out = per_layer("resid_pre"), per_layer("attn_out"), per_layer("mlp_out")
    final_in, final_out = cap.get(("ln_final.in", None)), cap.get(("ln_final.out", None))
    if final_in is not None:
        final_in, final_out = final_in[row].to(resid_pre.device), final_out[row].to(resid_pre.device)
    return Trace(
        input_ids=ids.cpu(),
        tokens=lm.tokenizer.batch_decode([[int(i)] for i in ids]),
        positions=torch.arange(ids.numel(), device=resid_pre.device),
        embed=resid_pre[0],
        resid_pre=resid_pre,
        resid_mid=per_layer("resid_mid"),
        resid_post=per_layer("resid_post"),
        attn_out=attn_out,
        attn_write=norm_out.get("ln_attn_out", attn_out),
        mlp_out=mlp_out,
        mlp_write=norm_out.get("ln_mlp_out", mlp_out),
        attn_probs=per_layer("pattern"),
        mlp_pre=per_layer("mlp_pre"),
        mlp_up=per_layer("mlp_up") if ("mlp_up", 0) in cap else None,
        norm_in=norm_in,
        norm_out=norm_out,
        final_in=final_in,
        final_out=final_out,
        logits=None if logits is None else logits.to(device=resid_pre.device, dtype=compute_dtype(logits.dtype)),
        placement=A.placement,
    )


def _math_device(lm: LoadedModel, device):
    device = device if device is not None else lm.anatomy.extras.get("placement", {}).get("math_device")
    return None if device is None else torch.device(device)


def trace(lm: LoadedModel, text: str | list[int] | Tensor, *, device: str | torch.device | None = None) -> Trace:
    """Run the model once on ``text`` (or token ids) and capture everything lenscope's methods read.

    ``device``: where the captures are kept (default: the ``math_device`` the model was loaded with, else where the
    first block's capture arrives: the model's device for a model on one device). Captures of bfloat16 / float16
    models are kept in float32."""
    ids = token_ids(lm, text)
    logits, cap = run(lm, ids[None], capture=trace_sites(lm), device=_math_device(lm, device), upcast=True)
    return _view(lm, cap, ids, 0, None if logits is None else logits[0])


@torch.no_grad()
def batch_traces(lm: LoadedModel, ids: Tensor) -> list[Trace]:
    """One :class:`Trace` per row of ``ids (batch, pos)`` from a single forward pass (rows of equal length; the
    same sites as :func:`trace`). ``logits`` hold the last position only; earlier positions are NaN."""
    ids = torch.as_tensor(ids, dtype=torch.long)
    B, n = ids.shape
    logits, cap = run(lm, ids, capture=trace_sites(lm), last_only=True)
    last = logits[:, -1]  # (batch, vocab)
    out = []
    for b in range(B):
        lg = last.new_full((n, last.shape[-1]), float("nan"))
        lg[-1] = last[b]
        out.append(_view(lm, cap, ids[b], b, lg))
    return out


@torch.no_grad()
def residual_states(lm: LoadedModel, ids: Tensor, *, mid: bool = False,
                    device: str | torch.device | None = None) -> dict[str, Tensor]:
    """Lean batched capture for lenses: ``ids (batch, pos)`` ->

    - ``states (layer + 1, batch, pos, d_model)``: the residual entering each block, then the last state
    - ``mid (layer, batch, pos, d_model)`` (when ``mid=True``): the residual after each block's attention
    - ``logits (batch, pos, vocab)``: the model's output

    All on ``device`` (default: the model's ``math_device``, else where the first block's input arrives); float32
    for bfloat16 / float16 models.
    """
    A = lm.anatomy
    L = A.n_layers
    last = ("ln_final.in", None) if A.final_norm is not None else ("resid_post", L - 1)
    sites = [("resid_pre", i) for i in range(L)] + [last] + ([("resid_mid", i) for i in range(L)] if mid else [])
    logits, cap = run(lm, ids, capture=sites, device=_math_device(lm, device), upcast=True)
    pre = cap.stacked("resid_pre")
    res = {"states": torch.cat([pre, cap[last].to(pre.device)[None]])}
    if mid:
        res["mid"] = cap.stacked("resid_mid")
    res["logits"] = None if logits is None else logits.to(device=pre.device, dtype=compute_dtype(logits.dtype))
    return res


def prefix_trace(tr: Trace, n: int) -> Trace:
    """The trace of the first ``n`` tokens, cut from ``tr``. Exact for causal models only (a position never
    sees later ones), where it lets a method that explains position ``n - 1`` skip the rest of the text."""
    if n >= len(tr.tokens):
        return tr

    def cut(x, axes):
        if x is None:
            return None
        for ax in axes:
            x = x.narrow(ax, 0, n)
        return x

    return Trace(
        input_ids=tr.input_ids[:n], tokens=tr.tokens[:n], positions=tr.positions[:n], embed=tr.embed[:n],
        resid_pre=cut(tr.resid_pre, [1]), resid_mid=cut(tr.resid_mid, [1]), resid_post=cut(tr.resid_post, [1]),
        attn_out=cut(tr.attn_out, [1]), attn_write=cut(tr.attn_write, [1]), mlp_out=cut(tr.mlp_out, [1]),
        mlp_write=cut(tr.mlp_write, [1]), attn_probs=cut(tr.attn_probs, [2, 3]), mlp_pre=cut(tr.mlp_pre, [1]),
        mlp_up=cut(tr.mlp_up, [1]), norm_in={k: cut(v, [1]) for k, v in tr.norm_in.items()},
        norm_out={k: cut(v, [1]) for k, v in tr.norm_out.items()}, final_in=cut(tr.final_in, [0]),
        final_out=cut(tr.final_out, [0]), logits=cut(tr.logits, [0]), placement=tr.placement, extras=tr.extras,
    )
