"""The table of context-attribution methods: the one place a method is named and dispatched.

Each :class:`Method` says what it needs (a target to explain, the trace, a causal decoder) and provides its
single-row computation (``explain``: one prediction, an :class:`~lenscope.attribution.explanation.Explanation`)
and its many-row one (``rows``: every generated token of a sequence, :class:`Rows`). :func:`lenscope.explain`,
:func:`~lenscope.attribution.explain.explain_all`, :func:`lenscope.generate`, the report's attribution and
generation views, ``lenscope serve``'s ``/api/token`` and ``lenscope eval alignment`` all read this table, so a
new method is one :func:`register` call (``tests/attribution/test_methods.py`` registers a dummy one and sees it
everywhere). The CLI's ``--method`` choices and help are :func:`names` (read when the command line is built), and
what the commands ask of a method is its entry: the options it takes (``options``, the values of an option that
names something: ``choices``), what it checks of its input (``check_prompt``), its words (``label``), whether it
reports a completeness error (``completeness``), eval alignment's once-per-call preparation (``prepare``) and
per-dataset summary (``summarize``). No code outside this file names a method.

This module imports no torch at module level (the command line's ``--help`` reads it): a method's code is imported
when it runs.

Order: the table's order is the order of :func:`names` (help texts, error messages); ``view_rank`` orders the
report's and the app's attribution views (ALTI-Logit first).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..errors import InputError
from ..registry import Table

if TYPE_CHECKING:
    from torch import Tensor

LOGIT, ALTI_LOGIT, ALTI, VALUE_ZEROING = "logit", "alti-logit", "alti", "value-zeroing"
GRAD_NORM, GRAD_X_INPUT, IG, ERASURE = "grad-norm", "grad-x-input", "ig", "erasure"
DEFAULT = ALTI_LOGIT  # lenscope.explain's and lenscope.generate's default; eval alignment's reference method

# tokens per forward/backward pass of the gradient methods in :func:`lenscope.generate` (rows x positions) unless
# batch_size is given: about 1 GB of saved activations for smollm2 (explain's integrated gradients on a 62-token
# text runs 16 x 62)
MAX_TOKENS = 1024


@dataclass
class Rows:
    """The many-row problem of :func:`lenscope.generate`: the predictions at ``rows (k,)`` of one sequence ``ids
    (pos,)`` (its trace ``tr``), each of token ``tok[i]`` against ``foils[i]`` (None: the token's logit alone).
    ``options``: the methods' options (``steps``, ``baseline``, ``batch_size``); ``cache``: computations shared by
    the methods of one generation (the logit parts, the ALTI / value-zeroing contributions, the gradients);
    ``f_input()``: the logit differences of the rows (computed on first use)."""

    lm: object
    tr: object
    ids: Tensor
    rows: Tensor
    tok: Tensor
    foils: Tensor | None
    options: dict = field(default_factory=dict)
    progress: Callable | None = None
    f_input_fn: Callable | None = None
    cache: dict = field(default_factory=dict)

    def shared(self, key: str, fn: Callable):
        if key not in self.cache:
            self.cache[key] = fn()
        return self.cache[key]

    def f_input(self) -> Tensor | None:
        """The rows' logit differences, or None without ``f_input_fn`` (a method then computes them itself)."""
        return None if self.f_input_fn is None else self.shared("f_input", self.f_input_fn)

    def batch(self) -> Tensor:
        return self.ids[None].expand(len(self.rows), -1)

    def source(self) -> dict:
        """The baselines' ``source=`` for every row: an encoder-decoder trace's source ids (``tr.encoder``), or
        nothing."""
        enc = getattr(self.tr, "encoder", None)
        return {} if enc is None else {"source": enc.input_ids[None].expand(len(self.rows), -1)}


@dataclass
class Texts:
    """The many-text problem of ``lenscope eval alignment``: the predictions at the last position of texts ``ids
    (k, n)`` of one length, text ``i`` of ``t[i]`` against ``f[i]``; ``trs``: their traces (one per text, for the
    trace-based methods), ``f_full (k,)`` their logit differences; ``options``: ``ig_steps``, ``max_tokens``,
    ``baseline`` (integrated gradients' baseline: a name, or the tensor it names)."""

    lm: object
    ids: Tensor
    t: Tensor
    f: Tensor
    trs: list | None
    f_full: Tensor
    options: dict = field(default_factory=dict)
    cache: dict = field(default_factory=dict)

    def shared(self, key, fn: Callable):
        if key not in self.cache:
            self.cache[key] = fn()
        return self.cache[key]

    def logit(self, k: int):
        """The Logit explanation of text ``k`` on its trace (computed once; eval alignment's per-layer updates
        read it too). A refusal (:class:`~lenscope.errors.LenscopeError`) is raised again on each call."""
        from ..errors import LenscopeError
        from .context import logit_explanation

        def compute():
            tr = self.trs[k]
            try:
                return logit_explanation(self.lm, tr.input_ids, int(self.t[k]), int(self.f[k]), tr=tr)
            except LenscopeError as e:
                return e

        out = self.shared((LOGIT, k), compute)
        if isinstance(out, Exception):
            raise out
        return out


@dataclass(frozen=True)
class Method:
    """One context-attribution method.

    - ``explain(lm, text, target, foil, *, position, **options) -> Explanation`` (and ``tr=`` when
      ``uses_trace``): one prediction.
    - ``rows(job: Rows) -> (scores (k, src), invariant_error (k,))``: every row of a generation at once (NaN
      invariant errors where the method has no invariant; those of ``uses_trace`` methods are checked; the
      baselines' over a source: the logit difference they explained against the trace's). None:
      :meth:`generation_rows` calls ``explain`` once per row.
    - ``texts``: the eval alignment form (:class:`Texts`; None: not in eval alignment): ``texts(job, i) -> scores
      (n,)`` of text ``i`` on its own trace for a ``uses_trace`` method, else ``texts(job) -> (scores (k, n),
      [info of each text] or None)``; timed as ``group`` or its name.
    - ``needs_target``: it explains a logit (target, foil); False: it reads no logit (a rollout row).
    - ``uses_trace``: it reads one captured trace, which several methods can share (``tr=``).
    - ``needs_causal``: it needs a causal decoder (the report and the app leave it out for other models).
    - ``reads_source``: it explains an encoder-decoder model given its source (``source=``).
    - ``options``: the options it takes in ``generate``; ``explain_options``: ``explain_all`` passes its options
      on to it; ``group``: methods of a group share one computation in ``generate`` (timed together).
    - ``view_rank``: its place in the report's and app's attribution views, ``view_options`` the options it runs
      with there; ``in_generation_view``: a default method of the report's generation view. (Its name in words,
      for the pages: ``LS.methodNames`` in ``viz/report/assets/core.js``.)
    - ``choices()``: ``{option: the values it may take}`` for its options that name something (read when checked,
      :meth:`allowed`; ``lenscope explain --baseline``).
    - ``check_prompt(n, source)``: refuses (:class:`InputError`) a generation's prompt of ``n`` tokens (``source``:
      whether it has an encoder's source) that the method cannot explain, before the model generates.
    - ``label``: its short name in the command line's lines (default its name).
    - ``completeness``: it reports how complete its scores are (``info["completeness_error"]``): in the report's
      checks as ``"<name>: <completeness>"``, in the attribution view's record and in ``lenscope explain``'s
      table (``"<label> completeness error"``); None: it reports none.
    - ``prepare(lm, options) -> options``: eval alignment's preparation, once per call, of what its ``texts``
      form reads (added to :class:`Texts`'s options).
    - ``summarize(records) -> {key: value}``: eval alignment's summary of one dataset's alignment records of the
      method (added to the dataset's summary).
    """

    name: str
    explain: Callable
    rows: Callable | None = None
    texts: Callable | None = None
    needs_target: bool = True
    uses_trace: bool = False
    needs_causal: bool = False
    reads_source: bool = False
    options: tuple[str, ...] = ()
    explain_options: bool = False
    group: str | None = None
    view_rank: int = 1000
    view_options: tuple[tuple[str, object], ...] = ()
    in_generation_view: bool = False
    choices: Callable[[], dict] | None = None
    check_prompt: Callable[[int, bool], None] | None = None
    label: str | None = None
    completeness: str | None = None
    prepare: Callable[[object, dict], dict] | None = None
    summarize: Callable[[list], dict] | None = None

    def allowed(self, option: str) -> tuple | None:
        """The values ``option`` may take (:attr:`choices`), or None (any)."""
        return None if self.choices is None else self.choices().get(option)

    def generation_rows(self, job: Rows) -> tuple[Tensor, Tensor]:
        """``rows(job)``, or without it ``explain`` on each row's prefix (one call per generated token)."""
        if self.rows is not None:
            return self.rows(job)
        import torch

        n = len(job.ids)
        scores = torch.zeros(len(job.rows), n, dtype=torch.float64)
        inv = torch.full((len(job.rows),), float("nan"), dtype=torch.float64)
        for i, r in enumerate(job.rows.tolist()):
            foil = None if job.foils is None or not self.needs_target else int(job.foils[i])
            e = self.explain(job.lm, job.ids[: r + 1], int(job.tok[i]) if self.needs_target else None, foil,
                             position=-1, **({k: v for k, v in job.options.items() if k in self.options}))
            scores[i, : r + 1] = e.scores.double()
            if e.invariant_error is not None:
                inv[i] = e.invariant_error
        return scores, inv


_TABLE: Table[Method] = Table("an attribution method", "unknown method {name!r}; {choose} {names}")
register, unregister, lookup = _TABLE.register, _TABLE.unregister, _TABLE.lookup
names = _TABLE.names  # the method names in table order (the CLI's ``--method`` choices)
methods = _TABLE.entries


def get(name: str, *, choose: str = "choose one of") -> Method:
    """The method named ``name``, or an :class:`InputError` listing the names."""
    return _TABLE.get(name, choose=choose)


def needs_target(name: str) -> bool:
    """Whether method ``name`` explains a logit (an unknown name, e.g. from an old file, is taken to)."""
    m = _TABLE.lookup(name)
    return True if m is None else m.needs_target


def without_target() -> tuple[str, ...]:
    """The methods that need no target (what ``explain_all`` runs without one)."""
    return tuple(m.name for m in _TABLE.entries() if not m.needs_target)


def source_readers() -> tuple[str, ...]:
    """The methods that explain an encoder-decoder model given its source (``reads_source``), in table order."""
    return tuple(m.name for m in _TABLE.entries() if m.reads_source)


def eval_methods() -> tuple[str, ...]:
    """The methods eval alignment runs (those with a ``texts`` form), in table order."""
    return tuple(m.name for m in _TABLE.entries() if m.texts is not None)


def eval_timers() -> tuple[str, ...]:
    """The timing stages of eval alignment's methods (a group's methods share one), in table order."""
    return tuple(dict.fromkeys(m.group or m.name for m in _TABLE.entries() if m.texts is not None))


def view_methods(*, has_logits: bool = True, causal: bool = True) -> list[Method]:
    """The methods of the report's and the app's attribution views for a model, in view order: those needing a
    target only with a language-model head, those needing a causal decoder only for one."""
    out = [m for m in _TABLE.entries() if (has_logits or not m.needs_target) and (causal or not m.needs_causal)]
    return sorted(out, key=lambda m: m.view_rank)


def generation_view_methods() -> tuple[str, ...]:
    """The report's generation view's default methods, in view order."""
    return tuple(m.name for m in sorted(_TABLE.entries(), key=lambda m: m.view_rank) if m.in_generation_view)


def taking(option: str) -> tuple[str, ...]:
    """The methods that take ``option`` (e.g. ``steps``), in table order."""
    return tuple(m.name for m in _TABLE.entries() if option in m.options)


def option_methods() -> dict[str, tuple[str, ...]]:
    """``{option: methods taking it}`` for ``generate``, options in first-seen order."""
    out: dict[str, list[str]] = {}
    for m in _TABLE.entries():
        for o in m.options:
            out.setdefault(o, []).append(m.name)
    return {o: tuple(ms) for o, ms in out.items()}


# ------------------------------------------------------------------------------------ the built-in methods


def _logit(lm, text, target, foil=None, **kw):
    from .context import logit_explanation

    return logit_explanation(lm, text, target, foil, **kw)


def _alti_logit(lm, text, target, foil=None, **kw):
    from .context import alti_logit_explanation

    return alti_logit_explanation(lm, text, target, foil, **kw)


def _rollout(kind: str):
    def explain(lm, text, target=None, foil=None, **kw):
        from .context import rollout_explanation

        return rollout_explanation(lm, text, method=kind, target=target, foil=foil, **kw)

    return explain


def _baseline(fn_name: str):
    def explain(lm, text, target, foil=None, **kw):
        from . import baselines

        return getattr(baselines, fn_name)(lm, text, target, foil, **kw)

    return explain


def _parts(job: Rows) -> dict:
    from .context import logit_parts

    return job.shared("parts", lambda: logit_parts(job.lm, job.tr, job.rows, job.tok, job.foils))


def _mixing(job: Rows, kind: str):
    from ..mixing.alti import encoder_decoder_mixing, mixing_matrices

    A, progress = job.lm.anatomy, job.progress
    if job.tr.encoder is not None:  # an encoder-decoder model: ALTI+ (ALTI-Logit reads it) or its value zeroing
        return job.shared(kind, lambda: encoder_decoder_mixing(A, job.tr, method=kind))
    return job.shared(kind, lambda: mixing_matrices(
        A, job.tr, kind, model_name=job.lm.name, rollout=False,
        progress=None if progress is None else (lambda l: progress(f"{kind} layers", l + 1, A.n_layers))))


def _logit_rows(job: Rows):
    parts = _parts(job)
    return parts["head_scores"].sum((1, 2)), parts["invariant_error"]


def _alti_logit_rows(job: Rows):
    from .context import alti_logit_rows

    parts = _parts(job)
    carried, inv = alti_logit_rows(job.lm, parts, _mixing(job, ALTI))
    return carried.sum(1), inv


def _rollout_rows(kind: str):
    def rows(job: Rows):
        from .context import rollout_rows

        r, inv = rollout_rows(_mixing(job, kind), job.rows)
        return r[:, -1], inv

    return rows


def _nan(job: Rows) -> Tensor:
    import torch

    return torch.full((len(job.rows),), float("nan"), dtype=torch.float64)


def _baseline_check(job: Rows, f: Tensor) -> Tensor:
    """The baselines' invariant error: NaN (none) for a decoder; over a source, the logit difference ``f (k,)``
    they explained against the trace's, relative to the row's largest logit (the two are one float32 pass each:
    an error here means the source or the prefix is not the trace's, e.g. a padded batch's row read wrongly)."""
    if getattr(job.tr, "encoder", None) is None:
        return _nan(job)
    import torch

    logits = job.tr.logits[job.rows.to(job.tr.logits.device)].double().cpu()  # (k, vocab)
    k = torch.arange(len(job.rows))
    want = logits[k, job.tok.cpu()] - (0.0 if job.foils is None else logits[k, job.foils.cpu()])
    return (f.double().cpu() - want).abs() / logits.abs().amax(-1).clamp_min(1e-30)


def _max_tokens(job: Rows):
    return None if job.options.get("batch_size") is not None else MAX_TOKENS


def _gradient_rows(kind: str):
    def rows(job: Rows):
        from .baselines import gradient_rows

        g = job.shared("gradients", lambda: gradient_rows(
            job.lm, job.batch(), job.tok, job.foils, position=job.rows,
            internal_batch_size=job.options.get("batch_size"), max_tokens=_max_tokens(job), **job.source()))
        return g[kind], _baseline_check(job, g["f"])

    return rows


def _ig_rows(job: Rows):
    from .baselines import integrated_gradients_rows

    res = integrated_gradients_rows(
        job.lm, job.batch(), job.tok, job.foils, position=job.rows, steps=int(job.options.get("steps", 16)),
        baseline=job.options.get("baseline", "zero"), internal_batch_size=job.options.get("batch_size"),
        max_tokens=_max_tokens(job), **job.source())
    return res["ig"], _baseline_check(job, res["f_input"])


def _erasure_rows(job: Rows):
    from .baselines import erasure_rows

    bs = job.options.get("batch_size")
    res = erasure_rows(job.lm, job.batch(), job.tok, job.foils, position=job.rows, f_input=job.f_input(),
                       internal_batch_size=bs if bs is not None else 64, **job.source())
    return res["erasure"], _baseline_check(job, res["f"])


def _logit_text(job: Texts, k: int) -> Tensor:
    return job.logit(k).scores


def _alti_logit_text(job: Texts, k: int) -> Tensor:
    from .context import alti_logit_explanation

    tr = job.trs[k]
    return alti_logit_explanation(job.lm, tr.input_ids, int(job.t[k]), int(job.f[k]), tr=tr).scores


def _gradient_texts(kind: str):
    def texts(job: Texts):
        from .baselines import gradient_rows

        g = job.shared("gradients", lambda: gradient_rows(job.lm, job.ids, job.t, job.f, last_only=True))
        return g[kind], None

    return texts


def _ig_texts(job: Texts):
    from .baselines import integrated_gradients_rows

    o = job.options
    res = integrated_gradients_rows(job.lm, job.ids, job.t, job.f, steps=int(o["ig_steps"]), last_only=True,
                                    max_tokens=o["max_tokens"], baseline=o["baseline"])
    name = o.get("baseline_name", o["baseline"])
    infos = [{"ig_completeness_error": float(res["completeness_error"][k]),
              "ig_completeness_abs": float(res["completeness_abs"][k]), "ig_f_input": float(res["f_input"][k]),
              "ig_f_baseline": float(res["f_baseline"][k]), "ig_baseline": name} for k in range(len(job.ids))]
    return res["ig"], infos


def _ig_choices() -> dict:
    from .inputs import IG_BASELINES

    return {"baseline": IG_BASELINES}


def _ig_prepare(lm, options: dict) -> dict:
    """Integrated gradients' baseline embedding, once per eval alignment call (the mean one is a pass over the
    vocabulary; the zero one stays its name, None there); its name stays ``baseline_name``."""
    from .inputs import ig_baseline

    name = options["baseline"]
    base = ig_baseline(lm, name)[0]
    return {"baseline": name if base is None else base, "baseline_name": name}


def _ig_summarize(records: list) -> dict:
    """``ig_completeness``: the baselines and the median and largest relative and absolute completeness errors of
    the records that integrated gradients explained."""
    import numpy as np

    ig = [r for r in records if IG in r.get("metrics", {})]
    rel = [r["info"]["ig_completeness_error"] for r in ig if r.get("info", {}).get("ig_completeness_error")
           is not None]
    ab = [r["info"]["ig_completeness_abs"] for r in ig if r["info"].get("ig_completeness_abs") is not None]
    bases = sorted({r["info"].get("ig_baseline", "zero") for r in ig})
    return {"ig_completeness": {
        "baseline": ",".join(bases) if bases else None, "n": len(rel),
        "median": float(np.median(rel)) if rel else None, "max": float(np.max(rel)) if rel else None,
        "median_abs": float(np.median(ab)) if ab else None, "max_abs": float(np.max(ab)) if ab else None}}


def _erasure_prompt(n: int, source: bool) -> None:
    if not source and n < 2:
        raise InputError("erasure needs a prompt of at least 2 tokens: the first step's prediction would have no "
                         "context left once its one token is erased")


def _erasure_texts(job: Texts):
    from .baselines import erasure_rows

    res = erasure_rows(job.lm, job.ids, job.t, job.f, f_input=job.f_full, last_only=True,
                       max_tokens=4 * job.options["max_tokens"])
    return res["erasure"], None


for _m in (
    Method(LOGIT, _logit, _logit_rows, _logit_text, uses_trace=True, needs_causal=True, reads_source=True,
           view_rank=1, in_generation_view=True),
    Method(ALTI_LOGIT, _alti_logit, _alti_logit_rows, _alti_logit_text, uses_trace=True, needs_causal=True,
           reads_source=True, view_rank=0, in_generation_view=True),
    Method(ALTI, _rollout(ALTI), _rollout_rows(ALTI), needs_target=False, uses_trace=True, reads_source=True,
           view_rank=6, in_generation_view=True),
    Method(GRAD_NORM, _baseline("grad_norm"), _gradient_rows(GRAD_NORM), _gradient_texts(GRAD_NORM),
           reads_source=True, options=("batch_size",), group="gradients", view_rank=3),
    Method(GRAD_X_INPUT, _baseline("grad_x_input"), _gradient_rows(GRAD_X_INPUT), _gradient_texts(GRAD_X_INPUT),
           reads_source=True, options=("batch_size",), group="gradients", view_rank=2),
    # in the views, integrated gradients' 32 steps in 4 passes of 8 rows, not one of 32: the same sum, and a
    # computation that is asked to stop (lenscope serve: its client went away) stops within a quarter of it
    Method(IG, _baseline("integrated_gradients"), _ig_rows, _ig_texts, reads_source=True,
           options=("steps", "baseline", "batch_size"), explain_options=True, view_rank=4,
           view_options=(("steps", 32), ("batch_size", 8)), choices=_ig_choices, label="IG",
           completeness="completeness error (reported; a zero baseline is not complete on every model, see "
           "docs/attribution.md)", prepare=_ig_prepare, summarize=_ig_summarize),
    Method(ERASURE, _baseline("erasure"), _erasure_rows, _erasure_texts, reads_source=True, options=("batch_size",),
           explain_options=True, view_rank=5, check_prompt=_erasure_prompt),
    Method(VALUE_ZEROING, _rollout(VALUE_ZEROING), _rollout_rows(VALUE_ZEROING), needs_target=False,
           uses_trace=True, reads_source=True, view_rank=7),
):
    register(_m)
del _m
