"""The view of a generated continuation explained token by token (``Generation``, whose class declares
``VIEW = "generation"``, or its ``to_dict()``).

Its script ``generation.js`` draws it: in the report (the section ``generation``, with ``--generate N``), in
notebooks and on the standalone page of ``lenscope generate --html PATH``, which is the report page holding just this
section with its run card (:func:`lenscope.viz.views.page`). This module turns the generation's dict into the
section's data (:func:`generation_payload`: floats rounded to 5 significant digits, nothing recomputed) and writes
that page (:func:`generation_html`).
"""

from __future__ import annotations

import platform
import time
from pathlib import Path

from ....errors import InputError
from ...report.payloads import rounded_tree
from .. import Shown, View, one, standalone

KEY = "generation"
TITLE = "Generated continuation"
BLURB = ("What the model wrote after the text, explained token by token: each generated token's probability, "
         "prediction depth and runner-up, and every method's scores over the tokens before it (contrastive "
         "methods: the token rather than the foil). Click a token, or a row of the matrix, to see its step.")
FIELDS = ("text", "tokens", "prompt_tokens", "methods", "generated")


def as_dict(d_or_gen) -> dict:
    """A generation's dict from the dict itself or an object with ``to_dict()`` (a ``Generation``)."""
    d = d_or_gen.to_dict() if hasattr(d_or_gen, "to_dict") else d_or_gen
    if not isinstance(d, dict):
        raise InputError(f"give a generation (lenscope.generate's result) or its to_dict(), not {type(d).__name__}")
    missing = [k for k in FIELDS if k not in d]
    if missing:
        raise InputError(f"this is not a generation's dict: it lacks {', '.join(missing)} "
                         "(give lenscope.generate(...).to_dict())")
    return d


def generation_payload(d_or_gen, digits: int = 5) -> dict:
    """The section's data: the generation's dict with every float rounded to ``digits`` significant digits
    (non-finite numbers become null)."""
    return rounded_tree(as_dict(d_or_gen), digits)


def invariant_errors(d: dict) -> dict[str, float | None]:
    """Each method's largest invariant error over the steps (None where the method reports none)."""
    out: dict[str, float | None] = {}
    for m in d["methods"]:
        vals = [g["explanations"][m].get("invariant_error") for g in d["generated"] if m in g["explanations"]]
        vals = [v for v in vals if v is not None]
        out[m] = max(vals) if vals else None
    return out


def check_name(method: str) -> str:
    return f"{method}: largest invariant error over the steps"


def run_meta(d: dict, lm=None, extra: dict | None = None) -> dict:
    """The run card's fields of a generation's dict (the model's, from ``lm`` when given; ``extra`` overrides)."""
    from ....version import __version__

    d = {**(d.get("settings") or {}), **d}  # run-card fields the generation records (family, n_layers, ...)
    if lm is not None:
        A = lm.anatomy
        d = {**d, "family": A.family, "model_type": A.model_type, "n_layers": A.n_layers, "d_model": A.d_model,
             "placement": A.placement}
    meta = {"model": d.get("model") or "?", "family": d.get("family", "?"), "model_type": d.get("model_type", "?"),
            "n_layers": d.get("n_layers", "?"), "d_model": d.get("d_model", "?"), "causal": True,
            "placement": d.get("placement", "?"), "text": d.get("prompt") or "".join(d["prompt_tokens"]),
            "tokens": d["tokens"], "target": d["text"], "target_id": None, "foil": None, "foil_id": None,
            "target_is_top_prediction": not d.get("sample", False), "lens": d.get("lens"),
            "versions": {"lenscope": __version__, "python": platform.python_version()},
            "created": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    meta.update(extra or {})
    return meta


def generation_html(d_or_gen, path: str | Path | None = None, *, lm=None, meta: dict | None = None,
                    tolerance: float | None = None) -> str:
    """The standalone page of a generation (``lenscope generate --html PATH``, ``Generation.to_html``): the report
    page with just the generation section and its run card (:func:`lenscope.viz.views.page`), self-contained
    (fetches nothing). Returns the HTML; also writes it to ``path`` when given.

    ``d_or_gen``: ``lenscope.generate(...)``'s result or its ``to_dict()``. ``lm``: the model that generated it
    (optional): the run card names its family, layers and width, and each method's largest invariant error is
    checked against the model's completeness tolerance. ``meta``: run-card fields to set. ``tolerance``: the
    largest invariant error that passes (default: the model's when ``lm`` is given; else every error is only
    reported).
    """
    return standalone(VIEW.show(d_or_gen, lm=lm, meta=meta, tolerance=tolerance), path)


class GenerationView(View):
    key = KEY
    title = TITLE
    blurb = BLURB
    order = 80
    height = 620
    run_card = True

    def show(self, obj, *, lm=None, meta: dict | None = None, tolerance: float | None = None) -> Shown:
        """A generation (or its ``to_dict()``): its data, and each method's largest invariant error as a check
        (against ``tolerance``, by default the model's completeness tolerance when ``lm`` is given; else
        reported)."""
        d = as_dict(one(obj, "a collection of generations"))
        if tolerance is None and lm is not None:
            from ....models.runtime.verify import completeness_tolerance

            tolerance = completeness_tolerance(lm)
        checks = []
        for m, v in invariant_errors(d).items():
            if v is None:
                continue
            ok = None if tolerance is None else bool(v <= tolerance)
            checks.append({"section": KEY, "name": check_name(m), "value": float(v), "tolerance": tolerance,
                           "ok": ok, "note": ""})
        seconds = d.get("seconds")
        return Shown(KEY, generation_payload(d), run_meta(d, lm, meta), TITLE, BLURB, checks,
                     {"generate": float(seconds)} if seconds is not None else {})


VIEW = GenerationView()
