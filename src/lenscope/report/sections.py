"""The report's sections, one class each. A section says whether it applies to the model (else a one-line note
takes its place), computes a JSON-able payload from the shared :class:`ReportContext` (calling the methods), and
records its exactness checks there; its view (the folder ``viz/views/<key>/``, :mod:`lenscope.viz.views`) converts
and draws it and gives its words. A section registers itself by subclassing :class:`Section` with a ``key``
(:data:`SECTIONS`, in the order they are defined); no other section changes."""

from __future__ import annotations

import torch

from ..viz import views
from ..viz.report.payloads import rounded as _r
from ..viz.views.attribution import attribution_payload
from ..viz.views.components import components_payload
from ..viz.views.features import features_payload
from ..viz.views.flow import flow_payload
from ..viz.views.graph import graph_checks, graph_payload
from ..viz.views.mixing import mixing_payload
from ..viz.views.trajectory import trajectory_payload
from .context import ReportContext

# every section, in the order of the report (a Section subclass with a key adds itself)
SECTIONS: list[type[Section]] = []


def _tol(ctx: ReportContext) -> float:
    """The methods' own limit for this model (larger for bfloat16 / float16 models: their rounding)."""
    from ..models.runtime.verify import completeness_tolerance

    return completeness_tolerance(ctx.lm)


class _ViewWords:
    """A section's title (0) or blurb (1): its view's words, read when asked (a plug-in's view may be found after its
    section is defined)."""

    def __init__(self, i: int):
        self.i = i

    def __get__(self, obj, owner) -> str:
        view = views.get(owner.key)
        return view.words[self.i] if view is not None else ""


class Section:
    """A view of the report. A subclass names its ``key`` (and so joins :data:`SECTIONS`, replacing a section of the
    same key); its ``title`` and ``blurb`` are its view's words (:mod:`lenscope.viz.views`) unless it sets its
    own."""

    key = ""
    title = _ViewWords(0)
    blurb = _ViewWords(1)
    needs_corrupted = False  # shown by default only when the report is given a corrupted prompt

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.key and "key" in cls.__dict__:
            SECTIONS[:] = [s for s in SECTIONS if s.key != cls.key] + [cls]

    def wanted(self, ctx: ReportContext) -> bool:
        """Whether the view is part of the default report for this context."""
        return ctx.corrupted is not None or not self.needs_corrupted

    def skip_reason(self, ctx: ReportContext) -> str | None:
        """None when the view applies; else the one-line note shown instead of it."""
        return None

    def compute(self, ctx: ReportContext) -> dict:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(key={self.key!r})"


def _need_logits(ctx: ReportContext, what: str) -> str | None:
    if not ctx.has_logits:
        return f"{ctx.lm.name} has no language-model head (an encoder without one), so there is no {what}."
    return None


class Prediction(Section):
    key = "prediction"

    def compute(self, ctx: ReportContext) -> dict:
        from ..models.runtime.verify import verify

        rep = verify(ctx.lm, tr=ctx.trace)
        ctx.check(self.key, "verify: largest relative residual error", rep.max_rel_resid_error, rep.resid_tol)
        ctx.check(self.key, "verify: largest relative sub-layer error", rep.max_rel_sublayer_error, rep.resid_tol)
        if rep.max_abs_logit_error is not None:
            ctx.check(self.key, "verify: largest absolute logit error", rep.max_abs_logit_error, rep.logit_tol)
        out = {"verify": {"ok": rep.ok, "max_rel_resid_error": rep.max_rel_resid_error,
                          "max_rel_sublayer_error": rep.max_rel_sublayer_error,
                          "max_abs_logit_error": rep.max_abs_logit_error}, "top": []}
        if ctx.has_logits:
            logits = ctx.final_logits
            probs = torch.softmax(logits.double(), -1)
            top = torch.topk(probs, min(ctx.top_k, probs.numel()))
            out["top"] = [{"token": ctx.token_text(i), "id": int(i), "prob": _r(p), "logit": _r(logits[i])}
                          for p, i in zip(top.values.tolist(), top.indices.tolist())]
            out["entropy"] = _r(-(probs * torch.log(probs.clamp_min(1e-300))).sum())
        return out


