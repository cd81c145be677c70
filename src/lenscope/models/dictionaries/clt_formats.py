"""Cross-layer transcoders in circuit-tracer's layout (0.5: its ``CrossLayerTranscoder.to_safetensors`` and
``load_clt``, and the cache ``circuit_tracer.utils.caching`` reads), written and read by lenscope:

- ``config.yaml``: ``model_kind: cross_layer_transcoder``, ``feature_input_hook: mlp.hook_in`` (the MLP's input
  after its norm, lenscope's ``ln_mlp.out``), ``feature_output_hook: mlp.hook_out`` (lenscope's ``mlp_out``),
  ``model_name``;
- per block ``l``: ``W_enc_{l}.safetensors`` holding ``W_enc_{l} (width, d_model)`` (the transpose of lenscope's),
  ``b_enc_{l} (width,)``, ``b_dec_{l} (d_model,)`` (the bias of block ``l``'s *output*) and, for a JumpReLU,
  ``threshold_{l} (width,)``; ``W_dec_{l}.safetensors`` holding ``W_dec_{l} (width, L - l, d_model)``.

circuit-tracer computes ``pre * (pre > threshold)`` where the files hold thresholds and ``relu(pre)`` otherwise;
lenscope's ``relu(pre) * (pre > threshold)`` is the first with the thresholds raised to 0, which is what is written.
It has no TopK: a TopK CLT is refused (the kind's ``check_circuit_tracer``). lenscope's record goes in each encoder
file's metadata.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ...errors import InputError
from . import kinds as kinds
from .dictionary_formats import CT_ARCHITECTURE, CT_CONFIG, CT_OUTPUT_HOOK

CT_CLT_KIND = "cross_layer_transcoder"


def _read_config(folder: Path) -> dict:
    import yaml

    try:
        cfg = yaml.safe_load((folder / CT_CONFIG).read_text())
    except FileNotFoundError:
        return {}
    except yaml.YAMLError as e:
        raise InputError(f"{folder / CT_CONFIG} is not valid YAML ({str(e).splitlines()[0]})") from None
    return cfg if isinstance(cfg, dict) else {}


def is_circuit_tracer_clt(folder: str | Path) -> bool:
    return _read_config(Path(folder)).get("model_kind") == CT_CLT_KIND


def save_circuit_tracer_clt(clt, folder: str | Path) -> Path:
    """Write ``clt`` (a :class:`~lenscope.models.dictionaries.clt.CrossLayerTranscoder`) in circuit-tracer's CLT
    layout (see the module's docstring) into ``folder`` (empty, or holding no other block's files)."""
    import yaml
    from safetensors.torch import save_file

    from .dictionary import _TL_HOOK

    clt.spec.check_circuit_tracer(clt.block(0))
    folder = Path(folder)
    L = clt.n_layers
    if folder.exists():
        stale = sorted(p.name for p in folder.glob("W_*_*.safetensors")
                       if p.stem.split("_")[-1].isdigit() and int(p.stem.split("_")[-1]) >= L)
        if stale:
            raise InputError(f"{folder} already holds {', '.join(stale)}, which circuit-tracer would read as more "
                             "blocks; write to an empty folder")
    folder.mkdir(parents=True, exist_ok=True)
    meta = {"lenscope": json.dumps(clt.record())}
    for i in range(L):
        enc = {f"W_enc_{i}": clt.W_enc[i].T, f"b_enc_{i}": clt.b_enc[i], f"b_dec_{i}": clt.b_dec[i]}
        if clt.threshold is not None:
            enc[f"threshold_{i}"] = clt.threshold[i].clamp(min=0)
        save_file({n: v.detach().contiguous().cpu() for n, v in enc.items()}, str(folder / f"W_enc_{i}.safetensors"),
                  metadata=meta)
        save_file({f"W_dec_{i}": clt.W_dec[i].detach().contiguous().cpu()}, str(folder / f"W_dec_{i}.safetensors"))
    cfg = {"model_kind": CT_CLT_KIND, "feature_input_hook": _TL_HOOK["ln_mlp.out"],
           "feature_output_hook": CT_OUTPUT_HOOK}
    if clt.model:
        cfg["model_name"] = clt.model
    (folder / CT_CONFIG).write_text(yaml.safe_dump(cfg, sort_keys=False))
    return folder


def load_circuit_tracer_clt(folder: str | Path):
    """A CLT in circuit-tracer's layout: a JumpReLU where the files hold ``threshold_{l}``, a ReLU (a JumpReLU at 0)
    otherwise, as circuit-tracer reads it; lenscope's record (the first encoder file's metadata) where present."""
    from safetensors import safe_open

    from .clt import CrossLayerTranscoder
    from .dictionary import site_of_hooks

    folder = Path(folder)
    where = folder / CT_CONFIG
    cfg = _read_config(folder)
    if cfg.get("model_kind") != CT_CLT_KIND:
        raise InputError(f"{where}: model_kind {cfg.get('model_kind')!r}; a CLT's is {CT_CLT_KIND!r}")
    hook_in, hook_out = cfg.get("feature_input_hook"), cfg.get("feature_output_hook")
    if not hook_in:
        raise InputError(f"{where} names no feature_input_hook")
    site_of_hooks(f"blocks.0.{hook_in}", hook_out and f"blocks.0.{hook_out}", "transcoder", where)
    L = len(list(folder.glob("W_enc_*.safetensors")))
    enc, dec = [], []
    meta: dict = {}
    for i in range(L):
        p, q = folder / f"W_enc_{i}.safetensors", folder / f"W_dec_{i}.safetensors"
        if not p.exists() or not q.exists():
            raise InputError(f"{folder}: circuit-tracer's CLT layout needs W_enc_{i}.safetensors and "
                             f"W_dec_{i}.safetensors for each block from 0 to {L - 1}")
        with safe_open(str(p), "pt") as f:
            meta = meta or (f.metadata() or {})
            e = {n: f.get_tensor(n) for n in f.keys()}
        with safe_open(str(q), "pt") as f:
            if f"W_dec_{i}" not in f.keys():
                raise InputError(f"{q} lacks W_dec_{i}")
            dec.append(f.get_tensor(f"W_dec_{i}"))
        missing = [n for n in (f"W_enc_{i}", f"b_enc_{i}", f"b_dec_{i}") if n not in e]
        if missing:
            raise InputError(f"{p} lacks {', '.join(missing)}")
        enc.append(e)
    if not L:
        raise InputError(f"{folder} holds no W_enc_0.safetensors")
    has = [f"threshold_{i}" in e for i, e in enumerate(enc)]
    if any(has) and not all(has):
        raise InputError(f"{folder}: thresholds for some blocks only")
    threshold = torch.stack([e[f"threshold_{i}"] for i, e in enumerate(enc)]) if all(has) else \
        torch.zeros(L, enc[0]["b_enc_0"].shape[0], dtype=enc[0]["b_enc_0"].dtype)
    if bool((threshold < 0).any()):
        raise InputError(f"{folder}: a negative threshold; lenscope's JumpReLU zeroes negative pre-activations, "
                         "circuit-tracer's keeps those above the threshold")
    own = json.loads(meta["lenscope"]) if "lenscope" in meta else {}
    kind = own.get("kind") or kinds.reading(CT_ARCHITECTURE, {}, {})[0].name
    return CrossLayerTranscoder(
        W_enc=torch.stack([e[f"W_enc_{i}"].T for i, e in enumerate(enc)]).contiguous(),
        b_enc=torch.stack([e[f"b_enc_{i}"] for i, e in enumerate(enc)]),
        b_dec=torch.stack([e[f"b_dec_{i}"] for i, e in enumerate(enc)]), W_dec=dec, threshold=threshold, kind=kind,
        k=own.get("k"), model=own.get("model", cfg.get("model_name")), fingerprint=own.get("fingerprint"),
        scale_in=own.get("scale_in"), scale_out=own.get("scale_out"), info=dict(own.get("info") or {}))


__all__ = ["CT_CLT_KIND", "is_circuit_tracer_clt", "load_circuit_tracer_clt", "save_circuit_tracer_clt"]
