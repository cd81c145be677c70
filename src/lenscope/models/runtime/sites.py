"""The engine's site table: the names of the activations it captures and edits, their parsing (:func:`site_key`)
and an edit of one (:class:`Edit`). :mod:`lenscope.models.runtime.engine` runs them.

Sites: a name and a block index, written ``("resid_pre", 3)`` or ``"resid_pre.3"`` (block-less sites such as the
final norm's take ``None``: ``"ln_final.in"``). Shapes as a hook sees them, reshaped to a batch of rows
(``b``: batch row, ``p``: position, ``h``: head, ``hk``: key/value head, ``s``: source position):

======================  ======================  ======  =====================================================
site                    shape                   edit    what it is
======================  ======================  ======  =====================================================
``resid_pre``           ``(b, p, d_model)``     yes     the residual stream entering block ``i``
``resid_mid``           ``(b, p, d_model)``     no      after the block's attention part (derived: the input
                                                        of ``ln_mlp``; ``ln_attn``'s output for Post-LN;
                                                        ``resid_pre + attn_out`` for parallel blocks)
``resid_post``          ``(b, p, d_model)``     yes     the residual stream leaving block ``i``
``attn_out``            ``(b, p, d_model)``     yes     the attention output projection's output (with bias)
``head``                ``(b, p, h, d_head)``   yes     per-head outputs: the output projection's input
``q``                   ``(b, p, h, d_head)``   yes     per-head queries: the query projection's output
                                                        (before rotary / q-norm / scaling)
``k``, ``v``            ``(b, p, hk, d_head)``  yes     per key/value-head keys and values (fused q/k/v
                                                        projections are split: GPT-2, GPT-NeoX, BLOOM)
``pattern``             ``(b, h, p, s)``        no      attention probabilities (the attention module's
                                                        second output; computed inside transformers'
                                                        attention function, which has no module to edit)
``mlp_pre``             ``(b, p, d_mlp)``       yes     the activation's input (of the gate for gated MLPs)
``mlp_up``              ``(b, p, d_mlp)``       yes     the linear branch of a gated MLP
``mlp_hidden``          ``(b, p, d_mlp)``       yes     the down projection's input: act(pre) (·up)
``mlp_out``             ``(b, p, d_model)``     yes     the MLP's output (with bias); a mixture of experts: the
                                                        whole block's output
``router_logits``       ``(b, p, expert)``      no      a mixture of experts' router logits
``routing_weights``     ``(b, p, expert)``      no      the routing weights: the chosen experts' weights, 0 for
                                                        the others (dense over the experts)
``expert_out``          ``(b, p, e, d_model)``  yes     each expert's weighted output (0 where not chosen); they
                                                        add up to ``mlp_out``; an edit names the expert in
                                                        ``head``
``cross_out``           ``(b, p, d_model)``     yes     an encoder-decoder model's decoder block: the
                                                        cross-attention's output (with bias)
``cross_head``          ``(b, p, h, d_head)``   yes     per-head cross-attention outputs
``cross_q``             ``(b, p, h, d_head)``   yes     cross-attention queries (decoder positions)
``cross_k``             ``(b, s, h, d_head)``   yes     cross-attention keys, over the source positions
``cross_v``             ``(b, s, h, d_head)``   yes     cross-attention values, over the source positions
``cross_pattern``       ``(b, h, p, s)``        no      cross-attention probabilities over the source
``<slot>.in``           ``(b, p, d_model)``     yes     a norm's input; slots ``ln_attn``, ``ln_mlp``,
``<slot>.out``          ``(b, p, d_model)``     yes     ``ln_attn_out``, ``ln_mlp_out`` (sandwich), ``ln_cross``
``<slot>.scale``        ``(b, p)``              no      per block, ``ln_final`` (block ``None``); ``scale`` is
                                                        the per-token factor ``1/sqrt(var + eps)``
``resid_pre.latents``   ``(b, p, width)``       yes     a sparse dictionary's latents (``run(...,
``resid_post.latents``  ``(b, p, width)``       yes     dictionaries=)``) at the site it reconstructs; a
``attn_out.latents``    ``(b, p, width)``       yes     transcoder's at the ``mlp_out`` it replaces; an edit
``mlp_out.latents``     ``(b, p, width)``       yes     changes the site by the change of the decoded latents
                                                        (the reconstruction error kept)
``logits``              ``(b, p, vocab)``       no      the model's output (block ``None``)
======================  ======================  ======  =====================================================

An encoder-decoder model (T5, BART, Marian; ``run(lm, target_prefix_ids, source=source_ids)``): the sites above
are the decoder's (positions ``p``: the target prefix); the encoder's are the same names with the prefix ``enc.``
(``"enc.resid_post.1"``, ``"enc.ln_final.out"``; positions: the source's), cross-attention's and the latents'
excepted.

A mixture of experts' ``mlp_pre``, ``mlp_up``, ``mlp_hidden`` hold every expert's units side by side, ``(b, p,
expert * d_mlp)`` (0 for the experts a token does not use), computed with ``expert_out`` by the Anatomy's own math
(:meth:`~lenscope.models.weights.moe.MoE.run`) from what the experts module receives (docs/design.md).

One name per activation: a site's name is its name everywhere (the :class:`~lenscope.models.runtime.trace.Trace`'s
fields,
``Trace.site``); the old names (:data:`ALIASES`) warn. The parts' display names (``L3H2``, ``L3.mlp``, ``L1H2@3``,
...) come from :func:`display_name`. This table and docs/design.md's are tested against the tuples below
(``tests/models/test_names.py``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from ...errors import InputError, warn_renamed

NORM_SLOTS = ("ln_attn", "ln_mlp", "ln_attn_out", "ln_mlp_out", "ln_cross")
NORM_SITES = tuple(f"{s}.{w}" for s in NORM_SLOTS for w in ("in", "out", "scale"))
ROUTER_SITES = ("router_logits", "routing_weights")
# an encoder-decoder model's decoder blocks: the cross-attention over the encoder's output (its norm: ``ln_cross``)
CROSS_SITES = ("cross_out", "cross_head", "cross_q", "cross_k", "cross_v", "cross_pattern")
LAYER_SITES = ("resid_pre", "resid_mid", "resid_post", "attn_out", "head", "q", "k", "v", "pattern", "mlp_pre",
               "mlp_up", "mlp_hidden", "mlp_out") + NORM_SITES + ROUTER_SITES + ("expert_out",) + CROSS_SITES
# a sparse dictionary's latents (``dictionaries=`` of the engine's run, :mod:`lenscope.models.dictionaries.dictionary`):
# the site it
# reconstructs (a transcoder: the mlp_out it replaces) + ".latents"
DICT_SITES = ("resid_pre", "resid_post", "attn_out", "mlp_out")
LATENT_SITES = tuple(f"{s}.latents" for s in DICT_SITES)
LAYER_SITES = LAYER_SITES + LATENT_SITES
MODEL_SITES = ("ln_final.in", "ln_final.out", "ln_final.scale", "logits")
READ_ONLY = ({"resid_mid", "pattern", "cross_pattern", "logits"} | set(ROUTER_SITES)
             | {s for s in LAYER_SITES + MODEL_SITES if s.endswith(".scale")})
HEAD_SITES = ("head", "q", "k", "v", "cross_head", "cross_q", "cross_k", "cross_v")
# an encoder-decoder model's encoder stack: its sites are the decoder's with this prefix (``"enc.resid_post.1"``,
# ``"enc.ln_final.out"``; positions: the source's), except those of cross-attention, the latents and the logits
ENC = "enc."
ENC_LAYER_SITES = tuple(ENC + s for s in LAYER_SITES if s not in CROSS_SITES and not s.startswith("ln_cross.")
                        and not s.endswith(".latents"))
ENC_MODEL_SITES = tuple(ENC + s for s in MODEL_SITES if s != "logits")
READ_ONLY |= {ENC + s for s in READ_ONLY}
_ALL = frozenset(LAYER_SITES + MODEL_SITES + ENC_LAYER_SITES + ENC_MODEL_SITES)
# the interventions' part kinds (activation patching's ``what``, path patching's senders, causal tracing's kinds;
# CLI options) -> the engine's site each patches
PART_SITES = {"resid": "resid_pre", "attn": "attn_out", "mlp": "mlp_out", "heads": "head"}
# the interventions' first names of sites, still accepted in Edit / run with a deprecation warning (:func:`canonical`)
ALIASES = {k: PART_SITES[k] for k in ("resid", "attn", "mlp")} | {"hidden": "mlp_hidden"}


def canonical(name: str) -> str:
    """The site ``name`` names: itself, or for an old alias (:data:`ALIASES`) its site, with a
    :class:`~lenscope.errors.RenamedWarning`."""
    if name in ALIASES:
        warn_renamed(f"the site name {name!r}", repr(ALIASES[name]))
        return ALIASES[name]
    return name


# The display names of a model's parts (the CLI's tables, the circuits' nodes, DLA's rows, JSON): one template per
# kind (a kind is a node kind or the engine's site it reads); display_name formats them, nothing else does.
DISPLAY = {
    "embed": "embed", "logits": "logits", "layer": "L{layer}",
    "head": "L{layer}H{head}",  # a head (the engine's site "head")
    "q": "L{layer}H{head}.q", "k": "L{layer}H{head}.k", "v": "L{layer}H{head}.v",  # a head's query / key / value
    "kv.k": "L{layer}KV{head}.k", "kv.v": "L{layer}KV{head}.v",  # a key/value head's (grouped attention)
    "attn": "L{layer}.attn", "mlp": "L{layer}.mlp", "resid": "L{layer}.resid",
    "expert": "L{layer}.E{expert}.mlp",  # one expert of a mixture of experts
    "neuron": "L{layer}.N{unit}",  # a unit of the MLP's hidden layer
    # direct logit attribution's rows, older than the circuits' names and kept (saved results use them)
    "dla.head": "L{layer}.H{head}", "dla.attn_bias": "L{layer}.attn_bias",
    # an encoder-decoder model's cross-attention: its write, a head's, and its output bias (DLA)
    "cross": "L{layer}.cross", "dla.cross_head": "L{layer}.cross.H{head}", "dla.cross_bias": "L{layer}.cross_bias",
}
# a sparse dictionary's parts (its engine site "<site>.latents"): latent ``unit`` ("resid_post.5/F123"), and the parts
# no latent writes: its decoder bias, a skip transcoder's skip path, the reconstruction error ("mlp_out.3/error")
DISPLAY |= {f"{s}.latents": f"{s}.{{layer}}/F{{unit}}" for s in DICT_SITES}
DISPLAY |= {f"{s}.latents.{part}": f"{s}.{{layer}}/{part}" for s in DICT_SITES for part in ("bias", "skip", "error")}
# the engine's sites that name a part: their display kind
SITE_DISPLAY = {"resid_pre": "resid", "attn_out": "attn", "mlp_out": "mlp", "expert_out": "expert",
                "cross_out": "cross"}


def display_name(kind: str, layer: int | None = None, head: int | None = None, pos: int | None = None,
                 expert: int | None = None, unit: int | None = None) -> str:
    """The display name of a part (:data:`DISPLAY`): ``("head", 3, 2)`` -> ``"L3H2"``, ``("mlp", 3)`` ->
    ``"L3.mlp"`` (with ``expert=1``: ``"L3.E1.mlp"``), ``("q", 3, 2)`` -> ``"L3H2.q"``, ``"embed"``, ``"logits"``;
    ``pos`` appends ``"@pos"`` (``"L1H2@3"``). ``kind`` may be an engine site (``"attn_out"`` -> ``"L3.attn"``); a
    dictionary's latent: ``("resid_post.latents", 5, unit=123)`` -> ``"resid_post.5/F123"``, its other parts
    ``("mlp_out.latents.error", 3)`` -> ``"mlp_out.3/error"`` (``.bias``, ``.skip``)."""
    kind = SITE_DISPLAY.get(kind, kind)
    if kind == "mlp" and expert is not None:
        kind = "expert"
    name = DISPLAY[kind].format(layer=layer, head=head, expert=expert, unit=unit)
    return name if pos is None else f"{name}@{pos}"


def site_key(site) -> tuple[str, int | None]:
    """``("resid_pre", 3)``, ``"resid_pre.3"``, ``"ln_final.in"`` -> ``(name, layer)`` (checked)."""
    if isinstance(site, str):
        head, _, tail = site.rpartition(".")
        name, layer = (head, int(tail)) if head and tail.isdigit() else (site, None)
    else:
        try:
            name, layer = site
        except (TypeError, ValueError):
            raise InputError(
                f"a site is a name and a block, e.g. ('resid_pre', 3) or 'resid_pre.3'; got {site!r}") from None
        layer = None if layer is None else int(layer)
    name = ENC + canonical(name[len(ENC):]) if name.startswith(ENC) else canonical(name)
    if name in MODEL_SITES or name in ENC_MODEL_SITES:
        if layer is not None:
            raise InputError(f"site {name!r} belongs to the whole model, not to a block: use ({name!r}, None)")
    elif name in LAYER_SITES or name in ENC_LAYER_SITES:
        if layer is None:
            raise InputError(f"site {name!r} needs a block index, e.g. ({name!r}, 0)")
    else:
        raise InputError(f"unknown site {name!r}; sites: {', '.join(LAYER_SITES + MODEL_SITES)} (an "
                         f"encoder-decoder model's encoder: the same with the prefix {ENC!r})")
    return name, layer


def stack_of(name: str) -> tuple[str, str]:
    """``(prefix, base name)`` of a site name: ``"enc.resid_post"`` -> ``("enc.", "resid_post")``."""
    return (ENC, name[len(ENC):]) if name.startswith(ENC) else ("", name)


class Captures(dict):
    """Captured sites by key ``(name, layer)``. The blocks of one site name share one preallocated
    ``(layer, ...)`` buffer (so a capture is never held twice); :meth:`stacked` returns it."""

    def __init__(self):
        super().__init__()
        self._bufs: dict[str, tuple[list[int], Tensor]] = {}

    @staticmethod
    def _key(key):
        return key if isinstance(key, tuple) and len(key) == 2 and key[0] in _ALL else site_key(key)

    def __getitem__(self, key):
        return super().__getitem__(self._key(key))

    def __contains__(self, key):
        try:
            return super().__contains__(self._key(key))
        except InputError:
            return False

    def get(self, key, default=None):
        return self[key] if key in self else default

    def pop(self, key, *default):
        return super().pop(self._key(key), *default)

    def stacked(self, name: str) -> Tensor:
        """Every captured block of ``name`` as one ``(layer, ...)`` tensor, blocks in ascending order."""
        name = canonical(name)
        if name in self._bufs:
            return self._bufs[name][1]
        layers = sorted(layer for (n, layer) in self if n == name)
        return torch.stack([self[(name, layer)] for layer in layers])


@dataclass
class Edit:
    """Replace (``mode="set"``), add to (``"add"``) or multiply (``"scale"``) the activation at ``site`` of
    block ``layer`` for the entries ``(rows[n], pos[n])`` (and ``head[n]`` for the per-head sites).

    ``mode="call"``: ``values`` is a function given the site's whole view ``(b, p, ...)`` (a copy) that returns its
    replacement, same shape (``rows`` and ``pos`` unused): an activation computed from others in the same pass, as a
    model frozen at a real run needs (:mod:`lenscope.features.graphs.replacement`); one pass only, not with a cache.

    ``rows, pos, head: (n,)`` long; ``values: (n, d)`` where ``d`` is the site's last axis (``d_head`` for
    per-head sites), or ``(n,)``/``(n, d)`` factors for ``"scale"``. Edits at one site apply in list order.
    ``expert_out`` edits name the expert in ``head``.
    """

    site: str
    layer: int
    rows: Tensor
    pos: Tensor
    values: Tensor
    head: Tensor | None = None
    mode: str = "set"

    def __post_init__(self):
        self.site = canonical(self.site)
        if self.mode not in ("set", "add", "scale", "call"):
            raise InputError(f"unknown edit mode {self.mode!r}; choose set, add, scale or call")
        if (self.mode == "call") != callable(self.values):
            raise InputError("a call edit (and only it) takes a function as its values")


def edits_within(edits: Iterable[Edit], start: int, stop: int) -> list[Edit]:
    """The entries of ``edits`` at positions ``start <= pos < stop``, their positions counted from ``start``
    (an edit with no entry left is dropped): the edits of one step of a decoding loop, or of a sequence that
    ended before the last position an edit names."""
    out = []
    for e in edits:
        idx = [torch.as_tensor(x) for x in (e.rows, e.pos, e.head) if x is not None]
        n = max(1, *(int(x.shape[0]) for x in idx if x.dim()))
        pos = torch.as_tensor(e.pos).reshape(-1).expand(n) if torch.as_tensor(e.pos).numel() == 1 else \
            torch.as_tensor(e.pos)
        keep = (pos >= start) & (pos < stop)
        if start == 0 and bool(keep.all()):
            out.append(e)
        elif bool(keep.any()):
            def sel(x, per_entry=True):  # the kept entries of a per-entry tensor; a broadcast one as it is
                x = torch.as_tensor(x)
                if not per_entry or x.dim() == 0 or x.shape[0] != n:
                    return x
                return x[keep.to(x.device)]

            v = e.values
            per_entry = v.dim() >= 2 or e.mode == "scale"  # set / add with a (d,) vector: one for every entry
            out.append(Edit(e.site, e.layer, sel(e.rows), sel(pos) - start, sel(v, per_entry),
                            head=None if e.head is None else sel(e.head), mode=e.mode))
    return out
