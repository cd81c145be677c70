"""Dictionary files other tools write and read: SAELens's inference settings folded into lenscope's one form
(:func:`saelens_form`, called by :meth:`~lenscope.models.dictionaries.dictionary.Dictionary.load`) and circuit-tracer's
per-layer transcoder layout (:func:`save_circuit_tracer`, :func:`load_circuit_tracer`, read by
:func:`~lenscope.models.dictionaries.dictionary.load_dictionaries`). See :mod:`lenscope.models.dictionaries.dictionary`
for the formats."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ...errors import InputError
from . import kinds as kinds
from .dictionary import (
    _TL_HOOK,
    CFG,
    Dictionary,
    site_of_hooks,
)

SCALER = "activation_scaler.json"  # where SAELens's checkpoints keep the factor of expected_average_only_in


def saelens_form(D: Dictionary, cfg: dict, folder: str | Path | None = None) -> Dictionary:
    """``D``, read from a SAELens folder (``cfg``: its ``cfg.json``), with SAELens's inference settings honoured by
    folding them into lenscope's one form (the same function; the folds are listed in ``info["saelens_folded"]``),
    or an :class:`~lenscope.errors.InputError` (one line) naming the setting and what to do:

    - ``apply_b_dec_to_input``: SAELens's SAE encodes ``x - b_dec`` where it is true (its default) and ``x`` where it
      is false (Gemma Scope's): ``x @ W_enc + b_enc = (x - b_dec) @ W_enc + (b_enc + b_dec @ W_enc)``. A transcoder's
      must be false: its ``b_dec`` is in the output's space (SAELens refuses it too).
    - ``rescale_acts_by_decoder_norm`` (TopK; SAELens's other classes have no such setting and ignore it): SAELens
      multiplies the pre-activations by the decoder rows' norms ``n`` before taking the top k and divides the latents
      by them before decoding; ``W_enc * n``, ``b_enc * n`` and ``W_dec / n`` (by rows) compute the same.
    - ``normalize_activations``: ``none``; ``expected_average_only_in`` (an SAE trained on its input times a fixed
      factor ``s``, its output divided by it): folded (:meth:`Dictionary.folded`) where the folder holds ``s``
      (``activation_scaler.json``, as SAELens's checkpoints keep it; a finished SAELens run has folded it and says
      ``none``), refused otherwise; ``constant_norm_rescale`` and ``layer_norm`` (each token's input scaled, and
      shifted, by its own statistics, undone on the output) are refused: lenscope's output is linear in the
      latents, which the engine's edits, attribution and graphs rely on; ``covariance_whitening`` (a statistic
      SAELens folds at the end of training) is refused.

    The folds run in float64; the result keeps the stored dtype, or float32 where that is narrower."""
    where = Path(folder) / CFG if folder is not None else CFG
    done = []
    sub = cfg.get("apply_b_dec_to_input")
    if D.role != "sae" and sub:
        raise InputError(f"{where}: apply_b_dec_to_input is true for a transcoder, whose b_dec is in its output's "
                         "space (SAELens refuses it too); set it to false")
    if D.role == "sae" and sub is not None and not sub:
        done.append("apply_b_dec_to_input: false")
    rescale = D.spec.rescale(cfg)
    if rescale:
        done.append("rescale_acts_by_decoder_norm: true")
    norm = cfg.get("normalize_activations")
    norm = "none" if norm is None or norm is False else "expected_average_only_in" if norm is True else str(norm)
    s = None
    if norm == "expected_average_only_in":
        s = _stored_scale(D, folder, where)
        done.append(f"normalize_activations: expected_average_only_in (factor {s!r})")
    elif norm in ("constant_norm_rescale", "layer_norm"):
        raise InputError(f"{where}: normalize_activations {norm!r} normalises each token's input by its own statistics "
                         "and undoes it on the output, so the output is not linear in the latents as lenscope's "
                         "edits, attributions and graphs need; run this dictionary with SAELens")
    elif norm == "covariance_whitening":
        raise InputError(f"{where}: normalize_activations 'covariance_whitening' is not folded into the weights; fold "
                         "it with SAELens (sae.fold_activation_whitening, as its trainer does when it ends) and save")
    elif norm != "none":
        raise InputError(f"{where}: normalize_activations {norm!r} is not one lenscope reads (none, "
                         "expected_average_only_in with its factor)")
    if not done:
        return D
    t = {n: v.double() for n, v in D.tensors().items()}
    if "apply_b_dec_to_input: false" in done:
        t["b_enc"] = t["b_enc"] + t["b_dec"] @ t["W_enc"]
    if rescale:
        n = t["W_dec"].norm(dim=-1)
        t["W_enc"], t["b_enc"] = t["W_enc"] * n, t["b_enc"] * n
        t["W_dec"] = t["W_dec"] / torch.where(n > 0, n, 1.0)[:, None]
    E = Dictionary(**t, kind=D.kind, role=D.role, k=D.k, site=D.site, model=D.model, fingerprint=D.fingerprint,
                   scale_in=D.scale_in, scale_out=D.scale_out, info={**D.info, "saelens_folded": done})
    if s is not None:
        E = E.folded(s)
    return E.to(torch.promote_types(D.W_enc.dtype, torch.float32))


def _stored_scale(D: Dictionary, folder, where) -> float:
    """The factor of ``expected_average_only_in`` that SAELens's checkpoint keeps beside the weights."""
    lacks = (f"{where}: normalize_activations 'expected_average_only_in': the SAE was trained on its input times a "
             f"factor this folder does not hold (SAELens keeps it in {SCALER} beside a checkpoint, or as "
             "norm_scaling_factor in its pretrained_saes.yaml); fold it in with SAELens "
             "(sae.fold_activation_norm_scaling_factor) and save with normalize_activations 'none'")
    if D.role != "sae":
        raise InputError(f"{where}: normalize_activations 'expected_average_only_in' on a transcoder is not a setting "
                         "SAELens defines; fold the scales into the weights and save with normalize_activations "
                         "'none'")
    try:
        rec = json.loads((Path(folder) / SCALER).read_text()) if folder is not None else {}
    except (FileNotFoundError, json.JSONDecodeError):
        rec = {}
    s = rec.get("scaling_factor") if isinstance(rec, dict) else None
    if not isinstance(s, (int, float)) or isinstance(s, bool) or not s > 0 or rec.get("has_whitening"):
        raise InputError(lacks)
    return float(s)


# -- circuit-tracer's per-layer layout -------------------------------------------------------------------------

CT_CONFIG = "config.yaml"
CT_THRESHOLD = "activation_function.threshold"  # circuit-tracer's JumpReLU threshold, its module's parameter
CT_ARCHITECTURE = "jumprelu"  # what circuit-tracer's files hold, in SAELens's words (a ReLU: a JumpReLU at 0)
CT_OUTPUT_HOOK = "mlp.hook_out"  # circuit-tracer's hook on the MLP's output (before a post-norm): lenscope's mlp_out


def save_circuit_tracer(dicts: list[Dictionary], folder: str | Path) -> Path:
    """Transcoders, one for every block from block 0, in circuit-tracer's per-layer layout (a ``transcoder_set``, as
    on the Hugging Face hub and in circuit-tracer's cache, which ``circuit_tracer.utils.caching`` and
    ``load_transcoder_set`` read): ``config.yaml`` (``model_kind: transcoder_set``, ``feature_input_hook:
    mlp.hook_in``, ``feature_output_hook: mlp.hook_out``, ``model_name``) and ``layer_{L}.safetensors`` holding
    ``W_enc (width, d_model)``, ``W_dec (width, d_model)``, ``b_enc``, ``b_dec``, ``activation_function.threshold``
    and ``W_skip (d_model, d_model)``, lenscope's record in each file's metadata.

    circuit-tracer (0.5) computes ``pre * (pre > threshold)`` where a file holds the threshold and ``relu(pre)``
    otherwise; lenscope's ``relu(pre) * (pre > threshold)`` is the first with the threshold raised to 0 where it is
    negative, which is what is written. Its files cannot say TopK (it would read a TopK transcoder as a ReLU one):
    a TopK transcoder is refused."""
    import yaml
    from safetensors.torch import save_file

    dicts = sorted(dicts, key=lambda d: (d.layer is None, d.layer or 0))
    if not dicts:
        raise InputError("no transcoders to write")
    for d in dicts:
        if not d.transcoder or d.site is None:
            raise InputError(f"circuit-tracer's layout holds transcoders of mlp_out.<block>, one per block; got {d!r}")
        d.spec.check_circuit_tracer(d)
    layers = [d.layer for d in dicts]
    if layers != list(range(len(dicts))):
        raise InputError(f"circuit-tracer replaces every MLP: it needs one transcoder for each block from 0; these are "
                         f"for blocks {layers}")
    if len({d.width for d in dicts}) > 1 or len({d.W_skip is None for d in dicts}) > 1:
        raise InputError("circuit-tracer's transcoders share one width, and a skip path on all or none of them")
    folder = Path(folder)
    stale = sorted(p.name for p in folder.glob("layer_*.safetensors")) if folder.exists() else []
    stale = [n for n in stale if n not in {f"layer_{L}.safetensors" for L in layers}]
    if stale:
        raise InputError(f"{folder} already holds {', '.join(stale)}, which circuit-tracer would read as more "
                         "layers; write to an empty folder")
    folder.mkdir(parents=True, exist_ok=True)
    for d in dicts:
        t = {"W_enc": d.W_enc.T, "W_dec": d.W_dec, "b_enc": d.b_enc, "b_dec": d.b_dec,
             CT_THRESHOLD: d.threshold.clamp(min=0)}
        if d.W_skip is not None:
            t["W_skip"] = d.W_skip
        save_file({n: v.detach().contiguous().cpu() for n, v in t.items()},
                  str(folder / f"layer_{d.layer}.safetensors"),
                  metadata={"lenscope": json.dumps({**d.record(), "model": d.model})})
    cfg = {"model_kind": "transcoder_set", "feature_input_hook": _TL_HOOK["ln_mlp.out"],
           "feature_output_hook": CT_OUTPUT_HOOK}
    if dicts[0].model:
        cfg["model_name"] = dicts[0].model
    (folder / CT_CONFIG).write_text(yaml.safe_dump(cfg, sort_keys=False))
    return folder


def load_circuit_tracer(folder: str | Path) -> list[Dictionary]:
    """Transcoders in circuit-tracer's per-layer layout (:func:`save_circuit_tracer`, its cache, the hub's
    ``transcoder_set``): ``config.yaml`` and the local files it lists (``transcoders``) or ``layer_{L}.safetensors``
    beside it. A JumpReLU where a file holds ``activation_function.threshold``, a ReLU otherwise, as circuit-tracer
    reads them; the hooks are checked as a SAELens file's (:func:`site_of_hooks`), lenscope's record (a file's
    metadata) read where present."""
    import yaml
    from safetensors import safe_open

    folder = Path(folder)
    where = folder / CT_CONFIG
    try:
        cfg = yaml.safe_load(where.read_text())
    except yaml.YAMLError as e:
        raise InputError(f"{where} is not valid YAML ({str(e).splitlines()[0]})") from None
    cfg = cfg if isinstance(cfg, dict) else {}
    if cfg.get("model_kind") != "transcoder_set":
        raise InputError(f"{where}: model_kind {cfg.get('model_kind')!r}; lenscope reads circuit-tracer's per-layer "
                         "transcoders (transcoder_set) here; a cross-layer transcoder: CrossLayerTranscoder.load")
    hook_in, hook_out = cfg.get("feature_input_hook"), cfg.get("feature_output_hook")
    if not hook_in:
        raise InputError(f"{where} names no feature_input_hook")
    listed = cfg.get("transcoders")
    if listed:
        remote = [p for p in listed if str(p).startswith("hf://")]
        if remote:
            raise InputError(f"{where} lists files on the Hugging Face hub ({remote[0]}, ...); lenscope reads local "
                             "files: download them and list their paths")
        paths = [Path(p) for p in listed]
    else:
        paths = sorted(folder.glob("layer_*.safetensors"), key=lambda p: int(p.stem.split("_")[1]))
        if [int(p.stem.split("_")[1]) for p in paths] != list(range(len(paths))) or not paths:
            raise InputError(f"{folder} holds {[p.name for p in paths]}: circuit-tracer's layout needs "
                             "layer_0.safetensors, layer_1.safetensors, ... one for each block from 0")
    kind = kinds.reading(CT_ARCHITECTURE, {}, {})[0].name  # what lenscope reads SAELens's jumprelu as
    out = []
    for L, p in enumerate(paths):
        if p.suffix != ".safetensors" or not p.exists():
            raise InputError(f"{where}: transcoder file {p} is not a .safetensors file lenscope can read")
        with safe_open(str(p), "pt") as f:
            meta, t = f.metadata() or {}, {n: f.get_tensor(n) for n in f.keys()}
        missing = [n for n in ("W_enc", "b_enc", "W_dec", "b_dec") if n not in t]
        if missing:
            raise InputError(f"{p} lacks {', '.join(missing)}")
        threshold = t.get(CT_THRESHOLD, torch.zeros_like(t["b_enc"]))
        if "log_thresholds" in t or bool((threshold < 0).any()):
            raise InputError(f"{p}: a negative or log threshold; lenscope's JumpReLU zeroes negative "
                             "pre-activations, circuit-tracer's keeps those above the threshold")
        own = json.loads(meta["lenscope"]) if "lenscope" in meta else {}
        site = own.get("site") or site_of_hooks(f"blocks.{L}.{hook_in}", hook_out and f"blocks.{L}.{hook_out}",
                                                "transcoder", where)
        out.append(Dictionary(W_enc=t["W_enc"].T.contiguous(), b_enc=t["b_enc"], W_dec=t["W_dec"], b_dec=t["b_dec"],
                              kind=own.get("kind", kind), role="skip" if "W_skip" in t else "transcoder",
                              threshold=threshold, W_skip=t.get("W_skip"), site=site,
                              model=own.get("model", cfg.get("model_name")), fingerprint=own.get("fingerprint"),
                              scale_in=float(own.get("scale_in", 1.0)), scale_out=float(own.get("scale_out", 1.0)),
                              info=dict(own.get("info") or {})))
    return out


__all__ = ["CT_CONFIG", "CT_OUTPUT_HOOK", "CT_THRESHOLD", "SCALER", "load_circuit_tracer", "save_circuit_tracer",
           "saelens_form"]
