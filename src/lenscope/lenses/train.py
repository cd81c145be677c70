"""Training a tuned lens: minimise KL(final || lens) over the tokens of a text corpus, model frozen.

Where the time goes: the model's forward pass is cheap next to decoding every layer's state through the
unembedding (``state x tokens x d_model x vocab`` multiply-adds, forwards and backwards). So:

- one frozen forward pass per batch yields every layer's state (hooks, no gradients);
- all translators run as one batched matmul;
- ``-sum_v p log q = lse(z) - p . z`` and ``p . z = x . (p W_U^T)``: the final distribution is folded into
  one ``(tokens, d_model)`` matrix per batch, so only the log-partition function needs the full vocabulary;
- the unembedding matmuls of training run in bfloat16 where the CPU runs it natively (AVX512-BF16 / AMX)
  or a one-off measurement says it is faster, in float32 otherwise (:func:`choose_precision`); the loss
  and everything else in float32; evaluation is float32 throughout;
- the log-partition's forward pass reads ``lse = z_k - log q_k`` at the final distribution's top token
  ``k`` (no pass over the vocabulary for a maximum).

``TrainSettings(max_minutes=M)`` sets a time budget instead of a token budget: the first steps are timed
and the number of steps (and with it the warm-up and decay of the learning rate) is fitted to what the
budget allows on this machine, refitted while the run goes on (see :func:`_fit_steps`).

The recipe otherwise follows Belrose et al. (2023): identity initialisation, KL objective averaged over
layers and tokens, linear warm-up then linear decay. The default optimizer is Adam (our measurements in
``docs/lenses.md`` show it converges faster than SGD-Nesterov on the small budgets a CPU affords);
``optimizer="sgd"`` gives the paper's Nesterov SGD. Beyond the paper, ``keep_best`` judges every state's
translator on a few held-out sequences about twelve times per run: a state that got worse goes back to
its best translator (the identity included) with a smaller step size (see :class:`_BestPerState`).
"""

from __future__ import annotations

import itertools
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
from torch import Tensor

from ..errors import InputError, UnsupportedModelError
from ..models.load import LoadedModel
from ..models.trace import residual_states
from .lenses import TunedLens, decode, fingerprint


@dataclass
class TrainSettings:
    """Settings of :func:`train_tuned_lens` (all visible in the lens file's ``training`` record)."""

    tokens: int = 32_768  # token budget (sequences x seq_len, rounded up to whole batches); with max_minutes
    # the most tokens to use (0: no limit)
    max_minutes: float | None = None  # time budget: the token budget follows from the measured speed
    seq_len: int = 256
    batch_size: int = 4  # sequences per optimizer step
    optimizer: str = "adam"  # "adam" or "sgd" (Nesterov momentum, as in the paper)
    lr: float | None = None  # default: 2e-3 for adam, 1.0 for sgd
    momentum: float = 0.9
    weight_decay: float = 1e-3
    warmup_fraction: float = 0.1
    seed: int = 0
    bf16: bool | None = None  # None: bfloat16 where the CPU runs it natively or a measurement says it is faster
    checkpoint_every: int = 0  # steps; 0 = no checkpoints
    keep_best: bool = True  # per state, keep the translator with the lowest validation KL (identity included)
    backoff: float = 0.3  # keep_best: a state worse than its best goes back to it, its step size times this
    patience: int = 1  # keep_best: failed checks in a row before the step size shrinks (it always goes back);
    # 2 is better on average but worse at some late layers (docs/lenses.md, issue 11), so not the default
    validation_tokens: int = 512  # held out of the training sequences for keep_best
    validate_every: int = 0  # steps between validations; 0 = about 12 per run
    mid: bool = False  # also train translators for the mid-layer (after-attention) states

    def base_lr(self) -> float:
        if self.lr is not None:
            return self.lr
        return {"adam": 2e-3, "sgd": 1.0}[self.optimizer]

    def check(self) -> None:
        if self.optimizer not in ("adam", "sgd"):
            raise InputError(f"optimizer must be 'adam' or 'sgd', not {self.optimizer!r}")
        if self.patience < 1:
            raise InputError(f"patience must be >= 1, not {self.patience}")
        if not 0.0 < self.backoff <= 1.0:
            raise InputError(f"backoff must be in (0, 1], not {self.backoff}")
        if self.validation_tokens < 0 or self.validate_every < 0:
            raise InputError("validation_tokens and validate_every must be >= 0")
        if self.max_minutes is not None and not self.max_minutes > 0:
            raise InputError(f"max_minutes must be positive, not {self.max_minutes}")
        if self.tokens < (0 if self.max_minutes else 1) or self.seq_len < 2 or self.batch_size < 1:
            raise InputError("tokens, seq_len (>= 2) and batch_size must be positive (tokens may be 0, no limit, "
                             "with max_minutes)")