class Trajectory(Section):
    key = "trajectory"

    def skip_reason(self, ctx):
        return _need_logits(ctx, "logit lens")

    def compute(self, ctx: ReportContext) -> dict:
        from ..lenses import LogitLens
        from ..lenses.trajectory import prediction_trajectory

        lenses = [LogitLens(ctx.lm.anatomy, model_name=ctx.lm.name)]
        if ctx.lens is not None:
            lenses.insert(0, ctx.lens)
        trajs = [prediction_trajectory(ctx.lm, lens=lens, k=5, tr=ctx.trace) for lens in lenses]  # the shared trace
        return trajectory_payload(trajs)


class Components(Section):
    key = "components"

    def skip_reason(self, ctx):
        if not ctx.lm.anatomy.causal:
            return "Direct logit attribution is defined for decoders (next-token logits); this model is an encoder."
        return _need_logits(ctx, "logit to decompose")

    def compute(self, ctx: ReportContext) -> dict:
        """One view per logit: the target minus the foil (when a foil is given), the target's, the foil's."""
        views = {}
        if ctx.foil_id is not None:
            views["difference"] = self._dla(ctx, ctx.target_id, ctx.foil_id)
        views["target"] = self._dla(ctx, ctx.target_id, None)
        if ctx.foil_id is not None:
            views["foil"] = self._dla(ctx, ctx.foil_id, None)
        return components_payload(views)

    def _dla(self, ctx: ReportContext, t_id: int, f_id: int | None):
        from ..attribution.dla import direct_logit_attribution

        res = direct_logit_attribution(ctx.lm, ctx.ids, t_id, f_id, by_head=True, tr=ctx.trace)
        what = ctx.token_text(t_id) if f_id is None else f"{ctx.token_text(t_id)} - {ctx.token_text(f_id)}"
        ctx.check(self.key, f"direct logit attribution of {what!r}: |sum of parts - logit|", res.completeness_error,
                  _tol(ctx))
        return res


class Attribution(Section):
    key = "attribution"
    # the methods and their options here: lenscope.attribution.methods.view_methods() (the method table)

    @staticmethod
    def explain_each(lm, ids, tr, target_id, foil_id, *, position: int = -1, has_logits: bool = True):
        """``(method, explanation or the NotApplicableError it raised)`` for each method of the view (the method
        table's :func:`~lenscope.attribution.methods.view_methods` for this model), one at a time; the report and
        ``lenscope serve``'s ``/api/token`` share it."""
        from ..attribution.explain import explain
        from ..attribution.methods import view_methods
        from ..errors import NotApplicableError
        from ..models.runtime.stop import checkpoint

        for m in view_methods(has_logits=has_logits, causal=lm.anatomy.causal):
            checkpoint()  # each method is a chunk (and within one, each forward pass or layer)
            kw = ({"tr": tr} if m.uses_trace else {}) | dict(m.view_options)
            try:
                yield m.name, explain(lm, ids, target_id if m.needs_target else None,
                                      foil_id if m.needs_target else None, method=m.name, position=position, **kw)
            except NotApplicableError as err:
                yield m.name, err

    def compute(self, ctx: ReportContext) -> dict:
        explanations = {}
        for m, e in self.explain_each(ctx.lm, ctx.ids, ctx.trace, ctx.target_id, ctx.foil_id,
                                      has_logits=ctx.has_logits):
            if isinstance(e, Exception):
                raise e
            explanations[m] = e
            if e.invariant_error is not None:
                ctx.check(self.key, f"{m}: invariant error", e.invariant_error, _tol(ctx))
            if e.reports_completeness:
                from ..attribution.methods import get

                ctx.check(self.key, f"{m}: {get(m).completeness}", e.info.get("completeness_error"))
        return attribution_payload(explanations, tokens=ctx.tokens, target=ctx.token_text(ctx.target_id),
                                            foil=ctx.token_text(ctx.foil_id))


class Mixing(Section):
    key = "mixing"

    def compute(self, ctx: ReportContext) -> dict:
        from ..mixing.maps import context_mixing

        maps = context_mixing(ctx.lm, tr=ctx.trace)
        for scope, m in maps.items():
            ctx.check(self.key, f"{scope}: completeness error", m.completeness_error, _tol(ctx))
        return mixing_payload(maps)


class Flow(Section):
    key = "flow"

    def compute(self, ctx: ReportContext) -> dict:
        from ..mixing.alti import mixing_matrices

        mm = mixing_matrices(ctx.lm.anatomy, ctx.trace, "alti", model_name=ctx.lm.name)
        ctx.check(self.key, "ALTI: decomposition error", mm.completeness_error, _tol(ctx))
        ctx.check(self.key, "ALTI: largest row-sum deviation", mm.row_sum_error, _tol(ctx))
        return flow_payload(mm)


