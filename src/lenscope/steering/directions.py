"""Steering directions: a vector in the residual stream entering one block, built from contrast pairs, and the
engine's edits that add a multiple of it.

A direction is read at the site ``resid_pre.L`` (the residual stream entering block ``L``, the engine's name) at
one position of each text (``position``, default the last token), and added back at that site. The methods (the
builders of :mod:`.builders`), each on the paired differences ``d_i = h(positive_i) - h(negative_i)``:

- ``actadd``: activation addition from one prompt pair (Turner et al. 2023): ``d_0`` (the first pair; further
  pairs are left out and the direction's notes say so);
- ``mean-diff``: the mean difference over the pairs, contrastive activation addition (Panickssery et al. 2023);
- ``pca``: the first principal component of the differences (representation engineering, Zou et al. 2023):
  the top right singular vector of the uncentred ``(pair, d_model)`` matrix, which is the first component of
  the differences taken in random order (``±d_i``), as RepE builds them;
- ``probe``: the weight vector of a logistic regression telling positive states from negative ones
  (scikit-learn's ``LogisticRegression``, L2, ``C=1``).

Every method gives a unit direction ``u``; the vector is scaled to ``v = (mean_i d_i . u) u``, the mean paired
difference's component along ``u``, so that multiplier 1 moves a state by as much as the pairs differ along it
on average, whatever the method (for ``mean-diff`` ``v`` is the mean difference itself, for ``actadd`` ``d_0``).
A multiplier ``alpha`` adds ``alpha * v``. A new kind of direction built from pairs is one
:func:`~lenscope.steering.builders.register` call (its own file); one made otherwise (e.g. a dictionary feature's
decoder row) is one more way to make a :class:`Direction`: the edits and the evaluation only read ``vector``,
``site`` and ``layer``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from ..data.steering import SteeringPair, data_hash
from ..errors import InputError
from ..models.loading.load import LoadedModel, require_decoder, token_ids
from ..models.loading.summary import fingerprint, same_model
from ..models.runtime.engine import Edit, capture, run
from . import builders

SITE = "resid_pre"
FORMAT = 1
VECTOR_FILE = "direction.safetensors"
CONFIG_FILE = "direction.json"


# ---------------------------------------------------------------------------------------------- the result


@dataclass(repr=False)
class Direction:
    """A steering vector ``vector (d_model,)`` for the site ``site`` of block ``layer`` of the model whose
    :func:`~lenscope.lenses.lenses.fingerprint` is ``fingerprint``; made by ``method`` from ``n_pairs`` pairs
    (``data_hash``: :func:`lenscope.data.steering.data_hash` of them) at ``position`` of each text.

    ``stats``: ``norm`` (of ``vector``), ``agreement`` (the share of pairs whose difference points along the
    vector), and per method ``explained`` (pca: the first component's share of the differences' second moment)
    or ``accuracy`` (probe: on the states it was fitted to). Saved as a folder (:meth:`save`): ``direction.json``
    and ``direction.safetensors``."""

    vector: Tensor
    model: str
    fingerprint: str
    layer: int
    method: str
    position: int = -1
    site: str = SITE
    data_hash: str = ""
    n_pairs: int = 0
    stats: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)

    @property
    def d_model(self) -> int:
        return int(self.vector.numel())

    @property
    def site_name(self) -> str:
        """The engine's name of the site, with the block: ``"resid_pre.6"``."""
        return f"{self.site}.{self.layer}"

    def config(self) -> dict:
        return {"format": FORMAT, "kind": "lenscope steering direction", "model": self.model,
                "fingerprint": self.fingerprint, "d_model": self.d_model, "site": self.site_name,
                "layer": self.layer, "method": self.method, "position": self.position, "data_hash": self.data_hash,
                "n_pairs": self.n_pairs, "scale": "alpha * vector; vector = (mean paired difference . u) u",
                "stats": self.stats, "notes": self.notes}

    def save(self, folder: str | Path) -> Path:
        """Write ``folder/direction.json`` (model fingerprint, site, method, data hash, stats) and
        ``folder/direction.safetensors`` (the vector)."""
        from safetensors.torch import save_file

        folder = Path(folder)
        if folder.exists() and not folder.is_dir():
            raise InputError(f"{folder} is a file; give a folder for the direction")
        folder.mkdir(parents=True, exist_ok=True)
        save_file({"vector": self.vector.detach().float().cpu().contiguous()}, str(folder / VECTOR_FILE))
        (folder / CONFIG_FILE).write_text(json.dumps(self.config(), indent=1) + "\n")
        return folder

    @classmethod
    def load(cls, folder: str | Path) -> Direction:
        """Read a folder written by :meth:`save` (or the path of either of its files)."""
        folder = Path(folder)
        if folder.is_file():
            folder = folder.parent
        cfg_path, vec_path = folder / CONFIG_FILE, folder / VECTOR_FILE
        if not folder.is_dir() or not cfg_path.is_file() or not vec_path.is_file():
            raise InputError(f"{folder} is not a steering direction (a folder with {CONFIG_FILE} and {VECTOR_FILE}, "
                             "written by `lenscope steer build`)")
        try:
            cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
            from safetensors.torch import load_file

            vec = load_file(str(vec_path))["vector"]
        except Exception as e:  # a corrupt JSON or safetensors file
            raise InputError(f"cannot read the direction in {folder} ({type(e).__name__}: {e})".splitlines()[0]) \
                from None
        if not isinstance(cfg, dict) or cfg.get("kind") != "lenscope steering direction":
            raise InputError(f"{cfg_path} is not a lenscope steering direction")
        if int(cfg.get("format", 0)) > FORMAT:
            raise InputError(f"{folder} was written by a newer lenscope (format {cfg['format']})")
        if vec.dim() != 1:
            raise InputError(f"{vec_path}: the vector has shape {tuple(vec.shape)}; a direction is one vector")
        try:
            site, layer = cfg["site"].rsplit(".", 1)
            return cls(vector=vec.float(), model=cfg["model"], fingerprint=cfg["fingerprint"], layer=int(layer),
                       method=cfg["method"], position=int(cfg.get("position", -1)), site=site,
                       data_hash=cfg.get("data_hash", ""), n_pairs=int(cfg.get("n_pairs", 0)),
                       stats=cfg.get("stats", {}), notes=cfg.get("notes", []))
        except (KeyError, ValueError, AttributeError) as e:
            raise InputError(f"{cfg_path} lacks a field of a steering direction ({e})") from None

    def check(self, lm: LoadedModel, layers=None) -> list[int]:
        """Refuse a direction made on another model or of the wrong width; return the blocks to steer
        (``layers``, default the direction's own), checked against the model."""
        A = lm.anatomy
        if self.site != SITE:
            raise InputError(f"this direction is for the site {self.site!r}; lenscope steers at {SITE!r}")
        if self.d_model != A.d_model:
            raise InputError(f"the direction has width {self.d_model}, but {lm.name} has d_model {A.d_model}; build "
                             "a direction on this model (`lenscope steer build`)")
        if not same_model(self.fingerprint, A):
            raise InputError(f"the direction was built on {self.model!r}, not on {lm.name!r} (model fingerprints "
                             "differ); build a direction on this model (`lenscope steer build`)")
        layers = [self.layer] if layers is None else layers
        if isinstance(layers, int):
            layers = [layers]
        out = []
        for layer in layers:
            if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < A.n_layers:
                raise InputError(f"layer {layer!r} is outside 0..{A.n_layers - 1} ({lm.name} has {A.n_layers} "
                                 "blocks)")
            if layer not in out:
                out.append(layer)
        if not out:
            raise InputError("no layer to steer; give at least one")
        return out

    def to_dict(self) -> dict:
        return self.config()

    def __repr__(self) -> str:
        return (f"Direction({self.method} at {self.site_name} of {self.model}, {self.n_pairs} pairs, "
                f"norm={self.stats.get('norm', float(self.vector.norm())):.4g})")