@dataclass
class TrainState:
    step: int = 0
    seconds: float = 0.0
    history: list = field(default_factory=list)  # [step, mean KL, seconds]
    n_steps: int = 0  # planned steps (fixed by the token budget, fitted to the time budget)
    warm: int = 0  # warm-up steps (0: warmup_fraction of n_steps)
    every: int = 0  # steps between validations
    precision: dict = field(default_factory=dict)  # the bfloat16 decision, kept on resume
    timing: dict = field(default_factory=dict)  # time budget: measured seconds per step, validation, checkpoint
    fits: list = field(default_factory=list)  # time budget: [step, planned steps, seconds per step] per (re)fit


def _settings_match(saved: dict, s: TrainSettings) -> dict:
    """Settings that differ between a checkpoint and now; a setting the checkpoint predates matches its default,
    and an automatic precision (``bf16=None``) matches whatever the checkpoint chose."""
    now = asdict(s)
    defaults = asdict(TrainSettings())
    return {k: (saved.get(k, defaults[k]), v) for k, v in now.items()
            if saved.get(k, defaults[k]) != v and not (k == "bf16" and v is None)}


def _optimizer(lens: TunedLens, s: TrainSettings):
    params = [p for pair in _groups(lens) for p in pair]
    if s.optimizer == "sgd":
        return torch.optim.SGD(params, lr=s.base_lr(), momentum=s.momentum, nesterov=True, weight_decay=s.weight_decay)
    return torch.optim.AdamW(params, lr=s.base_lr(), weight_decay=s.weight_decay)


def _warmup_steps(n_steps: int, s: TrainSettings) -> int:
    return max(1, round(s.warmup_fraction * n_steps))


def _lr_at(step: int, n_steps: int, s: TrainSettings, warm: int = 0) -> float:
    warm = warm or _warmup_steps(n_steps, s)
    if step < warm:
        return s.base_lr() * (step + 1) / warm
    return s.base_lr() * max(0.0, (n_steps - step) / max(1, n_steps - warm))


def cpu_features() -> dict:
    """The CPU's name (``lscpu``'s "Model name") and whether it has native bfloat16 (AVX512-BF16, AMX-BF16)."""
    import platform
    import subprocess

    name = platform.processor()
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False, timeout=10).stdout
        name = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), name)
    except (OSError, subprocess.SubprocessError):
        pass

    def probe(fn: str) -> bool:
        try:
            return bool(getattr(torch.cpu, fn)())
        except (AttributeError, RuntimeError):  # private torch API: absent in some versions
            return False

    return {"cpu": name, "avx512_bf16": probe("_is_avx512_bf16_supported"), "amx_bf16": probe("_is_amx_tile_supported")}


def _time_block(W: Tensor, x: Tensor, ref: Tensor, repeats: int = 2) -> float:
    """Seconds for one block of the training objective (forward and backward through the unembedding)."""
    best = float("inf")
    for _ in range(repeats):
        xx = x.clone().requires_grad_(True)
        t0 = time.perf_counter()
        _LogPartition.apply(xx, W, None, ref).sum().backward()
        best = min(best, time.perf_counter() - t0)
    return best


# Set to 1 or 0 to decide "the hardware runs bfloat16 natively" instead of asking the CPU, so that both branches
# of :func:`choose_precision` run (and are tested) on every machine; CI runs the lens tests with both.
NATIVE_BF16_ENV = "LENSCOPE_NATIVE_BF16"


def forced_native_bf16() -> bool | None:
    """``$LENSCOPE_NATIVE_BF16`` as a bool (``1``: native, ``0``: not), None when unset or empty."""
    import os

    v = os.environ.get(NATIVE_BF16_ENV, "").strip()
    if not v:
        return None
    if v not in ("0", "1"):
        raise InputError(
            f"{NATIVE_BF16_ENV} must be 1 (native bfloat16) or 0 (not), not {v!r}; unset it to ask the CPU")
    return v == "1"


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


