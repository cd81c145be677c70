"""Activations for training sparse dictionaries, in blocks: streamed from a model through the engine, or read from
a tensor file.

A source reads *units* (a model's training sequences; a file's rows) from a unit index on, and returns their
activations as rows ``(n, S, d)``, one slice per site it serves (``S`` sites: the inputs and targets of every
dictionary trained together). :class:`StreamSource` runs the model once per batch of sequences
(:func:`lenscope.models.runtime.engine.capture`, stopped at the last site needed), so one forward pass feeds every
dictionary; the special-token positions (BOS) are dropped. :class:`FileSource` reads a safetensors file: its one
tensor, or the one named ``activations``, float ``(n, d)`` or ``(n, 2, d)`` (input/output pairs of transcoders);
its rows are read in order, cycling (epochs).

The trainer (:mod:`lenscope.features.dictionaries.train`) shuffles within a block of ``buffer`` rows (the shuffle
buffer, bounded memory: ``buffer x S x d`` floats), so a block is fully determined by its first unit: a resumed run
re-reads the block it was interrupted in instead of storing it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ...distributed import ddp
from ...errors import InputError
from ...models.dictionaries.dictionary import Dictionary


def last_site(sites: list[str]) -> str:
    """The site a forward pass reading ``sites`` may stop after: the last of the deepest block's (its
    ``resid_post`` where that block's sites may run in either order, as attention and MLP in a parallel block)."""
    from ...models.runtime.sites import site_key

    keys = [site_key(s) for s in sites]
    top = max(layer for _, layer in keys)
    names = {n for n, layer in keys if layer == top}
    if len(names) == 1:
        name = names.pop()
    elif names <= {"ln_mlp.out", "mlp_out"}:
        name = "mlp_out"
    else:
        name = "resid_post"
    return f"{name}.{top}"


