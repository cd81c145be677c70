"""``lenscope report``: one self-contained HTML page with every view of one prediction.

>>> rep = build_report(lm, "When Mary and John went to the store, John gave a drink to")   # doctest: +SKIP
>>> rep.write("report.html")                                                             # doctest: +SKIP

Each view is a :class:`~lenscope.report.sections.Section`; all of them share one trace of the text. This
package computes the views' data (it calls the methods); :mod:`lenscope.viz.report` draws the page from that plain
data, inlining its data, styles and scripts (nothing is fetched when it is viewed).
"""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import InputError
from .context import ReportContext, packed, unpack
from .sections import SECTION_KEYS, SECTIONS, Section, section_keys

__all__ = ["Report", "build_report", "run_section", "report_meta", "ReportContext", "Section", "SECTIONS",
           "SECTION_KEYS", "section_keys", "packed", "unpack"]


@dataclass
class Report:
    """The computed report: ``meta`` (model, versions, text, target), per-section ``payloads`` (or a ``note``
    where a view does not apply), every exactness ``checks`` entry and the ``timings`` (seconds per section,
    the shared trace counted where it was first needed)."""

    VIEW = "report"  # its view: the report page, whole (lenscope.viz.notebook)

    meta: dict
    sections: list[dict]
    checks: list[dict]
    timings: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """False when any check with a tolerance failed."""
        return all(c["ok"] is not False for c in self.checks)

    def to_dict(self) -> dict:
        return {"meta": self.meta, "sections": self.sections, "checks": self.checks, "timings": self.timings,
                "ok": self.ok}

    def summary(self) -> dict:
        """The report without its (large) payloads: what the CLI prints with ``--json`` (a view's ``summary``, where
        its data has one: the alignment view's tokens, links and AER)."""
        return {"meta": self.meta, "ok": self.ok, "checks": self.checks, "timings": self.timings,
                "sections": [{"key": s["key"], "title": s["title"], "note": s.get("note"),
                              **({"summary": s["data"]["summary"]} if "summary" in s.get("data", {}) else {})}
                             for s in self.sections]}

    def html(self) -> str:
        from ..viz.report import render

        return render(self.to_dict())

    def write(self, path: str | Path) -> Path:
        from ..viz.html import write_page

        return write_page(self.html(), path)

    def _repr_html_(self) -> str:
        """In a notebook: the whole page in a sandboxed frame (:func:`lenscope.viz.notebook.report_html`)."""
        from ..viz.notebook import report_html

        return str(report_html(self.to_dict()))

    def __repr__(self) -> str:
        shown = [s["key"] for s in self.sections if "note" not in s]
        return f"Report(model={self.meta['model']!r}, sections={shown}, ok={self.ok})"


def _versions() -> dict:
    import torch
    import transformers

    from ..version import __version__

    return {"lenscope": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version()}


def build_report(lm, text: str, target=None, foil=None, *, corrupted: str | None = None, lens=None, sections=None,
                 top_k: int = 10, progress=None, circuit: dict | None = None, generate: int | None = None,
                 explain=None, dictionaries=None, dict_data=None, dict_tokens: int = 16_384, source: str | None = None,
                 gold=None, methods=None, labels: dict | None = None) -> Report:
    """Compute every view of the prediction at the last position of ``text``.

    ``target``/``foil``: the token to explain (text, ``"#ID"`` or id) and an optional contrast; without a
    target the model's own top prediction is explained. ``corrupted``: a corrupted prompt with as many tokens
    as ``text`` (needs ``target`` and ``foil``): adds the circuit view (:class:`~.sections.Circuit`).
    ``lens``: a tuned lens shown beside the logit lens. ``sections``: keys to include (default all:
    ``prediction, trajectory, components, attribution, mixing, flow``, ``circuit`` when given a corrupted
    prompt, ``generation`` when given ``generate``, ``features`` and ``graph`` when given ``dictionaries``).
    ``progress(key, title)`` is called before each section.
    ``circuit``: a :func:`~lenscope.circuits.circuit_json` result to draw instead of computing one (``lenscope
    circuit --html``).
    ``generate``: a number of tokens to generate after ``text`` and explain token by token (adds the generation
    view, :class:`~.sections.Generation`); ``explain``: that view's methods (default
    :attr:`~.sections.Generation.methods`).
    ``dictionaries``: sparse dictionaries (:func:`~lenscope.models.dictionaries.dictionary.load_dictionaries`): adds the
    features
    view (:class:`~.sections.Features`), with the cards of the strongest features at the last position measured on
    ``dict_tokens`` held-out tokens of ``dict_data`` (a text file or corpus folder) when given, and, when they include
    transcoders, the attribution graph (:class:`~.sections.Graph`); ``labels``: their features' labels (``{site:
    [label of each feature]}``, :func:`~lenscope.features.dictionaries.labels.labels_for` of their folder), shown in
    both views.
    ``source``: an encoder-decoder (translation) model's source, ``text`` being the target: the report is the
    alignment view (:class:`~.sections.Alignment`, by ``methods``, default every method that reads a source; ``gold``:
    the pair's gold links, an :class:`~lenscope.data.alignments.AlignedPair`), and one note names the views left out.
    Such a model needs a source, and any other model takes none.
    """
    if sections is not None:
        unknown = [k for k in sections if k not in section_keys()]
        if unknown:
            raise InputError(f"unknown report section(s) {unknown}; choose from {', '.join(section_keys())}")
    t0 = time.perf_counter()
    ctx = ReportContext(lm, text, target, foil, lens=lens, top_k=top_k, corrupted=corrupted, circuit=circuit,
                        generate=generate, explain=explain, dictionaries=dictionaries, dict_data=dict_data,
                        dict_tokens=dict_tokens, source=source, gold=gold, methods=methods, labels=labels)
    if ctx.source is not None:
        return _alignment_report(ctx, sections, progress, t0)
    if sections is None:
        chosen = [sec for sec in (cls() for cls in SECTIONS) if sec.wanted(ctx)]
    else:
        chosen = [cls() for cls in SECTIONS if cls.key in sections]
    timings: dict[str, float] = {}
    t = time.perf_counter()
    ctx.trace  # noqa: B018 - the one shared forward pass, timed on its own
    timings["trace"] = time.perf_counter() - t
    out = []
    for sec in chosen:
        if progress is not None:
            progress(sec.key, sec.title)
        rec, timings[sec.key] = run_section(ctx, sec)
        out.append(rec)
    timings["total"] = time.perf_counter() - t0
    return Report(meta=report_meta(ctx), sections=out, checks=[c.to_dict() for c in ctx.checks],
                  timings={k: round(v, 3) for k, v in timings.items()})


