"""lenscope: see how a transformer language model builds its prediction.

    import lenscope
    lm = lenscope.load("smollm2")            # model, tokenizer and Anatomy
    report = lenscope.verify(lm)              # our math vs the real model
    dla = lenscope.direct_logit_attribution(lm, "The capital of France is", " Paris")
    ex = lenscope.explain(lm, "The keys to the cabinet", " are", foil=" is", method="alti-logit")
"""

from .attribution import ComponentAttribution, Explanation, direct_logit_attribution, explain, explain_all
from .errors import (
    InputError,
    LenscopeError,
    MissingDependencyError,
    NotApplicableError,
    UnknownModelError,
    UnsupportedModelError,
)
from .models.anatomy import Anatomy
from .models.load import LoadedModel, available_names, load
from .models.trace import Trace, trace
from .models.verify import VerifyReport, verify
from .version import __version__ as __version__

__all__ = [
    "Anatomy", "ComponentAttribution", "Explanation", "InputError", "LenscopeError", "LoadedModel",
    "MissingDependencyError", "NotApplicableError", "Trace", "UnknownModelError", "UnsupportedModelError",
    "VerifyReport", "available_names", "direct_logit_attribution", "explain", "explain_all", "load", "trace", "verify",
]
