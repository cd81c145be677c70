"""lenscope: see how a transformer language model builds its prediction.

    import lenscope
    lm = lenscope.load("smollm2")            # model, tokenizer and Anatomy
    report = lenscope.verify(lm)              # our math vs the real model
    dla = lenscope.direct_logit_attribution(lm, "The capital of France is", " Paris")
"""

from .attribution.dla import ComponentAttribution, direct_logit_attribution
from .errors import (InputError, LenscopeError, MissingDependencyError, NotApplicableError, UnknownModelError,
                     UnsupportedModelError)
from .models.anatomy import Anatomy
from .models.load import LoadedModel, available_names, load
from .models.trace import Trace, trace
from .models.verify import VerifyReport, verify

__version__ = "0.1.0"

__all__ = [
    "Anatomy", "ComponentAttribution", "InputError", "LenscopeError", "LoadedModel", "MissingDependencyError",
    "NotApplicableError", "Trace", "UnknownModelError", "UnsupportedModelError", "VerifyReport", "available_names",
    "direct_logit_attribution", "load", "trace", "verify",
]
