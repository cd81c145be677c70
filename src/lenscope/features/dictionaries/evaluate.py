"""Evaluation of sparse dictionaries on held-out text, beside baselines (``lenscope dict eval``).

Every number is measured on the held-out part of the text (:func:`lenscope.data.corpus.token_batches` with
``part="heldout"``, which no dictionary trains on), the positions of the tokenizer's special tokens (BOS) left out.
Per dictionary ``D`` at its site, with ``y`` what the site holds (an SAE's site; a transcoder's ``mlp_out``) and
``ŷ = D(x)`` (``x``: what ``D`` reads):

- ``explained_variance = 1 - sum ||y - ŷ||² / sum ||y - mean(y)||²`` over the evaluated tokens;
- ``l0``: mean number of active latents per token; ``dead_fraction``: latents never active over the evaluated
  tokens (``dead_reliable``: whether at least :data:`DEAD_TOKENS` tokens were evaluated, as the issue asks);
  ``density``: the histogram of ``log10`` of each live latent's firing frequency;
- spliced into the model through the engine (``run(..., dictionaries=[D], splice=True)``: the reconstruction in
  place of the site at every position): ``delta_loss = CE_spliced - CE_clean`` (next-token cross-entropy, nats),
  ``loss_recovered = (CE_zero - CE_spliced) / (CE_zero - CE_clean)`` (``CE_zero``: the site set to 0 by an engine
  :class:`~lenscope.models.runtime.engine.Edit`), ``kl``: mean ``KL(clean || spliced)`` of the next-token distributions,
  ``top1_agreement`` with the clean model. Cross-entropy and KL are averaged over the predictions of a body token
  from a body token.

Baselines on the same tokens, with the same fields (spliced by an ``Edit`` ``"set"`` of the site), both fitted on
the first ``fit_tokens`` tokens of the TRAIN part:

- ``pca`` (beside an SAE): the site's mean plus its projection on the top ``round(l0)`` principal components of
  the site (``l0``: the dictionary's, measured here; ``components`` records it);
- ``linear`` (beside a transcoder): the least-squares affine map from the MLP's input to its output.

``beats_baseline``: the dictionary explains more variance than its baseline and, spliced, stays closer to the
clean model (a smaller ``kl``; the KL rather than ``delta_loss``, which a perturbation can lower by chance).
For two or more transcoders, ``replacement``: all of them spliced at once (the replacement model): its
``top1_agreement`` with the real model, ``delta_loss``, ``kl``.

Three streams, each memory-bounded (running sums): the baselines' fit (train part, the forward stopped at the
last site needed), the reconstruction statistics (held-out, stopped likewise), and the splices (held-out: one
clean pass per batch, then one pass per spliced variant).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from ...errors import InputError, NotApplicableError
from ...models.dictionaries.dictionary import Dictionary, load_dictionaries
from ...models.loading.devices import main_device
from ...models.loading.load import LoadedModel
from ...models.runtime.engine import Edit, run
from ...models.runtime.sites import site_key
from ...stats import UneditedNextToken
from .baselines import PCA, Linear, Moments, fit_linear, fit_pca  # noqa: F401 (fit_*: re-exported)

DEAD_TOKENS = 100_000
FIT_TOKENS = 32_768  # default train tokens the baselines are fitted on (a d x d covariance / normal equations)
SPLICE_TOKENS = 16_384  # default held-out tokens of the splices (a full forward pass per variant and batch)
METRICS = ("explained_variance", "l0", "dead_fraction", "delta_loss", "loss_recovered", "kl", "top1_agreement")
SPLICE = ("delta_loss", "loss_recovered", "kl", "top1_agreement", "ce_clean", "ce_spliced", "ce_zero")
DENSITY_STEP = 0.25  # width of a density bin, in log10 of the firing frequency


def _num(x):
    """A float for JSON: None where it is not finite."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


