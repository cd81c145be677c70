"""One feature seen whole (:func:`feature_card`, :func:`feature_cards`): over HELD-OUT text (the corpus's held-out
part, :func:`lenscope.data.corpus.token_batches` with ``part="heldout"``), streamed through the engine with only the
dictionary's latent site captured (the forward pass stops there), for each feature

- its top-activating contexts: the ``top`` token positions where it is largest, each with a window of tokens
  around it (``context = (before, after)``) and the feature's activation at every token of the window;
- its activation histogram (of the active tokens, ``bins`` linear bins from 0 to the largest activation) and its
  density (the fraction of the tokens where it is active); special tokens (BOS, the end-of-text separators) are
  not counted;
- the tokens its decoder direction promotes and suppresses through the readout: the direct path, ``W_dec[f]``
  (for an ``attn_out`` / ``mlp_out`` site or a transcoder: through the sub-layer's write, :meth:`Layer.write`)
  times the final norm's weight (centred first for a LayerNorm) times the unembedding. The final norm's per-token
  scale is left out: it multiplies every logit alike and does not change the order.

Many features share one pass over the text (:func:`feature_cards`). Memory: the running top contexts
``(feature, top, window)`` and the active values (8 bytes per active token and feature).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ...data.corpus import token_batches
from ...errors import InputError
from ...models.dictionaries.dictionary import Dictionary
from ...models.loading.load import LoadedModel, token_str
from ...models.runtime.engine import run
from ...models.weights.readout import Readout
from ...results import Result, finite_json
from ...viz.notebook import ReportView
from .result import latent_site

DEFAULT_TOKENS = 65_536


@dataclass(repr=False)
class FeatureCard(ReportView, Result):
    """One feature of one dictionary, measured on ``tokens_seen`` held-out tokens of ``data``.

    - ``context_tokens``: ``(context, window)`` token strings (None past the sequence's ends), the feature largest at
      index ``center`` of each window; ``context_values (context, window)`` its activation at each token (0 past
      the ends); ``context_max (context,)`` the activation at the centre, largest first; ``context_where
      (context, 2)``: the held-out sequence and position;
    - ``hist_counts (bins,)`` over ``hist_edges (bins + 1,)``: the active tokens' activations; ``density``: the
      fraction of tokens where the feature is active (``active`` of ``tokens_seen``);
    - ``promoted`` / ``suppressed``: the tokens whose logits the decoder direction raises / lowers most through the
      readout, with ``promoted_values`` / ``suppressed_values`` (the logit change per unit activation, before the
      final norm's per-token scale) and their ids."""

    VIEW = "feature"  # its view: drawn by viz/views/feature/feature.js (lenscope.viz.views)

    model: str
    site: str
    feature: int
    width: int
    kind: str
    role: str
    data: str
    tokens_seen: int
    active: int
    density: float
    max_activation: float
    mean_activation: float
    center: int
    context_tokens: list
    context_values: Tensor
    context_max: Tensor
    context_where: Tensor
    hist_counts: Tensor
    hist_edges: Tensor
    promoted: list
    promoted_ids: Tensor
    promoted_values: Tensor
    suppressed: list
    suppressed_ids: Tensor
    suppressed_values: Tensor

    def contexts(self) -> list[dict]:
        """Each top context as a record: ``tokens``, ``values``, ``max``, ``center``, ``sequence``, ``position``."""
        out = []
        for toks, vals, m, (s, p) in zip(self.context_tokens, self.context_values.tolist(),
                                          self.context_max.tolist(), self.context_where.tolist()):
            out.append({"tokens": toks, "values": vals, "max": m, "center": self.center, "sequence": s,
                        "position": p})
        return out

    def to_dict(self) -> dict:
        return finite_json({
            "model": self.model, "site": self.site, "feature": self.feature, "width": self.width, "kind": self.kind,
            "role": self.role, "data": self.data, "tokens": self.tokens_seen, "active": self.active,
            "density": self.density, "max_activation": self.max_activation,
            "mean_activation": self.mean_activation, "contexts": self.contexts(),
            "histogram": {"counts": self.hist_counts.tolist(), "edges": self.hist_edges.tolist()},
            "promoted": [{"token": t, "id": i, "value": v} for t, i, v in
                         zip(self.promoted, self.promoted_ids.tolist(), self.promoted_values.tolist())],
            "suppressed": [{"token": t, "id": i, "value": v} for t, i, v in
                           zip(self.suppressed, self.suppressed_ids.tolist(), self.suppressed_values.tolist())]})

    def to_frame(self):
        """The top contexts, one row each: rank, activation, the token, the window's text, sequence, position."""
        import pandas as pd

        rows = [{"rank": r, "activation": c["max"], "token": c["tokens"][c["center"]],
                 "context": "".join(t for t in c["tokens"] if t is not None), "sequence": c["sequence"],
                 "position": c["position"]} for r, c in enumerate(self.contexts())]
        return pd.DataFrame(rows, columns=["rank", "activation", "token", "context", "sequence", "position"])

    def plot(self, *, title: str | None = None):
        """The histogram and the promoted / suppressed tokens (:func:`lenscope.viz.feature_plots.plot_feature_card`)."""
        from ...viz.feature_plots import plot_feature_card

        return plot_feature_card(self, title=title)

    def __repr__(self) -> str:
        return (f"FeatureCard({self.site} #{self.feature}: density {self.density:.4g} over {self.tokens_seen} "
                f"held-out tokens, max {self.max_activation:.4g}, promotes {self.promoted[:5]})")


def decoder_logits(lm: LoadedModel, d: Dictionary, features: Tensor | list[int]) -> Tensor:
    """``(feature, vocab)``: what each feature's decoder row does to the logits along the direct path (see the
    module's docstring), per unit activation, before the final norm's per-token scale."""
    A = lm.anatomy
    readout = Readout.from_anatomy(A)
    v = d.W_dec[torch.as_tensor(features, dtype=torch.long)].float()
    name = d.site.rpartition(".")[0]
    if name in ("attn_out", "mlp_out"):
        layer = A.layers[d.layer]
        v = layer.write("attn" if name == "attn_out" else "mlp", v).float()
    v = readout.center(v) * readout.gain(v.shape[-1])
    return v @ readout.W_U.float()


def _check(lm: LoadedModel, d: Dictionary, features, top: int, context, bins: int, tokens: int) -> list[int]:
    if d.site is None:
        raise InputError("this dictionary names no site of a model; give it one (dictionary.site = 'resid_post.5')")
    d.check(lm)
    feats = [int(f) for f in features]
    if not feats:
        raise InputError("no feature given")
    bad = [f for f in feats if not 0 <= f < d.width]
    if bad:
        raise InputError(f"feature {bad[0]} is outside the dictionary's {d.width} latents (0..{d.width - 1})")
    if len(set(feats)) != len(feats):
        raise InputError("a feature is given twice")
    if top < 1:
        raise InputError("top must be at least 1")
    if len(context) != 2 or min(context) < 0:
        raise InputError("context is (tokens before, tokens after), both at least 0")
    if bins < 1:
        raise InputError("bins must be at least 1")
    if tokens < 1:
        raise InputError("tokens must be at least 1")
    return feats


class CardPass:
    """The running state of :func:`feature_cards` for ``n`` features of one dictionary over a pass of held-out
    text: the top contexts (values ``(n, top)``, window ids and activations ``(n, top, W)``, where ``(n, top, 2)``),
    the active values and which feature they belong to. :meth:`update` takes one batch's latents of these features,
    :meth:`cards` makes the cards. Several passes (chunks of a dictionary's features) can share one stream of
    batches (:func:`lenscope.features.dictionaries.labels.feature_labels`)."""

    def __init__(self, n: int, top: int, context: tuple[int, int]):
        self.n, self.top = int(n), int(top)
        self.before, self.after = int(context[0]), int(context[1])
        W = self.before + self.after + 1
        self.best_v = torch.full((n, 0), -1.0)
        self.best_ids = torch.zeros((n, 0, W), dtype=torch.long)
        self.best_acts = torch.zeros((n, 0, W))
        self.best_where = torch.zeros((n, 0, 2), dtype=torch.long)
        self.active_vals, self.active_feat = [], []
        self.seq0 = 0

    def update(self, ids: Tensor, z: Tensor) -> None:
        """One batch: ``ids (b, p)`` and the features' latents ``z (b, p, n)`` (float32, 0 at uncounted tokens)."""
        B, P = ids.shape
        F, top = self.n, self.top
        nz = z > 0
        self.active_vals.append(z[nz])
        self.active_feat.append(nz.nonzero()[:, 2])
        # the batch's candidates: its top positions per feature (only active ones can be a context)
        flat = z.reshape(B * P, F).T  # (F, b*p)
        k = min(top, B * P)
        cv, ci = flat.topk(k, dim=1)
        rows, pos = ci // P, ci % P  # (F, k)
        win = pos[..., None] + torch.arange(-self.before, self.after + 1)  # (F, k, W)
        inside = (win >= 0) & (win < P)
        winc = win.clamp(0, P - 1)
        r3 = rows[..., None].expand_as(winc)
        wid = torch.where(inside, ids[r3, winc], torch.full_like(winc, -1))
        fa = torch.arange(F)[:, None, None].expand_as(winc)
        wact = torch.where(inside, z[r3, winc, fa], torch.zeros(()))
        where = torch.stack([rows + self.seq0, pos], -1)
        cv = torch.where(cv > 0, cv, torch.full_like(cv, -1.0))  # inactive: never a context
        allv = torch.cat([self.best_v, cv], 1)
        keep = allv.topk(min(top, allv.shape[1]), dim=1).indices  # (F, top)
        self.best_v = allv.gather(1, keep)
        self.best_ids = torch.cat([self.best_ids, wid], 1)[torch.arange(F)[:, None], keep]
        self.best_acts = torch.cat([self.best_acts, wact], 1)[torch.arange(F)[:, None], keep]
        self.best_where = torch.cat([self.best_where, where], 1)[torch.arange(F)[:, None], keep]
        self.seq0 += B

    def cards(self, lm: LoadedModel, d: Dictionary, feats: list[int], data, seen: int, *, bins: int = 40,
              vocab_top: int = 10, vocab_cache: dict | None = None) -> list[FeatureCard]:
        """The cards of ``feats`` (this pass's features, in order) after ``seen`` counted tokens."""
        vals = torch.cat(self.active_vals) if self.active_vals else torch.zeros(0)
        which = torch.cat(self.active_feat) if self.active_feat else torch.zeros(0, dtype=torch.long)
        order = torch.sort(which, stable=True).indices  # each feature's values in the order they came
        per = torch.bincount(which, minlength=self.n).tolist()
        groups = vals[order].split(per)
        logit_dirs = decoder_logits(lm, d, feats)  # (F, vocab)
        kv = min(int(vocab_top), logit_dirs.shape[1])
        up, down = logit_dirs.topk(kv, dim=1), (-logit_dirs).topk(kv, dim=1)
        del logit_dirs
        cache = {} if vocab_cache is None else vocab_cache

        def text(i: int) -> str | None:
            if i < 0:
                return None
            if i not in cache:
                cache[i] = token_str(lm, i)
            return cache[i]

        cards = []
        for j, f in enumerate(feats):
            v = groups[j]
            n = int(v.numel())
            hi = float(v.max()) if n else 0.0
            edges = torch.linspace(0.0, hi if hi > 0 else 1.0, bins + 1)
            counts = torch.histc(v, bins=bins, min=0.0, max=float(edges[-1])) if n else torch.zeros(bins)
            real = self.best_v[j] > 0
            cards.append(FeatureCard(
                model=lm.name, site=d.site, feature=f, width=d.width, kind=d.kind, role=d.role, data=str(data),
                tokens_seen=seen, active=n, density=n / seen, max_activation=hi,
                mean_activation=float(v.mean()) if n else 0.0, center=self.before,
                context_tokens=[[text(int(t)) for t in row] for row in self.best_ids[j][real].tolist()],
                context_values=self.best_acts[j][real].contiguous(), context_max=self.best_v[j][real].contiguous(),
                context_where=self.best_where[j][real].contiguous(), hist_counts=counts.to(torch.long),
                hist_edges=edges, promoted=[text(int(i)) for i in up.indices[j]],
                promoted_ids=up.indices[j].contiguous(), promoted_values=up.values[j].contiguous(),
                suppressed=[text(int(i)) for i in down.indices[j]], suppressed_ids=down.indices[j].contiguous(),
                suppressed_values=(-down.values[j]).contiguous()))
        return cards


def counted_latents(lm: LoadedModel, d: Dictionary, ids: Tensor, special: Tensor) -> tuple[Tensor, Tensor]:
    """One batch's latents of ``d`` ``(b, p, width)`` (float32, 0 at the ``special`` tokens, which are not counted)
    from a pass stopped at the latent site, and the counted mask ``(b, p)``."""
    site = latent_site(d)
    z = run(lm, ids, capture=[site], dictionaries=[d], stop_after=site, logits=False).captured[site]
    counted = ~torch.isin(ids, special)
    return torch.where(counted[..., None], z.float(), torch.zeros(())), counted


def feature_cards(lm: LoadedModel, d: Dictionary, features, data, *, tokens: int = DEFAULT_TOKENS, top: int = 20,
                  context: tuple[int, int] = (12, 4), bins: int = 40, vocab_top: int = 10, seq_len: int = 128,
                  batch_size: int = 8) -> list[FeatureCard]:
    """The cards of several ``features`` of ``d`` from one pass over about ``tokens`` held-out tokens of ``data``
    (a corpus file or folder, :func:`lenscope.data.corpus.corpus_files`), in sequences of ``seq_len``.
    ``context``: tokens shown before and after each context's maximum; ``vocab_top``: promoted / suppressed tokens
    kept."""
    feats = _check(lm, d, features, top, context, bins, tokens)
    seq_len = min(int(seq_len), lm.anatomy.n_ctx)
    idx = torch.tensor(feats, dtype=torch.long)
    special = torch.tensor(sorted(set(lm.tokenizer.all_special_ids)), dtype=torch.long)
    state = CardPass(len(feats), top, context)
    seen = 0
    for ids in token_batches(lm.tokenizer, data, seq_len=seq_len, batch_size=batch_size, part="heldout",
                             max_sequences=-(-int(tokens) // seq_len)):
        z, counted = counted_latents(lm, d, ids, special)
        seen += int(counted.sum())
        state.update(ids, z[..., idx])
    if seen == 0:
        raise InputError(f"the held-out part of {data} holds no token to measure the features on")
    return state.cards(lm, d, feats, data, seen, bins=bins, vocab_top=vocab_top)


def feature_card(lm: LoadedModel, d: Dictionary, feature: int, data, **kw) -> FeatureCard:
    """The card of one ``feature`` of ``d`` (:func:`feature_cards`'s options)."""
    return feature_cards(lm, d, [feature], data, **kw)[0]


__all__ = ["DEFAULT_TOKENS", "CardPass", "FeatureCard", "counted_latents", "decoder_logits", "feature_card",
           "feature_cards"]