def _alignment_report(ctx: ReportContext, sections, progress, t0: float) -> Report:
    """The report of a translation pair: the alignment view, and one note naming the other views, left out."""
    from .alignment import OMITTED
    from .sections import Alignment

    sec = Alignment()
    default = [c.key for c in SECTIONS if c.wanted is Section.wanted and not c.needs_corrupted]  # a decoder's views
    others = [k for k in (default if sections is None else sections) if k != sec.key]
    timings: dict[str, float] = {}
    if progress is not None:
        progress(sec.key, sec.title)
    rec, timings[sec.key] = run_section(ctx, sec)
    out = [rec]
    if others:
        out.append({"key": "omitted", "title": "Other views", "blurb": "",
                    "note": OMITTED.format(model=ctx.lm.name, keys=", ".join(others))})
    timings["total"] = time.perf_counter() - t0
    return Report(meta=alignment_meta(ctx), sections=out, checks=[c.to_dict() for c in ctx.checks],
                  timings={k: round(v, 3) for k, v in timings.items()})


def alignment_meta(ctx: ReportContext) -> dict:
    """The run card of a translation pair: the model, the source and the target (the text) with their tokens."""
    from ..models.loading.load import target_prefix_ids
    from ..models.runtime.request import token_texts
    from ..models.runtime.trace import source_ids

    A, lm = ctx.lm.anatomy, ctx.lm
    return {"model": lm.name, "family": A.family, "model_type": A.model_type, "n_layers": A.n_layers,
            "d_model": A.d_model, "causal": A.causal, "placement": A.placement, "encoder_decoder": True,
            "text": ctx.text, "tokens": token_texts(lm, target_prefix_ids(lm, ctx.text)), "source": ctx.source,
            "source_tokens": token_texts(lm, source_ids(lm, ctx.source)), "target": None, "target_id": None,
            "foil": None, "foil_id": None, "target_is_top_prediction": False, "lens": None,
            "gold": None if ctx.gold is None else str(ctx.gold.id), "methods": list(ctx.methods),
            "versions": _versions(), "created": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def run_section(ctx: ReportContext, sec: Section) -> tuple[dict, float]:
    """One view on a context: ``({"key", "title", "blurb", "data" | "note"}, seconds)``. Its checks are recorded
    in ``ctx.checks`` (the one loop behind :func:`build_report` and ``lenscope serve``)."""
    rec = {"key": sec.key, "title": sec.title, "blurb": sec.blurb}
    reason = sec.skip_reason(ctx)
    t = time.perf_counter()
    if reason is not None:
        rec["note"] = reason
    else:
        rec["data"] = sec.compute(ctx)
    return rec, time.perf_counter() - t


def report_meta(ctx: ReportContext) -> dict:
    """The page's run card: the model, the text and its tokens, target and foil, lens, versions, time."""
    A = ctx.lm.anatomy
    lens = ctx.lens
    meta = {
        "model": ctx.lm.name, "family": A.family, "model_type": A.model_type, "n_layers": A.n_layers,
        "d_model": A.d_model, "causal": A.causal, "placement": A.placement, "text": ctx.text, "tokens": ctx.tokens,
        "target": ctx.token_text(ctx.target_id), "target_id": ctx.target_id, "foil": ctx.token_text(ctx.foil_id),
        "foil_id": ctx.foil_id, "target_is_top_prediction": ctx.has_logits and not ctx.target_given,
        "lens": None if lens is None else getattr(lens, "kind", type(lens).__name__),
        "versions": _versions(), "created": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    if ctx.corrupted is not None:
        meta["corrupted"] = ctx.corrupted
    return meta