# ---------------------------------------------------------------------------------------------- building


def text_ids(lm: LoadedModel, texts: list[str], rows: list[int], source: str) -> list[Tensor]:
    """Token ids of each text; a one-line :class:`InputError` naming ``source`` and the text's row otherwise."""
    out = []
    for text, row in zip(texts, rows):
        try:
            out.append(token_ids(lm, text))
        except InputError as e:
            raise InputError(f"{source}, row {row}: {e}") from None
    return out


def length_groups(ids: list[Tensor]) -> dict[int, list[int]]:
    """Indices of ``ids`` by token length (rows of one length batch without padding), shortest first."""
    groups: dict[int, list[int]] = {}
    for i, x in enumerate(ids):
        groups.setdefault(int(x.numel()), []).append(i)
    return dict(sorted(groups.items()))


@torch.no_grad()
def states_at(lm: LoadedModel, ids: list[Tensor], layer: int, position: int = -1, *, rows=None,
              source: str = "the data", max_tokens: int = 8192) -> Tensor:
    """``(text, d_model)`` float64: the residual stream entering block ``layer`` at ``position`` of each text
    (negative: from the end), read by the engine (texts of one length batched, the pass stopped at the site).
    ``rows`` name the texts in errors (a position outside a text)."""
    rows = list(range(1, len(ids) + 1)) if rows is None else rows
    out = torch.empty(len(ids), lm.anatomy.d_model, dtype=torch.float64)
    for n, idx in length_groups(ids).items():
        p = position if position >= 0 else n + position
        if not 0 <= p < n:
            raise InputError(f"{source}, row {rows[idx[0]]}: position {position} is outside its {n} tokens")
        step = max(1, max_tokens // n)
        for a in range(0, len(idx), step):
            chunk = idx[a: a + step]
            x = torch.stack([ids[i] for i in chunk])
            cap = capture(lm, x, [(SITE, layer)], stop_after=(SITE, layer))
            out[chunk] = cap[(SITE, layer)][:, p].double().cpu()
    return out


def build_direction(lm: LoadedModel, pairs: list[SteeringPair] | list[tuple[str, str]],
                    method: str = builders.DEFAULT, layer: int | None = None, *, position: int = -1,
                    source: str = "the pairs", **options) -> Direction:
    """A :class:`Direction` at ``resid_pre.layer`` (default: the middle block) from contrast ``pairs``
    (:class:`~lenscope.data.steering.SteeringPair` or ``(positive, negative)`` texts) by ``method`` (a builder of
    :mod:`lenscope.steering.builders`, given its ``options``), read at ``position`` of each text (default the last
    token; negative counts from the end). ``source`` names the pairs in errors (a CSV path)."""
    require_decoder(lm, "steering", causal=True, instead="steer a causal decoder such as smollm2")
    builder = builders.get(method)
    for k in options:
        if k not in builder.options:
            raise InputError(f"{method} takes no option {k!r}"
                             + (f"; it takes {', '.join(builder.options)}" if builder.options else ""))
    A = lm.anatomy
    layer = A.n_layers // 2 if layer is None else layer
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < A.n_layers:
        raise InputError(f"layer {layer!r} is outside 0..{A.n_layers - 1} ({lm.name} has {A.n_layers} blocks)")
    if isinstance(position, bool) or not isinstance(position, int):
        raise InputError(f"position must be an integer (negative: from the end), not {position!r}")
    pairs = [p if isinstance(p, SteeringPair) else SteeringPair(*p, row=i + 1) for i, p in enumerate(pairs)]
    if not pairs:
        raise InputError("no pairs given; a direction needs at least one (positive, negative) pair")
    notes = []
    if len(pairs) < builder.min_pairs:
        raise InputError(f"{method} needs at least {builder.min_pairs} pairs; {source} has {len(pairs)}")
    used = pairs[:1] if builder.one_pair else pairs
    if builder.one_pair and len(pairs) > 1:
        notes.append(f"{method} is built from one pair: the first of the {len(pairs)} (row {pairs[0].row}); "
                     f"use {builders.DEFAULT} for all of them")
    rows = [p.row or i + 1 for i, p in enumerate(used)]
    ids_pos = text_ids(lm, [p.positive for p in used], rows, source)
    ids_neg = text_ids(lm, [p.negative for p in used], rows, source)
    h = states_at(lm, ids_pos + ids_neg, layer, position, rows=rows + rows, source=source)
    pos, neg = h[: len(used)], h[len(used):]
    D = pos - neg
    if not bool(D.abs().sum(-1).gt(0).any()):
        raise InputError(f"every pair of {source} has the same state at position {position} of block {layer}: the "
                         "texts do not differ up to that position; read another position (--position)")
    u, extra = builder.build(pos, neg, **options)
    scale = float(D.mean(0) @ u)
    v = scale * u
    stats = {"norm": float(v.norm()), "agreement": float(((D @ v) > 0).double().mean()), **extra}
    return Direction(vector=v.float(), model=lm.name, fingerprint=fingerprint(A), layer=layer, method=method,
                     position=position, data_hash=data_hash(pairs), n_pairs=len(used), stats=stats, notes=notes)


# ---------------------------------------------------------------------------------------------- edits


def add_edits(vector: Tensor, rows: Tensor, layers: Tensor, alphas: Tensor, positions: Tensor) -> list[Edit]:
    """The engine's edits adding ``alphas[k] * vector`` to ``resid_pre`` of block ``layers[k]`` of batch row
    ``rows[k]`` at every one of ``positions``: one ``add`` edit per block. A row whose multiplier is 0 gets no
    edit at all (its run is the unsteered model's, bit for bit)."""
    rows, layers = torch.as_tensor(rows).reshape(-1), torch.as_tensor(layers).reshape(-1)
    alphas = torch.as_tensor(alphas, dtype=torch.float64).reshape(-1)
    positions = torch.as_tensor(positions, dtype=torch.long).reshape(-1)
    out = []
    P = len(positions)
    for layer in sorted(set(layers[alphas != 0].tolist())):
        k = ((layers == layer) & (alphas != 0)).nonzero()[:, 0]
        vals = (alphas[k, None] * vector.double()[None]).to(vector.dtype)  # (row, d)
        out.append(Edit(SITE, int(layer), rows[k].repeat_interleave(P), positions.repeat(len(k)),
                        vals.repeat_interleave(P, 0), mode="add"))
    return out


def _layers(direction: Direction, layers) -> list[int]:
    if layers is None:
        return [direction.layer]
    return [layers] if isinstance(layers, int) else list(layers)


def steering_edits(direction: Direction, alpha: float, positions, *, layers=None, row: int = 0) -> list[Edit]:
    """Edits adding ``alpha * direction.vector`` at ``resid_pre`` of each of ``layers`` (default: the direction's
    own block) at ``positions`` (an int count ``n``: positions ``0..n-1``; or a sequence of positions) of batch
    row ``row``. ``alpha == 0``: no edit at all."""
    layers = _layers(direction, layers)
    pos = torch.arange(positions) if isinstance(positions, int) else torch.as_tensor(positions, dtype=torch.long)
    n = len(layers)
    return add_edits(direction.vector, torch.full((n,), row), torch.tensor(layers), torch.full((n,), float(alpha)),
                     pos)


WHERE = ("all", "prompt", "generated")


def generation_edits(direction: Direction, alpha: float, *, layers=None, where: str = "all"):
    """For :func:`lenscope.generate` (``edits=``): a function ``(prompt_len, max_len) -> edits`` adding
    ``alpha * vector`` at the prompt's positions and every generated one (``"all"``), the prompt's only
    (``"prompt"``: the cached prompt keeps steering through attention), or the generated tokens' only
    (``"generated"``: from the first generated token on, so the first token is chosen unsteered)."""
    if where not in WHERE:
        raise InputError(f"where must be one of {', '.join(WHERE)}, not {where!r}")

    def edits(prompt_len: int, max_len: int) -> list[Edit]:
        lo = prompt_len if where == "generated" else 0
        hi = prompt_len if where == "prompt" else max_len
        return steering_edits(direction, alpha, torch.arange(lo, hi), layers=layers)

    return edits


@torch.no_grad()
def steered_logits(lm: LoadedModel, text, direction: Direction, alpha: float, *, layers=None) -> Tensor:
    """The model's logits ``(pos, vocab)`` on ``text`` (or ids) with ``alpha * vector`` added at every position
    of ``resid_pre`` of ``layers`` (default: the direction's block); ``alpha == 0`` is the plain model."""
    layers = direction.check(lm, layers)
    ids = token_ids(lm, text)
    return run(lm, ids[None], steering_edits(direction, alpha, ids.numel(), layers=layers)).logits[0]


def direction_dict(direction: Direction) -> dict:
    """The JSON fields of a direction (for results that record which direction they measured)."""
    d = direction.config()
    d.pop("format")
    d.pop("kind")
    return d


__all__ = ["Direction", "SITE", "WHERE", "add_edits", "build_direction", "direction_dict",
           "generation_edits", "length_groups", "states_at", "steered_logits", "steering_edits", "text_ids"]
