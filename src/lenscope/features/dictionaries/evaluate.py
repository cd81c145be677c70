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
``top1_agreement`` with the real model, ``delta_loss``, ``kl`` (``dictionaries``: how many, ``blocks``: how many
sites they replace, ``cross_layer``: false).

A cross-layer transcoder (:class:`~lenscope.models.dictionaries.clt.CrossLayerTranscoder`, or a folder
:func:`~lenscope.models.dictionaries.clt.is_clt_folder` recognises) is evaluated on its own, through the same
statistics and splices, as one entry per block ``l`` (site ``mlp_out.l``, role ``"clt"``):

- ``explained_variance`` of ``mlp_out.l`` by the CLT's reconstruction of it, ``clt.decode(latents, l)``: the sum of
  the decoders of blocks ``0 .. l`` (each block's latents encoded from its own captured MLP input); ``l0``,
  ``dead_fraction``, ``density`` of block ``l``'s latents;
- no per-block splice (the splice fields None, ``splice_tokens`` 0): block ``l`` alone is not a replacement of
  anything the CLT claims, since its latents also write every later block;
- ``baselines.linear``: the least-squares map of block ``l``'s MLP input to its output, as beside a per-layer
  transcoder, with its explained variance only (no splice either); ``beats_baseline`` compares the explained
  variances alone;
- ``replacement``: the whole CLT spliced (``run(lm, ids, dictionaries=[clt], splice=True)``: every MLP output the
  CLT's reconstruction from the spliced run's own MLP inputs), with ``dictionaries`` 1, ``blocks`` the CLT's,
  ``cross_layer`` true.

Three streams, each memory-bounded (running sums): the baselines' fit (train part, the forward stopped at the
last site needed), the reconstruction statistics (held-out, stopped likewise), and the splices (held-out: one
clean pass per batch, then one pass per spliced variant).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import Tensor

from ...errors import InputError, NotApplicableError
from ...models.dictionaries.clt import CrossLayerTranscoder, load_transcoders
from ...models.dictionaries.dictionary import Dictionary
from ...models.loading.devices import main_device
from ...models.loading.load import LoadedModel
from ...models.runtime.engine import Edit, run
from ...models.runtime.sites import site_key
from ...stats import UneditedNextToken
from .baselines import PCA, Linear, Moments, fit_linear, fit_pca  # noqa: F401 (fit_*: re-exported)
from .evaluation import DEAD_TOKENS, DictionaryEvaluation, DictionaryScore  # noqa: F401 (re-exported)

FIT_TOKENS = 32_768  # default train tokens the baselines are fitted on (a d x d covariance / normal equations)
SPLICE_TOKENS = 16_384  # default held-out tokens of the splices (a full forward pass per variant and batch)
SPLICE = ("delta_loss", "loss_recovered", "kl", "top1_agreement", "ce_clean", "ce_spliced", "ce_zero")
DENSITY_STEP = 0.25  # width of a density bin, in log10 of the firing frequency


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

    def add(self, x: Tensor, y: Tensor, z: Tensor | None = None, yh: Tensor | None = None) -> None:
        """Rows ``x`` (what the dictionary reads) and ``y`` (its site); ``z``, ``yh``: the latents and the
        reconstruction where they come from elsewhere (a cross-layer transcoder's block), else ``D``'s of ``x``."""
        D = self.D
        if z is None:
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


def _units(dicts) -> tuple[list[Dictionary], CrossLayerTranscoder | None]:
    """The per-layer dictionaries evaluated and None; or a cross-layer transcoder's blocks
    (:meth:`~lenscope.models.dictionaries.clt.CrossLayerTranscoder.block`: per-layer transcoders of ``mlp_out.l``
    with its encoders, which give the sites, sizes and baselines) and the CLT itself."""
    if isinstance(dicts, (Dictionary, CrossLayerTranscoder)):
        items = [dicts]
    elif isinstance(dicts, (str, Path)):
        items = load_transcoders(dicts)
    else:
        items = list(dicts)
    clts = [d for d in items if isinstance(d, CrossLayerTranscoder)]
    if not clts:
        return items, None
    if len(items) > 1:
        raise InputError("a cross-layer transcoder is evaluated on its own: give it without other dictionaries")
    C = clts[0]
    return [C.block(i) for i in range(C.n_layers)], C


