"""Attribution of a prediction to model components (direct logit attribution) and to context tokens
(Logit, ALTI-Logit, ALTI, gradient, erasure and value-zeroing explanations).

The package's face imports no torch: ``explain``, ``explain_all`` and the method table (:mod:`.methods`: the
command line's ``--help`` reads it) are light; the other names are imported on first use."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .explain import explain, explain_all
from .methods import Method, register, unregister

if TYPE_CHECKING:
    from .baselines import erasure, grad_norm, grad_x_input, integrated_gradients
    from .context import alti_logit_explanation, logit_explanation, rollout_explanation
    from .dla import ComponentAttribution, direct_logit_attribution
    from .explanation import Explanation

# name -> (module, its name there), imported when first asked for
_LAZY = {
    "explain_html": ("..viz.html", "explanation_html"), "erasure": (".baselines", "erasure"),
    "grad_norm": (".baselines", "grad_norm"), "grad_x_input": (".baselines", "grad_x_input"),
    "integrated_gradients": (".baselines", "integrated_gradients"),
    "alti_logit_explanation": (".context", "alti_logit_explanation"),
    "logit_explanation": (".context", "logit_explanation"), "rollout_explanation": (".context", "rollout_explanation"),
    "ComponentAttribution": (".dla", "ComponentAttribution"),
    "direct_logit_attribution": (".dla", "direct_logit_attribution"), "Explanation": (".explanation", "Explanation"),
}


def __getattr__(name: str):
    if name == "METHODS":  # the method table's names, read when asked for (a registered method is in it)
        from .methods import names

        return names()
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attr = _LAZY[name]
    value = getattr(importlib.import_module(module, __name__), attr)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | {"METHODS"})


__all__ = ["METHODS", "ComponentAttribution", "Explanation", "Method", "alti_logit_explanation",
           "direct_logit_attribution", "erasure", "explain", "explain_all", "explain_html", "grad_norm",
           "grad_x_input", "integrated_gradients", "logit_explanation", "register", "rollout_explanation",
           "unregister"]
