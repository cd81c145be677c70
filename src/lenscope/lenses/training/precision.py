"""The precision of tuned-lens training's unembedding matmuls: bfloat16 or float32, decided per machine.

Input: a loaded model (its unembedding's device and shape) and the user's ``bf16`` setting; output: a record
(:func:`choose_precision`) that training follows and keeps in the lens file's ``training`` record. The CPU's
features and ``$LENSCOPE_NATIVE_BF16`` (:mod:`lenscope.training.precision`, which dictionary training reads too) say
whether the hardware runs bfloat16 natively; without it a one-off timing of one block of the objective decides.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import Tensor

from ...models.loading.load import LoadedModel
from ...training.precision import NATIVE_BF16_ENV, cpu_features, forced_native_bf16
from .objective import LogPartition


def _time_block(W: Tensor, x: Tensor, ref: Tensor, repeats: int = 2) -> float:
    """Seconds for one block of the training objective (forward and backward through the unembedding)."""
    best = float("inf")
    for _ in range(repeats):
        xx = x.clone().requires_grad_(True)
        t0 = time.perf_counter()
        LogPartition.apply(xx, W, None, ref).sum().backward()
        best = min(best, time.perf_counter() - t0)
    return best


# The precision probe times bfloat16 on 1/PROBE_FIRST_PART of its block first (see choose_precision).
PROBE_FIRST_PART = 64

# One measurement per unembedding and device in a process: runs that follow (a resume, a second lens) take the
# same decision instead of a new timing that could fall on the other side of the threshold.
_PROBES: dict = {}


def choose_precision(lm: LoadedModel, bf16: bool | None = None, *, native: bool | None = None,
                     timer: Callable[[Tensor, Tensor, Tensor], float] | None = None) -> dict:
    """Decide the dtype of the unembedding matmuls of training; returns a record for the training info.

    ``bf16`` True/False is the user's choice. None (automatic): bfloat16 where the hardware runs it natively
    (a CUDA device, or a CPU with AVX512-BF16 or AMX), else a one-off measurement of one block of the
    objective in both dtypes decides (bfloat16 only if at least 10% faster; bfloat16 is timed on a 64th
    of the block first, and the probe stops there when that alone, scaled up, is over twice float32's time).
    Without native support CPUs emulate bfloat16 and it is usually slower than float32 (issue 11: 2.06 s
    against 0.49 s for a 512 x 576 x 49152 matmul on a Xeon without AVX512-BF16).
    """
    W = lm.anatomy.unembed.W_U
    rec: dict = {}
    if W.device.type == "cpu":
        rec.update(cpu_features())
    if native is None:
        native = forced_native_bf16()
        if native is not None:
            rec["native_bf16_from"] = f"{NATIVE_BF16_ENV}={int(native)}"
    if native is None:
        native = (torch.cuda.is_available() and W.device.type == "cuda" and torch.cuda.is_bf16_supported()) or (
            W.device.type == "cpu" and (rec.get("avx512_bf16", False) or rec.get("amx_bf16", False)))
    rec["native_bf16"] = bool(native)
    if bf16 is not None:
        use, why = bool(bf16), "set by the user"
    elif native:
        use, why = True, "the hardware runs bfloat16 natively"
    else:
        fn = timer or _time_block
        key = (W.data_ptr(), tuple(W.shape), str(W.device), fn)
        if timer is not None or key not in _PROBES:
            g = torch.Generator().manual_seed(0)
            rows = max(16, min(256, int(2e8 // (W.shape[1] * 16))))
            x = torch.randn(rows, W.shape[0], generator=g, device=W.device) * 0.5
            ref = torch.randint(0, W.shape[1], (rows,), generator=g).to(W.device)
            t32 = fn(W.float().contiguous(), x, ref)
            # emulated bfloat16 can be 100x slower than float32 (issue 22: 42 s for one block on an AMD EPYC):
            # time a 64th of the block first and stop there when it is clearly slower already
            W16 = W.to(torch.bfloat16).contiguous()
            part = max(1, rows // PROBE_FIRST_PART)
            t16 = fn(W16, x[:part], ref[:part]) * rows / part
            if t16 <= 2.0 * t32:
                part, t16 = rows, fn(W16, x, ref)
            if timer is None:
                _PROBES[key] = (t16, t32, rows, part)
        else:
            t16, t32, rows, part = _PROBES[key]
        use = t16 < 0.9 * t32
        rec["measured_s"] = {"bfloat16": round(t16, 4), "float32": round(t32, 4), "rows": rows}
        if part < rows:
            rec["measured_s"]["bfloat16_from_rows"] = part  # extrapolated from the first rows
        why = (f"no native bfloat16; measured one {rows}-row block: bfloat16 {t16:.3f} s"
               + (f" (scaled up from its first {part} rows)" if part < rows else "") + f", float32 {t32:.3f} s")
    rec.update({"unembed_dtype": "bfloat16" if use else "float32", "bf16": use, "reason": why})
    return rec


def resumed_precision(lm: LoadedModel, saved: dict, bf16: bool | None = None) -> dict:
    """The precision of a resumed run: the interrupted run's decision, read from its checkpoint record ``saved``
    (``{}`` when unreadable; see :func:`lenscope.lenses.training.checkpoint.read_checkpoint_info`), so that the resume
    computes as the interrupted run did. A checkpoint from before the automatic choice keeps its ``bf16``
    setting; without any, :func:`choose_precision` decides anew."""
    prec = saved.get("state", {}).get("precision")
    old_bf16 = saved.get("settings", {}).get("bf16")
    if not prec and bf16 is None and old_bf16 is not None:  # a checkpoint from before the automatic choice
        prec = {**choose_precision(lm, old_bf16), "reason": "kept from the interrupted run"}
    return prec or choose_precision(lm, bf16)


def describe(prec: dict) -> str:
    """One line for the log: the dtype chosen, why, and (on a CPU) the CPU's bfloat16 features."""
    return (f"unembedding matmuls in {prec['unembed_dtype']}: {prec['reason']}"
            + (f" ({prec['cpu']}; avx512_bf16={prec.get('avx512_bf16')}, amx_bf16={prec.get('amx_bf16')})"
               if "cpu" in prec else ""))


__all__ = ["NATIVE_BF16_ENV", "PROBE_FIRST_PART", "choose_precision", "cpu_features", "describe", "forced_native_bf16",
           "resumed_precision"]
