"""The table of sparse-dictionary kinds: the one place a kind (TopK, BatchTopK, JumpReLU, ...) is named and
dispatched. Each kind is one :class:`Kind` subclass in one file of this package (or anywhere: :func:`register`),
and declares what the rest of lenscope asks of it:

- its inference form (:meth:`Kind.activate`) and parameters (``k`` and / or a ``threshold (width,)``, checked by
  :meth:`Kind.check`), which :class:`~lenscope.models.dictionaries.dictionary.Dictionary` and so the engine's latent
  sites use;
- its files: SAELens's architecture name (:attr:`Kind.architecture`), its ``cfg.json`` fields
  (:meth:`Kind.config`), which SAELens architectures it reads (:meth:`Kind.reads`), whether circuit-tracer's layout
  can hold it (:meth:`Kind.check_circuit_tracer`);
- its training objective (:meth:`Kind.setup`, :meth:`Kind.train_forward`, :meth:`Kind.penalty`,
  :meth:`Kind.after_step`, :meth:`Kind.trained`), which :class:`lenscope.features.dictionaries.train.Trainable` calls
  with itself
  (its parameters and its tools: ``mm``, ``centre``, ``pick``, ``decode_rows``, ``reduce``), and the parameters
  training adds per latent (:attr:`Kind.trained_per_latent`, for ``--max-memory``);
- its name and help for the CLI (``lenscope dict train --kind``: :func:`names`, :func:`kind_help`).

Importing this table does not import torch (the CLI builds its help from it): a kind's file imports torch inside
its methods. The base class is the form every kind with a threshold stores, ``relu(pre) · H(pre - θ)`` (SAELens's
``jumprelu`` class at inference); a kind without one overrides the inference methods.
"""

from __future__ import annotations

from importlib import import_module

from ....errors import InputError
from ....registry import Table

DEFAULT = "topk"  # the kind Dictionary.init, DictSettings and ``dict train --kind`` start from


