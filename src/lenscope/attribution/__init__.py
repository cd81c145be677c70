"""Attribution of a prediction to model components (direct logit attribution) and to context tokens
(Logit, ALTI-Logit, ALTI, gradient, erasure and value-zeroing explanations)."""

from ..viz.html import explanation_html as explain_html
from .baselines import erasure, grad_norm, grad_x_input, integrated_gradients
from .context import alti_logit_explanation, logit_explanation, rollout_explanation
from .dla import ComponentAttribution, direct_logit_attribution
from .explain import explain, explain_all
from .explanation import Explanation
from .methods import Method, register, unregister


def __getattr__(name: str):
    if name == "METHODS":  # the method table's names, read when asked for (a registered method is in it)
        from .methods import names

        return names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["METHODS", "ComponentAttribution", "Explanation", "Method", "alti_logit_explanation",
           "direct_logit_attribution", "erasure", "explain", "explain_all", "explain_html", "grad_norm",
           "grad_x_input", "integrated_gradients", "logit_explanation", "register", "rollout_explanation",
           "unregister"]