class StreamSource:
    """A model's activations at ``sites`` on the ``part`` of the text at ``data``, one sequence per unit
    (``seq_len`` tokens, default: :func:`~lenscope.data.text.fit_seq_len`; ``forward_batch`` sequences per forward
    pass). Under ``torchrun`` each rank runs the
    model on its share of a read's sequences and the rows are gathered, so every rank holds the same rows."""

    def __init__(self, lm, sites: list[str], data: str | Path, *, seq_len: int | None = None, forward_batch: int = 8,
                 part: str = "train", dist: ddp.Dist = ddp.SINGLE, dtype: torch.dtype = torch.float32):
        from ...data.text import fit_seq_len, special_affixes

        self.lm, self.sites, self.data, self.part = lm, list(sites), str(data), part
        self.seq_len = fit_seq_len(lm, seq_len)
        self.forward_batch, self.dist, self.dtype = int(forward_batch), dist, dtype
        pre, post = special_affixes(lm.tokenizer)
        self.keep = slice(len(pre), self.seq_len - len(post))
        self.rows_per_unit = self.seq_len - len(pre) - len(post)
        self.stop_after = last_site(self.sites)
        self.d = lm.anatomy.d_model
        self._it, self._at = None, None  # the token stream and the sequence it stands at
        self.forwards = 0  # forward passes run (a statistic)

    def describe(self) -> dict:
        return {"data": self.data, "part": self.part, "seq_len": self.seq_len, "sites": self.sites,
                "stop_after": self.stop_after}

    def _sequences(self, start: int, n: int) -> Tensor | None:
        from ...data.corpus import token_batches

        if self._at != start:
            self._it = token_batches(self.lm.tokenizer, self.data, seq_len=self.seq_len, batch_size=1,
                                     part=self.part, skip=start)
            self._at = start
        rows = []
        for _ in range(n):
            b = next(self._it, None)
            if b is None:
                break
            rows.append(b)
        self._at += len(rows)
        return torch.cat(rows) if rows else None

    def read(self, start: int, n_rows: int) -> tuple[Tensor | None, int]:
        """At least ``n_rows`` rows (fewer at the end of the text; None when nothing is left) from sequence
        ``start`` on, and the sequence after the last one read."""
        n_seq = -(-n_rows // self.rows_per_unit)
        ids = self._sequences(start, n_seq)
        if ids is None:
            return None, start
        mine = ids[ddp.shard(len(ids), self.dist)]
        parts = []
        for s in range(0, len(mine), self.forward_batch):
            parts.append(self._rows(mine[s:s + self.forward_batch]))
        local = torch.cat(parts) if parts else torch.zeros(0, len(self.sites), self.d, dtype=self.dtype)
        rows = _gather(local, self.dist)
        return rows, start + len(ids)

    def _rows(self, ids: Tensor) -> Tensor:
        from ...models.runtime import engine

        self.forwards += 1
        cap = engine.capture(self.lm, ids, self.sites, stop_after=self.stop_after)
        x = torch.stack([cap[s][:, self.keep] for s in self.sites], dim=2)  # (b, p, S, d)
        return x.reshape(-1, len(self.sites), x.shape[-1]).to(self.dtype)


def _gather(local: Tensor, d: ddp.Dist) -> Tensor:
    """Every rank's rows, in rank order (ranks may hold different numbers of rows)."""
    if not d.active:
        return local
    import torch.distributed as dist

    n = torch.tensor([len(local)])
    sizes = [torch.zeros_like(n) for _ in range(d.world)]
    dist.all_gather(sizes, n)
    top = int(max(s.item() for s in sizes))
    pad = torch.zeros((top,) + tuple(local.shape[1:]), dtype=local.dtype)
    pad[:len(local)] = local
    out = [torch.zeros_like(pad) for _ in range(d.world)]
    dist.all_gather(out, pad)
    return torch.cat([o[:int(s.item())] for o, s in zip(out, sizes)])


def load_activations(path: str | Path) -> Tensor:
    """The activations tensor of a safetensors file (its one tensor, or the one named ``activations``): float
    ``(n, d)`` or ``(n, 2, d)``, returned as ``(n, S, d)`` (``S`` = 1 or 2); a one-line error otherwise."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise InputError(f"activations file not found: {path}")
    try:
        t = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise InputError(f"{path} is not a readable safetensors file ({e})") from None
    if "activations" in t:
        x = t["activations"]
    elif len(t) == 1:
        x = next(iter(t.values()))
    else:
        raise InputError(f"{path} holds {len(t)} tensors ({', '.join(sorted(t)[:5])}); name the one to train on "
                         "'activations'")
    if not x.is_floating_point():
        raise InputError(f"the activations in {path} are {str(x.dtype).removeprefix('torch.')}; they must be float")
    if x.dim() == 2:
        x = x[:, None]
    elif not (x.dim() == 3 and x.shape[1] == 2):
        raise InputError(f"the activations in {path} have shape {tuple(x.shape)}; expected (n, d), or (n, 2, d) "
                         "input/output pairs for a transcoder")
    if x.shape[0] < 1 or x.shape[-1] < 1:
        raise InputError(f"the activations in {path} are empty: shape {tuple(x.shape)}")
    if not torch.isfinite(x).all():
        raise InputError(f"the activations in {path} hold NaN or infinite values")
    return x


class FileSource:
    """Rows of an activations tensor ``(n, S, d)`` (:func:`load_activations`), one unit per row, read in order
    and cycling over the file (epochs)."""

    def __init__(self, x: Tensor, path: str | None = None, dtype: torch.dtype = torch.float32):
        self.x, self.path = x.to(dtype), path
        self.d = int(x.shape[-1])
        self.forwards = 0

    def describe(self) -> dict:
        return {"activations": self.path, "rows": int(self.x.shape[0])}

    def read(self, start: int, n_rows: int) -> tuple[Tensor, int]:
        n = len(self.x)
        idx = (torch.arange(n_rows) + start) % n
        return self.x[idx], start + n_rows


@dataclass
class Target:
    """One dictionary to train: where its input and target are among the source's sites (``x = rows[:, i_in]``,
    ``y = rows[:, i_out]``), and its template (role, site, model, fingerprint)."""

    like: Dictionary
    i_in: int
    i_out: int

    def indices(self) -> list[int]:
        """The source's sites this target reads."""
        return [self.i_in, self.i_out]

    def trainable(self, d: int, s, seed: int):
        """A new :class:`~lenscope.features.dictionaries.train.Trainable` for it (activations of width ``d``,
        settings ``s``)."""
        from .train import Trainable

        return Trainable(Dictionary.init(d, s.width, kind=s.kind, role=self.like.role, k=s.k, site=self.like.site,
                                         seed=seed), s)

    def shape(self, d: int, s) -> tuple[int, int]:
        """``(parameters, numbers per batch row)`` for the memory estimate (:func:`.train_memory.train_memory`)."""
        from .train_memory import dictionary_shape

        return dictionary_shape(s, d, self.like.role)


