"""Feature explanations written by a language model lenscope loads, each scored by detection (the explainer hook of
the feature labels, :mod:`lenscope.features.dictionaries.labels`).

**Writing.** For each chosen feature of a dictionary, its cards (:func:`~lenscope.features.dictionaries.cards.
feature_cards`) on held-out text give its top-activating contexts, ``context`` tokens around each maximum. The
``shown`` largest are written out, the token at the maximum between ``<<`` and ``>>``, under an instruction
(:data:`WRITE`); the explainer continues greedily (``max_new_tokens``, the one decoder of
:func:`lenscope.generation.run.decode`) and its first line, stripped, is the explanation.

**Detection** (Paulo et al. 2024's detection score, here with the same model as the judge): the judge reads the
explanation and one text without markers (:data:`JUDGE`) and its answer is the logit of ``" Yes"`` minus that of
``" No"`` at the last position. The texts are

- *active*: the feature's next ``n_test`` top contexts, the ones not shown to the explainer;
- *inactive*: ``n_test`` top contexts of the other chosen features on which this feature is silent: the subject
  model and the dictionary run on the text as the judge reads it (tokenised again, on its own) and the feature's
  latent is 0 at every position; drawn with ``seed`` from those.

The score is the AUROC of the answers, active against inactive (:func:`lenscope.detect.detectors.auroc`: 0.5 is
chance, 1 a perfect judge), beside ``accuracy``, the share of texts the sign of the answer puts right. A feature with
fewer than 2 active or 2 inactive texts gets no score (None). Explanations and scores are kept in the dictionary's
``labels.json`` beside the labels (:func:`save_explanations`), with the explainer's name.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np
import torch

from ..detect.detectors import auroc
from ..errors import InputError
from ..features.dictionaries.cards import DEFAULT_TOKENS, FeatureCard, counted_latents, feature_cards
from ..features.dictionaries.labels import load_labels, save_labels
from ..generation.run import decode
from ..models.dictionaries.dictionary import Dictionary
from ..models.loading.load import LoadedModel, encode
from ..models.runtime.engine import run
from ..results import Result, finite_json

WRITE = ("Below are texts in which one hidden feature of a language model fires; the token where it fires most is "
         "marked with << >>.\n\n{texts}\n\nIn a few words, the feature fires on")
JUDGE = ("A feature of a language model fires on {explanation}.\n\nText: {text}\n\nDoes the feature fire somewhere "
         "in this text? Answer:")
YES, NO = " Yes", " No"


def context_text(tokens: list, center: int | None = None) -> str:
    """A context's text (tokens outside the sequence, None, left out), the token at ``center`` between ``<<`` and
    ``>>`` when given."""
    return "".join(f"<<{t}>>" if i == center else t for i, t in enumerate(tokens) if t is not None)


@dataclass(repr=False)
class FeatureExplanations(Result):
    """Explanations of ``features`` of the dictionary at ``site`` of ``model``, written and judged by ``explainer``
    (see the module's docstring): ``detection`` (AUROC) and ``accuracy`` per feature, None where it has too few
    texts; ``n_active`` / ``n_inactive``: the texts judged; ``shown``: the contexts shown to the explainer."""

    model: str
    explainer: str
    site: str
    features: list[int]
    labels: list
    explanations: list[str]
    detection: list
    accuracy: list
    n_active: list[int]
    n_inactive: list[int]
    shown: int

    def to_frame(self):
        import pandas as pd

        return pd.DataFrame({"feature": self.features, "label": self.labels, "explanation": self.explanations,
                             "detection": self.detection, "accuracy": self.accuracy, "n_active": self.n_active,
                             "n_inactive": self.n_inactive})

    def mean_detection(self) -> float | None:
        got = [x for x in self.detection if x is not None]
        return float(np.mean(got)) if got else None

    def to_dict(self) -> dict:
        return finite_json({"model": self.model, "explainer": self.explainer, "site": self.site,
                            "shown": self.shown, "mean_detection": self.mean_detection(),
                            "features": self.to_frame().to_dict(orient="records")})

    def __repr__(self) -> str:
        m = self.mean_detection()
        return (f"FeatureExplanations({len(self.features)} features of {self.site}, explained by {self.explainer}, "
                f"mean detection AUROC {'n/a' if m is None else f'{m:.3f}'})")


def _one_token(lm: LoadedModel, text: str) -> int:
    ids = lm.tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        raise InputError(f"the judge {lm.name} spells {text!r} as {len(ids)} tokens; detection reads one token's "
                         "logit for Yes and one for No")
    return int(ids[0])


def write_explanation(explainer: LoadedModel, card: FeatureCard, shown: int, max_new_tokens: int = 16) -> str:
    """The explainer's one-line explanation of ``card``'s feature from its ``shown`` largest contexts."""
    texts = "\n".join(f"{i + 1}. {context_text(t, card.center)}" for i, t in enumerate(card.context_tokens[:shown]))
    ids = encode(explainer, WRITE.format(texts=texts))
    out = decode(explainer, ids, max_new_tokens)
    text = explainer.tokenizer.decode(out[ids.numel():].tolist(), skip_special_tokens=True)
    return text.strip().split("\n")[0].strip().rstrip(".") or "(nothing)"


def judge(explainer: LoadedModel, explanation: str, texts: list[str], answers: tuple[str, str] = (YES, NO)
          ) -> torch.Tensor:
    """The judge's answers ``(len(texts),)``: logit(yes) - logit(no) (``answers``, one token each) after
    :data:`JUDGE` for each text (one forward pass each: the prompts differ in length)."""
    yes, no = (_one_token(explainer, a) for a in answers)
    out = []
    for t in texts:
        ids = encode(explainer, JUDGE.format(explanation=explanation, text=t))
        logits = run(explainer, ids[None]).logits[0, -1].float()
        out.append(float(logits[yes] - logits[no]))
    return torch.tensor(out, dtype=torch.float64)


def silent(lm: LoadedModel, d: Dictionary, texts: list[str], features: list[int]) -> torch.Tensor:
    """``(len(texts), len(features))`` bool: the feature's latent is 0 at every position of the text, run on its
    own through the subject model and ``d``."""
    special = torch.tensor(sorted(set(lm.tokenizer.all_special_ids)), dtype=torch.long)
    idx = torch.tensor(features, dtype=torch.long)
    rows = []
    for t in texts:
        z, _ = counted_latents(lm, d, encode(lm, t)[None], special)
        rows.append((z[0][:, idx] <= 0).all(0))
    return torch.stack(rows) if rows else torch.zeros((0, len(features)), dtype=torch.bool)


def pick_features(cards_or_width, n: int, seed: int, alive: list[bool] | None = None) -> list[int]:
    """``n`` features drawn at random with ``seed`` (``np.random.default_rng``) from those ``alive`` (all when
    None) of a dictionary of width ``cards_or_width``, sorted."""
    width = int(cards_or_width)
    pool = [f for f in range(width) if alive is None or alive[f]]
    if n < 1 or not pool:
        raise InputError(f"nothing to explain: {n} features asked, {len(pool)} live features")
    rng = np.random.default_rng(seed)
    return sorted(int(x) for x in rng.choice(pool, size=min(n, len(pool)), replace=False))


def explain_features(lm: LoadedModel, d: Dictionary, features: list[int], data, explainer: LoadedModel | None = None,
                     *, shown: int = 10, n_test: int = 10, context: tuple[int, int] = (12, 4),
                     tokens: int = DEFAULT_TOKENS, seed: int = 0, max_new_tokens: int = 16,
                     labels: list | None = None, answers: tuple[str, str] = (YES, NO),
                     progress: bool = True) -> FeatureExplanations:
    """Explanations of ``features`` of ``d`` written by ``explainer`` (default: ``lm`` itself) from their top
    contexts on ``data``'s held-out text, each scored by detection (see the module's docstring); ``answers``: the
    judge's yes and no, one token each."""
    explainer = lm if explainer is None else explainer
    for a in answers:
        _one_token(explainer, a)  # refused before any work
    if len(features) < 2:
        raise InputError("detection needs at least 2 features: each one's inactive texts are the others' contexts")
    if shown < 1 or n_test < 2:
        raise InputError(f"shown must be at least 1 and n_test at least 2; got {shown} and {n_test}")
    say = (lambda m: sys.stderr.write(f"explain: {m}\n")) if progress else (lambda m: None)
    cards = feature_cards(lm, d, features, data, tokens=tokens, top=shown + n_test, context=context)
    tests = [[context_text(t) for t in c.context_tokens[shown:]] for c in cards]
    pool = [(j, t) for j, ts in enumerate(tests) for t in ts]
    quiet = silent(lm, d, [t for _, t in pool], list(features))
    rng = np.random.default_rng(seed)
    out = {k: [] for k in ("explanations", "detection", "accuracy", "n_active", "n_inactive")}
    for j, c in enumerate(cards):
        others = [i for i, (owner, _) in enumerate(pool) if owner != j and bool(quiet[i, j])]
        neg = [pool[i][1] for i in sorted(rng.permutation(others)[:n_test].tolist())] if others else []
        text = write_explanation(explainer, c, shown, max_new_tokens) if c.context_tokens else "(never active)"
        pos = tests[j]
        score = acc = None
        if len(pos) >= 2 and len(neg) >= 2:
            ans = judge(explainer, text, pos + neg, answers).numpy()
            truth = np.r_[np.ones(len(pos)), np.zeros(len(neg))]
            score, acc = auroc(truth, ans), float(((ans > 0) == (truth > 0)).mean())
        for k, v in zip(out, (text, score, acc, len(pos), len(neg))):
            out[k].append(v)
        say(f"#{c.feature}: {text!r}, detection {'n/a' if score is None else f'{score:.2f}'}")
    return FeatureExplanations(model=lm.name, explainer=explainer.name, site=d.site, features=list(features),
                               labels=list(labels) if labels is not None else [None] * len(features), shown=shown,
                               **out)


def save_explanations(res: FeatureExplanations, folder) -> None:
    """Keep ``res`` in ``folder``'s ``labels.json`` beside its site's labels, ``explanations``: ``{feature:
    {text, detection, accuracy, explainer}}`` (those of other features kept, these replaced)."""
    doc = load_labels(folder)
    if doc is None or res.site not in doc["dictionaries"]:
        raise InputError(f"{folder} holds no labels of {res.site}: run lenscope dict label first")
    rec = doc["dictionaries"][res.site]
    got = dict(rec.get("explanations", {}))
    for f, t, s, a in zip(res.features, res.explanations, res.detection, res.accuracy):
        got[str(f)] = finite_json({"text": t, "detection": s, "accuracy": a, "explainer": res.explainer})
    rec["explanations"] = got
    save_labels(doc, folder)


__all__ = ["JUDGE", "WRITE", "FeatureExplanations", "context_text", "explain_features", "judge", "pick_features",
           "save_explanations", "silent", "write_explanation"]