def eval_memory(lm: LoadedModel, dicts: list, *, seq_len: int, batch_size: int,
                baselines: bool = True) -> dict[str, int]:
    """The estimated peak memory of :func:`evaluate_dictionaries` in bytes, by term (float32: 4 bytes a number;
    ``T = batch_size * seq_len`` tokens a pass, ``V`` the vocabulary, ``d`` = d_model, ``H`` heads; ``dicts``:
    per-layer dictionaries or one cross-layer transcoder, whose ``L`` blocks count as ``L`` transcoders of width
    ``width`` for the captures and baselines):

    - ``forward``: one pass of the model, ``4 (2 batch_size H seq_len^2 + 12 T d)`` (a block's attention
      probabilities and the hidden states it works on);
    - ``captures``: the sites the dictionaries read and write, ``4 T d`` each;
    - ``latents``: the statistics on a batch, ``T (4 width L + 5 width + 24 d)``: the latents kept at once (float32;
      ``L`` 1 for a per-layer dictionary, every block of a CLT, whose block ``l`` is decoded from blocks
      ``0 .. l``), one block's pre-activations and which latents fired (bool), its output and the float64 sums'
      copies;
    - ``logits``: the splices' logits and log-probabilities, clean and spliced, with the KL's temporaries,
      ``4 * 7 T V``;
    - ``splice_latents``: the latents the engine keeps through a spliced pass, ``4 T`` times the widths spliced
      at once (one dictionary; every transcoder of a replacement model; all ``L`` blocks of a CLT);
    - ``baselines``: each dictionary's moments and fit in float64, ``8 * 2 (d_in + d_out)^2`` (with ``baselines``).

    ``total = baselines + forward + captures + max(latents, logits + splice_latents)``: the statistics and the
    splices are separate passes."""
    D, clt = _units(dicts)
    A = lm.anatomy
    T, H, d = batch_size * seq_len, max(layer.attn.n_heads for layer in A.layers), A.d_model
    if clt is not None:
        latents, spliced = T * (4 * clt.width * clt.n_layers + 5 * clt.width + 24 * clt.d_out), clt.width * len(D)
    else:
        latents = max(T * (9 * x.width + 24 * x.d_out) for x in D)
        tc = [x.width for x in D if x.transcoder]
        spliced = max(max(x.width for x in D), sum(tc) if len(tc) >= 2 else 0)
    out = {"forward": 4 * (2 * batch_size * H * seq_len**2 + 12 * T * d), "captures": 4 * T * d * len(_sites(D)),
           "latents": latents, "logits": 4 * 7 * T * A.vocab_size, "splice_latents": 4 * T * spliced,
           "baselines": sum(16 * (x.d_in + x.d_out) ** 2 for x in D) if baselines else 0}
    out["total"] = (out["baselines"] + out["forward"] + out["captures"]
                    + max(out["latents"], out["logits"] + out["splice_latents"]))
    return out


def evaluate_dictionaries(lm: LoadedModel, dicts, data, *, tokens: int = DEAD_TOKENS, seq_len: int | None = None,
                          batch_size: int = 4, baselines: bool = True, fit_tokens: int | None = None,
                          splice_tokens: int | None = None, splice_each: bool = True, progress: bool = False,
                          max_memory: int | str | None = None) -> DictionaryEvaluation:
    """Evaluate ``dicts`` (a :class:`~lenscope.models.dictionaries.dictionary.Dictionary`, a list, a dictionary
    folder, or a :class:`~lenscope.models.dictionaries.clt.CrossLayerTranscoder` or its folder) on about ``tokens``
    held-out tokens of ``data`` (a text file or folder, :mod:`lenscope.data.corpus`), beside their baselines
    (``baselines=True``: fitted on ``fit_tokens`` train tokens, default ``min(tokens, FIT_TOKENS)``). The splice
    metrics use the first ``splice_tokens`` of those tokens (default ``min(tokens, SPLICE_TOKENS)``: each variant is
    a full forward pass, where the statistics stop at the last site). ``max_memory``: the memory budget (bytes or a
    size such as ``"8GB"``; default: :func:`lenscope.memory.budget`'s); when :func:`eval_memory` exceeds it, a
    one-line :class:`~lenscope.errors.InputError` naming the ``--batch-size`` that fits. ``splice_each=False``:
    no per-dictionary splices (each is three full forward passes per batch: the splice, the site zeroed, the
    baseline), only the replacement model's; the per-dictionary splice fields are then None, as a CLT block's. See
    the module's docstring (a CLT: one entry per block, the whole CLT as ``replacement``)."""
    D, clt = _units(dicts)
    if not D:
        raise InputError("no dictionary to evaluate")
    if int(tokens) < 1:
        raise InputError(f"--tokens must be at least 1; got {tokens}")
    if not lm.anatomy.causal:
        raise NotApplicableError("dictionary evaluation measures the next-token loss: it needs a causal decoder")
    from ...data.text import fit_seq_len

    seq_len = fit_seq_len(lm, seq_len)
    if clt is not None:
        clt.check(lm)
    seen = set()
    for d in D if clt is None else ():
        d.check(lm)
        if d.site in seen:
            raise InputError(f"two dictionaries for the site {d.site}; evaluate them one at a time")
        seen.add(d.site)
    from ...data.corpus import HOLDOUT_EVERY, PSEUDO_DOC_CHARS, documents

    if next(documents(data, "heldout"), None) is None:
        raise InputError(f"{data} has no held-out text: one document in {HOLDOUT_EVERY} is held out (documents "
                         f"are separated by <|endoftext|> lines, or cut every ~{PSEUDO_DOC_CHARS} characters); give "
                         f"at least {HOLDOUT_EVERY} documents")
    _check_memory(lm, D if clt is None else [clt], seq_len, batch_size, baselines, max_memory)
    sites = _sites(D)
    say = _progress(progress)
    pcas, lins = _fit_baselines(lm, D, data, fit_tokens or min(tokens, FIT_TOKENS), seq_len, batch_size, sites,
                                say) if baselines else ({}, {})
    rec = {d.site: Reconstruction(d, pcas.get(d.site), lins.get(d.site)) for d in D}
    n_tok = _statistics(lm, D, clt, rec, data, tokens, seq_len, batch_size, sites, say)
    budget = min(n_tok, SPLICE_TOKENS) if splice_tokens is None else max(1, int(splice_tokens))
    clean, losses, repl, n_spl = _splices(lm, D if clt is None and splice_each else [], clt, D, rec, pcas, lins, data,
                                          budget, min(budget, n_tok), seq_len, batch_size, say)
    role = "clt" if clt is not None else None
    scores = [_score(d, rec[d.site], losses.get(d.site), clean, n_spl, baselines, role) for d in D]
    replacement = None
    if repl is not None:
        n = 1 if clt is not None else len([d for d in D if d.transcoder])
        replacement = {"dictionaries": n, "blocks": len(D) if clt is not None else n, "cross_layer": clt is not None,
                       "splice_tokens": n_spl, **repl.metrics(clean, None)}
    return DictionaryEvaluation(model=lm.name, data=str(data), tokens=n_tok, splice_tokens=n_spl, seq_len=seq_len,
                                dictionaries=scores, replacement=replacement)


