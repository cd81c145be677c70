"""``lenscope.explain``: one entry point for every context-attribution method (the table in
:mod:`lenscope.attribution.methods`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import InputError, NotApplicableError
from . import methods as table

if TYPE_CHECKING:  # imported by the package's light face (no torch at import)
    from ..models.loading.load import LoadedModel
    from ..models.runtime.trace import Trace
    from .explanation import Explanation


def explain(lm: LoadedModel, text=None, target=None, foil=None, *, method: str = table.DEFAULT, position: int = -1,
            tr: Trace | None = None, source=None, **options) -> Explanation:
    """Explain the prediction at ``position`` (default: the last token) by scores over the input tokens.

    ``method`` is one of ``logit, alti-logit, alti, grad-norm, grad-x-input, ig, erasure, value-zeroing``
    (:func:`lenscope.attribution.methods.names`, with any registered method).
    Methods that explain a logit need ``target`` (a token's text, ``"#ID"`` or an int); a ``foil`` makes them
    contrastive (target minus foil). ``alti`` and ``value-zeroing`` need no target: they give the row of
    their rollout at ``position`` (summing to one). ``text`` is a string or token ids; a precomputed
    ``tr = lenscope.trace(lm, text)`` can serve several trace-based methods (logit, alti-logit, alti,
    value-zeroing). Extra ``options`` go to the method (``steps`` for ``ig``, ``batch_size``). ``source``: an
    encoder-decoder model's source text (``text`` is then the target prefix), for the methods that read one
    (``Method.reads_source``: ``logit``, ``alti-logit``, the gradients, ``ig``, ``erasure``; docs/encoder-decoder.md).
    """
    m = table.get(method)
    if source is not None:
        if not m.reads_source:
            raise NotApplicableError(f"--method {method} does not read encoder-decoder models yet (a source); "
                                     f"{', '.join(table.source_readers())} does")
        options["source"] = source
    if text is None:
        if tr is None:
            raise InputError("give a text (or token ids) to explain")
        text = tr.input_ids
    if m.needs_target and target is None:
        raise InputError(f"--method {method} explains a logit and needs a target token (--target); "
                         f"{' and '.join(table.without_target())} need none")
    if m.uses_trace:
        options["tr"] = tr
    return m.explain(lm, text, target, foil, position=position, **options)


def explain_all(lm: LoadedModel, text, target=None, foil=None, *, methods=None, position: int = -1,
                **options) -> dict[str, Explanation]:
    """Several methods on one text, sharing one trace: ``{method: Explanation}``. Without a target, only the
    methods that need none run (``alti``, ``value-zeroing``)."""
    from ..models.runtime.trace import trace

    if methods is None:
        methods = table.names() if target is not None else table.without_target()
    tr = trace(lm, text)
    return {m: explain(lm, text, target, foil, method=m, position=position, tr=tr,
                       **(dict(options) if table.get(m).explain_options else {}))
            for m in methods}
