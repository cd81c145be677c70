"""Training sparse dictionaries (TopK, BatchTopK, JumpReLU; SAE, transcoder, skip transcoder) on a model's
activations streamed through the engine, or on a tensor file (:mod:`lenscope.features.dictionaries.sources`).

:func:`train_dictionaries` trains one or several dictionaries on the same rows (one forward pass of the model feeds
them all). Each kind's objective is in its own file (:mod:`lenscope.models.dictionaries.kinds`), which
:class:`Trainable` calls with itself: **TopK** (``topk.py``: the ``k`` largest pre-activations per token, loss
``|y - ŷ|²`` summed over dimensions and averaged over tokens, plus the auxiliary loss AuxK reviving dead latents,
``k_aux = min(width // 2, 512)``), **BatchTopK** (``batchtopk.py``: the ``k x n`` largest of a batch, its inference
threshold a moving average) and **JumpReLU** (``jumprelu.py``: learnt thresholds by the straight-through estimator,
``k`` the target L0 of a dual ascent). A latent is dead after ``dead_after`` training tokens without firing (default
200,000 tokens, below Gao's 10M which a CPU run of minutes never reaches; a latent of a width-4608, k-32 dictionary
fires once in 144 tokens on average).

All kinds: decoder rows unit-norm (the gradient's component along each row removed before the step, rows
renormalised after it); ``b_dec`` starts at the mean of the first block's targets. Normalisation: a fixed factor per
input (and output, transcoders) from the first block so the mean squared norm is ``d`` (SAELens's
``expected_average_only_in`` sets the mean norm to ``√d`` instead), folded into the weights at the end
(:meth:`~lenscope.models.dictionaries.dictionary.Dictionary.folded`). Adam (betas 0.9, 0.999), learning rate unless
given ``2e-4 ·
sqrt(16384 / width)`` for an SAE (Gao's scaling) and ``8e-3 · sqrt(4608 / width)`` for a transcoder (half the best of
a probe on smollm2's MLPs, ``benchmarks/bench_dict_transcoder_init.py --lrs``: SAE's rate learns 10 times too slowly
there), a linear warm-up over 5% of the run and a linear decay to 0 (the tuned-lens
:class:`~lenscope.training.plan.Planner`, which also fits a time budget to the measured speed).

The encoder matmul (and JumpReLU's decoder matmul) runs in the precision :func:`precision` gives (bfloat16 only
where the CPU runs it natively, as ``lens train`` decides; the rest in float32); one encoder matmul serves the
selection and the auxiliary loss. TopK and BatchTopK stay sparse after it: the decoding is a weighted sum of each
token's picked decoder rows (``embedding_bag``) and the gradients to the encoder and its input pass through the
picked pre-activations only (:meth:`Trainable.pick`), ``n·k·d`` work where dense latents cost ``n·width·d``.
Resumable to the same result (a checkpoint holds every parameter, the optimizer, the plan, the random generator and
where the current shuffle block started); data-parallel under ``torchrun`` (:mod:`lenscope.distributed.ddp`: the forward
passes and each batch sharded over ranks, gradients averaged).
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn

from ...distributed import ddp
from ...errors import InputError
from ...models.dictionaries import kinds as kinds
from ...models.dictionaries.dictionary import ROLES, Dictionary
from ...models.dictionaries.kinds.topk import AUX_COEF
from ...results import axis_size
from .sources import Target
from .train_memory import check_train_memory, train_memory

CHECKPOINT = "checkpoint"


SAE_LR, SAE_LR_WIDTH = 2e-4, 16384  # an SAE's default learning rate at width 16,384 (Gao's scaling)
TRANSCODER_LR, TRANSCODER_LR_WIDTH = 8e-3, 4608  # a transcoder's at width 4,608 (docs/features.md, "Transcoders")


@dataclass
class DictSettings:
    """Settings of :func:`train_dictionaries` (recorded in each dictionary's ``info``)."""

    kind: str = kinds.DEFAULT
    width: int = 1024
    k: int = 32  # TopK / BatchTopK: active latents per token; JumpReLU: the target L0
    role: str = "sae"
    tokens: int = 1_000_000  # token budget (0: none, with max_minutes)
    max_minutes: float | None = None
    batch_size: int = 4096  # tokens per optimizer step
    buffer: int = 65_536  # rows in the shuffle buffer (a block)
    lr: float | None = None
    seed: int = 0
    k_aux: int | None = None
    dead_after: int = 200_000  # tokens without firing after which a latent is dead
    warmup_fraction: float = 0.05
    checkpoint_every: int = 0  # steps; 0: only when stopped early
    bf16: bool | None = None

    def base_lr(self) -> float:
        if self.lr is not None:
            return self.lr
        if self.role != "sae":  # transcoders: see the module's docstring
            return TRANSCODER_LR * math.sqrt(TRANSCODER_LR_WIDTH / self.width)
        return SAE_LR * math.sqrt(SAE_LR_WIDTH / self.width)

    def check(self, d: int | None = None) -> None:
        kinds.get(self.kind)
        if self.role not in ROLES:
            raise InputError(f"unknown role {self.role!r}; roles: {', '.join(ROLES)}")
        if self.width < 1:
            raise InputError(f"width must be at least 1, not {self.width}")
        if not 0 < self.k < self.width:
            raise InputError(f"k must satisfy 0 < k < width ({self.width}); got k={self.k}")
        if self.batch_size < 1 or self.buffer < self.batch_size:
            raise InputError(f"batch_size must be >= 1 and buffer >= batch_size; got {self.batch_size}, "
                             f"{self.buffer}")
        if self.max_minutes is not None and not self.max_minutes > 0:
            raise InputError(f"max_minutes must be positive, not {self.max_minutes}")
        if self.tokens < (0 if self.max_minutes else 1):
            raise InputError("tokens must be positive (0, no limit, only with max_minutes)")
        if self.dead_after < 1:
            raise InputError("dead_after must be at least 1 token")


def precision(bf16: bool | None = None) -> dict:
    """The dtype of the encoder and decoder matmuls: bfloat16 where the CPU (or GPU) runs it natively, else float32
    (:mod:`lenscope.training.precision`'s detection; ``$LENSCOPE_NATIVE_BF16`` decides in its place)."""
    from ...training.precision import cpu_features, forced_native_bf16

    rec = cpu_features()
    native = forced_native_bf16()
    if native is None:
        native = rec["avx512_bf16"] or rec["amx_bf16"]
    rec["native_bf16"] = bool(native)
    use = bool(native) if bf16 is None else bool(bf16)
    rec.update({"matmul_dtype": "bfloat16" if use else "float32", "bf16": use,
                "reason": "set by the user" if bf16 is not None else
                ("the hardware runs bfloat16 natively" if native else "no native bfloat16")})
    return rec


class Trainable(nn.Module):
    """A :class:`Dictionary` as parameters, trained on normalised activations (see the module's docstring). Its
    kind (``spec``) adds its own parameters and computes its objective with the tools here (:meth:`mm`,
    :meth:`centre`, :meth:`pick`, :meth:`decode_rows`, :meth:`reduce`)."""

    def __init__(self, D: Dictionary, s: DictSettings):
        super().__init__()
        self.kind, self.role, self.k, self.s = D.kind, D.role, int(s.k), s
        self.spec = D.spec
        self.W_enc = nn.Parameter(D.W_enc.float().clone())
        self.b_enc = nn.Parameter(D.b_enc.float().clone())
        self.W_dec = nn.Parameter(D.W_dec.float().clone())
        self.b_dec = nn.Parameter(D.b_dec.float().clone())
        self.W_skip = nn.Parameter(D.W_skip.float().clone()) if D.W_skip is not None else None
        self.spec.setup(self, D)
        self.register_buffer("since_fired", torch.zeros(D.width, dtype=torch.long))
        self.k_aux = s.k_aux or min(D.width // 2, 512)
        self.mm_dtype = torch.float32

    width = axis_size("W_enc", 1)

    def centre(self, x: Tensor) -> Tensor:
        """The encoder's input: ``x - b_dec`` for an SAE, ``x`` for a transcoder."""
        return x - self.b_dec if self.role == "sae" else x

    def mm(self, a: Tensor, W: Tensor) -> Tensor:
        """``a @ W`` in the training's matmul precision (bfloat16 only where native), returned in float32."""
        if self.mm_dtype == torch.float32:
            return a @ W
        return (a.to(self.mm_dtype) @ W.to(self.mm_dtype)).float()

    def pick(self, xc: Tensor, pre: Tensor, rows: Tensor, cols: Tensor) -> Tensor:
        """The pre-activations ``pre[rows, cols]`` (computed without autograd), differentiable in the encoder and
        ``xc``: their gradient touches only those entries (:class:`_Picked`), not the dense ``(n, width)``."""
        return _Picked.apply(xc, self.W_enc, self.b_enc, rows, cols, pre[rows, cols])

    def decode_rows(self, rows: Tensor, cols: Tensor, vals: Tensor, n: int) -> Tensor:
        """``z @ W_dec`` for the sparse latents ``z`` (``vals`` at ``(rows, cols)``, 0 elsewhere) as a weighted
        sum of decoder rows: ``n·k·d`` work in place of ``n·width·d``, in both directions."""
        order = torch.argsort(rows, stable=True)
        offsets = torch.zeros(n, dtype=torch.long)
        offsets[1:] = torch.bincount(rows, minlength=n)[:-1].cumsum(0)
        return nn.functional.embedding_bag(cols[order], self.W_dec, offsets, mode="sum", per_sample_weights=vals[order])

    @staticmethod
    def reduce(x: Tensor, dist: ddp.Dist, op: str) -> Tensor:
        """``x`` reduced (``min``, ``max``) over ranks."""
        return _reduce(x, dist, op)

    def forward(self, x: Tensor, y: Tensor, n_global: int | None = None,
                dist: ddp.Dist = ddp.SINGLE) -> tuple[Tensor, dict]:
        """The loss of a batch (``x (n, d_in)``, ``y (n, d_out)``, normalised) and its statistics. Under
        ``torchrun`` the batch is this rank's share of ``n_global`` rows: what every rank must agree on (the
        latents that fired, BatchTopK's threshold, the L0 that steers JumpReLU's λ) is reduced over ranks."""
        n = x.shape[0]
        n_global = n if n_global is None else n_global
        xc = self.centre(x)
        stats: dict = {}
        pre, yhat, fired, extra = self.spec.train_forward(self, xc, n, dist, stats)
        if self.W_skip is not None:
            yhat = yhat + x @ self.W_skip.T
        err = y - yhat
        mse = err.pow(2).sum(-1).mean()
        dead = self.track(fired, stats, n, n_global, dist)
        loss = self.spec.penalty(self, mse, xc, pre, dead, err, extra)
        with torch.no_grad():
            var = (y - y.mean(0)).pow(2).sum()
            stats.update(mse=float(mse.detach()) / y.shape[1], explained_variance=float(1 - err.pow(2).sum() / var),
                         dead_fraction=float(dead.float().mean()), loss=float(loss.detach()))
        return loss, stats

    @torch.no_grad()
    def track(self, fired: Tensor, stats: dict, n: int, n_global: int, dist: ddp.Dist) -> Tensor:
        """The dead latents ``(width,)`` bool after a batch in which ``fired`` fired (reduced over ranks, with the
        batch's L0 in ``stats``)."""
        if dist.active:
            fired = _reduce(fired.to(torch.float32), dist, "max") > 0
            stats["l0"] = float(ddp.all_sum(stats["l0"] * n, dist)) / n_global
        self.since_fired += n_global
        self.since_fired[fired] = 0
        return self.since_fired >= self.s.dead_after

    def start(self, x: Tensor, y: Tensor) -> list:
        """From the first block's inputs ``x`` and targets ``y``: the fixed scales ``[scale_in, scale_out]``, ``b_dec``
        at the mean of the (normalised) targets, the kind's start (:meth:`Kind.first_block`)."""
        sin = _scale(x)
        sout = sin if self.role == "sae" else _scale(y)
        with torch.no_grad():
            self.b_dec.copy_((y.double().mean(0) * sout).float())
            self.spec.first_block(self, x, sin)
        return [sin, sout]

    def result(self, like: Dictionary, scale_in: float, scale_out: float) -> Dictionary:
        """The trained dictionary, its normalisation folded in."""
        return self.dictionary(like).folded(scale_in, None if like.role == "sae" else scale_out)

    def after_backward(self) -> None:
        """Remove the gradient's component along each decoder row (the unit-norm constraint's tangent)."""
        g, W = self.W_dec.grad, self.W_dec.detach()
        if g is not None:
            g.sub_((g * W).sum(-1, keepdim=True) * W)

    @torch.no_grad()
    def after_step(self, l0: float) -> None:
        self.W_dec.div_(self.W_dec.norm(dim=-1, keepdim=True).clamp_min(1e-12))
        self.spec.after_step(self, l0)

    def dictionary(self, like: Dictionary) -> Dictionary:
        """The trained weights as a :class:`Dictionary` (normalised: fold the scales afterwards)."""
        t = {n: getattr(self, n).detach().clone() for n in ("W_enc", "b_enc", "W_dec", "b_dec")}
        if self.W_skip is not None:
            t["W_skip"] = self.W_skip.detach().clone()
        self.spec.trained(self, t)
        return Dictionary(**t, kind=self.kind, role=self.role, k=self.k, site=like.site, model=like.model,
                          fingerprint=like.fingerprint, info=dict(like.info))


def _reduce(x: Tensor, d: ddp.Dist, op: str) -> Tensor:
    """``x`` reduced (``min``, ``max``) over ranks."""
    if not d.active:
        return x
    import torch.distributed as dist

    x = x.clone().float()
    dist.all_reduce(x, op={"min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[op])
    return x


class _Picked(torch.autograd.Function):
    """``(xc @ W_enc + b_enc)[rows, cols]``, its values given; backward: the gradients to ``xc``, ``W_enc`` and
    ``b_enc`` as products with the sparse ``(n, width)`` matrix of the picked entries' gradients (what autograd
    through a dense ``pre`` computes, with ``n·k·d`` work in place of ``n·width·d``)."""

    @staticmethod
    def forward(ctx, xc, W_enc, b_enc, rows, cols, vals):
        ctx.save_for_backward(xc, W_enc, rows, cols)
        return vals

    @staticmethod
    def backward(ctx, g):
        xc, W_enc, rows, cols = ctx.saved_tensors
        n, w = xc.shape[0], W_enc.shape[1]
        G = torch.sparse_coo_tensor(torch.stack([rows, cols]), g.to(xc.dtype), (n, w), check_invariants=False)
        g_x = torch.sparse.mm(G, W_enc.T) if ctx.needs_input_grad[0] else None
        g_W = torch.sparse.mm(G.t(), xc).T if ctx.needs_input_grad[1] else None
        g_b = torch.zeros(w, dtype=g.dtype).index_add_(0, cols, g) if ctx.needs_input_grad[2] else None
        return g_x, g_W, g_b, None, None, None


@dataclass
class RunState:
    """What a checkpoint restores besides the tensors: the plan, the block being read, the counters."""

    step: int = 0
    tokens: int = 0
    seconds: float = 0.0
    n_steps: int = 0
    every: int = 0
    warm: int = 0
    fits: list = field(default_factory=list)
    timing: dict = field(default_factory=dict)
    block_start: int = 0  # the source unit the current block starts at
    block_next: int = 0  # the unit after it
    block_batch: int = 0  # batches of the current block already trained on
    block_rows: int = 0  # the rows it was read with
    scales: list = field(default_factory=list)  # [scale_in, scale_out] per dictionary
    history: list = field(default_factory=list)  # [step, tokens, seconds, mean explained variance, mean L0]


def _scale(v: Tensor) -> float:
    """The factor making the mean squared norm of rows ``v`` equal ``d`` (SAELens's ``expected_average_only_in``
    makes the mean norm ``√d``)."""
    return float(math.sqrt(v.shape[-1] / v.double().pow(2).sum(-1).mean().clamp_min(1e-30)))


def train_dictionaries(source, targets: list[Target], s: DictSettings, *, out: str | Path | None = None,
                       resume: bool = False, progress: bool = True, max_steps: int | None = None,
                       dist: ddp.Dist = ddp.SINGLE, clock=time.perf_counter,
                       max_memory: int | str | None = None) -> list[Dictionary] | None:
    """Train one dictionary per target on the rows of ``source`` (see the module's docstring). Returns the
    trained dictionaries (the normalisation folded in, the record in ``info``), or None when stopped by
    ``max_steps`` (a checkpoint is then in ``out``). ``resume``: continue from ``out``'s checkpoint. ``max_memory``:
    the budget (:func:`lenscope.memory.budget`) :func:`train_memory` must meet, else a one-line InputError."""
    from ...training.plan import Planner, PlanSettings, TrainState, linear_lr

    s.check()
    started = clock()
    out = Path(out) if out is not None else None
    prec = precision(s.bf16)
    mm = torch.bfloat16 if prec["bf16"] else torch.float32
    gen = torch.Generator().manual_seed(s.seed)
    S = max(max(t.indices()) for t in targets) + 1
    check_train_memory(s, max_memory, d=source.d, sites=S, shapes=[t.shape(source.d, s) for t in targets])
    trainables = []
    for i, t in enumerate(targets):
        m = t.trainable(source.d, s, s.seed + i)
        m.mm_dtype = mm
        trainables.append(m)
    opts = [torch.optim.Adam(m.parameters(), lr=s.base_lr(), betas=(0.9, 0.999)) for m in trainables]
    st = RunState()
    ckpt = out / CHECKPOINT if out is not None else None
    if resume:
        if ckpt is None or not (ckpt / "state.json").exists():
            raise InputError(f"cannot resume: no checkpoint in {out}")
        st, gen_state = _load(ckpt, trainables, opts, s)
        gen.set_state(gen_state)
    ts = PlanSettings(tokens=s.tokens, max_minutes=s.max_minutes, seq_len=2, batch_size=s.batch_size,
                      warmup_fraction=s.warmup_fraction, checkpoint_every=s.checkpoint_every, lr=s.base_lr())
    tstate = TrainState(step=st.step, n_steps=st.n_steps, every=st.every or 1, warm=st.warm, fits=st.fits,
                        timing=st.timing)
    planner = Planner(ts, 1, started=started, clock=clock, validates=False, checkpoints=bool(s.checkpoint_every),
                      refit=not resume)
    planner.start(tstate)
    if not tstate.warm:
        from ...training.plan import warmup_steps
        tstate.warm = warmup_steps(tstate.n_steps, ts)
    log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if progress and dist.main else (lambda msg: None)
    log(f"dict train: {len(targets)} {s.kind} dictionar{'y' if len(targets) == 1 else 'ies'} of width {s.width}, "
        f"k {s.k}; shuffle buffer {s.buffer} rows x {S} sites x {source.d} = "
        f"{s.buffer * S * source.d * 4} bytes ({s.buffer * S * source.d * 4 / 2**20:.1f} MiB); matmuls in "
        f"{prec['matmul_dtype']} "
        f"({prec['reason']}); lr {s.base_lr():.3g}; {s.batch_size} tokens per step")
    step_times: list[float] = []
    rows = perm = block_gen = None
    read_share = 0.0
    stats_all: list[dict] = []
    while tstate.step < tstate.n_steps:
        t0 = clock()
        if rows is None or (st.block_batch + 1) * s.batch_size > len(rows):
            if rows is not None:  # the next block
                st.block_start, st.block_batch = st.block_next, 0
            block_gen = gen.get_state()
            if not (resume and st.block_rows and rows is None):  # (a resumed run re-reads its block as it was)
                # the last block holds only the rows the plan still needs
                st.block_rows = min(s.buffer, max(1, tstate.n_steps - tstate.step) * s.batch_size)
            rows, st.block_next = source.read(st.block_start, st.block_rows)
            if rows is None or len(rows) < s.batch_size:
                log("dict train: the text is used up")
                break
            if not st.scales:
                _normalisation(st, trainables, targets, rows)
            perm = torch.randperm(len(rows), generator=gen)
            # the planner sees each step's share of the block's reading (the forward passes), not its lumps
            read_share = (clock() - t0) / max(1, len(rows) // s.batch_size)
            t0 = clock()
        t0 -= read_share
        sel = perm[st.block_batch * s.batch_size:(st.block_batch + 1) * s.batch_size]
        batch = rows[sel[ddp.shard(len(sel), dist)]]
        lr = linear_lr(tstate.step, tstate.n_steps, tstate.warm, s.base_lr())
        step_stats = []
        for m, opt, t, (sin, sout) in zip(trainables, opts, targets, st.scales):
            x, y = _times(batch[:, t.i_in], sin), _times(batch[:, t.i_out], sout)
            for g in opt.param_groups:
                g["lr"] = lr
            opt.zero_grad(set_to_none=True)
            loss, stats = m(x, y, n_global=len(sel), dist=dist)
            loss.backward()
            ddp.average_gradients(m.parameters(), len(batch), dist)
            m.after_backward()
            opt.step()
            m.after_step(stats["l0"])
            step_stats.append(stats)
        planner.first_step(tstate, tstate.step, t0)
        st.block_batch += 1
        tstate.step += 1
        st.tokens += len(sel)
        t1 = clock()
        step_times.append(t1 - t0)
        msg = planner.after_step(tstate, step_times, t1)
        if msg:
            log(f"dict train: {msg}")
        stats_all = step_stats
        if tstate.step % max(1, tstate.n_steps // 20) == 0 or tstate.step == tstate.n_steps:
            mean = {k: sum(x[k] for x in step_stats) / len(step_stats) for k in step_stats[0]}
            el = st.seconds + clock() - started
            st.history.append([tstate.step, st.tokens, round(el, 2), round(mean["explained_variance"], 4),
                               round(mean["l0"], 2)])
            log(f"dict train: step {tstate.step}/{tstate.n_steps}, {st.tokens} tokens, "
                f"{st.tokens / max(el, 1e-9):.0f} tokens/s, mse {mean['mse']:.4g}, explained variance "
                f"{mean['explained_variance']:.4f}, L0 {mean['l0']:.1f}, dead {mean['dead_fraction']:.3f}")
        stop = max_steps is not None and tstate.step >= max_steps and tstate.step < tstate.n_steps
        periodic = s.checkpoint_every and tstate.step % s.checkpoint_every == 0 and tstate.step < tstate.n_steps
        if ckpt is not None and dist.main and (stop or periodic):
            _save(ckpt, trainables, opts, s, st, tstate, st.seconds + clock() - started, block_gen)
        if stop:
            return None
    seconds = st.seconds + clock() - started
    result = []
    for m, t, (sin, sout), stats in zip(trainables, targets, st.scales, stats_all or [{}] * len(targets)):
        D = m.result(t.like, sin, sout)
        D.info = {**t.like.info, "training": {
            "kind": s.kind, "role": s.role, "tokens": st.tokens, "steps": tstate.step,
            "seconds": round(seconds, 2), "machine": {"cpu": prec.get("cpu"), "threads": torch.get_num_threads()},
            "tokens_per_s": round(st.tokens / max(seconds, 1e-9), 1), "settings": asdict(s),
            "lr": s.base_lr(), "scale_in": sin, "scale_out": sout, "precision": prec,
            "final": {k: round(v, 6) for k, v in stats.items()}, "history": st.history,
            "time_budget": planner.record(tstate, step_times), "source": source.describe(),
            "ranks": dist.world}}
        result.append(D)
    return result


def _normalisation(st: RunState, ms: list[Trainable], targets: list[Target], rows: Tensor) -> None:
    """The fixed scales from the first block, and ``b_dec`` at the mean of its (normalised) targets."""
    for m, t in zip(ms, targets):
        st.scales.append(m.start(rows[:, t.i_in], rows[:, t.i_out]))


def _times(v: Tensor, scale) -> Tensor:
    """``v`` times its scale: a number, or one per site (``v (n, sites, d)``, a cross-layer transcoder's)."""
    return v * (torch.tensor(scale, dtype=v.dtype)[:, None] if isinstance(scale, list) else scale)


def _save(path: Path, ms: list[Trainable], opts, s: DictSettings, st: RunState, tstate, seconds: float,
          gen_state: Tensor) -> None:
    """The checkpoint: every parameter and buffer, the optimizers, the plan, the generator as the current block
    began (the block is re-read and re-shuffled on resume), the counters."""
    from ...training.checkpoint import flatten_optimizer, write_state

    tensors, metas = {"generator": gen_state.clone()}, []
    for i, (m, opt) in enumerate(zip(ms, opts)):
        tensors.update({f"d{i}.{n}": v.detach().clone() for n, v in m.state_dict().items()})
        ot, meta = flatten_optimizer(opt)
        tensors.update({f"d{i}.{k}": v for k, v in ot.items()})
        metas.append(meta)
    for name in ("step", "n_steps", "every", "warm", "fits", "timing"):
        setattr(st, name, getattr(tstate, name))
    st.seconds = seconds
    write_state(path, "state", tensors, {"state": asdict(st), "settings": asdict(s), "optimizers": metas})


def _load(path: Path, ms: list[Trainable], opts, s: DictSettings) -> tuple[RunState, Tensor]:
    from ...training.checkpoint import read_state, unflatten_optimizer

    info, tensors = read_state(path, "state")
    now = asdict(s)
    diff = {k: (v, now.get(k)) for k, v in info["settings"].items()
            if now.get(k) != v and k not in ("max_minutes", "checkpoint_every")}
    if diff:
        raise InputError(f"cannot resume: settings differ from the checkpoint's (checkpoint, now): {diff}")
    if len(info["optimizers"]) != len(ms):
        raise InputError(f"cannot resume: the checkpoint trains {len(info['optimizers'])} dictionaries, not {len(ms)}")
    for i, (m, opt) in enumerate(zip(ms, opts)):
        m.load_state_dict({n: tensors[f"d{i}.{n}"] for n in m.state_dict()})
        unflatten_optimizer(opt, {k.removeprefix(f"d{i}."): v for k, v in tensors.items()
                                   if k.startswith(f"d{i}.opt.")}, info["optimizers"][i])
    return RunState(**info["state"]), tensors["generator"]


def train(s: DictSettings, *, lm=None, sites: str | list[str] | None = None, data: str | Path | None = None,
          activations: str | Path | None = None, part: str = "train", seq_len: int | None = None,
          forward_batch: int = 8, out: str | Path | None = None, resume: bool = False, progress: bool = True,
          max_steps: int | None = None, dist: ddp.Dist = ddp.SINGLE, max_memory=None) -> list[Dictionary] | None:
    """Train ``s.role`` dictionaries at ``sites`` of ``lm`` on the ``part`` of the text ``data`` (streamed, one
    forward pass for all of them), or one on the ``activations`` file; saved into ``out`` when given (one folder,
    or a subfolder per site: :func:`~lenscope.models.dictionaries.dictionary.save_dictionaries`). Bad input, or an
    estimate over
    ``max_memory``: a one-line :class:`~lenscope.errors.InputError`."""
    from .sources import sources

    s.check()
    source, targets = sources(s.role, lm=lm, sites=sites, data=data, activations=activations, part=part,
                              seq_len=seq_len, forward_batch=forward_batch, dist=dist)
    dicts = train_dictionaries(source, targets, s, out=out, resume=resume, progress=progress, max_steps=max_steps,
                               dist=dist, max_memory=max_memory)
    if dicts is not None and out is not None and dist.main:
        import shutil

        from ...models.dictionaries.dictionary import save_dictionaries

        for D in dicts:
            D.info["training"]["forward_passes"] = source.forwards
        save_dictionaries(dicts, out)
        shutil.rmtree(Path(out) / CHECKPOINT, ignore_errors=True)
    return dicts


__all__ = ["AUX_COEF", "DictSettings", "Trainable", "precision", "train", "train_dictionaries", "train_memory"]