def _fit_baselines(lm: LoadedModel, D: list[Dictionary], data, tokens: int, seq_len: int, batch_size: int,
                   sites: list[tuple], say) -> tuple[dict[str, PCA], dict[str, Linear]]:
    """The baselines, fitted on ``tokens`` tokens of the train part: a PCA per SAE, a least-squares map per
    transcoder (a CLT's blocks included), by site."""
    moms = {d.site: Moments(d.d_in, d.d_out if d.transcoder else None) for d in D}
    it, a, b = _batches(lm, data, "train", tokens, seq_len, batch_size)
    for ids in it:
        cap = run(lm, ids, capture=sites, stop_after=sites[-1], logits=False, device="cpu").captured
        for d in D:
            x = _flat(cap[site_key(d.input_site)], a, b)
            moms[d.site].add(x, _flat(cap[site_key(d.site)], a, b) if d.transcoder else None)
    say("baselines fitted")
    pcas = {d.site: moms[d.site].pca() for d in D if not d.transcoder}
    lins = {d.site: moms[d.site].linear() for d in D if d.transcoder}
    return pcas, lins


def _statistics(lm: LoadedModel, D: list[Dictionary], clt: CrossLayerTranscoder | None, rec: dict, data,
                tokens: int, seq_len: int, batch_size: int, sites: list[tuple], say) -> int:
    """The reconstruction statistics on the held-out part (``rec``, by site); the body tokens read. A CLT: every
    block's latents encoded from its own captured MLP input, block ``l``'s output decoded from blocks ``0 .. l``."""
    it, a, b = _batches(lm, data, "heldout", tokens, seq_len, batch_size)
    n_tok = 0
    for ids in it:
        cap = run(lm, ids, capture=sites, stop_after=sites[-1], logits=False, device="cpu").captured
        xs = [_flat(cap[site_key(d.input_site)], a, b) for d in D]
        ys = [_flat(cap[site_key(d.site)], a, b) for d in D]
        if clt is None:
            for d, x, y in zip(D, xs, ys):
                rec[d.site].add(x, y)
        else:
            with torch.no_grad():
                z = [clt.encode(x, i) for i, x in enumerate(xs)]
                for i, d in enumerate(D):
                    rec[d.site].add(xs[i], ys[i], z[i], clt.decode(z, i))
            del z
        n_tok += ids.shape[0] * (b - a)
        say(f"statistics: {n_tok} tokens")
    return n_tok


