"""``lenscope.explain``: one entry point for every context-attribution method."""

from __future__ import annotations

from ..errors import InputError
from ..models.load import LoadedModel
from ..models.trace import Trace
from .explanation import LOGIT_METHODS, METHODS, ROLLOUT_METHODS, Explanation


def explain(lm: LoadedModel, text=None, target=None, foil=None, *, method: str = "alti-logit", position: int = -1,
            tr: Trace | None = None, **options) -> Explanation:
    """Explain the prediction at ``position`` (default: the last token) by scores over the input tokens.

    ``method`` is one of ``logit, alti-logit, alti, grad-norm, grad-x-input, ig, erasure, value-zeroing``.
    Methods that explain a logit need ``target`` (a token's text, ``"#ID"`` or an int); a ``foil`` makes them
    contrastive (target minus foil). ``alti`` and ``value-zeroing`` need no target: they give the row of
    their rollout at ``position`` (summing to one). ``text`` is a string or token ids; a precomputed
    ``tr = lenscope.trace(lm, text)`` can serve several trace-based methods (logit, alti-logit, alti,
    value-zeroing). Extra ``options`` go to the method (``steps`` for ``ig``, ``batch_size``).
    """
    if method not in METHODS:
        raise InputError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    if text is None:
        if tr is None:
            raise InputError("give a text (or token ids) to explain")
        text = tr.input_ids
    if method in LOGIT_METHODS and target is None:
        raise InputError(f"--method {method} explains a logit and needs a target token (--target); "
                         "alti and value-zeroing need none")
    from . import context

    if method == "logit":
        return context.logit_explanation(lm, text, target, foil, position=position, tr=tr, **options)
    if method == "alti-logit":
        return context.alti_logit_explanation(lm, text, target, foil, position=position, tr=tr, **options)
    if method in ROLLOUT_METHODS:
        return context.rollout_explanation(lm, text, method=method, position=position, target=target, foil=foil,
                                           tr=tr, **options)
    from . import baselines

    fn = {"grad-norm": baselines.grad_norm, "grad-x-input": baselines.grad_x_input,
          "ig": baselines.integrated_gradients, "erasure": baselines.erasure}[method]
    return fn(lm, text, target, foil, position=position, **options)


def explain_all(lm: LoadedModel, text, target=None, foil=None, *, methods=None, position: int = -1,
                **options) -> dict[str, Explanation]:
    """Several methods on one text, sharing one trace: ``{method: Explanation}``. Without a target, only the
    methods that need none run (``alti``, ``value-zeroing``)."""
    from ..models.trace import trace

    if methods is None:
        methods = METHODS if target is not None else ROLLOUT_METHODS
    tr = trace(lm, text)
    return {m: explain(lm, text, target, foil, method=m, position=position, tr=tr,
                       **({k: v for k, v in options.items()} if m in ("ig", "erasure") else {}))
            for m in methods}
