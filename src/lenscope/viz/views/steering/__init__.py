"""The view of a steering evaluation (``SteeringEvaluation``, whose class declares ``VIEW = "steering"``, or its
``to_dict()``): the page of ``lenscope steer eval --html PATH`` and ``SteeringEvaluation.to_html``.

Its script ``steering.js`` draws it on the report page holding just this section with its run card
(:func:`lenscope.viz.views.page`), self-contained. This module turns the evaluation's dict into the section's data
(:func:`steering_payload`: floats rounded to 5 significant digits, nothing recomputed) and writes the page
(:func:`steering_html`).
"""

from __future__ import annotations

import platform
import time
from pathlib import Path

from ....errors import InputError
from ...report.payloads import rounded_tree
from .. import Shown, View, one, standalone

KEY = "steering"
TITLE = "Steering, measured"
BLURB = ("How a steering vector moves the behaviour's measure, logit(answer +) \u2212 logit(answer \u2212) at the "
         "last position, input by input: the mean effect against the multiplier with its bootstrap interval, what "
         "it costs on held-out text (change in next-token loss, KL to the unsteered model), and every held-out "
         "input's slope (red: moved the wrong way; grey: not moved). Pick a layer above the charts.")
FIELDS = ("layers", "multipliers", "inputs", "direction")


def as_dict(d_or_ev) -> dict:
    """An evaluation's dict from the dict itself or an object with ``to_dict()`` (a ``SteeringEvaluation``)."""
    d = d_or_ev.to_dict() if hasattr(d_or_ev, "to_dict") else d_or_ev
    if not isinstance(d, dict) or any(k not in d for k in FIELDS):
        raise InputError("give a steering evaluation (lenscope.steering.evaluate_steering) or its to_dict()")
    return d


def steering_payload(d_or_ev, digits: int = 5) -> dict:
    """The section's data: the evaluation's dict, floats rounded to ``digits`` significant digits."""
    return rounded_tree(as_dict(d_or_ev), digits)


def run_meta(d: dict) -> dict:
    """The run card's fields of an evaluation's dict."""
    from ....version import __version__

    direction = d["direction"]
    return {"model": d["model"], "family": "?", "model_type": "?", "n_layers": "?",
            "d_model": direction.get("d_model", "?"), "causal": True, "placement": "?",
            "text": f"{d['n_inputs']} held-out inputs; {direction.get('method')} direction at {direction.get('site')}",
            "tokens": [], "target": "answer_positive", "target_id": None, "foil": "answer_negative", "foil_id": None,
            "target_is_top_prediction": False, "lens": None,
            "versions": {"lenscope": __version__, "python": platform.python_version()},
            "created": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def steering_html(d_or_ev, path: str | Path | None = None) -> str:
    """The standalone page of a steering evaluation: the report page with just this section and its run card
    (:func:`lenscope.viz.views.page`; fetches nothing). Returns the HTML; also writes it to ``path`` when given."""
    return standalone(VIEW.show(d_or_ev), path)


class Steering(View):
    key = KEY
    title = TITLE
    blurb = BLURB
    order = 120
    height = 700
    run_card = True

    def show(self, obj) -> Shown:
        """A steering evaluation (or its ``to_dict()``): its data, and the effect at multiplier 0 as a check."""
        d = as_dict(one(obj, "a collection of steering evaluations"))
        zero = [abs(e) for r in d["layers"].values() for a, e in zip(r["multipliers"], r["mean_effect"])
                if a == 0 and e is not None]
        checks = [{"section": KEY, "name": "effect at multiplier 0 (no edit applied)", "value": max(zero),
                   "tolerance": 0.0, "ok": max(zero) == 0.0, "note": ""}] if zero else []
        seconds = d.get("seconds") or {}
        return Shown(KEY, steering_payload(d), run_meta(d), TITLE, BLURB, checks,
                     {k: float(v) for k, v in seconds.items() if k != "total"})


VIEW = Steering()
