"""Cross-layer transcoders (CLTs; Ameisen et al. 2025, "Circuit Tracing"): the replacement of every MLP of a model by
one dictionary whose latents read one block's MLP input and write that block's MLP output and every later one's.

For ``L`` blocks, each of ``width`` latents per block::

    latents[l]  = act(ln_mlp.out.l @ W_enc[l] + b_enc[l])                act: the kind's (TopK, BatchTopK, JumpReLU)
    mlp_out.l'  ≈ sum over l <= l' of latents[l] @ W_dec[l][:, l' - l] + b_dec[l']

``W_enc (L, d_in, width)``, ``b_enc (L, width)``, ``threshold (L, width)`` (kinds with one), ``W_dec[l] (width,
L - l, d_out)`` (one tensor per source block: its decoders to its own block and every later one), ``b_dec (L,
d_out)`` (one per *output* block). The CLT covers blocks ``0 .. L-1`` of its model.

Why a class beside :class:`~lenscope.models.dictionaries.dictionary.Dictionary` and not a Dictionary grown a cross-layer
form: a Dictionary is one encoder, one decoder and one site, and every user of it (SAELens's files, the graph code,
evaluation) relies on that; a CLT's decoders and biases belong to *pairs* of blocks and its bias to the output block,
not to the latents' block. What the two share is the encoder and its activation, and that has one home: block ``l``
of a CLT *is* a per-layer transcoder (:meth:`CrossLayerTranscoder.block`: its encoder, its threshold or ``k``, its
own-block decoder), so encoding goes through ``Dictionary.encode`` and the kind's ``activate``, as the engine's latent
sites and training do for every dictionary.

The engine (:func:`lenscope.models.runtime.engine.run` with ``dictionaries=[clt]``) offers block ``l``'s latents as the
site ``("mlp_out.latents", l)``, as a per-layer transcoder of ``mlp_out.l``; an edit of them moves ``mlp_out`` of
block ``l`` and of every later block by the decoded change (the error kept), and ``splice=True`` replaces every MLP
output by the CLT's reconstruction (the replacement model).

Files: lenscope's own (:meth:`CrossLayerTranscoder.save`, :meth:`CrossLayerTranscoder.load`): ``clt.json`` (the
record) and ``clt.safetensors``; and circuit-tracer's CLT layout (:mod:`.clt_formats`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from ...errors import InputError
from . import kinds as kinds
from .dictionary import Dictionary

CLT_CONFIG = "clt.json"
CLT_WEIGHTS = "clt.safetensors"
FORMAT = "lenscope-clt"


@dataclass(repr=False)
class CrossLayerTranscoder:
    """A cross-layer transcoder (see the module's docstring for the equations and the shapes)."""

    W_enc: Tensor
    b_enc: Tensor
    W_dec: list[Tensor]
    b_dec: Tensor
    kind: str = kinds.DEFAULT
    k: int | None = None
    threshold: Tensor | None = None
    model: str | None = None
    fingerprint: str | None = None
    scale_in: list[float] | None = None
    scale_out: list[float] | None = None
    info: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.W_enc.dim() != 3:
            raise InputError(f"a CLT's W_enc is (layers, d_in, width); got {tuple(self.W_enc.shape)}")
        L, _, width = self.W_enc.shape
        d = self.b_dec.shape[-1]
        self.W_dec = list(self.W_dec)
        shapes = [tuple(w.shape) for w in self.W_dec]
        if (tuple(self.b_enc.shape) != (L, width) or tuple(self.b_dec.shape) != (L, d)
                or shapes != [(width, L - i, d) for i in range(L)]):
            raise InputError(f"CLT weights disagree: W_enc {tuple(self.W_enc.shape)}, b_enc {tuple(self.b_enc.shape)}, "
                             f"b_dec {tuple(self.b_dec.shape)}, W_dec {shapes} (expected (width, layers - l, d) "
                             "for each block l)")
        if self.threshold is not None and tuple(self.threshold.shape) != (L, width):
            raise InputError(f"a CLT's threshold is (layers, width); got {tuple(self.threshold.shape)}")
        self.scale_in = [1.0] * L if self.scale_in is None else [float(v) for v in self.scale_in]
        self.scale_out = [1.0] * L if self.scale_out is None else [float(v) for v in self.scale_out]
        self.block(0)  # the kind's checks (k, threshold), on block 0's view

    @classmethod
    def init(cls, n_layers: int, d: int, width: int, *, kind: str = kinds.DEFAULT, k: int | None = None,
             seed: int = 0, threshold: float = 0.0, dtype: torch.dtype = torch.float32, **kw) -> CrossLayerTranscoder:
        """A new CLT as training starts it: block ``l`` as :meth:`Dictionary.init` starts a transcoder writing
        ``L - l`` blocks (decoder rows random unit vectors over all the blocks a latent writes, seed ``seed + l``);
        biases 0."""
        enc, dec, thr = [], [], []
        for layer in range(n_layers):
            D = Dictionary.init(d, width, kind=kind, role="transcoder", k=k, d_out=(n_layers - layer) * d,
                                seed=seed + layer, threshold=threshold, dtype=dtype)
            enc.append(D.W_enc)
            dec.append(D.W_dec.reshape(width, n_layers - layer, d))
            thr.append(D.threshold)
        return cls(W_enc=torch.stack(enc), b_enc=torch.zeros(n_layers, width, dtype=dtype), W_dec=dec,
                   b_dec=torch.zeros(n_layers, d, dtype=dtype), kind=kind, k=k,
                   threshold=None if thr[0] is None else torch.stack(thr), **kw)

    # -- shape -----------------------------------------------------------------------------------------------------

    @property
    def n_layers(self) -> int:
        return int(self.W_enc.shape[0])

    @property
    def d_in(self) -> int:
        return int(self.W_enc.shape[1])

    @property
    def width(self) -> int:
        return int(self.W_enc.shape[2])

    @property
    def d_out(self) -> int:
        return int(self.b_dec.shape[-1])

    @property
    def spec(self) -> kinds.Kind:
        return kinds.get(self.kind)

    @property
    def sites(self) -> list[str]:
        """The sites it replaces: ``mlp_out.0`` .. ``mlp_out.{L-1}``."""
        return [f"mlp_out.{i}" for i in range(self.n_layers)]

    def decoder(self, source: int, target: int) -> Tensor:
        """``W_dec[source -> target] (width, d_out)``, for ``source <= target``."""
        if not 0 <= source <= target < self.n_layers:
            raise InputError(f"a CLT decodes block {source}'s latents to blocks {source}..{self.n_layers - 1}; "
                             f"got {source} -> {target}")
        return self.W_dec[source][:, target - source]

    def block(self, layer: int) -> Dictionary:
        """Block ``layer`` as a per-layer transcoder of ``mlp_out.layer``: its encoder, activation and own-block
        decoder (the one home of encoding, :meth:`Dictionary.encode`)."""
        return Dictionary(W_enc=self.W_enc[layer], b_enc=self.b_enc[layer], W_dec=self.W_dec[layer][:, 0],
                          b_dec=self.b_dec[layer], kind=self.kind, role="transcoder", k=self.k,
                          threshold=None if self.threshold is None else self.threshold[layer],
                          site=f"mlp_out.{layer}", model=self.model, fingerprint=self.fingerprint)

    def tensors(self) -> dict[str, Tensor]:
        out = {"W_enc": self.W_enc, "b_enc": self.b_enc, "b_dec": self.b_dec}
        out.update({f"W_dec_{i}": w for i, w in enumerate(self.W_dec)})
        if self.threshold is not None:
            out["threshold"] = self.threshold
        return out

    def to(self, *args, **kw) -> CrossLayerTranscoder:
        """A copy with every weight moved / cast (``torch.Tensor.to``'s arguments)."""
        return self._with({n: v.to(*args, **kw) for n, v in self.tensors().items()})

    def _with(self, t: dict, **changes) -> CrossLayerTranscoder:
        rec = dict(kind=self.kind, k=self.k, model=self.model, fingerprint=self.fingerprint,
                   scale_in=list(self.scale_in), scale_out=list(self.scale_out), info=dict(self.info))
        rec.update(changes)
        return CrossLayerTranscoder(W_enc=t["W_enc"], b_enc=t["b_enc"], b_dec=t["b_dec"],
                                    W_dec=[t[f"W_dec_{i}"] for i in range(len(t["b_dec"]))],
                                    threshold=t.get("threshold"), **rec)

    @staticmethod
    def parameters_count(n_layers: int, d: int, width: int, *, threshold: bool = False) -> int:
        """Numbers a CLT holds: encoders ``L d width`` and biases, decoders ``width d L (L + 1) / 2``, ``b_dec``."""
        return (n_layers * (d * width + width * (1 + int(threshold))) + width * d * n_layers * (n_layers + 1) // 2
                + n_layers * d)

    def memory(self) -> int:
        """Bytes its weights take in their dtype."""
        return sum(v.numel() * v.element_size() for v in self.tensors().values())

    # -- the function ----------------------------------------------------------------------------------------------

    def encode(self, x: Tensor, layer: int) -> Tensor:
        """Block ``layer``'s latents ``(..., width)`` of its MLP input ``x (..., d_in)``."""
        return self.block(layer).encode(x)

    def decode(self, latents: list[Tensor], target: int) -> Tensor:
        """``mlp_out.target``'s reconstruction ``(..., d_out)`` from the latents of blocks ``0 .. target``
        (``latents[l]``; more may be given)."""
        out = self.b_dec[target]
        for source in range(target + 1):
            out = out + latents[source].to(self.b_dec.dtype) @ self.decoder(source, target)
        return out

    def __call__(self, xs: list[Tensor] | Tensor) -> Tensor:
        """Every MLP output's reconstruction ``(L, ..., d_out)`` from the MLP inputs ``xs (L, ..., d_in)``."""
        z = [self.encode(xs[i], i) for i in range(self.n_layers)]
        return torch.stack([self.decode(z, t) for t in range(self.n_layers)])

    def folded(self, scale_in: list[float], scale_out: list[float]) -> CrossLayerTranscoder:
        """This CLT, trained on ``scale_in[l] * x_l`` to write ``scale_out[l'] * y_l'``, as one that reads and writes
        the model's own activations (pre-activations unchanged; each decoder block divided by its target's scale)."""
        s_in = torch.tensor([float(v) for v in scale_in], dtype=self.W_enc.dtype)
        s_out = torch.tensor([float(v) for v in scale_out], dtype=self.b_dec.dtype)
        t = self.tensors()
        t["W_enc"] = self.W_enc * s_in[:, None, None]
        t["b_dec"] = self.b_dec / s_out[:, None]
        for i, w in enumerate(self.W_dec):
            t[f"W_dec_{i}"] = w / s_out[i:, None]
        return self._with(t, scale_in=[a * float(b) for a, b in zip(self.scale_in, s_in)],
                          scale_out=[a * float(b) for a, b in zip(self.scale_out, s_out)])

    # -- the model it belongs to -----------------------------------------------------------------------------------

    def check(self, lm) -> None:
        """Refuse (one line) a CLT made for another model, or for more blocks or another width than ``lm`` has."""
        A = lm.anatomy
        if self.n_layers > A.n_layers:
            raise InputError(f"the CLT covers {self.n_layers} blocks; {lm.name!r} has {A.n_layers}")
        for i in range(self.n_layers):
            self.block(i).check(lm)

    # -- the engine's side (:class:`~lenscope.models.dictionaries.dictionary.Attached`) ------------------------------

    def encoders(self) -> list[tuple[str, str, Dictionary]]:
        """``(site, input site, encoder)`` per block: block ``l``'s latents are ``mlp_out.latents`` of block ``l``."""
        return [(f"mlp_out.{i}", f"ln_mlp.out.{i}", self.block(i)) for i in range(self.n_layers)]

    def writers(self) -> dict[str, tuple[list[tuple[str, Tensor]], Tensor]]:
        """Per site written: the ``(latents' site, decoder)`` pairs that write it and its bias."""
        return {f"mlp_out.{t}": ([(f"mlp_out.{s}", self.decoder(s, t)) for s in range(t + 1)], self.b_dec[t])
                for t in range(self.n_layers)}

    # -- files -----------------------------------------------------------------------------------------------------

    def record(self) -> dict:
        return {"format": FORMAT, "kind": self.kind, "k": self.k, "n_layers": self.n_layers, "d_in": self.d_in,
                "d_out": self.d_out, "width": self.width, "model": self.model, "fingerprint": self.fingerprint,
                "scale_in": self.scale_in, "scale_out": self.scale_out, "info": self.info,
                "dtype": str(self.W_enc.dtype).removeprefix("torch.")}

    def save(self, folder: str | Path) -> Path:
        """Write ``folder/clt.json`` and ``folder/clt.safetensors`` (``W_enc``, ``b_enc``, ``b_dec``, ``threshold``,
        ``W_dec_{l}``)."""
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        save_file({n: v.detach().contiguous().cpu() for n, v in self.tensors().items()}, str(folder / CLT_WEIGHTS))
        (folder / CLT_CONFIG).write_text(json.dumps(self.record(), indent=1) + "\n")
        return folder

    @classmethod
    def load(cls, folder: str | Path) -> CrossLayerTranscoder:
        """A CLT folder: lenscope's (``clt.json``) or circuit-tracer's (``config.yaml``, :func:`.clt_formats.
        load_circuit_tracer_clt`)."""
        from safetensors.torch import load_file

        from .clt_formats import CT_CONFIG, load_circuit_tracer_clt

        folder = Path(folder)
        if not (folder / CLT_CONFIG).exists():
            if (folder / CT_CONFIG).exists():
                return load_circuit_tracer_clt(folder)
            raise InputError(f"{folder} holds no CLT: neither {CLT_CONFIG} nor circuit-tracer's {CT_CONFIG}")
        try:
            rec = json.loads((folder / CLT_CONFIG).read_text())
        except json.JSONDecodeError as e:
            raise InputError(f"{folder / CLT_CONFIG} is not valid JSON ({e})") from None
        if not isinstance(rec, dict) or rec.get("format") != FORMAT:
            raise InputError(f"{folder / CLT_CONFIG} is not a lenscope CLT record (format {FORMAT!r})")
        if not (folder / CLT_WEIGHTS).exists():
            raise InputError(f"{folder} has {CLT_CONFIG} but no {CLT_WEIGHTS}")
        t = load_file(str(folder / CLT_WEIGHTS))
        L = int(rec["n_layers"])
        missing = [n for n in ["W_enc", "b_enc", "b_dec"] + [f"W_dec_{i}" for i in range(L)] if n not in t]
        if missing:
            raise InputError(f"{folder / CLT_WEIGHTS} lacks {', '.join(missing)}")
        return cls(W_enc=t["W_enc"], b_enc=t["b_enc"], b_dec=t["b_dec"], W_dec=[t[f"W_dec_{i}"] for i in range(L)],
                   threshold=t.get("threshold"), kind=rec["kind"], k=rec.get("k"), model=rec.get("model"),
                   fingerprint=rec.get("fingerprint"), scale_in=rec.get("scale_in"), scale_out=rec.get("scale_out"),
                   info=dict(rec.get("info") or {}))

    def __repr__(self) -> str:
        return (f"CrossLayerTranscoder({self.kind}{self.spec.describe(self)}, layers={self.n_layers}, "
                f"d_in={self.d_in}, width={self.width}, model={self.model!r})")


def is_clt_folder(path: str | Path) -> bool:
    """Whether ``path`` holds a CLT (lenscope's or circuit-tracer's layout)."""
    from .clt_formats import is_circuit_tracer_clt

    path = Path(path)
    return (path / CLT_CONFIG).exists() or is_circuit_tracer_clt(path)


def load_transcoders(path: str | Path) -> list:
    """What a folder of transcoders holds, as the engine and the graph take them: ``[clt]`` for a cross-layer
    transcoder (:func:`is_clt_folder`), else its per-layer dictionaries
    (:func:`~lenscope.models.dictionaries.dictionary.load_dictionaries`)."""
    from .dictionary import load_dictionaries

    return [CrossLayerTranscoder.load(path)] if is_clt_folder(path) else load_dictionaries(path)


__all__ = ["CLT_CONFIG", "CLT_WEIGHTS", "CrossLayerTranscoder", "is_clt_folder", "load_transcoders"]
