"""Training a tuned lens: minimise KL(final || lens) over the tokens of a text corpus, model frozen.

Where the time goes: the model's forward pass is cheap next to decoding every layer's state through the
unembedding (``state x tokens x d_model x vocab`` multiply-adds, forwards and backwards). So:

- one frozen forward pass per batch yields every layer's state (hooks, no gradients);
- all translators run as one batched matmul;
- ``-sum_v p log q = lse(z) - p . z`` and ``p . z = x . (p W_U^T)``: the final distribution is folded into
  one ``(tokens, d_model)`` matrix per batch, so only the log-partition function needs the full vocabulary;
- the unembedding matmuls of training run in bfloat16 (AMX/AVX-512 on CPUs that have them), the loss
  and everything else in float32; evaluation is float32 throughout.

The recipe otherwise follows Belrose et al. (2023): identity initialisation, KL objective averaged over
layers and tokens, linear warm-up then linear decay. The default optimizer is Adam (our measurements in
``docs/lenses.md`` show it converges faster than SGD-Nesterov on the small budgets a CPU affords);
``optimizer="sgd"`` gives the paper's Nesterov SGD. Beyond the paper, ``keep_best`` judges every state's
translator on a few held-out sequences about twelve times per run: a state that got worse goes back to
its best translator (the identity included) with a smaller step size (see :class:`_BestPerState`).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
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

    tokens: int = 32_768  # token budget (sequences x seq_len, rounded up to whole batches)
    seq_len: int = 256
    batch_size: int = 4  # sequences per optimizer step
    optimizer: str = "adam"  # "adam" or "sgd" (Nesterov momentum, as in the paper)
    lr: float | None = None  # default: 2e-3 for adam, 1.0 for sgd
    momentum: float = 0.9
    weight_decay: float = 1e-3
    warmup_fraction: float = 0.1
    seed: int = 0
    bf16: bool = True
    checkpoint_every: int = 0  # steps; 0 = no checkpoints
    keep_best: bool = True  # per state, keep the translator with the lowest validation KL (identity included)
    backoff: float = 0.3  # keep_best: a state worse than its best goes back to it, its step size times this
    patience: int = 1  # keep_best: failed checks in a row before the step size shrinks (it always goes back)
    validation_tokens: int = 512  # held out of the training sequences for keep_best
    validate_every: int = 0  # steps between validations; 0 = about 12 per run

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
        if self.tokens < 1 or self.seq_len < 2 or self.batch_size < 1:
            raise InputError("tokens, seq_len (>= 2) and batch_size must be positive")


@dataclass
class TrainState:
    step: int = 0
    seconds: float = 0.0
    history: list = field(default_factory=list)  # [step, mean KL, seconds]


def _optimizer(lens: TunedLens, s: TrainSettings):
    params = [lens.A, lens.b]
    if s.optimizer == "sgd":
        return torch.optim.SGD(params, lr=s.base_lr(), momentum=s.momentum, nesterov=True, weight_decay=s.weight_decay)
    return torch.optim.AdamW(params, lr=s.base_lr(), weight_decay=s.weight_decay)


def _lr_at(step: int, n_steps: int, s: TrainSettings) -> float:
    warm = max(1, int(round(s.warmup_fraction * n_steps)))
    if step < warm:
        return s.base_lr() * (step + 1) / warm
    return s.base_lr() * max(0.0, (n_steps - step) / max(1, n_steps - warm))


def kl_to_final_terms(lm: LoadedModel, final_logits: Tensor) -> tuple[Tensor, Tensor]:
    """Per-batch constants of the KL for final logits ``(tokens, vocab)``.

    With lens logits ``z = x W_U + b_U``: ``KL(p || softmax z) = c - x . pbar + lse(z)`` where
    ``c = sum p log p - p . b_U`` (tokens,) and ``pbar = p W_U^T`` (tokens, d_model).
    """
    U = lm.anatomy.unembed
    logp = torch.log_softmax(final_logits.float(), dim=-1)
    p = logp.exp()
    c = (p * logp).sum(-1)
    if U.b_U is not None:
        c = c - p @ U.b_U.float()
    return c, p @ U.W_U.T.float()


class _LogPartition(torch.autograd.Function):
    """``lse(x @ W + b)`` per row with ``W`` in bfloat16, fast on CPUs.

    One fused softmax pass gives the probabilities ``q`` (kept in bfloat16 for the backward, where the
    gradient is ``q W^T``); the log-partition comes from the most probable token, ``lse = z_j - log q_j``,
    which needs no second exponential pass. Gradients flow to ``x`` only (the unembedding is frozen).
    """

    @staticmethod
    def forward(ctx, x: Tensor, W: Tensor, b: Tensor | None) -> Tensor:
        z = x.to(W.dtype) @ W
        if b is not None:
            z += b.to(z.dtype)
        q = torch.softmax(z, dim=-1)
        q_max, j = q.max(dim=-1)
        lse = z.gather(-1, j[:, None]).squeeze(-1).float() - q_max.float().log()
        ctx.save_for_backward(q, W)
        return lse

    @staticmethod
    def backward(ctx, g: Tensor):
        q, W = ctx.saved_tensors
        return (q @ W.T).float() * g[:, None], None, None


def lens_kl_loss(lm: LoadedModel, lens: TunedLens, states: Tensor, c: Tensor, pbar: Tensor, W: Tensor,
                 first_state: int = 0) -> Tensor:
    """Sum over states and tokens of :func:`lens_kl`."""
    return lens_kl(lm, lens, states, c, pbar, W, first_state).sum()


def lens_kl(lm: LoadedModel, lens: TunedLens, states: Tensor, c: Tensor, pbar: Tensor, W: Tensor,
            first_state: int = 0) -> Tensor:
    """KL(final || lens) per state and token, ``(state, tokens)``, for ``states (state, tokens, d_model)`` that
    start at state ``first_state``; ``c, pbar`` from :func:`kl_to_final_terms` for the same tokens; ``W`` the
    unembedding in the dtype to multiply in (bfloat16 for speed, float32 for exactness)."""
    A = lm.anatomy
    n = states.shape[0]
    x = states + torch.bmm(states, lens.A[first_state : first_state + n]) + lens.b[first_state : first_state + n, None]
    if A.final_norm is not None:
        x = A.final_norm(x)
    x = A.unembed.transform(x)
    d = x.shape[-1]
    if W.dtype == torch.float32:
        z = x @ W
        if A.unembed.b_U is not None:
            z = z + A.unembed.b_U
        lse = torch.logsumexp(z, dim=-1)
    else:
        lse = _LogPartition.apply(x.reshape(-1, d), W, A.unembed.b_U).reshape(x.shape[:-1])
    return c - (x * pbar).sum(-1) + lse


def chunks(n_states: int, n_tokens: int, vocab: int, budget_bytes: float = 1.5e9):
    """(state slice, token slice) pairs whose ``(states, tokens, vocab)`` logits fit the memory budget."""
    per_row = vocab * 16  # bytes per (state, token) row: bf16 + fp32 logits, softmax and gradient buffers
    rows = max(1, int(budget_bytes // per_row))
    tok = min(n_tokens, rows)
    st = max(1, min(n_states, rows // tok))
    for s0 in range(0, n_states, st):
        for t0 in range(0, n_tokens, tok):
            yield slice(s0, min(n_states, s0 + st)), slice(t0, min(n_tokens, t0 + tok))


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


def kl_backward(lm: LoadedModel, lens: TunedLens, states: Tensor, final_logits: Tensor, bf16: bool = True) -> float:
    """Accumulate the gradient of the mean KL over ``states (state, tokens, d)``; returns the mean KL.

    Works chunk by chunk (states and tokens are independent), so memory stays bounded for any vocabulary.
    """
    c, pbar = kl_to_final_terms(lm, final_logits)
    W = _unembed_weight(lm, bf16)
    n_states, n_tokens = states.shape[:2]
    scale = 1.0 / (n_states * n_tokens)
    total = 0.0
    for ss, ts in chunks(n_states, n_tokens, lm.anatomy.vocab_size):
        loss = lens_kl_loss(lm, lens, states[ss, ts], c[ts], pbar[ts], W, first_state=ss.start) * scale
        loss.backward()
        total += loss.item()
    return total


class _BestPerState:
    """Per-state model selection with step-size back-off, on sequences held out of the training text.

    The objective is a sum of independent per-state terms, so each state can be judged on its own. At every
    validation point a state whose KL improved keeps its new translator; a state that got worse goes back
    to its best translator (the identity, at step 0, counts), its momentum is cleared and its step size is
    multiplied by ``backoff``. Near-identity late translators, which one learning rate for all layers makes
    worse on some models (gemma3-270m), so find their own smaller step instead of ending wherever the last
    step left them; the early layers keep the full rate.
    """

    def __init__(self, lm: LoadedModel, lens: TunedLens, val: Tensor, bf16: bool, backoff: float, patience: int = 1):
        A = lm.anatomy
        self.lm, self.W, self.backoff, self.patience = lm, _unembed_weight(lm, bf16), backoff, patience
        self.fails = torch.zeros(A.n_layers, dtype=torch.long)
        cap = residual_states(lm, val)
        self.states = cap["states"][: A.n_layers].flatten(1, 2)
        self.c, self.pbar = kl_to_final_terms(lm, cap["logits"].flatten(0, 1))
        self.A, self.b = lens.A.detach().clone(), lens.b.detach().clone()
        self.kl = torch.full((A.n_layers,), float("inf"))
        self.step = torch.zeros(A.n_layers, dtype=torch.long)
        self.identity_kl = torch.full((A.n_layers,), float("nan"))
        self.lr_scale = torch.ones(A.n_layers)

    def state_kl(self, lens) -> Tensor:
        n_states, n_tokens = self.states.shape[:2]
        kl = torch.zeros(n_states)
        with torch.no_grad():
            for ss, ts in chunks(n_states, n_tokens, self.lm.anatomy.vocab_size):
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
        with torch.no_grad():
            self.A[better] = lens.A.detach()[better]
            self.b[better] = lens.b.detach()[better]
            worse = ~better
            if step > 0 and bool(worse.any()):
                lens.A[worse] = self.A[worse]
                lens.b[worse] = self.b[worse]
                self.fails[worse] += 1
                shrink = worse & (self.fails >= self.patience)
                self.lr_scale[shrink] *= self.backoff
                self.fails[shrink] = 0
                for p in (lens.A, lens.b):
                    for key in ("exp_avg", "momentum_buffer"):
                        buf = opt.state.get(p, {}).get(key)
                        if buf is not None:
                            buf[worse] = 0.0

    def step_scaled(self, opt, lens: TunedLens) -> None:
        """``opt.step()`` with each state's change multiplied by its step-size factor."""
        if bool((self.lr_scale == 1.0).all()):
            opt.step()
            return
        before = lens.A.detach().clone(), lens.b.detach().clone()
        opt.step()
        with torch.no_grad():
            lens.A.sub_(before[0]).mul_(self.lr_scale[:, None, None]).add_(before[0])
            lens.b.sub_(before[1]).mul_(self.lr_scale[:, None]).add_(before[1])

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
                    best: "_BestPerState | None" = None) -> None:
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    tensors, meta = _flatten_optimizer(opt)
    tensors.update({"A": lens.A.detach().contiguous(), "b": lens.b.detach().contiguous()})
    if best is not None:
        tensors.update(best.tensors())
    tmp = path / "checkpoint.safetensors.tmp"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
    tmp.replace(path / "checkpoint.safetensors")
    (path / "checkpoint.json").write_text(json.dumps(
        {"state": asdict(state), "settings": asdict(settings), "fingerprint": fp, "optimizer": meta}))