class Circuit(Section):
    key = "circuit"
    needs_corrupted = True
    method = "eap-ig"
    level = "edges"
    top = 300  # the edges sent to the page (it draws at most 300)

    def skip_reason(self, ctx):
        if ctx.corrupted is None:
            return "The circuit view needs a corrupted prompt: give --corrupted TEXT (with --target and --foil)."
        return None

    def compute(self, ctx: ReportContext) -> dict:
        from ..circuits import circuit_json
        from ..data.contrast import ContrastPair

        if ctx.circuit is not None:
            return circuit_payload(ctx, ctx.circuit)
        pairs = [ContrastPair(ctx.text, ctx.corrupted, _spec(ctx.target), _spec(ctx.foil))]
        d = circuit_json(ctx.lm, pairs, method=self.method, level=self.level, top=self.top, faithfulness=True)
        return circuit_payload(ctx, d)


def _spec(token) -> str:
    """A target as :class:`~lenscope.data.contrast.ContrastPair` takes it: token text, or ``"#ID"`` for an id."""
    return token if isinstance(token, str) else f"#{int(token)}"


def circuit_payload(ctx: ReportContext, d: dict) -> dict:
    """``circuit_json``'s dict for the page: scores rounded to 5 digits, at most :attr:`Circuit.top` edges (the
    largest |score| first), and the faithfulness of the full graph recorded as a check (keeping every edge is
    the clean run: 1)."""
    out = dict(d)
    for key in ("metric_clean", "metric_corrupted", "seconds", "seconds_total"):
        if out.get(key) is not None:
            out[key] = _r(out[key])
    out["nodes"] = [dict(n, score=_r(n["score"])) for n in d.get("nodes", [])]
    edges = sorted(d.get("edges", []), key=lambda e: -abs(e["score"]))[:Circuit.top]
    out["edges"] = [dict(e, score=_r(e["score"])) for e in edges]
    faith = d.get("faithfulness") or []
    out["faithfulness"] = [{"k": int(f["k"]), "fraction": _r(f["fraction"]), "value": _r(f["value"])} for f in faith]
    if faith:
        full = max(faith, key=lambda f: f["k"])
        if full["fraction"] == 1:
            ctx.check(Circuit.key, "faithfulness with every edge kept: |value - 1|", abs(full["value"] - 1), 1e-3)
    if d.get("check"):
        ctx.check(Circuit.key, "against exact patching: Spearman correlation (reported)", d["check"]["spearman"])
    return out


from ..viz.views import generation as _gen_view  # noqa: E402 - the generation view's words live with its drawing


class Generation(Section):
    """A continuation of the text generated and explained token by token (``lenscope.generate``): shown when the
    report is given ``generate=N`` (``lenscope report TEXT --generate N``), with ``ctx.explain`` methods (default
    :attr:`methods`), each contrastive against the runner-up at its step."""

    key = _gen_view.KEY

    @staticmethod
    def methods() -> tuple[str, ...]:
        """The default methods (the method table's ``in_generation_view`` ones: trace-based, all steps from one
        forward pass)."""
        from ..attribution.methods import generation_view_methods

        return generation_view_methods()

    def wanted(self, ctx: ReportContext) -> bool:
        return ctx.generate is not None

    def skip_reason(self, ctx):
        if ctx.generate is None:
            return ("The generation view needs a number of tokens to generate: give --generate N "
                    "(build_report(..., generate=N)).")
        A = ctx.lm.anatomy
        if not A.causal or not ctx.has_logits:
            return (f"Generating a continuation needs a causal decoder with a language-model head; {ctx.lm.name} "
                    f"({A.family}) is not one.")
        return None

    def compute(self, ctx: ReportContext) -> dict:
        from ..generation import generate

        d = generate(ctx.lm, ctx.text, max_new_tokens=ctx.generate, explain=ctx.explain or self.methods()).to_dict()
        for m, worst in _gen_view.invariant_errors(d).items():
            if worst is not None:
                ctx.check(self.key, _gen_view.check_name(m), worst, _tol(ctx))
        return _gen_view.generation_payload(d)


