"""Attribution of a prediction to model components (direct logit attribution) and to context tokens
(Logit, ALTI-Logit, ALTI, gradient, erasure and value-zeroing explanations)."""

from ..viz.explain_html import explanation_html as explain_html
from .dla import ComponentAttribution, direct_logit_attribution
from .explain import explain, explain_all
from .explanation import METHODS, Explanation

__all__ = ["METHODS", "ComponentAttribution", "Explanation", "direct_logit_attribution", "explain", "explain_all",
           "explain_html"]