def load_checkpoint(path: Path, lens: TunedLens, opt, settings: TrainSettings, fp: str,
                    best: "_BestPerState | None" = None) -> TrainState:
    from safetensors.torch import load_file

    try:
        info = json.loads((path / "checkpoint.json").read_text())
        tensors = load_file(str(path / "checkpoint.safetensors"))
    except (OSError, ValueError) as e:
        raise InputError(f"cannot resume: no readable checkpoint in {path} ({e})") from None
    if info["fingerprint"] != fp:
        raise InputError(f"cannot resume: the checkpoint in {path} was made for another model")
    if info["settings"] != asdict(settings):
        diff = {k: (v, asdict(settings)[k]) for k, v in info["settings"].items() if asdict(settings).get(k) != v}
        raise InputError(f"cannot resume: settings differ from the checkpoint's (checkpoint, now): {diff}")
    with torch.no_grad():
        lens.A.copy_(tensors["A"])
        lens.b.copy_(tensors["b"])
    _unflatten_optimizer(opt, tensors, info["optimizer"])
    if best is not None:
        best.load(tensors)
    return TrainState(**info["state"])


def train_tuned_lens(
    lm: LoadedModel,
    sequences: Tensor,
    settings: TrainSettings | None = None,
    *,
    out: str | Path | None = None,
    resume: bool = False,
    progress: bool = True,
    max_steps: int | None = None,
) -> TunedLens:
    """Train a :class:`TunedLens` on token ``sequences (n_seq, seq_len)`` within ``settings.tokens``.

    With ``out``, checkpoints go to ``out/checkpoint*`` every ``settings.checkpoint_every`` steps and the
    finished lens to ``out``; ``resume=True`` continues from the checkpoint to the same result as an
    uninterrupted run. ``max_steps`` stops early (after a checkpoint), to simulate an interruption.
    """
    from tqdm.auto import tqdm

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
    n_steps = max(1, math.ceil(s.tokens / per_step))
    g = torch.Generator().manual_seed(s.seed)
    order = torch.cat([torch.randperm(n_seq, generator=g) for _ in range(math.ceil(n_steps * s.batch_size / n_seq))])

    fp = fingerprint(A)
    lens = TunedLens(A, model_name=lm.name)
    opt = _optimizer(lens, s)
    state = TrainState()
    best = _BestPerState(lm, lens, best_val, s.bf16, s.backoff, s.patience) if best_val is not None else None
    every = s.validate_every or max(1, round(n_steps / 12))
    out = Path(out) if out is not None else None
    if resume:
        if out is None:
            raise InputError("resume needs the output directory of the interrupted run")
        state = load_checkpoint(out, lens, opt, s, fp, best)
    elif best is not None:
        t0 = time.perf_counter()
        best.update(lens, opt, 0)
        state.seconds += time.perf_counter() - t0

    bar = tqdm(total=n_steps, initial=state.step, desc=f"tuned lens {lm.name}", unit="step", disable=not progress)
    stop_at = n_steps if max_steps is None else min(n_steps, state.step + max_steps)
    while state.step < stop_at:
        t0 = time.perf_counter()
        k = state.step
        batch = sequences[order[k * s.batch_size : (k + 1) * s.batch_size]]
        cap = residual_states(lm, batch)
        states = cap["states"][: A.n_layers].flatten(1, 2)  # (state, tokens, d): the output state needs no lens
        for group in opt.param_groups:
            group["lr"] = _lr_at(k, n_steps, s)
        opt.zero_grad(set_to_none=True)
        loss = kl_backward(lm, lens, states, cap["logits"].flatten(0, 1), bf16=s.bf16)
        if best is not None:
            best.step_scaled(opt, lens)
        else:
            opt.step()
        state.step += 1
        if best is not None and (state.step % every == 0 or state.step == n_steps):
            best.update(lens, opt, state.step)
        state.seconds += time.perf_counter() - t0
        state.history.append([state.step, loss, round(state.seconds, 3)])
        bar.update(1)
        bar.set_postfix(kl=f"{loss:.3f}", tok_s=f"{state.step * per_step / state.seconds:.0f}")
        if out is not None and s.checkpoint_every and (state.step % s.checkpoint_every == 0 or state.step == stop_at):
            save_checkpoint(out, lens, opt, state, s, fp, best)
    bar.close()
    selection = {}
    if best is not None and state.step >= n_steps:
        with torch.no_grad():
            lens.A.copy_(best.A)
            lens.b.copy_(best.b)
        selection = {"validation_tokens": int(best.states.shape[1]), "validate_every": every,
                     "selected_step": best.step.tolist(), "validation_kl": [round(x, 4) for x in best.kl.tolist()],
                     "validation_kl_identity": [round(x, 4) for x in best.identity_kl.tolist()],
                     "step_size_factor": [round(x, 6) for x in best.lr_scale.tolist()]}
    lens.training_info = {
        "settings": asdict(s), "steps": state.step, "n_steps": n_steps, "tokens_seen": state.step * per_step,
        "seconds": round(state.seconds, 2), "tokens_per_s": round(state.step * per_step / max(state.seconds, 1e-9), 2),
        "history": state.history, "complete": state.step >= n_steps, **({"selection": selection} if selection else {}),
    }
    if out is not None and state.step >= n_steps:
        lens.save(out)
    return lens


__all__ = ["TrainSettings", "kl_backward", "train_tuned_lens"]
