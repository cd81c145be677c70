"""The context-attribution view: which input tokens made the model predict the target, every method side by side
(``Explanation``, whose class declares ``VIEW = "attribution"``; a dict or list of them: one per method)."""

from __future__ import annotations

from typing import Any, Protocol

from torch import Tensor

from ...report.payloads import packed, rounded_list
from .. import Shown, View, keyed, meta_of


class ExplanationLike(Protocol):
    """A context attribution of one method (:class:`lenscope.attribution.Explanation`)."""

    method: str
    tokens: list[str]
    scores: Tensor
    target: str | None
    foil: str | None
    invariant_error: float | None
    layer_scores: Tensor | None
    info: dict[str, Any]
    reports_completeness: bool  # its method reports info["completeness_error"]


def explanation_record(e: ExplanationLike) -> dict:
    """One method's row of the ``attribution`` view: its scores, invariant error and (where its method reports
    one: integrated gradients) completeness error."""
    rec = {"scores": rounded_list(e.scores), "invariant_error": e.invariant_error}
    if e.reports_completeness:
        rec["completeness_error"] = e.info.get("completeness_error")
    return rec


def attribution_payload(explanations: dict[str, ExplanationLike] | list[ExplanationLike] | ExplanationLike, *,
                        tokens: list[str] | None = None, target=..., foil=...) -> dict:
    """The ``attribution`` view: every method's scores side by side, and the per-layer scores of the methods that
    split the attention's logit update by layer (those with ``layer_scores`` and ``attention_update``: Logit,
    ALTI-Logit). ``tokens``/``target``/``foil`` default to the explanations' own (the first that has a target;
    None where none has)."""
    if not isinstance(explanations, dict):
        if not isinstance(explanations, (list, tuple)):
            explanations = [explanations]
        explanations = {e.method: e for e in explanations}
    exs = list(explanations.values())
    if tokens is None:
        tokens = list(exs[0].tokens)
    named = [e for e in exs if e.target is not None]
    if target is ...:
        target = named[0].target if named else None
    if foil is ...:
        foil = named[0].foil if named else None
    out = {"tokens": tokens, "target": target, "foil": foil, "methods": {}, "layers": {}}
    for m, e in explanations.items():
        out["methods"][m] = explanation_record(e)
        if e.layer_scores is not None and e.attention_update is not None:
            out["layers"][m] = packed(e.layer_scores)
    return out


class Attribution(View):
    key = "attribution"
    title = "Context attribution"
    blurb = ("Which input tokens made the model predict the target (rather than the foil): every method side "
             "by side, and ALTI-Logit per layer.")
    order = 40
    height = 520

    def show(self, obj) -> Shown:
        exs = keyed(obj, "method")
        first = next(iter(exs.values()))
        named = [e for e in exs.values() if e.target is not None]
        title = f"{self.title} · " + ", ".join(exs) + (f" · {named[0].what()}" if named else "")
        return Shown(self.key, attribution_payload(exs), meta_of(named[0] if named else first), title)


VIEW = Attribution()
