"""What every report section reads: the model, the text, one shared trace, the target and foil, and a ledger
of checks (every completeness / invariant error a section computed) and timings."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property

from torch import Tensor

from ..errors import InputError
from ..models.loading.load import LoadedModel, token_ids
from ..models.runtime.request import Request
from ..viz.report.payloads import packed, unpack  # noqa: F401 - re-exported: lenscope.report.packed


@dataclass
class Check:
    """One number that says whether a view is exact: ``value`` against ``tolerance`` (None: reported only)."""

    section: str
    name: str
    value: float | None
    tolerance: float | None = None
    note: str = ""

    @property
    def ok(self) -> bool | None:
        if self.tolerance is None or self.value is None:
            return None
        return bool(self.value <= self.tolerance)

    def to_dict(self) -> dict:
        v = self.value
        return {"section": self.section, "name": self.name,
                "value": None if v is None or not math.isfinite(v) else float(v),
                "tolerance": self.tolerance, "ok": self.ok, "note": self.note}


@dataclass
class ReportContext:
    """Inputs and shared intermediate results of one report. Sections read ``trace`` (computed once, on first
    use) and record their exactness checks with :meth:`check`."""

    lm: LoadedModel
    text: str
    target: str | int | None = None
    foil: str | int | None = None
    lens: object | None = None  # a tuned lens (lenscope.lenses.TunedLens) or None
    top_k: int = 10
    corrupted: str | None = None  # a corrupted prompt (same token count as ``text``): the circuit view
    circuit: dict | None = None  # a circuit_json result computed elsewhere (lenscope circuit --html) to show as is
    generate: int | None = None  # tokens to generate after the text and explain (the generation view)
    explain: tuple[str, ...] | None = None  # the generation view's methods (default: sections.Generation.methods)
    # sparse dictionaries (lenscope.models.dictionaries.dictionary.Dictionary): the features view
    dictionaries: list | None = None
    dict_data: str | None = None  # text whose held-out part the features view's cards are measured on
    dict_tokens: int = 16_384  # held-out tokens read for those cards
    labels: dict | None = None  # the dictionaries' feature labels, {site: [label of each feature]} (labels_for)
    source: str | None = None  # an encoder-decoder model's source (the text is the target): the alignment view
    gold: object | None = None  # the pair's gold links (lenscope.data.alignments.AlignedPair) for the alignment view
    methods: tuple[str, ...] | None = None  # the alignment view's methods (default: every one that reads a source)
    checks: list[Check] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def __post_init__(self):
        if self.source is not None or self.lm.anatomy.is_encoder_decoder:
            self._check_alignment()
            return
        if self.gold is not None or self.methods is not None:
            raise InputError("gold alignments and the alignment view's methods need a translation model and a "
                             "source: give --source with an encoder-decoder model")
        self.ids = token_ids(self.lm, self.text)  # validates the text (empty, too long, ...)
        A = self.lm.anatomy
        self.has_logits = A.unembed is not None
        self.request = Request.of(self.lm, self.target, self.foil)  # a foil needs a target; both one token each
        if self.target is not None and not self.has_logits:
            raise InputError(f"{self.lm.name} has no language-model head, so there is no target to explain; "
                             "leave out --target/--foil")
        if self.corrupted is not None:
            self._check_contrast()
        if self.generate is not None or self.explain is not None:
            self._check_generate()
        if self.dictionaries is not None:
            if not self.dictionaries:
                raise InputError("no dictionary given for the features view")
            for d in self.dictionaries:
                d.check(self.lm)  # a dictionary for another model or site is refused before any view is computed
        if self.dict_data is not None:
            from ..data.corpus import corpus_files

            corpus_files(self.dict_data)  # a missing file is refused before any view is computed

    def _check_alignment(self) -> None:
        """A translation pair (source, and the text as the target) is checked before any view is computed: a source
        for an encoder-decoder model only, and none of the options of the one-text views."""
        from .alignment import check_pair, normalized, view_methods

        check_pair(self.lm, self.source)
        given = [o for o, v in (("--target", self.target), ("--foil", self.foil), ("--corrupted", self.corrupted),
                                ("--generate", self.generate), ("--lens", self.lens), ("--dict", self.dictionaries))
                 if v is not None]
        if given:
            raise InputError(f"{', '.join(given)} do not apply to the alignment view of a translation model (every "
                             "target token is explained); leave them out")
        self.source, self.text = normalized(self.source, "source"), normalized(self.text, "target")
        self.methods = view_methods(self.methods)
        self.ids = None
        self.has_logits = self.lm.anatomy.unembed is not None
        self.request = Request()

    def _check_generate(self) -> None:
        """``generate`` and ``explain`` are refused before any view is computed: a whole number of tokens, at least
        one, that fits in the context after the text, and known methods. (An encoder gets the view's note.)"""
        from ..attribution.explanation import METHODS

        n = self.generate
        if n is not None:
            if isinstance(n, bool) or not isinstance(n, int):
                raise InputError(f"--generate takes a whole number of tokens, not {n!r}")
            if n < 1:
                raise InputError(f"--generate must be at least 1 (tokens to generate), not {n}")
            room = self.lm.anatomy.n_ctx - len(self.ids)
            if n > room:
                raise InputError(f"--generate {n}: the text has {len(self.ids)} tokens and the model's context is "
                                 f"{self.lm.anatomy.n_ctx}, so at most {max(room, 0)} more fit; generate fewer")
        if self.explain is not None:
            self.explain = (self.explain,) if isinstance(self.explain, str) else tuple(self.explain)
            unknown = [m for m in self.explain if m not in METHODS]
            if unknown or not self.explain:
                raise InputError(f"unknown method(s) {unknown} for the generation view; choose from "
                                 f"{', '.join(METHODS)}")

    def _check_contrast(self) -> None:
        """A corrupted prompt is refused before any view is computed: it needs a target and a foil (the circuit's
        metric is logit(target) - logit(foil)), a decoder, and as many tokens as the clean text."""
        from ..models.loading.load import require_decoder
        from ..models.runtime.request import contrast

        if self.target is None or self.foil is None:
            raise InputError("a corrupted prompt needs a target and a foil (the circuit is scored on "
                             "logit(target) - logit(foil)): give --target and --foil as well")
        from ..circuits.graph import ComponentGraph

        require_decoder(self.lm, "the circuit view", instead="leave out --corrupted", causal=True)
        ComponentGraph.of(self.lm)  # refuses a model without an edge graph (Post-LN) before any view is computed
        contrast(self.lm, self.text, self.corrupted, self.target, self.foil, "logit_diff", -1)

    @cached_property
    def trace(self):
        from ..models.runtime.trace import trace

        return trace(self.lm, self.ids)

    @property
    def tokens(self) -> list[str]:
        return list(self.trace.tokens)

    @cached_property
    def final_logits(self) -> Tensor | None:
        """Logits at the last position: from the model itself, or lenscope's unembedding of the last state."""
        if not self.has_logits:
            return None
        tr = self.trace
        if tr.logits is not None:
            return tr.logits[-1].float()
        return self.lm.anatomy.logits(tr.site("ln_final.in")[-1:])[0].float()

    @cached_property
    def target_id(self) -> int | None:
        """The token to explain: the one given, else the model's own top prediction at the last position."""
        if not self.has_logits:
            return None
        return self.request.or_top(self.final_logits).target

    @cached_property
    def foil_id(self) -> int | None:
        return self.request.foil

    def token_text(self, i: int | None) -> str | None:
        return None if i is None else self.lm.tokenizer.decode([int(i)])

    @property
    def target_given(self) -> bool:
        return self.target is not None

    def check(self, section: str, name: str, value, tolerance: float | None = None, note: str = "") -> None:
        self.checks.append(Check(section, name, None if value is None else float(value), tolerance, note))