def expand_sites(spec: str | list[str], n_layers: int | None) -> list[str]:
    """``"resid_post.5,mlp_out.*"`` -> the sites (``NAME.*``: every block of a model with ``n_layers``)."""
    parts = [p.strip() for p in (spec.split(",") if isinstance(spec, str) else spec) if p.strip()]
    out: list[str] = []
    for p in parts:
        if p.endswith(".*"):
            if n_layers is None:
                raise InputError(f"{p!r} means every block of a model: give --model")
            out += [f"{p[:-2]}.{i}" for i in range(n_layers)]
        else:
            out.append(p)
    if not out:
        raise InputError("no site given: --site resid_post.5 (or several, comma-separated; NAME.* for every block)")
    if len(set(out)) != len(out):
        raise InputError(f"a site is named twice in {spec!r}")
    return out


def sources(role: str, *, lm=None, sites: str | list[str] | None = None, data: str | Path | None = None,
            activations: str | Path | None = None, part: str = "train", seq_len: int | None = None,
            forward_batch: int = 8, dist: ddp.Dist = ddp.SINGLE):
    """The source and the targets of a training run of ``role`` dictionaries: at ``sites`` of ``lm`` on the text
    ``data`` (every site read in one forward pass), or on the ``activations`` file; checked (a site the model
    lacks, a transcoder site that is not ``mlp_out``, a file of the wrong shape: one-line
    :class:`~lenscope.errors.InputError`)."""
    if (data is None) == (activations is None):
        raise InputError("give the training data as exactly one of --data (text, streamed through the model) and "
                         "--activations (a safetensors file)")
    fp = None
    if lm is not None:
        from ...models.loading.summary import fingerprint

        fp = fingerprint(lm.anatomy)
    names = expand_sites(sites, lm.anatomy.n_layers if lm is not None else None) if sites else []
    targets, wanted = [], []

    def index(site: str) -> int:
        if site not in wanted:
            wanted.append(site)
        return wanted.index(site)

    for site in names:
        like = Dictionary.init(2, 2, kind="topk", k=1, role=role, site=site,
                               model=lm.name if lm is not None else None, fingerprint=fp)
        if lm is not None:
            like = Dictionary.init(lm.anatomy.d_model, 2, kind="topk", k=1, role=role, site=site, model=lm.name,
                                   fingerprint=fp)
            like.check(lm)
        targets.append(Target(like, index(like.input_site), index(like.site)))
    if activations is not None:
        x = load_activations(activations)
        pairs = x.shape[1] == 2
        if pairs != (role != "sae"):
            have = "(n, 2, d) input/output pairs" if pairs else "(n, d) rows"
            need = "a transcoder trains on (n, 2, d) pairs" if role != "sae" else "an SAE trains on (n, d) rows"
            raise InputError(f"the activations in {activations} are {have}; {need}")
        if len(targets) > 1:
            raise InputError("an activations file trains one dictionary: give at most one --site")
        if lm is not None and x.shape[-1] != lm.anatomy.d_model:
            raise InputError(f"the activations in {activations} have d {x.shape[-1]}; {lm.name!r} has d_model "
                             f"{lm.anatomy.d_model}")
        like = targets[0].like if targets else Dictionary.init(2, 2, kind="topk", k=1, role=role)
        targets = [Target(like, 0, 1 if pairs else 0)]
        source = FileSource(x, str(activations))
    else:
        if lm is None or not targets:
            raise InputError("training from text (--data) needs --model and --site")
        source = StreamSource(lm, wanted, data, seq_len=seq_len, forward_batch=forward_batch, part=part, dist=dist)
    return source, targets


__all__ = ["FileSource", "StreamSource", "Target", "expand_sites", "last_site", "load_activations", "sources"]
