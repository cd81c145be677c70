"""How well a direction steers, input by input, and what it costs.

For each held-out input (:class:`~lenscope.data.steering.SteeringInput`), the behaviour's measure is
``logit(answer_positive) - logit(answer_negative)`` at the text's last position; the **effect** at a multiplier
``alpha`` is the measure with ``alpha * vector`` added to ``resid_pre`` of the block at every position of the
input, minus the unsteered measure (so 0 at ``alpha = 0``, where no edit is made). From the effects:

- ``mean_effect`` per multiplier with a bootstrap interval over the inputs (``effect_ci``);
- per input, the **slope** of the effect against the multiplier (least squares) with an interval from a residual
  bootstrap of that line (wide where the response is far from a line); an input is *moved* when the line moves
  its measure by at least ``min_effect`` at the largest multiplier (``|slope| * max|alpha| >= min_effect``),
  *steerable* when moved with a positive slope, *anti-steerable* when moved with a negative slope (the wrong way,
  Tan et al. 2024), *unmoved* otherwise; the three fractions with bootstrap intervals over the inputs;
- **damage** on held-out text (the vector added at every position): the change in mean next-token loss and the
  mean KL(unsteered || steered) per position, per multiplier.

Every (input, layer, multiplier) setting is one row of a batch: inputs of one token length are stacked with
every setting of the sweep and run through the engine in chunks of at most ``max_tokens`` tokens (one forward pass
per chunk, not one per setting); the damage text's sequences likewise.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from ..data.steering import SteeringInput, data_hash
from ..errors import InputError
from ..models.loading.load import LoadedModel, require_decoder, token_str
from ..models.runtime.engine import run
from ..models.runtime.request import Request
from ..results import Result
from ..stats import UneditedNextToken, percentile_interval, resample
from .directions import Direction, add_edits, direction_dict, length_groups, text_ids

DEFAULT_MULTIPLIERS = (-8.0, -4.0, -2.0, 0.0, 2.0, 4.0, 8.0)
DAMAGE_FILE = "wikitext2/wiki.test.raw"  # under the shared data folder: held-out text (WikiText-2 test split)
DAMAGE_TOKENS = 2048
DAMAGE_SEQ_LEN = 128
LOGITS_BYTES = 256 * 2 ** 20  # full-vocabulary logits held at once by the damage pass
FRACTIONS = ("steerable", "anti_steerable", "unmoved")


# ---------------------------------------------------------------------------------------------- the result


def _f(x) -> float | None:
    x = float(x)
    return x if math.isfinite(x) else None


@dataclass(repr=False)
class SteeringEvaluation(Result):
    """A direction measured on held-out inputs (shapes with named axes; ``layer`` runs over ``layers``,
    ``mult`` over ``multipliers`` in the order given).

    - ``effects (layer, input, mult)``: the measure's change from the unsteered one (exactly 0 at multiplier 0);
      ``base_measure (input,)``: the unsteered measure ``logit(answer_positive) - logit(answer_negative)``;
    - ``slopes (layer, input)``, ``slope_ci (layer, input, 2)``: each input's least-squares slope and its
      residual-bootstrap interval;
    - ``effect_ci (layer, mult, 2)``: bootstrap interval (over the inputs) of the mean effect;
      ``mean_slope_ci (layer, 2)`` and ``fraction_ci (layer, 3, 2)`` (steerable, anti-steerable, unmoved) the same;
    - ``delta_loss``, ``kl (layer, mult)``: damage on held-out text (None when there was none; ``damage`` says
      why), ``damage``: its source, token count and the unsteered loss.

    ``settings``: ``bootstrap`` draws, ``seed``, ``confidence``, ``min_effect``, ``max_tokens``.
    """

    VIEW = "steering"  # its view: drawn by viz/views/steering/steering.js (lenscope.viz.views)

    model: str
    direction: dict
    layers: list[int]
    texts: list[str]
    answers: list[list[str]]
    rows: list[int]
    multipliers: Tensor
    base_measure: Tensor
    effects: Tensor
    slopes: Tensor
    slope_ci: Tensor
    effect_ci: Tensor
    mean_slope_ci: Tensor
    fraction_ci: Tensor
    delta_loss: Tensor | None = None
    kl: Tensor | None = None
    damage: dict = field(default_factory=dict)
    data_hash: str = ""
    settings: dict = field(default_factory=dict)
    seconds: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)

    # ------------------------------------------------------------------------------------------- views

    @property
    def n_inputs(self) -> int:
        return len(self.texts)

    @property
    def mean_effect(self) -> Tensor:
        """``(layer, mult)``: the mean effect over the inputs."""
        return self.effects.mean(1)

    def moved(self) -> Tensor:
        """``(layer, input)`` bool: the fitted line moves the measure by at least ``min_effect`` at the largest
        multiplier."""
        top = float(self.multipliers.abs().max())
        return self.slopes.abs() * top >= float(self.settings.get("min_effect", 0.1))

    def fractions(self) -> Tensor:
        """``(layer, 3)``: the fractions of inputs steerable, anti-steerable and unmoved."""
        return _fractions(self.slopes, self.moved()).mean(-2)

    def wrong_way(self) -> Tensor:
        """``(layer, mult)``: the fraction of inputs that the multiplier moves the wrong way (an effect of the
        opposite sign, at least ``min_effect`` large); 0 at multiplier 0. Where the response to the multiplier is
        not monotone, an input can be steerable by its slope and still move the wrong way at some multiplier."""
        sign = torch.sign(self.multipliers)[None, None]
        wrong = (self.effects * sign <= -float(self.settings.get("min_effect", 0.1))) & (sign != 0)
        return wrong.double().mean(1)

    def _index(self, layer: int) -> int:
        if layer not in self.layers:
            raise InputError(f"layer {layer} was not measured; this evaluation has layers {self.layers}")
        return self.layers.index(layer)

    def layer_dict(self, layer: int) -> dict:
        """The JSON record of one layer (see :meth:`to_dict`)."""
        k = self._index(layer)
        fr = self.fractions()[k]
        d = {"multipliers": [_f(a) for a in self.multipliers],
             "mean_effect": [_f(x) for x in self.mean_effect[k]],
             "effect_ci": [[_f(a), _f(b)] for a, b in self.effect_ci[k].tolist()],
             "steerable_fraction": _f(fr[0]), "anti_steerable_fraction": _f(fr[1]), "unmoved_fraction": _f(fr[2]),
             "fraction_ci": {name: [_f(a), _f(b)] for name, (a, b) in zip(FRACTIONS, self.fraction_ci[k].tolist())},
             "wrong_way_fraction": [_f(x) for x in self.wrong_way()[k]],
             "mean_slope": _f(self.slopes[k].mean()),
             "mean_slope_ci": [_f(x) for x in self.mean_slope_ci[k]],
             "delta_loss": None if self.delta_loss is None else [_f(x) for x in self.delta_loss[k]],
             "kl": None if self.kl is None else [_f(x) for x in self.kl[k]],
             "slopes": [_f(x) for x in self.slopes[k]],
             "slope_ci": [[_f(a), _f(b)] for a, b in self.slope_ci[k].tolist()],
             "effects": [[_f(x) for x in row] for row in self.effects[k].tolist()]}
        return d

    def to_dict(self) -> dict:
        """``{"model", "direction", "n_inputs", "multipliers", "layers": {"<L>": {multipliers, mean_effect,
        effect_ci, steerable_fraction, anti_steerable_fraction, unmoved_fraction, fraction_ci, wrong_way_fraction,
        mean_slope, mean_slope_ci, delta_loss, kl, slopes, slope_ci, effects}}, "inputs", "damage", "settings",
        "seconds", "notes"}`` (documented in docs/steering.md)."""
        return {
            "model": self.model, "direction": self.direction, "n_inputs": self.n_inputs, "data_hash": self.data_hash,
            "multipliers": [_f(a) for a in self.multipliers],
            "layers": {str(layer): self.layer_dict(layer) for layer in self.layers},
            "inputs": [{"row": r, "text": t, "answer_positive": a[0], "answer_negative": a[1],
                        "base_measure": _f(m)} for r, t, a, m in zip(self.rows, self.texts, self.answers,
                                                                      self.base_measure)],
            "damage": dict(self.damage), "settings": dict(self.settings),
            "seconds": {k: round(v, 4) for k, v in self.seconds.items()}, "notes": list(self.notes)}

    def to_frame(self):
        """One row per (layer, input, multiplier): ``layer, input, row, text, multiplier, effect, slope, moved``."""
        import pandas as pd

        moved = self.moved()
        recs = []
        for k, layer in enumerate(self.layers):
            for i, text in enumerate(self.texts):
                for j, a in enumerate(self.multipliers.tolist()):
                    recs.append((layer, i, self.rows[i], text, a, float(self.effects[k, i, j]),
                                 float(self.slopes[k, i]), bool(moved[k, i])))
        return pd.DataFrame(recs, columns=["layer", "input", "row", "text", "multiplier", "effect", "slope",
                                           "moved"])

    def plot(self, kind: str = "effect", ax=None):
        """``"effect"``: mean effect against the multiplier with its interval, per layer; ``"damage"``: the
        change in loss against the mean effect; ``"slopes"``: every input's slope, per layer."""
        from ..viz.steering_plots import plot_steering

        return plot_steering(self, kind, ax=ax)

    def to_html(self, path: str | Path | None = None) -> str:
        """A self-contained page of this evaluation (written to ``path`` when given)."""
        from ..viz.views.steering import steering_html

        return steering_html(self.to_dict(), path)

    def _repr_html_(self) -> str:
        """In a notebook: the report's steering view of this result, drawn by the report's own script
        (:func:`lenscope.viz.notebook.view`; ``lenscope.show(result)`` opens it in a browser)."""
        from ..viz.notebook import view

        return str(view(self))

    def __repr__(self) -> str:
        fr = self.fractions()
        best = int(self.mean_effect.abs().max(1).values.argmax()) if len(self.layers) else 0
        return (f"SteeringEvaluation({self.direction.get('method')} direction of {self.model}, {self.n_inputs} "
                f"inputs, layers {self.layers}, multipliers {[_f(a) for a in self.multipliers]}; layer "
                f"{self.layers[best]}: steerable {float(fr[best, 0]):.2f}, anti-steerable {float(fr[best, 1]):.2f})")


