"""lenscope: see how a transformer language model builds its prediction.

    import lenscope
    lm = lenscope.load("smollm2")            # model, tokenizer and Anatomy
    report = lenscope.verify(lm)              # our math vs the real model
    dla = lenscope.direct_logit_attribution(lm, "The capital of France is", " Paris")
    ex = lenscope.explain(lm, "The keys to the cabinet", " are", foil=" is")  # ALTI-Logit; method=...
    lenscope.show(dla)                        # its view in a browser (in Jupyter: just `dla`)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .errors import (
    InputError,
    LenscopeError,
    MissingDependencyError,
    NotApplicableError,
    UnknownModelError,
    UnsupportedModelError,
)
from .version import __version__ as __version__

if TYPE_CHECKING:
    from .attribution import ComponentAttribution, Explanation, direct_logit_attribution, explain, explain_all
    from .generation import Generation, generate
    from .models.loading.load import LoadedModel, available_names, load
    from .models.runtime.trace import Trace, trace
    from .models.runtime.verify import VerifyReport, verify
    from .models.weights.anatomy import Anatomy
    from .viz.notebook import show

# The public names that need torch are imported on first use (``lenscope.load`` ...), so that ``import lenscope``
# and the command line's ``--help`` stay fast: name -> the module that defines it.
_LAZY = {
    "ComponentAttribution": ".attribution", "Explanation": ".attribution", "direct_logit_attribution": ".attribution",
    "explain": ".attribution", "explain_all": ".attribution", "Generation": ".generation", "generate": ".generation",
    "Anatomy": ".models.weights.anatomy",
    "LoadedModel": ".models.loading.load", "available_names": ".models.loading.load", "load": ".models.loading.load",
    "Trace": ".models.runtime.trace", "trace": ".models.runtime.trace", "VerifyReport": ".models.runtime.verify",
    "verify": ".models.runtime.verify",
    "show": ".viz.notebook",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

__all__ = [
    "Anatomy", "ComponentAttribution", "Explanation", "Generation", "InputError", "LenscopeError", "LoadedModel",
    "MissingDependencyError", "NotApplicableError", "Trace", "UnknownModelError", "UnsupportedModelError",
    "VerifyReport", "available_names", "direct_logit_attribution", "explain", "explain_all", "generate", "load",
    "show", "trace", "verify",
]
