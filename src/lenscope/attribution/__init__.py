"""Attribution of a prediction to model components (direct logit attribution) and to context tokens
(Logit, ALTI-Logit, ALTI, gradient, erasure and value-zeroing explanations)."""

from ..viz.html import explanation_html as explain_html
from .baselines import erasure, grad_norm, grad_x_input, integrated_gradients
from .context import alti_logit_explanation, logit_explanation, rollout_explanation
from .dla import ComponentAttribution, direct_logit_attribution
from .explain import explain, explain_all
from .explanation import METHODS, Explanation

__all__ = ["METHODS", "ComponentAttribution", "Explanation", "alti_logit_explanation", "direct_logit_attribution",
           "erasure", "explain", "explain_all", "explain_html", "grad_norm", "grad_x_input", "integrated_gradients",
           "logit_explanation", "rollout_explanation"]