def _splices(lm: LoadedModel, solo: list[Dictionary], clt: CrossLayerTranscoder | None, D: list[Dictionary],
             rec: dict, pcas: dict, lins: dict, data, budget: int, tokens: int, seq_len: int, batch_size: int, say):
    """The splices on about ``tokens`` held-out tokens, until ``budget`` predictions: per batch one clean pass, then
    per dictionary of ``solo`` its splice, its site zeroed and its baseline set there, then the replacement model
    (every transcoder of ``D`` at once when there are two or more; a CLT, whose blocks are not spliced alone).
    Returns the clean :class:`_Loss`, the per-site ones (``dict``, ``zero``, ``base``), the replacement's (or None)
    and the predictions counted."""
    clean = _Loss()
    losses = {d.site: {"dict": _Loss(), "zero": _Loss(), "base": _Loss()} for d in solo}
    together = [clt] if clt is not None else [d for d in D if d.transcoder]
    together = together if clt is not None or len(together) >= 2 else []
    repl = _Loss() if together else None
    it, a, b = _batches(lm, data, "heldout", tokens, seq_len, batch_size)
    need = sorted({site_key(d.site if not d.transcoder else d.input_site) for d in solo}) if pcas or lins else ()
    dev = main_device(lm.model)
    on = {}  # the engine's copies, on the model's device (statistics: on the CPU)
    for d in [*solo, *together]:
        on.setdefault(id(d), d.to(dev))
    n_spl = 0
    with torch.no_grad():
        for ids in it:
            if n_spl >= budget:
                break
            out = run(lm, ids, capture=need, device="cpu")
            targets = ids[:, a + 1:b].to(out.logits.device)
            lp0 = UneditedNextToken(_body(out.logits, a, b))
            clean.add(lp0, targets)
            for d in solo:
                name, layer = site_key(d.site)
                L = losses[d.site]
                spliced = run(lm, ids, dictionaries=[on[id(d)]], splice=True).logits
                L["dict"].add(lp0, targets, _body(spliced, a, b))
                zero = torch.zeros(ids.shape[0], ids.shape[1], d.d_out)
                L["zero"].add(lp0, targets, _body(run(lm, ids, [_whole(name, layer, zero)]).logits, a, b))
                if need:
                    if d.transcoder:
                        yb = lins[d.site](out.captured[site_key(d.input_site)].double())
                    else:
                        yb = pcas[d.site].reconstruct(out.captured[site_key(d.site)].double(),
                                                      rec[d.site].components())
                    L["base"].add(lp0, targets, _body(run(lm, ids, [_whole(name, layer, yb.float())]).logits, a, b))
            if repl is not None:
                spliced = run(lm, ids, dictionaries=[on[id(d)] for d in together], splice=True).logits
                repl.add(lp0, targets, _body(spliced, a, b))
            n_spl += targets.numel()
            say(f"splices: {n_spl} predictions")
    return clean, losses, repl, n_spl


def _score(d: Dictionary, r: Reconstruction, L: dict | None, clean: _Loss, n_spl: int,
           baselines: bool, role: str | None = None) -> DictionaryScore:
    """One dictionary's score from its statistics ``r`` and splices ``L`` (None: not spliced alone, a CLT's block
    or ``splice_each=False``: its splice fields None, its baseline's explained variance only); ``role``: instead of
    the dictionary's own (a CLT's block: ``"clt"``)."""
    m = {} if L is None else {**L["dict"].metrics(clean, L["zero"]), "splice_tokens": n_spl}
    s = DictionaryScore(site=d.site, kind=d.kind, role=role or d.role, width=d.width,
                        explained_variance=r.ev(r.sse), l0=r.l0(), dead_fraction=float((r.fired == 0).double().mean()),
                        dead_reliable=r.n >= DEAD_TOKENS, tokens=r.n, density=density(r.fired, r.n), fired=r.fired,
                        mse=r.sse / max(1, r.n * d.d_out), **m)
    if not baselines:
        return s
    if d.transcoder:
        name, sse = "linear", r.sse_lin
        base = {"explained_variance": r.ev(sse), "l0": float(d.d_out), "dead_fraction": 0.0}
    else:
        name, k = "pca", r.components()
        sse = max(0.0, r.sse_pca_total - float(r.proj[:k].sum()))
        base = {"explained_variance": r.ev(sse), "l0": float(k), "dead_fraction": 0.0, "components": k}
    base.update(tokens=r.n, mse=sse / max(1, r.n * d.d_out))
    s.baselines = {name: base}
    if L is None:
        s.beats_baseline = bool(s.explained_variance > base["explained_variance"])
        return s
    base.update(splice_tokens=n_spl, **L["base"].metrics(clean, L["zero"]))
    s.beats_baseline = bool(s.explained_variance > base["explained_variance"] and s.kl < base["kl"])
    return s


def _check_memory(lm: LoadedModel, D: list, seq_len: int, batch_size: int, baselines: bool, max_memory) -> None:
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
