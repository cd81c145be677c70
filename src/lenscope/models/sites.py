"""The engine's site table: the names of the activations it captures and edits (``docs/design.md`` lists them),
their parsing (:func:`site_key`) and an edit of one (:class:`Edit`). :mod:`lenscope.models.engine` runs them."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from ..errors import InputError

NORM_SLOTS = ("ln_attn", "ln_mlp", "ln_attn_out", "ln_mlp_out")
NORM_SITES = tuple(f"{s}.{w}" for s in NORM_SLOTS for w in ("in", "out", "scale"))
ROUTER_SITES = ("router_logits", "routing_weights")
LAYER_SITES = ("resid_pre", "resid_mid", "resid_post", "attn_out", "head", "q", "k", "v", "pattern", "mlp_pre",
               "mlp_up", "mlp_hidden", "mlp_out") + NORM_SITES + ROUTER_SITES + ("expert_out",)
MODEL_SITES = ("ln_final.in", "ln_final.out", "ln_final.scale", "logits")
READ_ONLY = ({"resid_mid", "pattern", "logits"} | set(ROUTER_SITES)
             | {s for s in LAYER_SITES + MODEL_SITES if s.endswith(".scale")})
HEAD_SITES = ("head", "q", "k", "v")
_ALL = frozenset(LAYER_SITES + MODEL_SITES)
# the interventions' first vocabulary, still accepted in Edit / run
ALIASES = {"resid": "resid_pre", "attn": "attn_out", "mlp": "mlp_out", "hidden": "mlp_hidden"}

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
    name = ALIASES.get(name, name)
    if name in MODEL_SITES:
        if layer is not None:
            raise InputError(f"site {name!r} belongs to the whole model, not to a block: use ({name!r}, None)")
    elif name in LAYER_SITES:
        if layer is None:
            raise InputError(f"site {name!r} needs a block index, e.g. ({name!r}, 0)")
    else:
        raise InputError(f"unknown site {name!r}; sites: {', '.join(LAYER_SITES + MODEL_SITES)}")
    return name, layer


@dataclass
class Edit:
    """Replace (``mode="set"``), add to (``"add"``) or multiply (``"scale"``) the activation at ``site`` of
    block ``layer`` for the entries ``(rows[n], pos[n])`` (and ``head[n]`` for the per-head sites).

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
        self.site = ALIASES.get(self.site, self.site)
        if self.mode not in ("set", "add", "scale"):
            raise InputError(f"unknown edit mode {self.mode!r}; choose set, add or scale")
