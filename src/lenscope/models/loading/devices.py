"""Models split across devices (accelerate device maps, offloading) and reduced-precision dtypes.

- :func:`parse_dtype` reads ``"bfloat16" | "bf16" | "float16" | "fp16" | "half" | "float32" | "fp32"`` (or a
  ``torch.dtype``); :func:`compute_dtype` is the dtype lenscope's own math uses for a model of that dtype:
  float32 for bfloat16 / float16 models (the Anatomy holds float32 copies of their weights and the Trace
  float32 copies of their activations, both exact), the model's own dtype otherwise.
- :func:`dispatch` places a model with accelerate (``device_map`` a dict ``{module: device}`` or
  ``"auto" | "balanced" | "balanced_low_0" | "sequential"``; devices ``"cpu"``, ``"disk"``, ``0``, ``"cuda:1"``...).
- :func:`materialised` gives offloaded weights (parameters left on the ``meta`` device, the real values in
  accelerate's weights map on CPU or disk) real values while an Anatomy is read from the model.
- :func:`main_device` is where a (possibly dispatched) model takes its inputs.

See ``docs/devices.md`` for what was tested and what was not.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from ...errors import InputError

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "float64": torch.float64, "fp64": torch.float64, "double": torch.float64,
}
DTYPE_CHOICES = ("bfloat16", "float16", "float32")
DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")


def parse_dtype(dtype: str | torch.dtype | None, default: torch.dtype = torch.float32) -> torch.dtype:
    """A ``torch.dtype`` from a name (``"bfloat16"``, ``"bf16"``, ``"float16"``, ``"fp16"``, ``"float32"``...)."""
    if dtype is None:
        return default
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise InputError(f"dtype {dtype} is not a floating-point dtype; use one of {', '.join(DTYPE_CHOICES)}")
        return dtype
    key = str(dtype).strip().lower().removeprefix("torch.")
    if key not in DTYPES:
        raise InputError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPE_CHOICES)}")
    return DTYPES[key]


def is_reduced(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` has less precision than float32 (bfloat16, float16)."""
    return dtype.is_floating_point and torch.finfo(dtype).bits < 32


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype lenscope computes in for a model stored in ``dtype``: float32 for bfloat16 / float16."""
    return torch.float32 if is_reduced(dtype) else dtype


def parse_device_map(device_map: Any) -> Any:
    """``None``, a strategy name, a dict, a JSON object string or the path of a JSON file -> what accelerate takes.

    Integer-like device strings (``"0"``) become ints (CUDA ordinals), as accelerate expects."""
    if device_map is None or isinstance(device_map, dict):
        return _normalise_map(device_map) if isinstance(device_map, dict) else None
    if not isinstance(device_map, str):
        raise InputError(f"device_map must be a dict or a string, not {type(device_map).__name__}")
    s = device_map.strip()
    if s in ("", "none"):
        return None
    if s in DEVICE_MAP_STRATEGIES:
        return s
    if s.startswith("{"):
        try:
            return _normalise_map(json.loads(s))
        except json.JSONDecodeError as e:
            raise InputError(f"--device-map is not valid JSON ({e}); give e.g. "
                             "'{\"model.layers.0\": \"cpu\", \"model.layers.1\": \"disk\"}'") from None
    p = Path(s).expanduser()
    if p.is_file():
        try:
            return _normalise_map(json.loads(p.read_text()))
        except json.JSONDecodeError as e:
            raise InputError(f"{p} is not a JSON device map ({e})") from None
    raise InputError(f"unknown device map {device_map!r}: give one of {', '.join(DEVICE_MAP_STRATEGIES)}, a JSON "
                     "object {module: device} or the path of a JSON file holding one")


def _normalise_map(m: dict) -> dict:
    if not isinstance(m, dict) or not m:
        raise InputError("a device map must be a non-empty JSON object {module name: device}")
    out = {}
    for k, v in m.items():
        if isinstance(v, str) and v.strip().isdigit():
            v = int(v)
        out[str(k)] = v
    return out


OFFLOAD_PREFIX = "lenscope-offload-"


def _offload_dir() -> str:
    """A temporary folder for the weights accelerate offloads to disk, named after this process
    (``lenscope-offload-<pid>-*``) and removed at exit. A process that was killed leaves its folder behind (GBs of
    weights): the folders of processes that no longer run are removed first (:func:`sweep_offload_dirs`)."""
    sweep_offload_dirs()
    d = tempfile.mkdtemp(prefix=f"{OFFLOAD_PREFIX}{os.getpid()}-")
    atexit.register(shutil.rmtree, d, ignore_errors=True)
    return d


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    return True


def sweep_offload_dirs(root: str | None = None) -> list[str]:
    """Remove the offload folders under ``root`` (the temporary folder) whose process no longer runs; returns
    them. A folder whose name holds no process id (made before they did) is left alone."""
    gone = []
    base = Path(root or tempfile.gettempdir())
    for d in base.glob(f"{OFFLOAD_PREFIX}*-*"):
        pid = d.name[len(OFFLOAD_PREFIX):].split("-", 1)[0]
        if d.is_dir() and pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)
            gone.append(str(d))
    return gone


def needs_offload_folder(device_map: Any, max_memory: dict | None) -> bool:
    if isinstance(device_map, dict):
        return "disk" in device_map.values()
    return isinstance(device_map, str)  # a strategy may offload to disk when memory runs out


def complete_device_map(model, device_map: dict, tied: bool | None = None) -> dict:
    """A ``{module: device}`` map that names only some modules, completed: every other block (``...layers.N``,
    ``...h.N``) and module with weights stays on the CPU, and tied input / output embeddings share a device
    (accelerate wants every weight placed). ``model`` may be a skeleton on the ``meta`` device."""
    if tied is None:
        tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    names = list(model.state_dict().keys())
    mods = {id(m): n for n, m in model.named_modules()}

    def covered(name: str, m: dict) -> bool:
        return "" in m or any(name == k or name.startswith(k + ".") for k in m)

    def where(name: str, m: dict):
        best = max((k for k in m if name == k or name.startswith(k + ".")), key=len)
        return m[best]

    known = set(mods.values())
    unknown = [k for k in device_map if k and k not in known]
    if unknown:
        examples = ", ".join(n for n in list(mods.values())[1:] if n.count(".") <= 2)[:200]
        raise InputError(f"the device map names module(s) this model does not have: {', '.join(unknown)}; "
                         f"its modules are named like: {examples} ...")
    out = dict(device_map)
    if tied and hasattr(model, "get_output_embeddings") and model.get_output_embeddings() is not None:
        pair = [mods.get(id(model.get_input_embeddings())), mods.get(id(model.get_output_embeddings()))]
        if all(pair):
            dev = next((where(p + ".weight", out) for p in pair if covered(p + ".weight", out)), "cpu")
            for p in pair:
                if not covered(p + ".weight", out):
                    out[p] = dev
    blocks = ("layers", "h", "layer", "blocks")
    for n in names:
        if covered(n, out):
            continue
        parts = n.split(".")
        i = next((j for j, x in enumerate(parts[:-2]) if x in blocks and parts[j + 1].isdigit()), None)
        cut = i + 2 if i is not None else len(parts) - 1
        out[".".join(parts[:cut]) or n] = "cpu"
    return out


def dispatch(model, device_map: Any, *, max_memory: dict | None = None, offload_folder: str | None = None):
    """Place an already built model with accelerate: ``device_map`` a dict or a strategy (computed with
    :func:`accelerate.infer_auto_device_map` under ``max_memory``). Disk offload writes to ``offload_folder``
    (a temporary folder, removed at exit, when not given)."""
    from accelerate import dispatch_model, infer_auto_device_map

    if isinstance(device_map, str):
        no_split = getattr(model, "_no_split_modules", None) or []
        device_map = infer_auto_device_map(model, max_memory=max_memory, no_split_module_classes=list(no_split))
    device_map = _normalise_map(device_map)
    if "" not in device_map:
        device_map = _normalise_map(complete_device_map(model, device_map))
    if device_map.get("") == "disk" or set(device_map.values()) == {"disk"}:
        raise InputError("the whole model would be offloaded to disk (max_memory leaves no room on any device); "
                         "give more memory to a device, or place at least the embeddings on one")
    if "disk" in device_map.values() and offload_folder is None:
        offload_folder = _offload_dir()
    try:
        model = dispatch_model(model, device_map=device_map, offload_dir=offload_folder, force_hooks=True)
    except (ValueError, KeyError, RuntimeError) as e:
        raise InputError(f"cannot place the model with device map {device_map}: {e}") from None
    model.hf_device_map = dict(device_map)
    return model


def is_dispatched(model) -> bool:
    """Whether accelerate placed the model (it then carries ``hf_device_map`` and device hooks)."""
    return bool(getattr(model, "hf_device_map", None))


def main_device(model) -> torch.device:
    """Where the model takes its inputs: accelerate's execution device of the whole model when dispatched, else
    the device of its first parameter (as before)."""
    hook = getattr(model, "_hf_hook", None)
    dev = getattr(hook, "execution_device", None)
    if dev is not None:
        return torch.device(f"cuda:{dev}" if isinstance(dev, int) else dev)
    for p in model.parameters():
        if p.device.type != "meta":
            return p.device
    return torch.device("cpu")


def offloaded_modules(model) -> list[str]:
    """Names of the modules whose weights accelerate keeps off-device (on ``meta`` until a forward pass)."""
    try:
        from accelerate.utils import has_offloaded_params
    except ImportError:
        return []
    return [n for n, m in model.named_modules() if has_offloaded_params(m)]


@contextmanager
def materialised(model, device: str | torch.device = "cpu"):
    """While inside, every offloaded parameter of ``model`` holds its real value (read from accelerate's weights
    map, i.e. CPU memory or the disk offload folder) on ``device``. Tensors taken from the parameters inside stay
    valid after the context, which puts the parameters back on ``meta``. A no-op for models without offload."""
    if not is_dispatched(model):
        yield model
        return
    from accelerate.utils import has_offloaded_params, set_module_tensor_to_device

    done = []
    try:
        for m in model.modules():
            if not has_offloaded_params(m):
                continue
            hook = m._hf_hook
            names = [n for n, _ in m.named_parameters(recurse=False)]
            if getattr(hook, "offload_buffers", False):
                names += [n for n, _ in m.named_buffers(recurse=False)]
            for n in names:
                if getattr(m, n).device.type != "meta":
                    continue
                set_module_tensor_to_device(m, n, device, value=hook.weights_map[n])
                done.append((m, n))
        yield model
    finally:
        for m, n in done:
            set_module_tensor_to_device(m, n, "meta")


def device_summary(model) -> dict:
    """What lenscope records about a model's placement (``Anatomy.extras["placement"]``)."""
    info: dict = {"dtype": str(getattr(model, "dtype", None)).removeprefix("torch.")}
    if is_dispatched(model):
        info["device_map"] = {k: str(v) for k, v in model.hf_device_map.items()}
        info["main_device"] = str(main_device(model))
        info["offloaded"] = offloaded_modules(model)
    return info