@dataclass(repr=False)
class DictionaryScore:
    """One dictionary's evaluation (see the module's docstring for every field); ``baselines``: ``{"pca": {...}}``
    or ``{"linear": {...}}`` with the same metric fields; ``fired (width,)``: on how many evaluated tokens each
    latent was active."""

    site: str
    kind: str
    role: str
    width: int
    explained_variance: float
    l0: float
    dead_fraction: float
    dead_reliable: bool
    tokens: int
    density: dict
    fired: Tensor
    mse: float
    splice_tokens: int = 0
    delta_loss: float | None = None
    loss_recovered: float | None = None
    kl: float | None = None
    top1_agreement: float | None = None
    ce_clean: float | None = None
    ce_spliced: float | None = None
    ce_zero: float | None = None
    baselines: dict = field(default_factory=dict)
    beats_baseline: bool | None = None

    @property
    def baseline(self) -> str | None:
        return next(iter(self.baselines), None)

    def to_dict(self, fired: bool = False) -> dict:
        out = {"site": self.site, "kind": self.kind, "role": self.role, "width": self.width}
        for name in ("explained_variance", "l0", "dead_fraction", "delta_loss", "loss_recovered", "kl",
                     "top1_agreement", "ce_clean", "ce_spliced", "ce_zero", "mse"):
            out[name] = _num(getattr(self, name))
        out.update(tokens=self.tokens, splice_tokens=self.splice_tokens, dead_reliable=self.dead_reliable,
                   density=self.density, baselines={k: {n: (_num(v) if isinstance(v, float) else v)
                                                         for n, v in b.items()} for k, b in self.baselines.items()},
                   beats_baseline=self.beats_baseline)
        if fired:
            out["fired"] = self.fired.tolist()
        return out

    @classmethod
    def from_dict(cls, d: dict) -> DictionaryScore:
        d = dict(d)
        d["fired"] = torch.tensor(d.get("fired") or [], dtype=torch.long)
        return cls(**d)