def kl_to_final_terms(lm: LoadedModel, final_logits: Tensor, W: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Per-batch constants of the KL for final logits ``(tokens, vocab)``.

    With lens logits ``z = x W_U + b_U``: ``KL(p || softmax z) = c - x . pbar + lse(z)`` where
    ``c = sum p log p - p . b_U`` (tokens,) and ``pbar = p W_U^T`` (tokens, d_model). ``W``: the unembedding
    in the dtype to multiply in (default: float32).
    """
    U = lm.anatomy.unembed
    logp = torch.log_softmax(final_logits.float(), dim=-1)
    p = logp.exp()
    c = (p * logp).sum(-1)
    if U.b_U is not None:
        c = c - p @ U.b_U.float()
    if W is None or W.dtype == torch.float32:
        return c, p @ U.W_U.T.float()
    return c, (p.to(W.dtype) @ W.T).float()


class _LogPartition(torch.autograd.Function):
    """``lse(x @ W + b)`` per row, with ``W`` in the dtype to multiply in (bfloat16 is fast on CPUs with
    native support).

    One fused softmax pass gives the probabilities ``q`` (kept in ``W``'s dtype for the backward, where the
    gradient is ``q W^T``); the log-partition is read at one token, ``lse = z_k - log q_k``, which needs no
    second exponential pass. ``ref (rows,)`` names that token (training passes the final distribution's top
    token, which the lens's distribution rarely puts below float underflow); without it, or where ``q_k``
    underflowed, the most probable token is used (one more pass over the vocabulary). Gradients flow to ``x``
    only (the unembedding is frozen).
    """

    @staticmethod
    def forward(ctx, x: Tensor, W: Tensor, b: Tensor | None, ref: Tensor | None = None) -> Tensor:
        z = x.to(W.dtype) @ W
        if b is not None:
            z += b.to(z.dtype)
        q = torch.softmax(z, dim=-1)
        if ref is None:
            q_k, j = q.max(dim=-1)
            lse = z.gather(-1, j[:, None]).squeeze(-1).float() - q_k.float().log()
        else:
            k = ref[:, None]
            lse = z.gather(-1, k).squeeze(-1).float() - q.gather(-1, k).squeeze(-1).float().log()
            bad = ~torch.isfinite(lse)
            if bool(bad.any()):
                q_k, j = q[bad].max(dim=-1)
                lse[bad] = z[bad].gather(-1, j[:, None]).squeeze(-1).float() - q_k.float().log()
        ctx.save_for_backward(q, W)
        return lse

    @staticmethod
    def backward(ctx, g: Tensor):
        q, W = ctx.saved_tensors
        return (q @ W.T).float() * g[:, None], None, None, None


def lens_kl_loss(lm: LoadedModel, lens: TunedLens, states: Tensor, c: Tensor, pbar: Tensor, W: Tensor,
                 first_state: int = 0, ref: Tensor | None = None) -> Tensor:
    """Sum over states and tokens of :func:`lens_kl`."""
    return lens_kl(lm, lens, states, c, pbar, W, first_state, ref).sum()


def _groups(lens: TunedLens) -> list[tuple[Tensor, Tensor]]:
    """The translator parameters in training order: the regular states, then (if any) the mid-layer ones."""
    return [(lens.A, lens.b)] + ([(lens.A_mid, lens.b_mid)] if lens.A_mid is not None else [])


def _translators(lens: TunedLens, first: int, n: int) -> tuple[Tensor, Tensor]:
    """``A, b`` of training states ``first .. first + n - 1`` (``n_layers + l`` is layer ``l``'s mid state)."""
    L = lens.n_layers
    if first >= L:
        return lens.A_mid[first - L : first - L + n], lens.b_mid[first - L : first - L + n]
    if first + n > L:
        raise ValueError("a block of states may not span the regular and the mid-layer states")
    return lens.A[first : first + n], lens.b[first : first + n]


def lens_kl(lm: LoadedModel, lens: TunedLens, states: Tensor, c: Tensor, pbar: Tensor, W: Tensor,
            first_state: int = 0, ref: Tensor | None = None) -> Tensor:
    """KL(final || lens) per state and token, ``(state, tokens)``, for ``states (state, tokens, d_model)`` that
    start at state ``first_state`` (``n_layers + l``: layer ``l``'s mid-layer state); ``c, pbar`` from
    :func:`kl_to_final_terms` for the same tokens; ``W`` the unembedding in the dtype to multiply in (bfloat16
    for speed, float32 for exactness). ``ref (tokens,)``: the final distribution's top token, which makes the
    log-partition cheaper (training); without it the float32 path is ``torch.logsumexp``."""
    A = lm.anatomy
    n = states.shape[0]
    tA, tb = _translators(lens, first_state, n)
    x = states + torch.bmm(states, tA) + tb[:, None]
    if A.final_norm is not None:
        x = A.final_norm(x)
    x = A.unembed.transform(x)
    d = x.shape[-1]
    if W.dtype == torch.float32 and ref is None:
        z = x @ W
        if A.unembed.b_U is not None:
            z = z + A.unembed.b_U
        lse = torch.logsumexp(z, dim=-1)
    else:
        r = None if ref is None else ref.expand(n, -1).reshape(-1)
        lse = _LogPartition.apply(x.reshape(-1, d), W, A.unembed.b_U, r).reshape(x.shape[:-1])
    return c - (x * pbar).sum(-1) + lse


def chunks(n_states: int, n_tokens: int, vocab: int, budget_bytes: float = 1.5e9, split_at: int | None = None):
    """(state slice, token slice) pairs whose ``(states, tokens, vocab)`` logits fit the memory budget; no
    state slice crosses ``split_at`` (the boundary between regular and mid-layer states)."""
    per_row = vocab * 16  # bytes per (state, token) row: bf16 + fp32 logits, softmax and gradient buffers
    rows = max(1, int(budget_bytes // per_row))
    tok = min(n_tokens, rows)
    st = max(1, min(n_states, rows // tok))
    bounds = [0, n_states] if split_at is None or not 0 < split_at < n_states else [0, split_at, n_states]
    for g0, g1 in itertools.pairwise(bounds):
        for s0 in range(g0, g1, st):
            for t0 in range(0, n_tokens, tok):
                yield slice(s0, min(g1, s0 + st)), slice(t0, min(n_tokens, t0 + tok))


# Training works through blocks of about this many bytes of logits. Smaller, cache-sized blocks (200 MB) were
# tried in issue 11: faster for an isolated matmul + softmax, but slower for the whole step (more blocks, each
# with its own translator, norm and autograd graph), so the budget stays at 1.5 GB.
TRAIN_BLOCK_BYTES = 1.5e9


_W_CACHE: dict = {}


def _unembed_weight(lm: LoadedModel, bf16: bool) -> Tensor:
    """The unembedding as a contiguous matrix in the training dtype, converted once per model."""
    W_U = lm.anatomy.unembed.W_U
    if not bf16:
        return W_U
    key = (id(lm.anatomy), W_U.data_ptr())
    if key not in _W_CACHE:
        _W_CACHE.clear()
        _W_CACHE[key] = W_U.to(torch.bfloat16).contiguous()
    return _W_CACHE[key]


def kl_backward(lm: LoadedModel, lens: TunedLens, states: Tensor, final_logits: Tensor, bf16: bool = True,
                budget_bytes: float = TRAIN_BLOCK_BYTES) -> float:
    """Accumulate the gradient of the mean KL over ``states (state, tokens, d)``; returns the mean KL.

    ``states`` are the regular states ``0..`` and, for a lens with mid-layer translators, the ``n_layers``
    mid-layer states after them. Works block by block (states and tokens are independent), so memory stays
    bounded for any vocabulary.
    """
    W = _unembed_weight(lm, bf16)
    c, pbar = kl_to_final_terms(lm, final_logits)  # float32: a bfloat16 p W^T measured no faster (issue 11)
    ref = final_logits.argmax(-1)
    n_states, n_tokens = states.shape[:2]
    scale = 1.0 / (n_states * n_tokens)
    total = 0.0
    for ss, ts in chunks(n_states, n_tokens, lm.anatomy.vocab_size, budget_bytes, split_at=lens.n_layers):
        loss = lens_kl_loss(lm, lens, states[ss, ts], c[ts], pbar[ts], W, first_state=ss.start, ref=ref[ts]) * scale
        loss.backward()
        total += loss.item()
    return total


def _training_states(cap: dict, L: int, mid: bool) -> Tensor:
    """``(state, tokens, d)``: the regular states ``0..L-1``, then (``mid``) the ``L`` mid-layer states."""
    states = cap["states"][:L]
    if mid:
        states = torch.cat([states, cap["mid"]])
    return states.flatten(1, 2)


class _BestPerState:
    """Per-state model selection with step-size back-off, on sequences held out of the training text.

    The objective is a sum of independent per-state terms, so each state can be judged on its own. At every
    validation point a state whose KL improved keeps its new translator; a state that got worse goes back
    to its best translator (the identity, at step 0, counts), its momentum is cleared and, after
    ``patience`` failed checks in a row, its step size is multiplied by ``backoff``. Near-identity late
    translators, which one learning rate for all layers makes worse on some models (gemma3-270m), so find
    their own smaller step instead of ending wherever the last step left them; the early layers keep the
    full rate. States are numbered like :func:`lens_kl`'s (mid-layer states after the regular ones).
    """

    def __init__(self, lm: LoadedModel, lens: TunedLens, val: Tensor, bf16: bool, backoff: float, patience: int = 1):
        A = lm.anatomy
        self.lm, self.W, self.backoff, self.patience = lm, _unembed_weight(lm, bf16), backoff, patience
        self.mid = lens.has_mid_translators
        n = A.n_layers * (2 if self.mid else 1)
        self.fails = torch.zeros(n, dtype=torch.long)
        cap = residual_states(lm, val, mid=self.mid)
        self.states = _training_states(cap, A.n_layers, self.mid)
        self.c, self.pbar = kl_to_final_terms(lm, cap["logits"].flatten(0, 1))
        self.A, self.b = self._stack(lens)
        self.kl = torch.full((n,), float("inf"))
        self.step = torch.zeros(n, dtype=torch.long)
        self.identity_kl = torch.full((n,), float("nan"))
        self.lr_scale = torch.ones(n)

    @staticmethod
    def _stack(lens: TunedLens) -> tuple[Tensor, Tensor]:
        g = _groups(lens)
        return (torch.cat([a.detach() for a, _ in g]).clone(), torch.cat([b.detach() for _, b in g]).clone())

    @staticmethod
    def _write(lens: TunedLens, mask: Tensor, A: Tensor, b: Tensor) -> None:
        """Set the translators of the states in ``mask`` to ``A[mask], b[mask]``."""
        L = lens.n_layers
        with torch.no_grad():
            for gi, (pA, pb) in enumerate(_groups(lens)):
                m = mask[gi * L : (gi + 1) * L]
                pA[m] = A[gi * L : (gi + 1) * L][m]
                pb[m] = b[gi * L : (gi + 1) * L][m]

    def state_kl(self, lens) -> Tensor:
        n_states, n_tokens = self.states.shape[:2]
        kl = torch.zeros(n_states)
        with torch.no_grad():
            for ss, ts in chunks(n_states, n_tokens, self.lm.anatomy.vocab_size, split_at=self.lm.anatomy.n_layers):
                kl[ss] += lens_kl(self.lm, lens, self.states[ss, ts], self.c[ts], self.pbar[ts], self.W,
                                  first_state=ss.start).sum(1)
        return kl / n_tokens

    def update(self, lens: TunedLens, opt, step: int) -> None:
        kl = self.state_kl(lens)
        if step == 0:
            self.identity_kl = kl.clone()
        better = kl < self.kl
        self.kl = torch.where(better, kl, self.kl)
        self.step[better] = step
        self.fails[better] = 0
        now_A, now_b = self._stack(lens)
        with torch.no_grad():
            self.A[better] = now_A[better]
            self.b[better] = now_b[better]
            worse = ~better
            if step > 0 and bool(worse.any()):
                self._write(lens, worse, self.A, self.b)
                self.fails[worse] += 1
                shrink = worse & (self.fails >= self.patience)
                self.lr_scale[shrink] *= self.backoff
                self.fails[shrink] = 0
                L = lens.n_layers
                for gi, pair in enumerate(_groups(lens)):
                    w = worse[gi * L : (gi + 1) * L]
                    for p in pair:
                        for key in ("exp_avg", "momentum_buffer"):
                            buf = opt.state.get(p, {}).get(key)
                            if buf is not None:
                                buf[w] = 0.0

    def step_scaled(self, opt, lens: TunedLens) -> None:
        """``opt.step()`` with each state's change multiplied by its step-size factor."""
        if bool((self.lr_scale == 1.0).all()):
            opt.step()
            return
        groups = _groups(lens)
        before = [(a.detach().clone(), b.detach().clone()) for a, b in groups]
        opt.step()
        L = lens.n_layers
        with torch.no_grad():
            for gi, ((pA, pb), (A0, b0)) in enumerate(zip(groups, before)):
                f = self.lr_scale[gi * L : (gi + 1) * L]
                pA.sub_(A0).mul_(f[:, None, None]).add_(A0)
                pb.sub_(b0).mul_(f[:, None]).add_(b0)

    def tensors(self) -> dict:
        return {"best.A": self.A, "best.b": self.b, "best.kl": self.kl, "best.step": self.step,
                "best.identity_kl": self.identity_kl, "best.lr_scale": self.lr_scale, "best.fails": self.fails}

    def load(self, t: dict) -> None:
        self.A, self.b, self.kl, self.step = t["best.A"], t["best.b"], t["best.kl"], t["best.step"]
        self.identity_kl, self.lr_scale, self.fails = t["best.identity_kl"], t["best.lr_scale"], t["best.fails"]


def _flatten_optimizer(opt) -> tuple[dict, dict]:
    sd = opt.state_dict()
    tensors, meta = {}, {"param_groups": sd["param_groups"], "state_keys": {}}
    for pid, st in sd["state"].items():
        meta["state_keys"][str(pid)] = list(st)
        for k, v in st.items():
            tensors[f"opt.{pid}.{k}"] = v if isinstance(v, Tensor) else torch.tensor(v)
    return tensors, meta


def _unflatten_optimizer(opt, tensors: dict, meta: dict) -> None:
    state = {int(pid): {k: tensors[f"opt.{pid}.{k}"] for k in keys} for pid, keys in meta["state_keys"].items()}
    opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def save_checkpoint(path: Path, lens: TunedLens, opt, state: TrainState, settings: TrainSettings, fp: str,
                    best: _BestPerState | None = None) -> None:
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    tensors, meta = _flatten_optimizer(opt)
    tensors.update({"A": lens.A.detach().contiguous(), "b": lens.b.detach().contiguous()})
    if lens.has_mid_translators:
        tensors.update({"A_mid": lens.A_mid.detach().contiguous(), "b_mid": lens.b_mid.detach().contiguous()})
    if best is not None:
        tensors.update(best.tensors())
    tmp = path / "checkpoint.safetensors.tmp"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
    tmp.replace(path / "checkpoint.safetensors")
    (path / "checkpoint.json").write_text(json.dumps(
        {"state": asdict(state), "settings": asdict(settings), "fingerprint": fp, "optimizer": meta}))


def load_checkpoint(path: Path, lens: TunedLens, opt, settings: TrainSettings, fp: str,
                    best: _BestPerState | None = None) -> TrainState:
    from safetensors.torch import load_file

    try:
        info = json.loads((path / "checkpoint.json").read_text())
        tensors = load_file(str(path / "checkpoint.safetensors"))
    except (OSError, ValueError) as e:
        raise InputError(f"cannot resume: no readable checkpoint in {path} ({e})") from None
    if info["fingerprint"] != fp:
        raise InputError(f"cannot resume: the checkpoint in {path} was made for another model")
    diff = _settings_match(info["settings"], settings)
    if diff:
        raise InputError(f"cannot resume: settings differ from the checkpoint's (checkpoint, now): {diff}")
    with torch.no_grad():
        lens.A.copy_(tensors["A"])
        lens.b.copy_(tensors["b"])
        if lens.has_mid_translators:
            lens.A_mid.copy_(tensors["A_mid"])
            lens.b_mid.copy_(tensors["b_mid"])
    _unflatten_optimizer(opt, tensors, info["optimizer"])
    if best is not None:
        best.load(tensors)
    known = {f.name for f in fields(TrainState)}
    return TrainState(**{k: v for k, v in info["state"].items() if k in known})


# The time budget: steps timed before the number of steps is fixed (the first one, which also pays one-off
# costs, is left out of the estimate), and the margin kept free for what the estimate cannot see.
CALIBRATION_STEPS = 3
BUDGET_MARGIN = 0.02


def _fit_steps(done: int, seconds_left: float, step_s: float, *, val_s: float = 0.0, every: int = 0,
               ckpt_s: float = 0.0, ckpt_every: int = 0, n_checks: int = 12, cap: int | None = None) -> int:
    """How many steps in all fit the time left, at ``step_s`` seconds per step.

    The time left also pays for the validations still to come (``val_s`` each, every ``every`` steps, or
    ``n_checks`` in the whole run while ``every`` is not fixed yet, plus the final one) and the checkpoints
    (``ckpt_s`` each, every ``ckpt_every`` steps, plus the final save). At least ``done`` steps, at least one;
    at most ``cap``.
    """
    step_s = max(step_s, 1e-9)
    left = max(0.0, seconds_left - ckpt_s)  # the final save
    n_left = left / step_s
    for _ in range(4):  # the overheads depend on the number of steps: a few fixed-point iterations
        n_total = done + n_left
        ev = every or max(1, round(n_total / n_checks))
        vals = n_left / ev + 1
        ckpts = n_left / ckpt_every if ckpt_every else 0.0
        n_left = max(0.0, (left - vals * val_s - ckpts * ckpt_s) / step_s)
    n = max(done, 1, done + math.floor(n_left))
    return n if cap is None else max(done, 1, min(n, cap))


def train_tuned_lens(
    lm: LoadedModel,
    sequences: Tensor,
    settings: TrainSettings | None = None,
    *,
    out: str | Path | None = None,
    resume: bool = False,
    progress: bool = True,
    max_steps: int | None = None,
    clock: Callable[[], float] | None = None,
    started: float | None = None,
    log: Callable[[str], None] | None = None,
    dist=None,
) -> TunedLens:
    """Train a :class:`TunedLens` on token ``sequences (n_seq, seq_len)`` within ``settings.tokens`` or, with
    ``settings.max_minutes``, within a time budget.

    With ``out``, checkpoints go to ``out/checkpoint*`` every ``settings.checkpoint_every`` steps and the
    finished lens to ``out``; ``resume=True`` continues from the checkpoint to the same result as an
    uninterrupted run (a time-budgeted run keeps the number of steps it had planned when it was interrupted and
refits no more). ``max_steps`` stops
    early (after a checkpoint), to simulate an interruption.

    Time budget: the budget runs from ``started`` (a ``clock()`` reading; default: now), so a caller can count
    its own model loading. The first :data:`CALIBRATION_STEPS` steps are timed; the number of steps that fits
    what is left (validations and checkpoints included, :func:`_fit_steps`) fixes the warm-up and the linear
    decay of the learning rate, and is refitted after every step when the measured speed says the plan is
    more than 3% off. ``clock`` (default ``time.perf_counter``) is what the budget is measured with (tests
    inject a fake one). ``log`` receives one-line messages (the precision decision, the plan).

    ``dist``: a :class:`lenscope.distributed.ddp.Dist` (``ddp.from_env()`` under ``torchrun``): each rank runs the
    model and the loss on its share of every step's global batch, the gradients are averaged over all the
    tokens, every rank takes the same step; rank 0 alone writes checkpoints and the lens. The global batch
    (``batch_size`` sequences) does not depend on the number of ranks, so the lens is the single process's
    (up to float rounding) and a checkpoint resumes with any number of ranks.
    """
    from ..distributed import ddp

    d = dist or ddp.SINGLE
    from tqdm.auto import tqdm

    progress = progress and d.main
    clock = clock or time.perf_counter
    t_begin = clock()
    started = t_begin if started is None else started
    say = log or (lambda msg: None)
    s = settings or TrainSettings()
    s.check()
    A = lm.anatomy
    if A.unembed is None:
        decode(A, torch.zeros(1, A.d_model))  # raises the clear error
    if A.unembed.softcap is not None:
        raise UnsupportedModelError("tuned-lens training does not support final-logit soft-capping yet")
    sequences = torch.as_tensor(sequences, dtype=torch.long)
    if sequences.dim() != 2 or sequences.shape[0] == 0:
        raise InputError("sequences must be a non-empty (n_seq, seq_len) tensor of token ids")
    n_seq, S = sequences.shape
    best_val = None
    if s.keep_best and s.validation_tokens > 0:
        n_val = min(math.ceil(s.validation_tokens / S), n_seq // 5)  # never more than a fifth of the text
        if n_val > 0:
            sequences, best_val = sequences[:-n_val], sequences[-n_val:]
            n_seq = sequences.shape[0]
    per_step = s.batch_size * S
    budgeted = s.max_minutes is not None
    cap_steps = max(1, math.ceil(s.tokens / per_step)) if s.tokens else None
    deadline = started + 60.0 * s.max_minutes if budgeted else None
    g = torch.Generator().manual_seed(s.seed)
    order = torch.zeros(0, dtype=torch.long)

    def batch_ids(k: int) -> Tensor:
        nonlocal order
        while order.numel() < (k + 1) * s.batch_size:  # one permutation per epoch, drawn as needed
            order = torch.cat([order, torch.randperm(n_seq, generator=g)])
        return order[k * s.batch_size : (k + 1) * s.batch_size]

    fp = fingerprint(A)
    lens = TunedLens(A, model_name=lm.name, mid_translators=s.mid)
    opt = _optimizer(lens, s)
    state = TrainState()
    out = Path(out) if out is not None else None
    if resume:
        if out is None:
            raise InputError("resume needs the output directory of the interrupted run")
        # read the state first: the precision decision must be the interrupted run's
        try:
            saved_all = json.loads((out / "checkpoint.json").read_text())
        except (OSError, ValueError):
            saved_all = {}
        prec = saved_all.get("state", {}).get("precision")
        old_bf16 = saved_all.get("settings", {}).get("bf16")
        if not prec and s.bf16 is None and old_bf16 is not None:  # a checkpoint from before the automatic choice
            prec = {**choose_precision(lm, old_bf16), "reason": "kept from the interrupted run"}
        prec = prec or choose_precision(lm, s.bf16)
    else:
        prec = choose_precision(lm, s.bf16)
    prec = ddp.broadcast(prec, d)  # every rank computes in rank 0's precision
    bf16 = bool(prec["bf16"])
    say(f"unembedding matmuls in {prec['unembed_dtype']}: {prec['reason']}"
        + (f" ({prec['cpu']}; avx512_bf16={prec.get('avx512_bf16')}, amx_bf16={prec.get('amx_bf16')})"
           if "cpu" in prec else ""))
    best = _BestPerState(lm, lens, best_val, bf16, s.backoff, s.patience) if best_val is not None else None
    if resume:
        state = load_checkpoint(out, lens, opt, s, fp, best)
        if not budgeted:  # (a checkpoint from before issue 11 has no plan in its state)
            state.n_steps = cap_steps
            state.every = state.every or s.validate_every or max(1, round(cap_steps / 12))
    else:
        state.precision = prec
        if not budgeted:
            state.n_steps = cap_steps
            state.every = s.validate_every or max(1, round(cap_steps / 12))
        if best is not None:
            t0 = clock()
            best.update(lens, opt, 0)
            dt = clock() - t0
            state.seconds += dt
            state.timing["validation_s"] = round(dt, 4)
    if not state.n_steps:  # time budget, not calibrated yet: a provisional plan, replaced after the first step
        state.n_steps = cap_steps or 10**9
    calibrated = lambda: not budgeted or state.step >= CALIBRATION_STEPS or state.n_steps <= state.step

    def fit(step_s: float, done: int, now: float) -> int:
        t = state.timing
        return _fit_steps(done, deadline - now - BUDGET_MARGIN * 60.0 * s.max_minutes, step_s,
                          val_s=t.get("validation_s", 0.0) if best is not None else 0.0, every=state.every,
                          ckpt_s=t.get("checkpoint_s", 0.0), ckpt_every=s.checkpoint_every if out is not None else 0,
                          cap=cap_steps)

    step_times: list[float] = list(state.timing.get("step_s", []))
    bar = tqdm(total=state.n_steps if state.n_steps < 10**9 else None, initial=state.step,
               desc=f"tuned lens {lm.name}", unit="step", disable=not progress)
    stop_at = None if max_steps is None else state.step + max_steps
    while state.step < state.n_steps and (stop_at is None or state.step < stop_at):
        t0 = clock()
        k = state.step
        ids = batch_ids(k)
        ids = ids[ddp.shard(len(ids), d)]  # this rank's share of the global batch (all of it in one process)
        opt.zero_grad(set_to_none=True)
        if len(ids):
            cap = residual_states(lm, sequences[ids], mid=s.mid)
            states = _training_states(cap, A.n_layers, s.mid)  # (state, tokens, d): the output state needs no lens
            loss = kl_backward(lm, lens, states, cap["logits"].flatten(0, 1), bf16=bf16)
        else:
            loss = 0.0
        if d.active:  # the mean over every rank's tokens, of the loss and of its gradient
            ddp.average_gradients(lens.parameters(), len(ids) * S, d)
            loss = float(ddp.all_sum(loss * len(ids), d)) / max(1, s.batch_size)
        if budgeted and k == 0 and not calibrated():
            # a provisional plan from the first step (it also pays one-off costs, so it errs on the short side)
            state.n_steps = fit(clock() - t0, 0, clock())
            state.fits.append([0, state.n_steps, round(clock() - t0, 4)])
        for group in opt.param_groups:
            group["lr"] = _lr_at(k, state.n_steps, s, state.warm)
        if best is not None:
            best.step_scaled(opt, lens)
        else:
            opt.step()
        state.step += 1
        t1 = clock()
        step_times.append(t1 - t0)
        if budgeted:
            if state.step == CALIBRATION_STEPS or (state.step < CALIBRATION_STEPS and state.step >= state.n_steps):
                step_s = sum(step_times[1:]) / max(1, len(step_times) - 1) if len(step_times) > 1 else step_times[0]
                state.every = s.validate_every or 0
                n = fit(step_s, state.step, t1)
                state.every = s.validate_every or max(1, round(n / 12))
                state.n_steps = fit(step_s, state.step, t1)
                state.warm = _warmup_steps(state.n_steps, s)
                state.fits.append([state.step, state.n_steps, round(step_s, 4)])
                say(f"time budget {s.max_minutes:g} min: {step_s:.1f} s per step of {per_step} tokens -> "
                    f"{state.n_steps} steps ({state.n_steps * per_step} tokens), warm-up {state.warm}, "
                    f"validation every {state.every}")
            elif state.step > CALIBRATION_STEPS and state.step < state.n_steps and not resume:
                # (a resumed run keeps the plan it was interrupted with, so that it ends where the straight run would)
                recent = step_times[-5:]
                step_s = sum(recent) / len(recent)
                n = fit(step_s, state.step, t1)
                if abs(n - state.n_steps) > 0.03 * state.n_steps:
                    state.n_steps = max(n, state.step)
                    state.fits.append([state.step, state.n_steps, round(step_s, 4)])
            # rank 0's clock decides the plan, so that every rank takes the same number of steps
            state.n_steps, state.every, state.warm = ddp.broadcast((state.n_steps, state.every, state.warm), d)
            bar.total = state.n_steps
            bar.refresh()
        if best is not None and calibrated() and (state.step % state.every == 0 or state.step == state.n_steps):
            tv = clock()
            best.update(lens, opt, state.step)
            state.timing["validation_s"] = round(clock() - tv, 4)
        state.seconds += clock() - t0
        state.timing["step_s"] = [round(x, 4) for x in step_times]
        state.history.append([state.step, loss, round(state.seconds, 3)])
        bar.update(1)
        bar.set_postfix(kl=f"{loss:.3f}", tok_s=f"{state.step * per_step / max(state.seconds, 1e-9):.0f}")
        if out is not None and d.main and s.checkpoint_every and (
                state.step % s.checkpoint_every == 0 or state.step == stop_at) and state.step < state.n_steps:
            tc = clock()
            save_checkpoint(out, lens, opt, state, s, fp, best)
            dt = clock() - tc
            state.timing["checkpoint_s"] = round(dt, 4)
            state.seconds += dt
    bar.close()
    n_steps = state.n_steps
    selection = {}
    if best is not None and state.step >= n_steps:
        with torch.no_grad():
            _BestPerState._write(lens, torch.ones_like(best.kl, dtype=torch.bool), best.A, best.b)
        L = A.n_layers
        sel = lambda t: [round(float(x), 6) for x in t]
        selection = {"validation_tokens": int(best.states.shape[1]), "validate_every": state.every,
                     "selected_step": best.step[:L].tolist(),
                     "validation_kl": [round(x, 4) for x in best.kl[:L].tolist()],
                     "validation_kl_identity": [round(x, 4) for x in best.identity_kl[:L].tolist()],
                     "step_size_factor": sel(best.lr_scale[:L])}
        if lens.has_mid_translators:
            selection["mid"] = {"selected_step": best.step[L:].tolist(),
                                "validation_kl": [round(x, 4) for x in best.kl[L:].tolist()],
                                "validation_kl_identity": [round(x, 4) for x in best.identity_kl[L:].tolist()],
                                "step_size_factor": sel(best.lr_scale[L:])}
    budget = {}
    if budgeted:
        budget = {"max_minutes": s.max_minutes, "token_cap": s.tokens or None,
                  "wall_s": round(clock() - started, 2), "fits": state.fits,
                  "seconds_per_step": (round(sum(step_times[1:]) / max(1, len(step_times) - 1), 4)
                                       if len(step_times) > 1 else None),
                  "warmup_steps": state.warm}
    lens.training_info = {
        "settings": asdict(s), "steps": state.step, "n_steps": n_steps, "tokens_seen": state.step * per_step,
        "seconds": round(state.seconds, 2), "tokens_per_s": round(state.step * per_step / max(state.seconds, 1e-9), 2),
        "precision": state.precision or prec, "history": state.history, "complete": state.step >= n_steps,
        **({"selection": selection} if selection else {}), **({"time_budget": budget} if budget else {}),
    }
    if d.active:
        lens.training_info["ranks"] = d.world
    if out is not None and state.step >= n_steps and d.main:
        lens.save(out)
    ddp.barrier(d)  # the lens is on disk before any rank returns
    return lens


__all__ = ["NATIVE_BF16_ENV", "TrainSettings", "choose_precision", "cpu_features", "forced_native_bf16", "kl_backward",
           "train_tuned_lens"]