# ---------------------------------------------------------------------------------------------- statistics


def _fractions(slopes: Tensor, moved: Tensor) -> Tensor:
    """``(..., input, 3)`` indicators: steerable, anti-steerable, unmoved."""
    return torch.stack([moved & (slopes > 0), moved & (slopes < 0), ~moved], -1).double()


def fit_slopes(alphas: Tensor, effects: Tensor) -> Tensor:
    """Least-squares slopes of ``effects (..., mult)`` against ``alphas (mult,)``."""
    a = alphas.double() - alphas.double().mean()
    return (effects.double() * a).sum(-1) / (a * a).sum()


def bootstrap_stats(alphas: Tensor, effects: Tensor, slopes: Tensor, moved: Tensor, *, draws: int, seed: int,
                    confidence: float, chunk: int = 2 ** 22) -> dict[str, Tensor]:
    """Percentile bootstrap intervals: over the inputs for the mean effect, the mean slope and the three
    fractions; over each input's residuals from its line for its slope. ``effects (layer, input, mult)``. The
    draws are made in chunks of about ``chunk`` resampled values (memory stays bounded for many inputs)."""
    g = torch.Generator().manual_seed(int(seed))
    L, n, m = effects.shape
    idx = resample(n, draws, g)
    a = alphas.double()
    fit = effects.mean(-1, keepdim=True) + slopes[..., None] * (a - a.mean())
    res = effects - fit  # (layer, input, mult)
    ridx = resample(m, draws, g)
    ind = _fractions(slopes, moved)  # (layer, input, 3)
    step = max(1, chunk // max(1, L * n * m))
    mean_eff, mean_slope, frac, boot_slope = [], [], [], []
    for s in range(0, draws, step):
        i, r = idx[s: s + step], ridx[s: s + step]
        mean_eff.append(effects[:, i].mean(2).movedim(1, 0))  # (draw, layer, mult)
        mean_slope.append(slopes[:, i].mean(2).movedim(1, 0))  # (draw, layer)
        frac.append(ind[:, i].mean(2).movedim(1, 0))  # (draw, layer, 3)
        boot_slope.append(fit_slopes(a, fit[None] + res[..., r].movedim(2, 0)))  # (draw, layer, input)
    return {"effect_ci": percentile_interval(torch.cat(mean_eff), confidence),
            "mean_slope_ci": percentile_interval(torch.cat(mean_slope), confidence),
            "fraction_ci": percentile_interval(torch.cat(frac), confidence),
            "slope_ci": percentile_interval(torch.cat(boot_slope), confidence)}


# ---------------------------------------------------------------------------------------------- inputs


def resolve_inputs(lm: LoadedModel, inputs, source: str = "the inputs") -> tuple[list[SteeringInput], Tensor]:
    """The inputs as :class:`SteeringInput` (from tuples ``(text, answer_positive, answer_negative)`` too) and their
    answers' token ids ``(input, 2)``; a one-line :class:`InputError` naming ``source`` and the row where an answer
    is not one token or both answers are the same token."""
    items = [x if isinstance(x, SteeringInput) else SteeringInput(*x, row=i + 1) for i, x in enumerate(inputs)]
    if not items:
        raise InputError(f"{source} holds no inputs")
    ids = []
    for i, x in enumerate(items):
        row = x.row or i + 1
        pair = []
        for name, ans in (("answer_positive", x.answer_positive), ("answer_negative", x.answer_negative)):
            try:
                pair.append(Request.of(lm, ans).target)
            except InputError as e:
                raise InputError(f"{source}, row {row}: {name}: {e}") from None
        if pair[0] == pair[1]:
            raise InputError(f"{source}, row {row}: answer_positive and answer_negative are the same token "
                             f"(#{pair[0]}); the measure would be 0")
        ids.append(pair)
    return items, torch.tensor(ids, dtype=torch.long)


def _multipliers(multipliers) -> Tensor:
    try:
        a = torch.tensor([float(x) for x in multipliers], dtype=torch.float64)
    except (TypeError, ValueError):
        raise InputError(f"multipliers must be numbers, not {multipliers!r}") from None
    if not bool(torch.isfinite(a).all()):
        raise InputError("multipliers must be finite numbers")
    if len(set(a.tolist())) != len(a):
        raise InputError(f"a multiplier is repeated in {a.tolist()}; give each once")
    if len(a) < 2:
        raise InputError("give at least two multipliers (e.g. 0 and 4): a slope needs two points")
    return a


# ---------------------------------------------------------------------------------------------- the sweep


@torch.no_grad()
def sweep_measures(lm: LoadedModel, vector: Tensor, ids: list[Tensor], answers: Tensor, layers: list[int],
                   alphas: Tensor, *, max_tokens: int = 4096, progress=None) -> tuple[Tensor, Tensor]:
    """The measure of every input under every (layer, multiplier) setting: ``(base (input,), measure (layer,
    input, mult))``, NaN where the multiplier is 0 (no run: the effect there is 0 by definition).

    Inputs of one token length and every setting form the rows of one batch (the input repeated, each row with
    its own edit), run in chunks of at most ``max_tokens`` tokens with the last position's logits only."""
    L, M = len(layers), len(alphas)
    settings = [(-1, 0.0)] + [(k, float(a)) for k in range(L) for a in alphas.tolist() if a != 0]
    S = len(settings)
    set_layer = torch.tensor([layers[k] if k >= 0 else 0 for k, _ in settings])
    set_alpha = torch.tensor([a for _, a in settings], dtype=torch.float64)
    col = {a: j for j, a in enumerate(alphas.tolist())}
    set_k = torch.tensor([k for k, _ in settings])  # -1: the unsteered row
    set_j = torch.tensor([col.get(a, 0) for _, a in settings])
    base = torch.empty(len(ids), dtype=torch.float64)
    measure = torch.full((L, len(ids), M), float("nan"), dtype=torch.float64)
    total, done = len(ids) * S, 0
    vec = vector.to(torch.float32)
    for P, idx in length_groups(ids).items():
        x_all = torch.stack([ids[i] for i in idx])
        idx = torch.tensor(idx)
        n_rows = len(idx) * S
        r_input = torch.arange(len(idx)).repeat_interleave(S)  # rows: every setting of an input together
        r_set = torch.arange(S).repeat(len(idx))
        step = max(1, max_tokens // P)
        for a in range(0, n_rows, step):
            ri, rs = r_input[a: a + step], r_set[a: a + step]
            edits = add_edits(vec, torch.arange(len(ri)), set_layer[rs], set_alpha[rs], torch.arange(P))
            lg = run(lm, x_all[ri], edits, last_only=True).logits[:, -1].double().cpu()
            i = idx[ri]
            m = lg.gather(1, answers[i, :1])[:, 0] - lg.gather(1, answers[i, 1:])[:, 0]
            b = set_k[rs] < 0
            base[i[b]] = m[b]
            measure[set_k[rs][~b], i[~b], set_j[rs][~b]] = m[~b]
            done += len(ri)
            if progress is not None:
                progress("inputs", done, total)
    return base, measure


# ---------------------------------------------------------------------------------------------- damage


def damage_sequences(lm: LoadedModel, damage, tokens: int, seq_len: int) -> tuple[Tensor | None, dict]:
    """Held-out token sequences ``(seq, seq_len)`` for the damage measure and a record of where they came from:
    ``damage="default"`` reads the start of the shared data's WikiText-2 test split (absent: None and a note),
    a path reads that text file, None measures no damage (a note says so)."""
    from ..data.shared import read_text, shared_file
    from ..data.text import token_sequences

    if damage is None or damage is False:
        return None, {"data": None, "note": "no damage text asked for (damage=None / --no-damage)"}
    if isinstance(damage, str) and damage == "default":
        path = shared_file(DAMAGE_FILE)
        if path is None:
            return None, {"data": None, "note": f"no held-out text: {DAMAGE_FILE} is not under the shared data folder "
                          "(set LENSCOPE_DATA, or give --damage-data FILE); delta_loss and kl are null"}
        label = DAMAGE_FILE
    else:
        path = Path(damage)
        label = str(damage)
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 2:
        raise InputError(f"damage tokens must be an integer of at least 2, not {tokens!r}")
    seq_len = max(2, min(int(seq_len), int(tokens), lm.anatomy.n_ctx))
    text = read_text(Path(path), "give a plain text file")
    if not text.strip():
        raise InputError(f"{label} is empty; give held-out text for the damage measure")
    seqs = token_sequences(lm, text[: 40 * tokens + 10_000], seq_len, max_tokens=tokens)  # ample characters
    return seqs, {"data": label, "tokens": int(seqs.numel()), "sequences": int(seqs.shape[0]), "seq_len": seq_len}


@torch.no_grad()
def damage(lm: LoadedModel, vector: Tensor, seqs: Tensor, layers: list[int], alphas: Tensor, *,
           max_tokens: int = 4096, progress=None) -> tuple[Tensor, Tensor, float]:
    """``(delta_loss (layer, mult), kl (layer, mult), base_loss)`` on ``seqs (seq, pos)`` with ``alpha * vector``
    added to ``resid_pre`` of the layer at every position: the change in mean next-token loss and the mean
    KL(unsteered || steered) over every position; exactly 0 at multiplier 0 (no run). Each sequence's unsteered
    distribution is computed once and compared with every setting's (rows of one batch, chunked so that at most
    :data:`LOGITS_BYTES` of logits are held; the loss and KL: :class:`lenscope.stats.UneditedNextToken`, which holds
    one tensor of the steered logits' size besides them)."""
    L, M = len(layers), len(alphas)
    N, T = seqs.shape
    V = lm.anatomy.vocab_size
    settings = [(k, j) for k in range(L) for j in range(M) if alphas[j] != 0]
    loss_sum = torch.zeros(L, M, dtype=torch.float64)
    kl_sum = torch.zeros(L, M, dtype=torch.float64)
    base_sum = 0.0
    rows_per = max(1, min(max_tokens // T, LOGITS_BYTES // (4 * T * V)))
    vec = vector.to(torch.float32)
    total, done = N * (len(settings) + 1), 0
    for s in range(N):
        x = seqs[s: s + 1]
        tgt = x[0, 1:]
        ref = UneditedNextToken(run(lm, x).logits[0])  # (pos, vocab)
        base_sum += float(ref.nll(tgt).sum())
        done += 1
        for a in range(0, len(settings), rows_per):
            chunk = settings[a: a + rows_per]
            lay = torch.tensor([layers[k] for k, _ in chunk])
            al = torch.stack([alphas[j] for _, j in chunk])
            edits = add_edits(vec, torch.arange(len(chunk)), lay, al, torch.arange(T))
            z = run(lm, x.expand(len(chunk), -1), edits).logits  # (row, pos, vocab)
            nll, kl, _ = ref.compare(z, tgt)
            kj = (torch.tensor([k for k, _ in chunk]), torch.tensor([j for _, j in chunk]))
            loss_sum.index_put_(kj, nll.sum(1), accumulate=True)
            kl_sum.index_put_(kj, kl.sum(1), accumulate=True)
            del z
            done += len(chunk)
            if progress is not None:
                progress("damage", done, total)
    n_pred, n_pos = N * (T - 1), N * T
    base_loss = base_sum / n_pred
    delta = torch.where(alphas[None] != 0, loss_sum / n_pred - base_loss, torch.zeros(L, M, dtype=torch.float64))
    kl = torch.where(alphas[None] != 0, (kl_sum / n_pos).clamp_min(0), torch.zeros(L, M, dtype=torch.float64))
    return delta, kl, base_loss


# ---------------------------------------------------------------------------------------------- the entry point


def evaluate_steering(lm: LoadedModel, direction: Direction, inputs, multipliers=DEFAULT_MULTIPLIERS, layers=None,
                      *, damage_data="default", damage_tokens: int = DAMAGE_TOKENS,
                      damage_seq_len: int = DAMAGE_SEQ_LEN, bootstrap: int = 1000, seed: int = 0,
                      confidence: float = 0.95, min_effect: float = 0.1, max_tokens: int = 4096,
                      source: str = "the inputs", progress=None) -> SteeringEvaluation:
    """Measure ``direction`` on held-out ``inputs`` (:class:`~lenscope.data.steering.SteeringInput` or
    ``(text, answer_positive, answer_negative)`` tuples) at every multiplier and layer (default: the direction's
    own; other blocks of the same model are allowed) and the damage on held-out text (``damage_data``:
    ``"default"`` = the start of WikiText-2's test split from the shared data, a text file's path, or None;
    ``damage_tokens`` tokens in sequences of ``damage_seq_len``). ``bootstrap`` draws (seeded by ``seed``) give the
    ``confidence`` intervals; ``min_effect`` (logits) is how far the fitted line must move an input's measure at
    the largest multiplier to count as moved. ``max_tokens``: tokens per forward pass (rows x positions).
    ``source`` names the inputs in errors; ``progress(stage, done, total)`` follows the passes."""
    t0 = time.perf_counter()
    require_decoder(lm, "steering", causal=True, instead="steer a causal decoder such as smollm2")
    layers = direction.check(lm, layers)
    alphas = _multipliers(multipliers)
    for name, v in (("bootstrap", bootstrap), ("max_tokens", max_tokens)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise InputError(f"{name} must be a positive integer, not {v!r}")
    if not 0 < confidence < 1:
        raise InputError(f"confidence must lie between 0 and 1, not {confidence!r}")
    if not min_effect >= 0:
        raise InputError(f"min_effect must be at least 0, not {min_effect!r}")
    items, answers = resolve_inputs(lm, inputs, source)
    rows = [x.row or i + 1 for i, x in enumerate(items)]
    ids = text_ids(lm, [x.text for x in items], rows, source)
    seqs, dmg = damage_sequences(lm, damage_data, damage_tokens, damage_seq_len)
    seconds = {}

    t = time.perf_counter()
    base, measure = sweep_measures(lm, direction.vector, ids, answers, layers, alphas, max_tokens=max_tokens,
                                   progress=progress)
    effects = torch.where(alphas != 0, measure - base[None, :, None], torch.zeros_like(measure))
    seconds["sweep"] = time.perf_counter() - t

    t = time.perf_counter()
    slopes = fit_slopes(alphas, effects)
    moved = slopes.abs() * float(alphas.abs().max()) >= float(min_effect)
    boot = bootstrap_stats(alphas, effects, slopes, moved, draws=bootstrap, seed=seed, confidence=confidence)
    seconds["bootstrap"] = time.perf_counter() - t

    delta_loss = kl = None
    if seqs is not None:
        t = time.perf_counter()
        delta_loss, kl, base_loss = damage(lm, direction.vector, seqs, layers, alphas, max_tokens=max_tokens,
                                           progress=progress)
        dmg["base_loss"] = base_loss
        seconds["damage"] = time.perf_counter() - t
    seconds["total"] = time.perf_counter() - t0
    notes = []
    if seqs is None:
        notes.append(dmg["note"])
    return SteeringEvaluation(
        model=lm.name, direction=direction_dict(direction), layers=layers, texts=[x.text for x in items],
        answers=[[token_str(lm, int(a)), token_str(lm, int(b))] for a, b in answers.tolist()], rows=rows,
        multipliers=alphas, base_measure=base, effects=effects, slopes=slopes, slope_ci=boot["slope_ci"],
        effect_ci=boot["effect_ci"], mean_slope_ci=boot["mean_slope_ci"], fraction_ci=boot["fraction_ci"],
        delta_loss=delta_loss, kl=kl, damage=dmg, data_hash=data_hash(items),
        settings={"bootstrap": bootstrap, "seed": seed, "confidence": confidence, "min_effect": min_effect,
                  "max_tokens": max_tokens, "positions": "all", "measure": "logit(answer_positive) - "
                  "logit(answer_negative) at the last position"},
        seconds=seconds, notes=notes)


__all__ = ["DEFAULT_MULTIPLIERS", "SteeringEvaluation", "bootstrap_stats", "damage", "damage_sequences",
           "evaluate_steering", "fit_slopes", "resolve_inputs", "sweep_measures"]
