"""Lens files: lenscope's (``config.json`` + ``params.safetensors``) and the tuned-lens library's
(``config.json`` + ``params.pt``, read with ``torch.load(weights_only=True)``: tensors only, no code)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import InputError
from ..models.loading.load import LoadedModel
from ..models.loading.summary import same_model
from .lenses import LENS_FORMAT, TunedLens


def _read_config(directory: Path) -> dict:
    if not directory.is_dir():
        raise InputError(f"lens directory not found: {directory}")
    try:
        return json.loads((directory / "config.json").read_text())
    except FileNotFoundError:
        raise InputError(f"{directory} has no config.json; it is not a lens directory") from None
    except json.JSONDecodeError as e:
        raise InputError(f"{directory / 'config.json'} is not valid JSON ({e})") from None


def load_lens_dir(directory: str | Path, lm: LoadedModel, *, check_model: bool = True) -> TunedLens:
    directory = Path(directory)
    cfg = _read_config(directory)
    A = lm.anatomy
    if "lenscope_lens" in cfg:
        if cfg["lenscope_lens"] > LENS_FORMAT:
            raise InputError(f"{directory} was written by a newer lenscope (format {cfg['lenscope_lens']})")
        if check_model and not same_model(cfg.get("fingerprint"), A):
            raise InputError(
                f"the lens in {directory} was trained on {cfg.get('model')!r} ({cfg.get('family')}, "
                f"{cfg.get('n_layers')} layers, d_model {cfg.get('d_model')}), not on {lm.name!r}; "
                "train a lens for this model with `lenscope lens train`"
            )
        from safetensors.torch import load_file

        try:
            params = load_file(str(directory / "params.safetensors"))
        except Exception as e:  # a corrupt or missing file
            raise InputError(f"cannot read {directory / 'params.safetensors'} ({e})") from None
        has_mid = "A_mid" in params
        lens = TunedLens(A, model_name=cfg.get("model", lm.name), mid=cfg.get("mid", False),
                         training=cfg.get("training"), mid_translators=has_mid)
        _assign(lens, params.get("A"), params.get("b"), directory)
        if has_mid:
            _assign(lens, params.get("A_mid"), params.get("b_mid"), directory, mid=True)
        return lens
    if (directory / "params.pt").exists():
        return _load_tuned_lens_library(directory, cfg, lm)
    raise InputError(f"{directory} holds neither a lenscope lens (params.safetensors) nor a tuned-lens one (params.pt)")


def _assign(lens: TunedLens, A, b, directory: Path, mid: bool = False) -> None:
    pA, pb = (lens.A_mid, lens.b_mid) if mid else (lens.A, lens.b)
    want = (tuple(pA.shape), tuple(pb.shape))
    got = (None if A is None else tuple(A.shape), None if b is None else tuple(b.shape))
    if got != want:
        what = "mid-layer parameter" if mid else "parameter"
        raise InputError(f"the lens in {directory} has {what} shapes {got}, this model needs {want}")
    with torch.no_grad():
        pA.copy_(A)
        pb.copy_(b)


def _load_tuned_lens_library(directory: Path, cfg: dict, lm: LoadedModel) -> TunedLens:
    """tuned-lens 0.2 stores ``{i}.weight/bias`` of ``nn.Linear(d, d)`` translators applied as
    ``h + W h + b`` for hidden states 0..n_layers-1."""
    A = lm.anatomy
    d, L = cfg.get("d_model"), cfg.get("num_hidden_layers")
    if (d, L) != (A.d_model, A.n_layers):
        raise InputError(
            f"the tuned-lens lens in {directory} is for d_model={d}, {L} layers "
            f"({cfg.get('base_model_name_or_path')}); {lm.name} has d_model={A.d_model}, {A.n_layers} layers"
        )
    try:
        sd = torch.load(directory / "params.pt", map_location="cpu", weights_only=True)
    except Exception as e:
        raise InputError(f"cannot read {directory / 'params.pt'} as a tensor file ({e})") from None
    # tuned-lens 0.2 saves the translators' ModuleList ("0.weight", ...); accept the prefixed form too
    prefix = "layer_translators." if "layer_translators.0.weight" in sd else ""
    try:
        W = torch.stack([sd[f"{prefix}{i}.weight"].T for i in range(L)]).float()
        if cfg.get("bias", True):
            b = torch.stack([sd[f"{prefix}{i}.bias"] for i in range(L)]).float()
        else:
            b = torch.zeros(L, d)
    except KeyError as e:
        raise InputError(f"{directory / 'params.pt'} lacks {e}; not a tuned-lens lens") from None
    lens = TunedLens(A, model_name=str(cfg.get("base_model_name_or_path", lm.name)),
                     training={"source": "tuned-lens library", "config": cfg})
    _assign(lens, W, b, directory)
    return lens
