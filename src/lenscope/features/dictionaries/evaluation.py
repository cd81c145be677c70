"""The result of :func:`lenscope.features.dictionaries.evaluate.evaluate_dictionaries` (``lenscope dict eval``): a
:class:`DictionaryScore` per dictionary (per block of a cross-layer transcoder) and the :class:`DictionaryEvaluation`
holding them and the replacement model's metrics; saved, loaded, as a frame, as JSON and as the lines the CLI
prints. What each field means: :mod:`lenscope.features.dictionaries.evaluate`'s docstring."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from ...errors import InputError

DEAD_TOKENS = 100_000
METRICS = ("explained_variance", "l0", "dead_fraction", "delta_loss", "loss_recovered", "kl", "top1_agreement")

def _num(x):
    """A float for JSON: None where it is not finite."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


@dataclass(repr=False)
class DictionaryScore:
    """One dictionary's evaluation (see the module's docstring for every field); ``baselines``: ``{"pca": {...}}``
    or ``{"linear": {...}}`` with the same metric fields; ``fired (width,)``: on how many evaluated tokens each
    latent was active."""

    site: str
    kind: str
    role: str
    width: int
    explained_variance: float
    l0: float
    dead_fraction: float
    dead_reliable: bool
    tokens: int
    density: dict
    fired: Tensor
    mse: float
    splice_tokens: int = 0
    delta_loss: float | None = None
    loss_recovered: float | None = None
    kl: float | None = None
    top1_agreement: float | None = None
    ce_clean: float | None = None
    ce_spliced: float | None = None
    ce_zero: float | None = None
    baselines: dict = field(default_factory=dict)
    beats_baseline: bool | None = None

    @property
    def baseline(self) -> str | None:
        return next(iter(self.baselines), None)

    def to_dict(self, fired: bool = False) -> dict:
        out = {"site": self.site, "kind": self.kind, "role": self.role, "width": self.width}
        for name in ("explained_variance", "l0", "dead_fraction", "delta_loss", "loss_recovered", "kl",
                     "top1_agreement", "ce_clean", "ce_spliced", "ce_zero", "mse"):
            out[name] = _num(getattr(self, name))
        out.update(tokens=self.tokens, splice_tokens=self.splice_tokens, dead_reliable=self.dead_reliable,
                   density=self.density, baselines={k: {n: (_num(v) if isinstance(v, float) else v)
                                                         for n, v in b.items()} for k, b in self.baselines.items()},
                   beats_baseline=self.beats_baseline)
        if fired:
            out["fired"] = self.fired.tolist()
        return out

    @classmethod
    def from_dict(cls, d: dict) -> DictionaryScore:
        d = dict(d)
        d["fired"] = torch.tensor(d.get("fired") or [], dtype=torch.long)
        return cls(**d)