class Kind:
    """One sparse-dictionary kind (see the module's docstring). Subclass it, set :attr:`name`, and register an
    instance (:func:`register`)."""

    name: str = ""
    help: str = ""  # one line for the CLI's --kind help
    k_help: str = ""  # what --k means for this kind
    architecture: str = ""  # SAELens's name of the inference class (``jumprelu``; role suffixes added)
    threshold: bool = True  # holds a threshold (width,)
    trained_per_latent: int = 0  # parameters per latent that training adds to the dictionary's (train_memory)

    # -- inference -------------------------------------------------------------------------------------------------

    def check(self, D) -> None:
        """Refuse a dictionary ``D`` whose parameters this kind cannot run (one line); may normalise them."""
        if self.threshold and D.threshold is None:
            raise InputError(f"a {self.name} dictionary needs its threshold (width,)")

    def init_threshold(self, width: int, value: float, dtype):
        """The threshold of a new dictionary (``Dictionary.init``), or None for a kind without one."""
        import torch

        if not self.threshold:
            return None
        return torch.full((width,), float(value), dtype=dtype)

    def activate(self, D, pre):
        """The latents of pre-activations ``pre (..., width)`` of dictionary ``D``."""
        return pre.relu() * (pre > D.threshold).to(pre.dtype)

    def describe(self, D) -> str:
        """What ``repr(D)`` adds after the kind's name (``, k=32``)."""
        return ""

    # -- files -----------------------------------------------------------------------------------------------------

    def config(self, D) -> dict:
        """The fields of SAELens's ``cfg.json`` this kind writes besides the common ones."""
        return {}

    def reads(self, base: str, cfg: dict, tensors: dict) -> dict | None:
        """``{"k": ...}`` when SAELens's architecture ``base`` (its transcoder suffix removed) with ``cfg`` is read as
        this kind (``tensors``: the weights read, which a kind may complete), else None. The first kind of the table
        that answers reads the file (lenscope's own record may name another kind afterwards)."""
        return {"k": cfg.get("k")} if base == self.name else None

    def check_file(self, tensors: dict, where) -> None:
        """Refuse (one line naming ``where``) the weights of a file that this kind cannot run."""

    def rescale(self, cfg: dict) -> bool:
        """Whether SAELens's ``rescale_acts_by_decoder_norm`` of ``cfg`` applies to this kind (folded on reading)."""
        return False

    def check_circuit_tracer(self, D) -> None:
        """Refuse a transcoder that circuit-tracer's layout (a JumpReLU threshold or a ReLU) cannot hold."""
        if not self.threshold:
            raise InputError(f"the transcoder for {D.site} is {self.name}, which circuit-tracer cannot read")

    # -- training (``m``: a lenscope.features.dictionaries.train.Trainable) ------------------------------------------

    def setup(self, m, D) -> None:
        """Add this kind's trained parameters to ``m``; the two scalar buffers every checkpoint holds (a running
        ``threshold`` and a sparsity coefficient ``l0_coef``, 0 where a kind uses neither) are registered here."""
        import torch

        m.log_threshold = None
        m.register_buffer("threshold", torch.zeros(()))
        m.register_buffer("l0_coef", torch.zeros(()))

    def first_block(self, m, x, scale: float) -> None:
        """Start the kind's parameters from the first block's inputs ``x (rows, d_in)`` (times ``scale``)."""

    def train_forward(self, m, xc, n: int, dist, stats: dict):
        """The batch's pre-activations, output (no skip path), latents fired ``(width,)`` bool, and what
        :meth:`penalty` needs, for centred inputs ``xc (n, d_in)``; sets ``stats["l0"]``."""
        raise InputError(f"the dictionary kind {self.name!r} cannot be trained by lenscope")

    def penalty(self, m, loss, xc, pre, dead, err, extra):
        """The loss with the kind's terms added (``dead``: the dead latents, ``err``: ``y - ŷ``)."""
        return loss

    def after_step(self, m, l0: float) -> None:
        """After the optimizer's step (``l0``: the batch's mean active latents)."""

    def trained(self, m, tensors: dict) -> None:
        """Add the kind's parameters (``threshold``) to the trained weights ``tensors``."""


_TABLE: Table[Kind] = Table("a dictionary kind", "unknown dictionary kind {name!r}; kinds: {names}")
register, unregister, get = _TABLE.register, _TABLE.unregister, _TABLE.get
names = _TABLE.names  # the kinds' names in table order (the CLI's ``--kind`` choices)
kinds = _TABLE.entries


def reading(base: str, cfg: dict, tensors: dict) -> tuple[Kind, dict] | None:
    """The first kind that reads SAELens's architecture ``base`` (:meth:`Kind.reads`) and its parameters."""
    for k in _TABLE.entries():
        got = k.reads(base, cfg, tensors)
        if got is not None:
            return k, got
    return None


def _or(words: list[str]) -> str:
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def kind_help() -> str:
    """``dict train --kind``'s help: every kind with its line."""
    return "; ".join(f"{k.name}: {k.help}" for k in _TABLE.entries()) + "."


def k_help() -> str:
    """``dict train --k``'s help: what ``k`` is for each kind."""
    return "; ".join(f"{k.name}: {k.k_help}" for k in _TABLE.entries()) + "."


def circuit_tracer_kinds() -> str:
    """The kinds circuit-tracer's layout holds, in words (``batchtopk or jumprelu``)."""
    return _or([k.name for k in _TABLE.entries() if k.threshold])


# the built-in kinds, each registering itself, in the table's order (the first to read a file wins: TopK's reading of
# SAELens's old ``standard`` + ``activation_fn: topk`` before JumpReLU's of a ReLU)
for _name in ("topk", "batchtopk", "jumprelu"):
    import_module(f"{__name__}.{_name}")

__all__ = ["DEFAULT", "Kind", "circuit_tracer_kinds", "get", "k_help", "kind_help", "kinds", "names", "reading",
           "register", "unregister"]