class Features(Section):
    """The features of the prompt, per dictionary and token (``FeatureActivations``), with the cards of the
    strongest :attr:`cards` features at the prediction's position per dictionary (measured on the held-out part of
    ``ctx.dict_data``, when given). Shown when the report is given dictionaries (``lenscope report TEXT --dict
    DIR``)."""

    key = "features"
    cards = 3

    def wanted(self, ctx: ReportContext) -> bool:
        return ctx.dictionaries is not None

    def skip_reason(self, ctx):
        if ctx.dictionaries is None:
            return "The features view needs sparse dictionaries: give --dict DIR (build_report(..., dictionaries=))."
        return None

    def compute(self, ctx: ReportContext) -> dict:
        from ..features.dictionaries.cards import feature_cards
        from ..features.dictionaries.result import active_features

        fa = active_features(ctx.lm, ctx.ids, ctx.dictionaries)
        cards = []
        if ctx.dict_data is not None:
            for j, d in enumerate(ctx.dictionaries):
                top = [int(i) for i in fa.ids[j, -1, : self.cards].tolist() if i >= 0]
                if top:
                    cards += feature_cards(ctx.lm, d, top, ctx.dict_data, tokens=ctx.dict_tokens)
        for j, s in enumerate(fa.sites):
            ctx.check(self.key, f"{s}: mean active features per token (L0, reported)", float(fa.l0[j].float().mean()))
        return features_payload(fa, cards, ctx.labels)


def transcoders(ctx: ReportContext) -> list:
    """The transcoders among the report's dictionaries (the graph view's replacement MLPs)."""
    return [d for d in ctx.dictionaries or () if d.transcoder]


class Graph(Section):
    """The attribution graph of the prediction through the report's transcoders (``attribution_graph``), at most
    :attr:`max_feature_nodes` features (the most influential) so that the report stays fast; its logit nodes are the
    target when one is given, else the most probable tokens. Shown when the report's dictionaries include transcoders
    (``lenscope report TEXT --dict DIR``)."""

    key = "graph"
    max_feature_nodes = 500

    def wanted(self, ctx: ReportContext) -> bool:
        return bool(transcoders(ctx))

    def skip_reason(self, ctx):
        if not transcoders(ctx):
            return ("The attribution graph needs transcoders: give --dict DIR with transcoders (lenscope dict train "
                    "--transcoder --site 'mlp_out.*').")
        if not ctx.lm.anatomy.causal or not ctx.has_logits:
            return "An attribution graph explains a causal decoder's next token; this model is not one."
        return None

    def graph(self, ctx: ReportContext, target=...):
        """The graph (``target``: the logit node; default the report's target when one was given)."""
        from ..features.graphs.graph import attribution_graph

        if target is ...:
            target = ctx.target_id if ctx.target_given else None
        return attribution_graph(ctx.lm, ctx.ids, transcoders(ctx), target=target,
                                 max_feature_nodes=self.max_feature_nodes)

    def payload(self, ctx: ReportContext, g) -> dict:
        """The view's data, its checks recorded in ``ctx``."""
        d = graph_payload(g, labels=ctx.labels)
        for name, value, tol in graph_checks(g, d):
            ctx.check(self.key, name, value, tol)
        return d

    def compute(self, ctx: ReportContext) -> dict:
        return self.payload(ctx, self.graph(ctx))


class Alignment(Section):
    """A translation (encoder-decoder) model's source-target alignment (:func:`~lenscope.report.alignment.
    alignment_view`): every target token explained over the source and the target prefix by each method that reads
    a source, the word links, and with ``ctx.gold`` the gold links and each method's AER. Shown when the report is
    given a source (``lenscope report TARGET --source SOURCE``); the only view of such a model."""

    key = "alignment"

    def wanted(self, ctx: ReportContext) -> bool:
        return ctx.source is not None

    def skip_reason(self, ctx):
        if ctx.source is None:
            return ("The alignment view explains a translation: give an encoder-decoder model and its source "
                    "(--source TEXT; the text is the target).")
        return None

    def compute(self, ctx: ReportContext) -> dict:
        from .alignment import alignment_view

        data, checks = alignment_view(ctx.lm, ctx.source, ctx.text, ctx.methods, ctx.gold)
        for name, value, tol in checks:
            ctx.check(self.key, name, value, tol)
        return data


def section_keys() -> tuple[str, ...]:
    """The keys of :data:`SECTIONS` (a plug-in's section included), in order."""
    return tuple(s.key for s in SECTIONS)


SECTION_KEYS = section_keys()  # lenscope's own sections