@dataclass(repr=False)
class DictionaryEvaluation:
    """The evaluation of one or several dictionaries on held-out text (:func:`evaluate_dictionaries`):
    ``dictionaries`` one :class:`DictionaryScore` each (a cross-layer transcoder: one per block), ``replacement``
    (two or more transcoders, or a cross-layer transcoder) the replacement model's splice metrics."""

    model: str
    data: str
    tokens: int
    splice_tokens: int
    seq_len: int
    dictionaries: list[DictionaryScore]
    replacement: dict | None = None

    def means(self) -> dict:
        """The mean over the dictionaries of each metric (None where one has none)."""
        out = {}
        for name in METRICS:
            vals = [getattr(s, name) for s in self.dictionaries]
            out[name] = None if any(v is None or not math.isfinite(v) for v in vals) else \
                sum(vals) / len(vals)
        return out

    def to_dict(self, fired: bool = False) -> dict:
        """``dict eval --json``'s object: one dictionary's fields at the top level; several (or a replacement
        model, as a cross-layer transcoder of one block makes): their means at the top level, each one under
        ``dictionaries``, the replacement model under ``replacement``."""
        per = [s.to_dict(fired=fired) for s in self.dictionaries]
        head = {"model": self.model, "data": self.data, "seq_len": self.seq_len}
        if len(per) == 1 and self.replacement is None:
            return {**head, **per[0]}
        out = {**head, **{k: _num(v) for k, v in self.means().items()}, "tokens": self.tokens,
               "splice_tokens": self.splice_tokens, "dictionaries": per}
        if self.replacement is not None:
            out["replacement"] = {k: (_num(v) if isinstance(v, float) else v) for k, v in self.replacement.items()}
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def to_frame(self):
        """One row per dictionary and per baseline (``method``: ``dictionary``, ``pca``, ``linear``), and the
        replacement model's row when there is one."""
        import pandas as pd

        rows = []
        for s in self.dictionaries:
            d = s.to_dict()
            rows.append({"site": s.site, "method": "dictionary", **{k: d.get(k) for k in METRICS},
                         "tokens": s.tokens, "beats_baseline": s.beats_baseline})
            for name, b in s.baselines.items():
                rows.append({"site": s.site, "method": name, **{k: b.get(k) for k in METRICS},
                             "tokens": b.get("tokens"), "beats_baseline": None})
        if self.replacement is not None:
            rows.append({"site": "all", "method": "replacement", **{k: self.replacement.get(k) for k in METRICS},
                         "tokens": self.replacement.get("splice_tokens"), "beats_baseline": None})
        return pd.DataFrame(rows)

    def lines(self) -> list[str]:
        """The text ``dict eval`` prints: a line per dictionary and its baseline, one where it does not beat it."""
        def fmt(x, spec=".4f"):
            return "n/a" if x is None else format(x, spec)

        def spliced(m: dict) -> str:  # a cross-layer transcoder's blocks are not spliced one at a time
            if not m.get("splice_tokens"):
                return ""
            return (f", delta loss {fmt(m.get('delta_loss'))}, loss recovered {fmt(m.get('loss_recovered'))}, "
                    f"KL {fmt(m.get('kl'))}")

        r = self.replacement
        n = len(self.dictionaries)
        what = (f"a cross-layer transcoder ({n} blocks)" if r is not None and r.get("cross_layer") else
                f"{n} dictionar{'y' if n == 1 else 'ies'}")
        out = [f"{self.model}: {what} on {self.tokens} held-out tokens of {self.data} (splice on "
               f"{self.splice_tokens} predictions)"]
        for s in self.dictionaries:
            out.append(f"{s.site} ({s.role}, {s.kind}, width {s.width}): explained variance "
                       f"{fmt(s.explained_variance)}, L0 {s.l0:.2f}, dead {s.dead_fraction:.2%}"
                       f"{spliced(vars(s))}")
            for name, b in s.baselines.items():
                extra = f" ({b['components']} components)" if "components" in b else ""
                out.append(f"  {name}{extra}: explained variance {fmt(b.get('explained_variance'))}{spliced(b)}")
            if s.beats_baseline is False:
                out.append(f"  {s.site}: the dictionary does NOT beat its {s.baseline} baseline")
            if not s.dead_reliable:
                out.append(f"  dead latents over {s.tokens} tokens only (fewer than {DEAD_TOKENS}): not reliable")
        if r is not None:
            what = (f"a cross-layer transcoder, {r.get('blocks')} blocks" if r.get("cross_layer") else
                    f"{r['dictionaries']} transcoders")
            out.append(f"replacement model ({what}): top-1 agreement {fmt(r.get('top1_agreement'))}, delta loss "
                       f"{fmt(r.get('delta_loss'))}, KL {fmt(r.get('kl'))}")
        return out

    def save(self, path: str | Path) -> Path:
        """Write the evaluation as JSON (every latent's firing count included)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        d = {"model": self.model, "data": self.data, "tokens": self.tokens, "splice_tokens": self.splice_tokens,
             "seq_len": self.seq_len, "replacement": self.replacement,
             "dictionaries": [s.to_dict(fired=True) for s in self.dictionaries], "lenscope_type": type(self).__name__}
        path.write_text(json.dumps(d) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> DictionaryEvaluation:
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError:
            raise InputError(f"no such file: {path}") from None
        except json.JSONDecodeError as e:
            raise InputError(f"{path} is not JSON ({e})") from None
        if d.pop("lenscope_type", None) != cls.__name__:
            raise InputError(f"{path} is not a saved {cls.__name__}")
        d["dictionaries"] = [DictionaryScore.from_dict(s) for s in d["dictionaries"]]
        return cls(**d)

    def __repr__(self) -> str:
        sites = ", ".join(s.site for s in self.dictionaries)
        return f"DictionaryEvaluation({self.model!r}, [{sites}], tokens={self.tokens})"


__all__ = ["DEAD_TOKENS", "METRICS", "DictionaryEvaluation", "DictionaryScore"]
