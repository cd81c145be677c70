"""Sparse dictionaries over a model's activations: sparse autoencoders (SAEs), transcoders and skip transcoders,
as the engine runs them and as they are stored (SAELens's folder layout).

A dictionary reads an input ``x (..., d_in)`` and writes an output ``(..., d_out)`` through ``width`` latents::

    pre     = (x - b_dec) @ W_enc + b_enc          (an SAE subtracts b_dec from its input; a transcoder does not)
    latents = act(pre)                              TopK: the k largest of pre, ReLU'd, 0 elsewhere
                                                    JumpReLU / BatchTopK: relu(pre) where pre > threshold, else 0
    output  = latents @ W_dec + b_dec (+ x @ W_skip.T for a skip transcoder)

- role ``sae``: reconstructs the activation at ``site`` from itself (``d_in == d_out``);
- role ``transcoder`` / ``skip``: replaces an MLP: reads the MLP's input (:func:`input_site`: the output of
  ``ln_mlp`` of the same block) and writes ``mlp_out`` of that block; ``site`` is the ``mlp_out`` it replaces.

Kinds: the table of :mod:`lenscope.models.dictionaries.kinds`, one file each: ``topk`` (Gao et al. 2024),
``batchtopk`` (Bussmann et al. 2024; at inference a JumpReLU with the global threshold learned in training, as SAELens
stores it), ``jumprelu`` (Rajamanoharan et al. 2024). A ReLU dictionary read from SAELens (``standard``,
``transcoder``, ``skip_transcoder``) is a JumpReLU with threshold 0, the same function. A kind declares its
activation, its parameters, its files' fields and its training objective; nothing here branches on its name.

Training normalises activations by a fixed factor (the scale that makes the mean squared norm ``d``; SAELens's
``expected_average_only_in`` makes the mean *norm* ``√d`` instead, a factor differing by the ratio of the root mean
square norm to the mean norm); the factor is folded into the weights (:meth:`Dictionary.folded`), so a dictionary
reads and writes the model's own activations, and is recorded (``scale_in``, ``scale_out``).

The engine (:func:`lenscope.models.runtime.engine.run` with ``dictionaries=``) exposes a dictionary's latents as the
site ``"<site>.latents"`` (``("mlp_out.latents", 5)``), to capture and to edit with the reconstruction error kept.

Files (:meth:`Dictionary.save`, :func:`load_dictionaries`): a folder with ``cfg.json`` and
``sae_weights.safetensors`` as SAELens writes them (``architecture``, ``d_in``, ``d_sae``, ``metadata.hook_name``
in TransformerLens's hook names, ...), lenscope's record under ``metadata.lenscope`` (site, kind, role, model
fingerprint, normalisation); several dictionaries trained together: one subfolder each. A transcoder's input is named
``blocks.L.mlp.hook_in`` (circuit-tracer's hook on the MLP's input, after the norm and its gain), not
TransformerLens's ``blocks.L.ln2.hook_normalized``, which holds the activations before the gain.

SAELens's inference settings are honoured by folding them into the one form above, or refused in one line
(:func:`~lenscope.models.dictionaries.dictionary_formats.saelens_form`): ``apply_b_dec_to_input`` false (an SAE that
does not
subtract ``b_dec``: ``b_enc += b_dec @ W_enc``), ``rescale_acts_by_decoder_norm`` (TopK: pre-activations times the
decoder rows' norms, latents divided by them before decoding: the norms folded into ``W_enc``, ``b_enc`` and
``W_dec``), ``normalize_activations`` ``expected_average_only_in`` with its factor stored beside the weights
(``activation_scaler.json``, as SAELens's checkpoints keep it; folded as :meth:`Dictionary.folded`); a per-token
normalisation (``constant_norm_rescale``, ``layer_norm``) or a statistic the folder lacks is refused.

Transcoders also go to circuit-tracer's per-layer layout (:func:`save_circuit_tracer`; read back by
:func:`load_dictionaries`): ``config.yaml`` and ``layer_{L}.safetensors``. circuit-tracer (0.5) applies a JumpReLU
where the file holds ``activation_function.threshold`` and a ReLU otherwise; it has no TopK, so a TopK transcoder is
refused there.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from ...errors import InputError
from ...results import axis_size
from ..runtime.sites import DICT_SITES, LATENT_SITES, site_key
from . import kinds as kinds

ROLES = ("sae", "transcoder", "skip")
CFG = "cfg.json"
WEIGHTS = "sae_weights.safetensors"

# TransformerLens's hook names, which SAELens records (``metadata.hook_name``). A transcoder reads the MLP's input
# after its norm, gain included: in TransformerLens (loaded without fold_ln, as circuit-tracer loads it) that is the
# input of the MLP module, the hook ``mlp.hook_in`` that circuit-tracer's ReplacementModel puts on it (and its output
# ``mlp.hook_out``, the MLP's output before any post-norm: lenscope's ``mlp_out``); TransformerLens's
# ``ln2.hook_normalized`` is before the gain (:data:`PRE_GAIN_HOOK`).
_TL_HOOK = {"resid_pre": "hook_resid_pre", "resid_post": "hook_resid_post", "attn_out": "hook_attn_out",
            "mlp_out": "hook_mlp_out", "ln_mlp.out": "mlp.hook_in", "resid_mid": "hook_resid_mid"}
_FROM_TL = {v: k for k, v in _TL_HOOK.items()} | {"mlp.hook_out": "mlp_out"}
PRE_GAIN_HOOK = "ln2.hook_normalized"


def tl_hook_name(site: str) -> str:
    """``"resid_post.5"`` -> ``"blocks.5.hook_resid_post"`` (TransformerLens's name, which SAELens records);
    ``"ln_mlp.out.5"`` (a transcoder's input) -> ``"blocks.5.mlp.hook_in"``."""
    name, layer = site_key(site)
    return f"blocks.{layer}.{_TL_HOOK[name]}"


def site_of_hook(hook: str) -> str:
    """The inverse of :func:`tl_hook_name` (``blocks.L.mlp.hook_out`` is ``mlp_out.L`` too), or an
    :class:`~lenscope.errors.InputError` naming what is understood. ``blocks.L.ln2.hook_normalized`` is refused: it
    is the MLP's input before the norm's gain, which no lenscope site holds."""
    m = re.fullmatch(r"blocks\.(\d+)\.(.+)", hook or "")
    if m and m.group(2) == PRE_GAIN_HOOK:
        L = m.group(1)
        raise InputError(f"the dictionary reads {hook}, TransformerLens's MLP input before the norm's gain; lenscope "
                         f"reads the MLP's input after it (blocks.{L}.mlp.hook_in): fold the norm's weights into the "
                         f"encoder, or, if it was trained after the gain, set its hook_name to blocks.{L}.mlp.hook_in")
    if not m or m.group(2) not in _FROM_TL:
        raise InputError(f"the dictionary's hook {hook!r} names no site lenscope knows; lenscope reads "
                         f"blocks.<i>.{{{', '.join(_FROM_TL)}}}")
    return f"{_FROM_TL[m.group(2)]}.{m.group(1)}"


def site_of_hooks(hook_in: str, hook_out: str | None, role: str, where) -> str:
    """The site of a dictionary from the hooks its file names (no lenscope record): an SAE's own; a transcoder's
    ``mlp_out.L``, checked against its input hook, which must be the MLP input of that block
    (``blocks.L.mlp.hook_in``)."""
    if role == "sae":
        return site_of_hook(hook_in)
    name, L = site_key(site_of_hook(hook_in))
    if name != "ln_mlp.out":
        raise InputError(f"{where}: the transcoder reads {hook_in}; lenscope's transcoders read the MLP's input "
                         f"after its norm (blocks.{L}.mlp.hook_in)")
    site = site_of_hook(hook_out) if hook_out else f"mlp_out.{L}"
    if site != f"mlp_out.{L}":
        raise InputError(f"{where}: the transcoder reads blocks.{L}.mlp.hook_in but writes {hook_out}; lenscope's "
                         f"transcoders write the output of the MLP they read (blocks.{L}.hook_mlp_out)")
    return site


def input_site(site: str, role: str) -> str:
    """The site a dictionary reads: its own for an SAE; for a transcoder of ``mlp_out.i``, ``ln_mlp.out.i`` (what
    the MLP of block ``i`` reads in a pre-norm, sandwich or parallel block)."""
    name, layer = site_key(site)
    if role == "sae":
        return f"{name}.{layer}"
    if name != "mlp_out":
        raise InputError(f"a transcoder replaces an MLP: its site is mlp_out.<block> (the MLP output it writes); "
                         f"got {site!r}")
    return f"ln_mlp.out.{layer}"


def check_site(site: str, role: str = "sae") -> str:
    """``site`` as ``"name.layer"``, checked: a site a dictionary can reconstruct."""
    name, layer = site_key(site)
    if name not in DICT_SITES:
        raise InputError(f"a dictionary's site is one of {', '.join(s + '.<block>' for s in DICT_SITES)}; "
                         f"got {site!r}")
    input_site(f"{name}.{layer}", role)
    return f"{name}.{layer}"


# A transcoder's encoder starts at this multiple of a unit-variance random map (see :meth:`Dictionary.init`).
TRANSCODER_ENC_INIT = 0.1


@dataclass(repr=False)
class Dictionary:
    """One sparse dictionary (see the module's docstring for the equations). Weights: ``W_enc (d_in, width)``,
    ``b_enc (width,)``, ``W_dec (width, d_out)``, ``b_dec (d_out,)``, ``threshold (width,)`` (JumpReLU,
    BatchTopK), ``W_skip (d_out, d_in)`` (skip transcoders)."""

    W_enc: Tensor
    b_enc: Tensor
    W_dec: Tensor
    b_dec: Tensor
    kind: str = kinds.DEFAULT
    role: str = "sae"
    k: int | None = None
    threshold: Tensor | None = None
    W_skip: Tensor | None = None
    site: str | None = None
    model: str | None = None
    fingerprint: str | None = None
    scale_in: float = 1.0
    scale_out: float = 1.0
    info: dict = field(default_factory=dict)

    def __post_init__(self):
        spec = kinds.get(self.kind)
        if self.role not in ROLES:
            raise InputError(f"unknown dictionary role {self.role!r}; roles: {', '.join(ROLES)}")
        d_in, width = self.W_enc.shape
        if tuple(self.W_dec.shape) != (width, self.d_out) or tuple(self.b_enc.shape) != (width,):
            raise InputError(f"dictionary weights disagree: W_enc {tuple(self.W_enc.shape)}, b_enc "
                             f"{tuple(self.b_enc.shape)}, W_dec {tuple(self.W_dec.shape)}, b_dec "
                             f"{tuple(self.b_dec.shape)}")
        spec.check(self)
        if self.role == "sae" and d_in != self.d_out:
            raise InputError(f"an SAE reads and writes one site: d_in {d_in} != d_out {self.d_out}")
        if (self.role == "skip") != (self.W_skip is not None):
            raise InputError("a skip transcoder (and only it) has W_skip")
        if self.site is not None:
            self.site = check_site(self.site, self.role)

    @classmethod
    def init(cls, d_in: int, width: int, *, kind: str = kinds.DEFAULT, role: str = "sae", k: int | None = None,
             d_out: int | None = None, site: str | None = None, seed: int = 0, threshold: float = 0.0,
             dtype: torch.dtype = torch.float32, **kw) -> Dictionary:
        """A new dictionary as training starts it: decoder rows random unit vectors; an SAE's encoder their
        transpose (Gao et al. 2024); a transcoder's an independent random matrix scaled by
        :data:`TRANSCODER_ENC_INIT` / sqrt(d_in), so that its first outputs are small instead of a projection of its
        input onto random directions, which the MLP's output is not (that start costs a CPU run most of its steps:
        ``benchmarks/bench_dict_transcoder_init.py``); biases 0, thresholds ``threshold``, a skip path 0."""
        d_out = d_in if d_out is None else int(d_out)
        g = torch.Generator().manual_seed(int(seed))
        W_dec = torch.randn(width, d_out, generator=g, dtype=torch.float64)
        W_dec = W_dec / W_dec.norm(dim=1, keepdim=True)
        W_enc = W_dec.T.clone() if role == "sae" and d_out == d_in else \
            torch.randn(d_in, width, generator=g, dtype=torch.float64) * (TRANSCODER_ENC_INIT / d_in ** 0.5)
        return cls(W_enc=W_enc.to(dtype), b_enc=torch.zeros(width, dtype=dtype), W_dec=W_dec.to(dtype),
                   b_dec=torch.zeros(d_out, dtype=dtype), kind=kind, role=role, k=k,
                   threshold=kinds.get(kind).init_threshold(width, threshold, dtype),
                   W_skip=torch.zeros(d_out, d_in, dtype=dtype) if role == "skip" else None, site=site, **kw)

    # -- shape ---------------------------------------------------------------------------------------------------

    d_in = axis_size("W_enc", 0)
    width = axis_size("W_enc", 1)
    d_out = axis_size("b_dec", 0)

    @property
    def spec(self) -> kinds.Kind:
        """This dictionary's kind (:mod:`lenscope.models.dictionaries.kinds`)."""
        return kinds.get(self.kind)

    @property
    def input_site(self) -> str | None:
        return None if self.site is None else input_site(self.site, self.role)

    @property
    def layer(self) -> int | None:
        return None if self.site is None else site_key(self.site)[1]

    @property
    def transcoder(self) -> bool:
        return self.role != "sae"

    def tensors(self) -> dict[str, Tensor]:
        out = {"W_enc": self.W_enc, "b_enc": self.b_enc, "W_dec": self.W_dec, "b_dec": self.b_dec}
        if self.threshold is not None:
            out["threshold"] = self.threshold
        if self.W_skip is not None:
            out["W_skip"] = self.W_skip
        return out

    def to(self, *args, **kw) -> Dictionary:
        """A copy with every weight moved / cast (``torch.Tensor.to``'s arguments)."""
        t = {n: v.to(*args, **kw) for n, v in self.tensors().items()}
        return Dictionary(**t, kind=self.kind, role=self.role, k=self.k, site=self.site, model=self.model,
                          fingerprint=self.fingerprint, scale_in=self.scale_in, scale_out=self.scale_out,
                          info=dict(self.info))

    # -- the function --------------------------------------------------------------------------------------------

    def pre(self, x: Tensor) -> Tensor:
        """The latents' pre-activations ``(..., width)`` of inputs ``x (..., d_in)``."""
        x = x.to(self.W_enc.dtype)
        if self.role == "sae":
            x = x - self.b_dec
        return x @ self.W_enc + self.b_enc

    def activate(self, pre: Tensor) -> Tensor:
        """The latents of pre-activations ``pre (..., width)`` (the inference form of every kind)."""
        return self.spec.activate(self, pre)

    def encode(self, x: Tensor) -> Tensor:
        """The latents ``(..., width)`` of inputs ``x (..., d_in)``."""
        return self.activate(self.pre(x))

    def decode(self, latents: Tensor, x: Tensor | None = None) -> Tensor:
        """The output ``(..., d_out)`` of ``latents``; a skip transcoder also needs its input ``x``."""
        out = latents.to(self.W_dec.dtype) @ self.W_dec + self.b_dec
        if self.W_skip is not None:
            if x is None:
                raise InputError("a skip transcoder's output needs its input x (the skip path)")
            out = out + x.to(self.W_skip.dtype) @ self.W_skip.T
        return out

    def __call__(self, x: Tensor) -> Tensor:
        """The reconstruction (SAE) or the MLP output's replacement (transcoder) of ``x``."""
        return self.decode(self.encode(x), x)

    def folded(self, scale_in: float, scale_out: float | None = None) -> Dictionary:
        """This dictionary, trained on ``scale_in * x`` (and, for a transcoder, to write ``scale_out * y``), as
        one that reads ``x`` and writes ``y`` directly: the pre-activations (and so the latents) are unchanged,
        the decoder is divided by ``scale_out``."""
        s_in = float(scale_in)
        s_out = s_in if scale_out is None else float(scale_out)
        if self.role == "sae" and s_out != s_in:
            raise InputError("an SAE reads and writes one site: one scale")
        t = self.tensors()
        t["W_enc"] = self.W_enc * s_in
        t["W_dec"] = self.W_dec / s_out
        t["b_dec"] = self.b_dec / s_out  # an SAE's input shift (x*s - b) becomes s*(x - b/s): the same pre
        if self.W_skip is not None:
            t["W_skip"] = self.W_skip * (s_in / s_out)
        return Dictionary(**t, kind=self.kind, role=self.role, k=self.k, site=self.site, model=self.model,
                          fingerprint=self.fingerprint, scale_in=self.scale_in * s_in,
                          scale_out=self.scale_out * s_out, info=dict(self.info))

    # -- the model it belongs to ---------------------------------------------------------------------------------

    def check(self, lm) -> None:
        """Refuse (:class:`~lenscope.errors.InputError`, one line) a dictionary made for another model or for a
        site this model lacks."""
        from ..loading.summary import fingerprint, same_model

        A = lm.anatomy
        if self.fingerprint is not None and not same_model(self.fingerprint, A):
            raise InputError(f"the dictionary for {self.site} was trained on {self.model!r}, not on {lm.name!r} "
                             f"(model fingerprints {self.fingerprint} and {fingerprint(A)} differ)")
        if self.site is None:
            raise InputError("this dictionary names no site of a model (trained on an activations file); give it "
                             "one with dictionary.site = 'resid_post.5' to run it on a model")
        layer = self.layer
        if not 0 <= layer < A.n_layers:
            raise InputError(f"the dictionary's site {self.site} is past the model's {A.n_layers} blocks")
        if self.d_in != A.d_model or self.d_out != A.d_model:
            raise InputError(f"the dictionary for {self.site} reads {self.d_in} and writes {self.d_out} dimensions; "
                             f"{lm.name!r} has d_model {A.d_model}")
        if self.transcoder and A.placement == "post":
            raise InputError("transcoders read ln_mlp's output, which a post-norm model's MLP does not read")

    # -- files ---------------------------------------------------------------------------------------------------

    def architecture(self) -> str:
        """SAELens's name for this dictionary's class (``topk``, ``jumprelu``, ``jumprelu_transcoder``,
        ``jumprelu_skip_transcoder``, ...). BatchTopK is stored as its inference form, a JumpReLU. SAELens (6.54) has
        no TopK transcoder: those are written ``topk_transcoder`` and ``topk_skip_transcoder``, names only lenscope
        reads."""
        act = self.spec.architecture
        return {"sae": act, "transcoder": f"{act}_transcoder", "skip": f"{act}_skip_transcoder"}[self.role]

    def record(self) -> dict:
        """lenscope's record of this dictionary (``metadata.lenscope`` of its ``cfg.json``)."""
        return {"kind": self.kind, "role": self.role, "site": self.site, "fingerprint": self.fingerprint,
                "scale_in": self.scale_in, "scale_out": self.scale_out, "info": self.info}

    def config(self) -> dict:
        """The ``cfg.json`` SAELens reads, lenscope's record under ``metadata.lenscope``. Its settings say what the
        weights compute: an SAE subtracts ``b_dec`` from its input (``apply_b_dec_to_input``), a transcoder does
        not; no rescaling by the decoder norms; no normalisation (the scales are folded into the weights)."""
        meta = {"model_name": self.model, "hook_name": None, "hook_head_index": None, "prepend_bos": True,
                "lenscope": self.record()}
        if self.site is not None:
            meta["hook_name"] = tl_hook_name(self.input_site)
            if self.transcoder:
                meta["hook_name_out"] = tl_hook_name(self.site)
        cfg = {"architecture": self.architecture(), "d_in": self.d_in, "d_sae": self.width,
               "dtype": str(self.W_enc.dtype).removeprefix("torch."), "device": "cpu",
               "apply_b_dec_to_input": self.role == "sae", "normalize_activations": "none",
               "reshape_activations": "none", "metadata": meta}
        cfg.update(self.spec.config(self))
        if self.transcoder:
            cfg["d_out"] = self.d_out
        return cfg

    def save(self, folder: str | Path) -> Path:
        """Write ``folder/cfg.json`` and ``folder/sae_weights.safetensors``."""
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        save_file({n: v.detach().contiguous().cpu() for n, v in self.tensors().items()}, str(folder / WEIGHTS))
        (folder / CFG).write_text(json.dumps(self.config(), indent=1) + "\n")
        return folder

    @classmethod
    def load(cls, folder: str | Path) -> Dictionary:
        """Read one dictionary folder (lenscope's or SAELens's layout), SAELens's inference settings honoured or
        refused in one line (:func:`saelens_form`)."""
        from safetensors.torch import load_file

        folder = Path(folder)
        try:
            cfg = json.loads((folder / CFG).read_text())
        except FileNotFoundError:
            raise InputError(f"{folder} has no {CFG}: not a dictionary folder") from None
        except json.JSONDecodeError as e:
            raise InputError(f"{folder / CFG} is not valid JSON ({e})") from None
        if not (folder / WEIGHTS).exists():
            raise InputError(f"{folder} has {CFG} but no {WEIGHTS}")
        t = load_file(str(folder / WEIGHTS))
        missing = [n for n in ("W_enc", "b_enc", "W_dec", "b_dec") if n not in t]
        if missing:
            raise InputError(f"{folder / WEIGHTS} lacks {', '.join(missing)}")
        # SAELens before 6.0 kept the hook and the model at the top level (``hook_point`` before ``hook_name``)
        flat = {"hook_name": cfg.get("hook_name", cfg.get("hook_point")), "hook_name_out": cfg.get("hook_name_out"),
                "model_name": cfg.get("model_name")}
        meta = {**{k: v for k, v in flat.items() if v is not None}, **(cfg.get("metadata") or {})}
        own = meta.get("lenscope") or {}
        arch = str(cfg.get("architecture", "standard"))
        role = own.get("role") or ("skip" if "skip_transcoder" in arch else "transcoder" if "transcoder" in arch
                                   else "sae")
        base = arch.replace("_skip_transcoder", "").replace("skip_transcoder", "").replace("_transcoder", "") \
            .replace("transcoder", "")
        read = kinds.reading(base, cfg, t)  # (SAELens before 6.0 wrote TopK as standard with activation_fn topk)
        if read is None:
            raise InputError(f"{folder / CFG}: architecture {arch!r} is not one lenscope reads (topk, jumprelu, "
                             "standard, transcoder, skip_transcoder and their TopK / JumpReLU forms)")
        spec, k = read[0], read[1]["k"]
        spec = kinds.get(own["kind"]) if "kind" in own else spec
        spec.check_file(t, folder / WEIGHTS)
        # lenscope's own record says the site (its files before the hook was named blocks.L.mlp.hook_in named a
        # transcoder's input blocks.L.ln2.hook_normalized); another file's hooks say it
        site = own.get("site")
        if not own and meta.get("hook_name"):
            site = site_of_hooks(meta["hook_name"], meta.get("hook_name_out"), role, folder / CFG)
        D = cls(W_enc=t["W_enc"], b_enc=t["b_enc"], W_dec=t["W_dec"], b_dec=t["b_dec"], kind=spec.name, role=role,
                k=k, threshold=t.get("threshold") if spec.threshold else None, W_skip=t.get("W_skip"),
                site=site, model=meta.get("model_name"), fingerprint=own.get("fingerprint"),
                scale_in=float(own.get("scale_in", 1.0)), scale_out=float(own.get("scale_out", 1.0)),
                info=dict(own.get("info") or {}))
        return saelens_form(D, cfg, folder)

    # -- the engine's side (:class:`Attached`) ------------------------------------------------------------------------

    def encoders(self) -> list[tuple[str, str, Dictionary]]:
        """``(site, input site, encoder)``: its latents are ``<site>.latents``."""
        return [(self.site, self.input_site, self)]

    def writers(self) -> dict[str, tuple[list[tuple[str, Tensor]], Tensor]]:
        """The site it writes: its own latents through ``W_dec``, and ``b_dec`` (a skip path: ``W_skip``)."""
        return {self.site: ([(self.site, self.W_dec)], self.b_dec)}

    def __repr__(self) -> str:
        return (f"Dictionary({self.role}, {self.kind}{self.spec.describe(self)}, site={self.site!r}, "
                f"d_in={self.d_in}, width={self.width}, model={self.model!r})")


class Attached:
    """The engine's side of ``run(..., dictionaries=, splice=)``: the encoders by the site whose latents they make
    (a per-layer dictionary: one, at its site; a cross-layer transcoder: one per block, at ``mlp_out.l``) and the
    sites written, each by the ``(latents' site, decoder)`` pairs that write it and a bias (every object given
    declares them: ``encoders()``, ``writers()``). Only what this pass reads or edits is run (all of it with
    ``splice``). An encoder's input (``ln_mlp.out`` of a transcoder) is kept from its hook until its latents' site;
    the latents (and their change by the edits) are kept until the last site they write."""

    def __init__(self, lm, dictionaries, splice: bool, capture: set, by_site: dict, stop_after):
        self.splice, self.capture, self.by_site, self.stop_after = splice, capture, by_site, stop_after
        self.encs: dict[tuple, Dictionary] = {}  # latents' site key (mlp_out, 3) -> encoder
        self.writers: dict[tuple, tuple[list, Tensor, Dictionary | None]] = {}  # site -> ([(lat key, W)], b, skip)
        self.inputs: dict[tuple, tuple] = {}  # an encoder's input site -> its latents' site
        self.stash: dict[tuple, Tensor] = {}
        self.z: dict[tuple, tuple] = {}  # latents' site -> (z, z - z0)
        input_of: dict[tuple, tuple] = {}
        for d in dictionaries:
            if getattr(d, "site", "") is None:
                raise InputError("a dictionary given to the engine needs its site (dictionary.site = 'resid_post.5')")
            d.check(lm)
            for site, inp, enc in d.encoders():
                key = site_key(site)
                if key in self.encs:
                    raise InputError(f"two dictionaries for the site {site}; give one per site")
                self.encs[key] = enc
                input_of[key] = site_key(inp)
            for site, (pairs, b) in d.writers().items():
                skip = d if getattr(d, "W_skip", None) is not None else None
                self.writers[site_key(site)] = ([(site_key(s), W) for s, W in pairs], b, skip)
        for name, layer in [k for k in capture | set(by_site) if k[0] in LATENT_SITES]:
            if (name.removesuffix(".latents"), layer) not in self.encs:
                raise InputError(f"site {name}.{layer} needs a dictionary for {name.removesuffix('.latents')}."
                                 f"{layer}: pass it in dictionaries=")
        for key in list(self.encs):
            lat = (f"{key[0]}.latents", key[1])
            if not (splice or lat in capture or lat in by_site or lat == stop_after):
                del self.encs[key]  # attached but not used in this pass: the model runs untouched there
            elif input_of[key] != key:
                self.inputs[input_of[key]] = key
        for key in list(self.writers):  # a site none of whose used encoders write stays as it is
            if not splice and not any(s in self.encs for s, _ in self.writers[key][0]):
                del self.writers[key]

    def hooks(self, key) -> bool:
        return key in self.encs or key in self.writers or key in self.inputs

    def visit(self, key, x: Tensor, session) -> Tensor:
        """The site ``key`` after its latents' edits and captures, then as written: ``x + sum (z' - z) @ W_dec``
        over the latents that write it (the error ``x - dec(z)`` kept: ``x`` itself without an edit), or with
        ``splice`` ``sum z' @ W_dec + b (+ a skip path)``. ``session``: the engine's (its ``B, P, grad``, ``keep``,
        ``_Stop``)."""
        B, P = session.B, session.P
        if key in self.inputs:
            self.stash[self.inputs[key]] = x.reshape(B, P, x.shape[-1])
        src = None
        d = self.encs.get(key)
        lat = (f"{key[0]}.latents", key[1])
        if d is not None:
            src = self.stash.pop(key) if key in self.inputs.values() else x.reshape(B, P, x.shape[-1])
            src = src.detach().to(d.W_enc.dtype)
            with torch.no_grad():
                z0 = d.encode(src)
            es = self.by_site.get(lat)
            leaf = session.grad and lat in self.capture
            z = z0.clone() if es or leaf else z0
            if es:
                session.apply(z, es)
            if leaf:
                z.requires_grad_(True)  # a leaf: the output's gradient reaches the latents (z0 holds none)
            if lat in self.capture:
                session.keep(lat, z)
            self.z[key] = (z, (z - z0) if es or leaf else None)
        w = self.writers.get(key)
        if w is not None:
            pairs, b, skip = w
            if self.splice:
                out = b
                for s, W in pairs:
                    out = out + self.z[s][0].to(W.dtype) @ W
                if skip is not None:
                    out = out + src.to(skip.W_skip.dtype) @ skip.W_skip.T
                x = out.to(x.dtype).reshape(x.shape)
            else:
                for s, W in pairs:
                    dz = self.z.get(s, (None, None))[1]
                    if dz is not None:
                        x = x + (dz @ W).to(x.dtype).reshape(x.shape)
        if d is not None and lat == self.stop_after:
            session.stop()
        return x


def load_dictionaries(path: str | Path) -> list[Dictionary]:
    """The dictionaries in ``path``: one folder with ``cfg.json``, or a folder of such folders (one per site, as
    ``lenscope dict train`` writes several sites trained together), in the order of their sites; or transcoders in
    circuit-tracer's layout (a folder with ``config.yaml``: :func:`load_circuit_tracer`)."""
    path = Path(path)
    if not path.exists():
        raise InputError(f"dictionary folder {path} does not exist")
    if (path / CFG).exists():
        return [Dictionary.load(path)]
    if (path / CT_CONFIG).exists():
        return load_circuit_tracer(path)
    if (path / "clt.json").exists():
        raise InputError(f"{path} holds a cross-layer transcoder: read it with CrossLayerTranscoder.load "
                         "(lenscope.models.dictionaries.clt); this command reads per-layer dictionaries")
    subs = sorted(p for p in path.iterdir() if p.is_dir() and (p / CFG).exists())
    if not subs:
        raise InputError(f"{path} holds no dictionary: neither {CFG} nor subfolders with one")
    out = [Dictionary.load(p) for p in subs]

    def order(d: Dictionary):
        if d.site is None:
            return (1, 0, "")
        name, layer = site_key(d.site)
        return (0, layer, name)

    return sorted(out, key=order)


def save_dictionaries(dicts: list[Dictionary], folder: str | Path) -> Path:
    """One dictionary: ``folder`` itself; several: a subfolder per site (named by the site, ``mlp_out.5``)."""
    folder = Path(folder)
    if len(dicts) == 1:
        return dicts[0].save(folder)
    names = [d.site or f"dict{i}" for i, d in enumerate(dicts)]
    if len(set(names)) != len(names):
        raise InputError("two dictionaries for one site cannot share a folder")
    for d, n in zip(dicts, names):
        d.save(folder / n)
    return folder


# -- SAELens's inference settings ------------------------------------------------------------------------------

# the foreign formats live beside (they read and write a Dictionary); imported here so that load / load_dictionaries
# find them and the names stay importable from this module
from .dictionary_formats import CT_CONFIG, SCALER, load_circuit_tracer, saelens_form, save_circuit_tracer  # noqa: E402

__all__ = ["Attached", "CFG", "CT_CONFIG", "DICT_SITES", "Dictionary", "LATENT_SITES", "PRE_GAIN_HOOK",
           "ROLES", "SCALER", "WEIGHTS", "check_site", "input_site", "load_circuit_tracer", "load_dictionaries",
           "saelens_form", "save_circuit_tracer", "save_dictionaries", "site_of_hook", "site_of_hooks", "tl_hook_name"]