@dataclass(repr=False)
class DictionaryEvaluation:
    """The evaluation of one or several dictionaries on held-out text (:func:`evaluate_dictionaries`):
    ``dictionaries`` one :class:`DictionaryScore` each, ``replacement`` (two or more transcoders) the replacement
    model's splice metrics."""

    model: str
    data: str
    tokens: int
    splice_tokens: int
    seq_len: int
    dictionaries: list[DictionaryScore]
    replacement: dict | None = None

    def means(self) -> dict:
        """The mean over the dictionaries of each metric (None where one has none)."""
        out = {}
        for name in METRICS:
            vals = [getattr(s, name) for s in self.dictionaries]
            out[name] = None if any(v is None or not math.isfinite(v) for v in vals) else \
                sum(vals) / len(vals)
        return out

    def to_dict(self, fired: bool = False) -> dict:
        """``dict eval --json``'s object: one dictionary's fields at the top level; several: their means at the
        top level, each one under ``dictionaries``, the replacement model under ``replacement``."""
        per = [s.to_dict(fired=fired) for s in self.dictionaries]
        head = {"model": self.model, "data": self.data, "seq_len": self.seq_len}
        if len(per) == 1:
            return {**head, **per[0]}
        out = {**head, **{k: _num(v) for k, v in self.means().items()}, "tokens": self.tokens,
               "splice_tokens": self.splice_tokens, "dictionaries": per}
        if self.replacement is not None:
            out["replacement"] = {k: (_num(v) if isinstance(v, float) else v) for k, v in self.replacement.items()}
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def to_frame(self):
        """One row per dictionary and per baseline (``method``: ``dictionary``, ``pca``, ``linear``), and the
        replacement model's row when there is one."""
        import pandas as pd

        rows = []
        for s in self.dictionaries:
            d = s.to_dict()
            rows.append({"site": s.site, "method": "dictionary", **{k: d.get(k) for k in METRICS},
                         "tokens": s.tokens, "beats_baseline": s.beats_baseline})
            for name, b in s.baselines.items():
                rows.append({"site": s.site, "method": name, **{k: b.get(k) for k in METRICS},
                             "tokens": b.get("tokens"), "beats_baseline": None})
        if self.replacement is not None:
            rows.append({"site": "all", "method": "replacement", **{k: self.replacement.get(k) for k in METRICS},
                         "tokens": self.replacement.get("splice_tokens"), "beats_baseline": None})
        return pd.DataFrame(rows)

    def lines(self) -> list[str]:
        """The text ``dict eval`` prints: a line per dictionary and its baseline, one where it does not beat it."""
        def fmt(x, spec=".4f"):
            return "n/a" if x is None else format(x, spec)

        out = [f"{self.model}: {len(self.dictionaries)} dictionar{'y' if len(self.dictionaries) == 1 else 'ies'} "
               f"on {self.tokens} held-out tokens of {self.data} (splice on {self.splice_tokens} predictions)"]
        for s in self.dictionaries:
            out.append(f"{s.site} ({s.role}, {s.kind}, width {s.width}): explained variance "
                       f"{fmt(s.explained_variance)}, L0 {s.l0:.2f}, dead {s.dead_fraction:.2%}, delta loss "
                       f"{fmt(s.delta_loss)}, loss recovered {fmt(s.loss_recovered)}, KL {fmt(s.kl)}")
            for name, b in s.baselines.items():
                extra = f" ({b['components']} components)" if "components" in b else ""
                out.append(f"  {name}{extra}: explained variance {fmt(b.get('explained_variance'))}, delta loss "
                           f"{fmt(b.get('delta_loss'))}, loss recovered {fmt(b.get('loss_recovered'))}, KL "
                           f"{fmt(b.get('kl'))}")
            if s.beats_baseline is False:
                out.append(f"  {s.site}: the dictionary does NOT beat its {s.baseline} baseline")
            if not s.dead_reliable:
                out.append(f"  dead latents over {s.tokens} tokens only (fewer than {DEAD_TOKENS}): not reliable")
        if self.replacement is not None:
            r = self.replacement
            out.append(f"replacement model ({r['dictionaries']} transcoders): top-1 agreement "
                       f"{fmt(r.get('top1_agreement'))}, delta loss {fmt(r.get('delta_loss'))}, KL {fmt(r.get('kl'))}")
        return out

    def save(self, path: str | Path) -> Path:
        """Write the evaluation as JSON (every latent's firing count included)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        d = {"model": self.model, "data": self.data, "tokens": self.tokens, "splice_tokens": self.splice_tokens,
             "seq_len": self.seq_len, "replacement": self.replacement,
             "dictionaries": [s.to_dict(fired=True) for s in self.dictionaries], "lenscope_type": type(self).__name__}
        path.write_text(json.dumps(d) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> DictionaryEvaluation:
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError:
            raise InputError(f"no such file: {path}") from None
        except json.JSONDecodeError as e:
            raise InputError(f"{path} is not JSON ({e})") from None
        if d.pop("lenscope_type", None) != cls.__name__:
            raise InputError(f"{path} is not a saved {cls.__name__}")
        d["dictionaries"] = [DictionaryScore.from_dict(s) for s in d["dictionaries"]]
        return cls(**d)

    def __repr__(self) -> str:
        sites = ", ".join(s.site for s in self.dictionaries)
        return f"DictionaryEvaluation({self.model!r}, [{sites}], tokens={self.tokens})"


# -------------------------------------------------------------------------------------------- streams


def _sites(dicts: list[Dictionary]) -> list[tuple]:
    """Every site the dictionaries read or write, in forward order (the last one is where a read pass stops)."""
    keys = set()
    for d in dicts:
        keys.add(site_key(d.site))
        keys.add(site_key(d.input_site))
    order = {"resid_pre": 0, "ln_mlp.out": 2, "attn_out": 1, "mlp_out": 3, "resid_post": 4}
    return sorted(keys, key=lambda k: (k[1], order.get(k[0], 5)))


def _batches(lm: LoadedModel, data, part: str, tokens: int, seq_len: int, batch_size: int):
    """Token batches of ``part`` covering about ``tokens`` body tokens; the body positions ``[a, b)``."""
    from ...data.corpus import token_batches
    from ...data.text import special_affixes

    pre, post = special_affixes(lm.tokenizer)
    body = seq_len - len(pre) - len(post)
    n_seq = max(1, -(-int(tokens) // max(1, body)))
    it = token_batches(lm.tokenizer, data, seq_len=seq_len, batch_size=batch_size, part=part, max_sequences=n_seq)
    return it, len(pre), seq_len - len(post)


def _flat(x: Tensor, a: int, b: int) -> Tensor:
    return x[:, a:b].reshape(-1, x.shape[-1])


class Reconstruction:
    """Running reconstruction statistics of one dictionary (and its baseline) at its site."""

    def __init__(self, D: Dictionary, pca: PCA | None, linear: Linear | None):
        self.D, self.pca, self.linear = D, pca, linear
        d = D.d_out
        self.n = 0
        self.sum_y = torch.zeros(d, dtype=torch.float64)
        self.sum_yy = 0.0
        self.sse = 0.0
        self.active = 0
        self.fired = torch.zeros(D.width, dtype=torch.long)
        self.proj = torch.zeros(d, dtype=torch.float64)  # PCA: sum over tokens of the squared component scores
        self.sse_pca_total = 0.0  # sum ||y - m||² (m: the train mean)
        self.sse_lin = 0.0

    def add(self, x: Tensor, y: Tensor) -> None:
        D = self.D
        with torch.no_grad():
            z = D.encode(x)
            yh = D.decode(z, x)
        y64 = y.double()
        self.n += y.shape[0]
        self.sum_y += y64.sum(0)
        self.sum_yy += float(y64.pow(2).sum())
        self.sse += float((y64 - yh.double()).pow(2).sum())
        on = z != 0
        self.active += int(on.sum())
        self.fired += on.sum(0)
        if self.pca is not None:
            c = y64 - self.pca.mean
            self.sse_pca_total += float(c.pow(2).sum())
            self.proj += (c @ self.pca.components).pow(2).sum(0)
        if self.linear is not None:
            self.sse_lin += float((y64 - self.linear(x.double())).pow(2).sum())

    @property
    def tss(self) -> float:
        return self.sum_yy - float(self.sum_y.pow(2).sum()) / max(1, self.n)

    def ev(self, sse: float) -> float:
        tss = self.tss
        return 1.0 - sse / tss if tss > 0 else float("nan")

    def l0(self) -> float:
        return self.active / max(1, self.n)

    def components(self) -> int:
        return min(self.D.d_out, max(1, round(self.l0())))


def reconstruction(D: Dictionary, x: Tensor, y: Tensor | None = None, *, chunk: int = 8192) -> dict:
    """``D`` scored on rows already in hand (a tensor file, synthetic data), with the same sums as
    :func:`evaluate_dictionaries`: ``explained_variance`` of ``y`` (default ``x``: an SAE) by ``D(x)``, ``l0`` and
    ``dead_fraction`` (latents never active on these rows), over ``rows`` rows."""
    if y is not None and len(y) != len(x):
        raise InputError(f"{len(x)} input rows but {len(y)} output rows")
    r = Reconstruction(D, None, None)
    for i in range(0, len(x), chunk):
        r.add(x[i:i + chunk].float(), (x if y is None else y)[i:i + chunk].float())
    return {"explained_variance": r.ev(r.sse), "l0": r.l0(), "dead_fraction": float((r.fired == 0).double().mean()),
            "rows": r.n}


def density(fired: Tensor, tokens: int) -> dict:
    """The histogram of ``log10`` firing frequencies of the live latents: ``edges`` (bins of
    :data:`DENSITY_STEP` from ``log10(1 / tokens)`` rounded down to 0), ``counts``, and the number of ``dead``."""
    live = fired[fired > 0].double() / max(1, tokens)
    lo = math.floor(math.log10(1.0 / max(1, tokens)) / DENSITY_STEP) * DENSITY_STEP
    n_bins = max(1, round(-lo / DENSITY_STEP))
    edges = [lo + i * DENSITY_STEP for i in range(n_bins + 1)]
    idx = ((live.log10() - lo) / DENSITY_STEP).floor().long().clamp(0, n_bins - 1)
    counts = torch.bincount(idx, minlength=n_bins)
    return {"edges": [round(e, 6) for e in edges], "counts": counts.tolist(), "dead": int((fired == 0).sum())}


class _Loss:
    """Running next-token cross-entropy, KL(clean || this) and top-1 agreement of one variant of the model
    (:class:`lenscope.stats.UneditedNextToken` measures each batch)."""

    def __init__(self):
        self.ce = 0.0
        self.kl = 0.0
        self.agree = 0
        self.n = 0

    def add(self, clean: UneditedNextToken, targets: Tensor, logits: Tensor | None = None) -> None:
        """``targets (b, n)`` the body tokens after each body position; ``logits (b, n, vocab)`` this variant's at
        those positions, None for the clean model itself."""
        self.n += targets.numel()
        if logits is None:
            self.ce += float(clean.nll(targets).sum())
            self.agree += targets.numel()
            return
        nll, kl, top1 = clean.compare(logits, targets)
        self.ce += float(nll.sum())
        self.kl += float(kl.sum())
        self.agree += int(top1.sum())

    def mean_ce(self) -> float:
        return self.ce / max(1, self.n)

    def metrics(self, clean: _Loss, zero: _Loss | None) -> dict:
        ce, ce0 = self.mean_ce(), clean.mean_ce()
        out = {"delta_loss": ce - ce0, "kl": self.kl / max(1, self.n), "top1_agreement": self.agree / max(1, self.n),
               "ce_clean": ce0, "ce_spliced": ce}
        if zero is not None:
            cz = zero.mean_ce()
            out["ce_zero"] = cz
            out["loss_recovered"] = (cz - ce) / (cz - ce0) if cz != ce0 else float("nan")
        return out


def _body(logits: Tensor, a: int, b: int) -> Tensor:
    """The logits ``(b, n, vocab)`` of the predictions from body position ``t`` of body token ``t + 1``."""
    return logits[:, a:b - 1]


def _whole(site: str, layer: int, values: Tensor) -> Edit:
    """An engine edit setting ``site`` of block ``layer`` at every row and position to ``values (b, p, d)``."""
    B, P = values.shape[:2]
    return Edit(site, layer, torch.arange(B)[:, None], torch.arange(P)[None, :], values, mode="set")


def _as_list(dicts) -> list[Dictionary]:
    if isinstance(dicts, Dictionary):
        return [dicts]
    if isinstance(dicts, (str, Path)):
        return load_dictionaries(dicts)
    return list(dicts)


def eval_memory(lm: LoadedModel, dicts: list[Dictionary], *, seq_len: int, batch_size: int,
                baselines: bool = True) -> dict[str, int]:
    """The estimated peak memory of :func:`evaluate_dictionaries` in bytes, by term (float32: 4 bytes a number;
    ``T = batch_size * seq_len`` tokens a pass, ``V`` the vocabulary, ``d`` = d_model, ``H`` heads):

    - ``forward``: one pass of the model, ``4 (2 batch_size H seq_len^2 + 12 T d)`` (a block's attention
      probabilities and the hidden states it works on);
    - ``captures``: the sites the dictionaries read and write, ``4 T d`` each;
    - ``latents``: one dictionary on a batch, ``T (9 width + 24 d)``: its pre-activations and latents (float32),
      which fired (bool), its output and the float64 sums' copies;
    - ``logits``: the splices' logits and log-probabilities, clean and spliced, with the KL's temporaries,
      ``4 * 7 T V``;
    - ``baselines``: each dictionary's moments and fit in float64, ``8 * 2 (d_in + d_out)^2`` (with ``baselines``).

    ``total = baselines + forward + captures + max(latents, logits)``: the statistics and the splices are separate
    passes."""
    A = lm.anatomy
    T, H, d = batch_size * seq_len, max(layer.attn.n_heads for layer in A.layers), A.d_model
    out = {"forward": 4 * (2 * batch_size * H * seq_len**2 + 12 * T * d), "captures": 4 * T * d * len(_sites(dicts)),
           "latents": max(T * (9 * D.width + 24 * D.d_out) for D in dicts), "logits": 4 * 7 * T * A.vocab_size,
           "baselines": sum(16 * (D.d_in + D.d_out) ** 2 for D in dicts) if baselines else 0}
    out["total"] = out["baselines"] + out["forward"] + out["captures"] + max(out["latents"], out["logits"])
    return out


def evaluate_dictionaries(lm: LoadedModel, dicts, data, *, tokens: int = DEAD_TOKENS, seq_len: int | None = None,
                          batch_size: int = 4, baselines: bool = True, fit_tokens: int | None = None,
                          splice_tokens: int | None = None, progress: bool = False,
                          max_memory: int | str | None = None) -> DictionaryEvaluation:
    """Evaluate ``dicts`` (a :class:`~lenscope.models.dictionaries.dictionary.Dictionary`, a list, or a dictionary
    folder) on about ``tokens`` held-out tokens of ``data`` (a text file or folder, :mod:`lenscope.data.corpus`), beside
    their baselines (``baselines=True``: fitted on ``fit_tokens`` train tokens, default
    ``min(tokens, FIT_TOKENS)``). The splice metrics use the first ``splice_tokens`` of those tokens (default
    ``min(tokens, SPLICE_TOKENS)``: each variant is a full forward pass, where the statistics stop at the last
    site). ``max_memory``: the memory budget (bytes or a size such as ``"8GB"``; default:
    :func:`lenscope.memory.budget`'s); when :func:`eval_memory` exceeds it, a one-line
    :class:`~lenscope.errors.InputError` naming the ``--batch-size`` that fits. See the module's docstring."""
    D = _as_list(dicts)
    if not D:
        raise InputError("no dictionary to evaluate")
    if int(tokens) < 1:
        raise InputError(f"--tokens must be at least 1; got {tokens}")
    if not lm.anatomy.causal:
        raise NotApplicableError("dictionary evaluation measures the next-token loss: it needs a causal decoder")
    from ...data.text import fit_seq_len

    seq_len = fit_seq_len(lm, seq_len)
    seen = set()
    for d in D:
        d.check(lm)
        if d.site in seen:
            raise InputError(f"two dictionaries for the site {d.site}; evaluate them one at a time")
        seen.add(d.site)
    from ...data.corpus import HOLDOUT_EVERY, PSEUDO_DOC_CHARS, documents

    if next(documents(data, "heldout"), None) is None:
        raise InputError(f"{data} has no held-out text: one document in {HOLDOUT_EVERY} is held out (documents "
                         f"are separated by <|endoftext|> lines, or cut every ~{PSEUDO_DOC_CHARS} characters); give "
                         f"at least {HOLDOUT_EVERY} documents")
    _check_memory(lm, D, seq_len, batch_size, baselines, max_memory)
    sites = _sites(D)
    say = _progress(progress)

    # 1. baselines, fitted on the train part
    pcas: dict[str, PCA] = {}
    lins: dict[str, Linear] = {}
    if baselines:
        moms = {d.site: Moments(d.d_in, d.d_out if d.transcoder else None) for d in D}
        it, a, b = _batches(lm, data, "train", fit_tokens or min(tokens, FIT_TOKENS), seq_len, batch_size)
        for ids in it:
            cap = run(lm, ids, capture=sites, stop_after=sites[-1], logits=False, device="cpu").captured
            for d in D:
                x = _flat(cap[site_key(d.input_site)], a, b)
                moms[d.site].add(x, _flat(cap[site_key(d.site)], a, b) if d.transcoder else None)
        say("baselines fitted")
        for d in D:
            if d.transcoder:
                lins[d.site] = moms[d.site].linear()
            else:
                pcas[d.site] = moms[d.site].pca()

    # 2. reconstruction statistics on the held-out part
    rec = {d.site: Reconstruction(d, pcas.get(d.site), lins.get(d.site)) for d in D}
    it, a, b = _batches(lm, data, "heldout", tokens, seq_len, batch_size)
    n_tok = 0
    for ids in it:
        cap = run(lm, ids, capture=sites, stop_after=sites[-1], logits=False, device="cpu").captured
        for d in D:
            rec[d.site].add(_flat(cap[site_key(d.input_site)], a, b), _flat(cap[site_key(d.site)], a, b))
        n_tok += ids.shape[0] * (b - a)
        say(f"statistics: {n_tok} tokens")

    # 3. splices on the held-out part
    clean = _Loss()
    losses = {d.site: {"dict": _Loss(), "zero": _Loss(), "base": _Loss()} for d in D}
    transcoders = [d for d in D if d.transcoder]
    repl = _Loss() if len(transcoders) >= 2 else None
    budget = min(n_tok, SPLICE_TOKENS) if splice_tokens is None else max(1, int(splice_tokens))
    it, a, b = _batches(lm, data, "heldout", min(budget, n_tok), seq_len, batch_size)
    need = sorted({site_key(d.site if not d.transcoder else d.input_site) for d in D})
    dev = main_device(lm.model)
    on = {d.site: d.to(dev) for d in D}  # the engine's copies, on the model's device (statistics: on the CPU)
    n_spl = 0
    with torch.no_grad():
        for ids in it:
            if n_spl >= budget:
                break
            out = run(lm, ids, capture=need if baselines else (), device="cpu")
            targets = ids[:, a + 1:b].to(out.logits.device)
            lp0 = UneditedNextToken(_body(out.logits, a, b))
            clean.add(lp0, targets)
            for d in D:
                name, layer = site_key(d.site)
                L = losses[d.site]
                spliced = run(lm, ids, dictionaries=[on[d.site]], splice=True).logits
                L["dict"].add(lp0, targets, _body(spliced, a, b))
                zero = torch.zeros(ids.shape[0], ids.shape[1], d.d_out)
                L["zero"].add(lp0, targets, _body(run(lm, ids, [_whole(name, layer, zero)]).logits, a, b))
                if baselines:
                    if d.transcoder:
                        yb = lins[d.site](out.captured[site_key(d.input_site)].double())
                    else:
                        yb = pcas[d.site].reconstruct(out.captured[site_key(d.site)].double(),
                                                      rec[d.site].components())
                    L["base"].add(lp0, targets, _body(run(lm, ids, [_whole(name, layer, yb.float())]).logits, a, b))
            if repl is not None:
                spliced = run(lm, ids, dictionaries=[on[d.site] for d in transcoders], splice=True).logits
                repl.add(lp0, targets, _body(spliced, a, b))
            n_spl += targets.numel()
            say(f"splices: {n_spl} predictions")

    scores = []
    for d in D:
        r, L = rec[d.site], losses[d.site]
        m = L["dict"].metrics(clean, L["zero"])
        s = DictionaryScore(site=d.site, kind=d.kind, role=d.role, width=d.width, explained_variance=r.ev(r.sse),
                            l0=r.l0(), dead_fraction=float((r.fired == 0).double().mean()),
                            dead_reliable=r.n >= DEAD_TOKENS, tokens=r.n, density=density(r.fired, r.n),
                            fired=r.fired, mse=r.sse / max(1, r.n * d.d_out), splice_tokens=n_spl, **m)
        if baselines:
            bm = L["base"].metrics(clean, L["zero"])
            if d.transcoder:
                base = {"explained_variance": r.ev(r.sse_lin), "l0": float(d.d_out), "dead_fraction": 0.0,
                        "tokens": r.n, "splice_tokens": n_spl, "mse": r.sse_lin / max(1, r.n * d.d_out), **bm}
                s.baselines = {"linear": base}
            else:
                k = r.components()
                sse = max(0.0, r.sse_pca_total - float(r.proj[:k].sum()))
                base = {"explained_variance": r.ev(sse), "l0": float(k), "dead_fraction": 0.0, "components": k,
                        "tokens": r.n, "splice_tokens": n_spl, "mse": sse / max(1, r.n * d.d_out), **bm}
                s.baselines = {"pca": base}
            s.beats_baseline = bool(s.explained_variance > base["explained_variance"] and s.kl < base["kl"])
        scores.append(s)
    replacement = None
    if repl is not None:
        replacement = {"dictionaries": len(transcoders), "splice_tokens": n_spl, **repl.metrics(clean, None)}
    return DictionaryEvaluation(model=lm.name, data=str(data), tokens=n_tok, splice_tokens=n_spl, seq_len=seq_len,
                                dictionaries=scores, replacement=replacement)


def _check_memory(lm: LoadedModel, D: list[Dictionary], seq_len: int, batch_size: int, baselines: bool,
                  max_memory) -> None:
    from ...memory import budget, format_bytes

    limit = budget(max_memory)
    need = eval_memory(lm, D, seq_len=seq_len, batch_size=batch_size, baselines=baselines)["total"]
    if need <= limit:
        return
    fits = [b for b in range(1, batch_size) if eval_memory(lm, D, seq_len=seq_len, batch_size=b,
                                                           baselines=baselines)["total"] <= limit]
    fix = f"use --batch-size {fits[-1]}" if fits else "even --batch-size 1 does not fit: lower --seq-len"
    raise InputError(f"dict eval: needs about {format_bytes(need)} ({batch_size} sequences of {seq_len} tokens a "
                     f"pass), more than the memory budget of {format_bytes(limit)}; {fix}, or raise --max-memory")


def _progress(on: bool):
    import sys

    def say(msg: str) -> None:
        if on:
            sys.stderr.write(f"dict eval: {msg}\n")

    return say


__all__ = ["DEAD_TOKENS", "FIT_TOKENS", "SPLICE_TOKENS", "DictionaryEvaluation", "DictionaryScore", "Linear", "PCA",
           "density", "eval_memory", "evaluate_dictionaries", "fit_linear", "fit_pca"]
