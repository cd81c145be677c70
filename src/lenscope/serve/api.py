"""What the server computes, as plain functions of a request's fields (run in the model's worker thread): the report
views (:func:`lenscope.report.run_section` on a shared :class:`~lenscope.report.ReportContext`), one head (its
pattern, what it writes through the unembedding, its direct logit attribution, its patching effect), one token
(every attribution method at a position) and the static report page. Nothing here re-derives a method: each reads
the report, the attribution, the readout or the patching code."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field

import torch

from ..errors import InputError, NotApplicableError
from ..models.runtime.stop import checkpoint
from ..report import SECTIONS, Report, ReportContext, report_meta, run_section, section_keys
from ..report.sections import Attribution
from ..viz.report.payloads import rounded as _r
from ..viz.report.payloads import rounded_list as _rl
from ..viz.views.attribution import explanation_record
from .jobs import LRU, ApiError, Jobs, ModelPool


def section_class(key: str):
    """The report's section ``key`` (a plug-in's too: :data:`lenscope.report.SECTIONS`)."""
    return next(cls for cls in SECTIONS if cls.key == key)


FIRST_VIEWS = ("prediction", "trajectory", "components")


@dataclass
class Card:
    """What an answer says about its input besides the views (kept after its context's trace is let go, so that
    a repeated request gets the same answer byte for byte): tokens, target and foil, the run card, the trace's
    seconds, and the default views."""

    tokens: list[str]
    target: dict | None
    foil: dict | None
    meta: dict
    trace_s: float
    default_keys: list[str]


@dataclass
class Entry:
    """A cached context: the :class:`ReportContext` (its trace shared by every view of the same input) and its
    :class:`Card`."""

    ctx: ReportContext
    card: Card
    lock: threading.Lock = field(default_factory=threading.Lock)


def _tok(ctx: ReportContext, tid: int | None) -> dict | None:
    return None if tid is None else {"token": ctx.token_text(tid), "id": int(tid)}


def _line(e: BaseException) -> str:
    s = str(e).strip()
    return s.splitlines()[0] if s else type(e).__name__


def _json_bytes(value) -> int:
    """About what a cached result holds: the length of its JSON (a patching sweep: its tensors' bytes)."""
    if hasattr(value, "raw"):
        return sum(t.numel() * t.element_size() for t in (value.raw, value.values))
    return len(json.dumps(value, default=str))


def _graph_bytes(g) -> int:
    """About what a kept attribution graph holds: its adjacency's bytes."""
    return g.adjacency.numel() * g.adjacency.element_size()


def _context_bytes(entry) -> int:
    """The bytes of a context's trace tensors (what a cached context holds)."""
    total = 0
    for v in vars(entry.ctx.trace).values():
        vs = list(v.values()) if isinstance(v, dict) else v if isinstance(v, (list, tuple)) else [v]
        for t in (x for u in vs for x in (u if isinstance(u, (list, tuple)) else [u])):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


class Service:
    """The server's state: models (:class:`ModelPool`), workers (:class:`Jobs`), the context and result caches."""

    def __init__(self, models: list[str], *, max_tokens: int = 512, max_queue: int = 16, max_resident: int = 2,
                 lens: str | None = None, contexts: int = 8, context_mb: float = 2048, results: int = 512,
                 results_mb: float = 512, loader=None, dicts: str | None = None, dict_data: str | None = None,
                 dict_tokens: int = 16_384):
        self.models = list(models)
        self.dict_dir, self.dict_data, self.dict_tokens = dicts, dict_data, int(dict_tokens)
        self._dicts: dict[str, list] = {}  # model name -> the dictionaries of --dict that fit it
        self._labels: dict | None = None  # the features' labels cached in --dict (labels_for), read once
        self._dict_lock = threading.Lock()
        self.max_tokens = int(max_tokens)
        self.contexts = LRU(contexts, max_bytes=int(context_mb * 2**20), sizeof=_context_bytes)
        self.cards = LRU(results)
        self.results = LRU(results, max_bytes=int(results_mb * 2**20), sizeof=_json_bytes)
        self.extras = LRU(results, max_bytes=int(results_mb * 2**20) // 4, sizeof=_json_bytes)  # heads, tokens
        # attribution graphs by (model, text, target), with the supernodes grouped on them
        self.graphs = LRU(contexts, max_bytes=int(results_mb * 2**20), sizeof=_graph_bytes)
        self.pool = ModelPool(max_resident, lens, loader=loader, on_unload=self.forget)
        self.jobs = Jobs(max_queue)
        self.max_resident = self.pool.max_resident

    def forget(self, name: str) -> None:
        """Drop what was cached for a model that is let go (its traces hold most of the memory)."""
        for c in (self.contexts, self.cards, self.results, self.extras, self.graphs):
            c.drop(lambda k: k[0] == name)
        with self._dict_lock:
            self._dicts.pop(name, None)

    # ------------------------------------------------------------------------------------ dictionaries

    def dictionaries(self, name: str, lm) -> list | None:
        """The dictionaries of ``--dict`` that fit model ``name`` (read once per loaded model; one that is for
        another model or site is left out with a warning); None without ``--dict``."""
        if self.dict_dir is None:
            return None
        with self._dict_lock:
            got = self._dicts.get(name)
            if got is None:
                import logging

                from ..errors import LenscopeError
                from ..models.dictionaries.dictionary import load_dictionaries

                got = []
                for d in load_dictionaries(self.dict_dir):
                    try:
                        d.check(lm)
                        got.append(d)
                    except LenscopeError as e:
                        logging.getLogger("lenscope.serve").warning("dictionary %s not used for %s: %s", d.site,
                                                                    name, _line(e))
                self._dicts[name] = got
            return got or None

    def labels(self) -> dict | None:
        """The features' labels that ``lenscope dict label`` cached in ``--dict`` (``{site: [label of each
        feature]}``, :func:`~lenscope.features.dictionaries.labels.labels_for`), read once; None without ``--dict``."""
        if self.dict_dir is None:
            return None
        with self._dict_lock:
            if self._labels is None:
                from ..features.dictionaries.labels import labels_for

                self._labels = labels_for(self.dict_dir)
            return self._labels

    # ------------------------------------------------------------------------------------------ models

    def models_info(self) -> list[dict]:
        out = []
        for name in self.models:
            got = self.pool.loaded(name)
            if got is None:
                out.append({"name": name, "loaded": False})
                continue
            A = got[0].anatomy
            out.append({"name": name, "loaded": True, "family": A.family, "n_layers": A.n_layers,
                        "n_heads": max((l.attn.n_heads for l in A.layers), default=0), "causal": bool(A.causal),
                        "has_logits": A.unembed is not None})
        return out

    # ----------------------------------------------------------------------------------------- context

    def context(self, name: str, text: str, target=None, foil=None, corrupted=None) -> Entry:
        """The shared context of one input (cached): validates the text (400 / 413), resolves the target and foil
        (default: the model's top prediction and runner-up), computes the one trace."""
        key = (name, text, target, foil, corrupted)
        got = self.contexts.get(key)
        if got is not None:
            return got
        from ..models.loading.load import token_ids

        lm, lens = self.pool.get(name)
        dicts = self.dictionaries(name, lm)
        n = token_ids(lm, text).numel()
        if n > self.max_tokens:
            raise ApiError(413, f"the text is {n} tokens long, more than this server's limit of {self.max_tokens} "
                                "(--max-tokens); shorten it")
        t = time.perf_counter()
        defaulted = target is None and lm.anatomy.unembed is not None
        base = None
        if defaulted:
            base = ReportContext(lm, text, lens=lens)
            top = torch.topk(base.final_logits, 2).indices.tolist()
            target = f"#{top[0]}"
            if foil is None:
                foil = f"#{top[1]}"
        ctx = ReportContext(lm, text, target, foil, lens=lens, corrupted=corrupted, dictionaries=dicts,
                            labels=self.labels())
        if base is not None:
            ctx.__dict__["trace"] = base.trace  # the one forward pass (cached_property's slot)
        ctx.target_id, ctx.foil_id  # noqa: B018 - a target/foil that is not one token is refused here (400)
        ctx.trace  # noqa: B018
        trace_s = time.perf_counter() - t
        card = self.cards.get(key)
        if card is None:
            meta = report_meta(ctx)
            if defaulted:
                meta["target_is_top_prediction"] = True
            card = Card(ctx.tokens, _tok(ctx, ctx.target_id), _tok(ctx, ctx.foil_id), meta, round(trace_s, 3),
                        [c.key for c in SECTIONS if c().wanted(ctx)])
            self.cards.put(key, card)
        entry = Entry(ctx, card)
        self.contexts.put(key, entry)
        return entry

    # ----------------------------------------------------------------------------------------- analyze

    @staticmethod
    def section_keys(sections, card: Card | None = None) -> list[str]:
        """The requested view keys (unknown ones refused), or the input's default views."""
        if sections is None:
            return [] if card is None else list(card.default_keys)
        unknown = [k for k in sections if k not in section_keys()]
        if unknown:
            raise InputError(f"unknown section(s) {unknown}; choose from {', '.join(section_keys())}")
        return list(dict.fromkeys(sections))

    def _section(self, ckey: tuple, entry: Entry, key: str) -> tuple[dict, list, float]:
        if key == "graph":  # computed once and kept with its supernodes, not cached as data
            return self._graph_section(ckey, entry)
        rkey = ckey + (key,)
        hit = self.results.get(rkey)
        if hit is not None:
            return hit
        checkpoint()  # each view is a chunk: a job whose client has gone stops before the next one
        ctx = entry.ctx
        sec = section_class(key)()
        with entry.lock:
            n0 = len(ctx.checks)
            try:
                rec, secs = run_section(ctx, sec)
            except NotApplicableError as e:
                rec, secs = {"key": sec.key, "title": sec.title, "blurb": sec.blurb, "note": _line(e)}, 0.0
            except BaseException:
                del ctx.checks[n0:]  # a view stopped (or failed) half-way leaves none of its checks behind
                raise
            checks = [c.to_dict() for c in ctx.checks[n0:]]
        out = (rec, checks, round(secs, 3))
        self.results.put(rkey, out)
        return out

    def analyze(self, name: str, text: str, target=None, foil=None, corrupted=None, sections=None,
                cached_only: bool = False) -> dict | None:
        """``POST /api/analyze``. ``cached_only``: answer only from the caches (None when something must be
        computed), so that a repeated request needs no worker."""
        ckey = (name, text, target, foil, corrupted)
        card = self.cards.get(ckey)
        keys = self.section_keys(sections, card)
        hits = None if card is None else [self.results.get(ckey + (k,)) for k in keys]
        if hits is None or any(h is None for h in hits):
            if cached_only:
                return None
            entry = self.context(name, text, target, foil, corrupted)
            card = entry.card
            keys = self.section_keys(sections, card)
            hits = [self._section(ckey, entry, k) for k in keys]
        out = {"model": name, "text": text, "tokens": card.tokens, "target": card.target, "foil": card.foil,
               "checks": [], "sections": {}, "notes": {}, "timings": {"trace": card.trace_s}, "meta": card.meta}
        for k, (rec, checks, secs) in zip(keys, hits):
            if "note" in rec:
                out["notes"][k] = rec["note"]
            else:
                out["sections"][k] = rec["data"]
            out["checks"].extend(checks)
            out["timings"][k] = secs
        return out

    def report(self, name: str, text: str, target=None, foil=None, corrupted=None) -> str:
        """``GET /api/report``: today's static page (:meth:`lenscope.report.Report.html`) from the cached views."""
        ckey = (name, text, target, foil, corrupted)
        entry = self.context(name, text, target, foil, corrupted)
        keys = self.section_keys(None, entry.card)
        recs, checks, timings = [], [], {"trace": entry.card.trace_s}
        for k in keys:
            rec, ch, secs = self._section(ckey, entry, k)
            recs.append(rec)
            checks.extend(ch)
            timings[k] = secs
        timings["total"] = round(sum(timings.values()), 3)
        return Report(meta=entry.card.meta, sections=recs, checks=checks, timings=timings).html()

    # ------------------------------------------------------------------------------------- any one view

    @staticmethod
    def view_keys() -> tuple[str, ...]:
        """The views ``/api/view/<key>`` answers: every section of the report (a plug-in's too)."""
        return section_keys()

    def view(self, name: str, key: str, text: str, target=None, foil=None, corrupted=None) -> dict:
        """``POST /api/view/<key>``: one view of an input, as ``/api/analyze`` computes it (the same caches): its
        ``data`` (or the ``note`` saying why it does not apply), its checks and seconds, and the run card."""
        ckey = (name, text, target, foil, corrupted)
        entry = self.context(*ckey)
        rec, checks, secs = self._section(ckey, entry, key)
        card = entry.card
        return {"model": name, "text": text, "tokens": card.tokens, "target": card.target, "foil": card.foil, **rec,
                "checks": checks, "seconds": secs, "meta": card.meta}

    def view_page(self, name: str, key: str, text: str, target=None, foil=None, corrupted=None) -> str:
        """``GET /api/view/<key>``: that view's self-contained page (the report page holding just it)."""
        ans = self.view(name, key, text, target, foil, corrupted)
        rec = {k: ans[k] for k in ("key", "title", "blurb", "data", "note") if k in ans}
        return Report(meta=ans["meta"], sections=[rec], checks=ans["checks"],
                      timings={key: ans["seconds"]}).html()

    # -------------------------------------------------------------------------------------------- head

    def head(self, name: str, text: str, layer: int, head: int, target=None, foil=None, corrupted=None) -> dict:
        """``POST /api/head``: one head's attention pattern, its write at the last position read through the final
        norm (traced scale) and the unembedding, its direct logit attribution, and with ``corrupted`` the clean
        run's logit difference with this head patched in from the corrupted run."""
        entry = self.context(name, text, target, foil, corrupted)
        ctx = entry.ctx
        lm = ctx.lm
        A = lm.anatomy
        if not 0 <= layer < A.n_layers:
            raise InputError(f"layer {layer} is outside the model's layers 0..{A.n_layers - 1}")
        H = A.layers[layer].attn.n_heads
        if not 0 <= head < H:
            raise InputError(f"head {head} is outside layer {layer}'s heads 0..{H - 1}")
        ckey = (name, text, target, foil, corrupted)
        hit = self.extras.get(ckey + ("head", layer, head))
        if hit is not None:
            return hit
        tr = ctx.trace
        p = len(ctx.ids) - 1
        out = {"layer": layer, "head": head, "tokens": ctx.tokens, "position": p,
               "pattern": [_rl(r) for r in tr.pattern[layer][head].float()], "promoted": None,
               "suppressed": None, "dla": None, "patch": None, "notes": {}}
        with entry.lock:
            try:
                out.update(self._head_write(ctx, layer, head, p))
            except NotApplicableError as e:
                out["notes"]["write"] = _line(e)
            if corrupted is not None:
                out["patch"] = self._head_patch(ckey, ctx, layer, head)
        self.extras.put(ckey + ("head", layer, head), out)
        return out

    @staticmethod
    def _head_write(ctx: ReportContext, layer: int, head: int, p: int) -> dict:
        from ..attribution.dla import traced_head_writes
        from ..models.loading.load import require_decoder
        from ..models.weights.readout import Readout

        lm = ctx.lm
        require_decoder(lm, "a head's write read through the unembedding", sum_of_blocks=True,
                        instead="pick a decoder model")
        readout = Readout.from_anatomy(lm.anatomy)
        s = readout.scale(ctx.trace.site("ln_final.in")[p])
        vec = traced_head_writes(lm.anatomy, ctx.trace, layer, p)[0][head]
        logits = readout.part_logits(vec, s, readout.W_U.float())
        k = min(10, logits.numel())
        up, down = torch.topk(logits, k), torch.topk(-logits, k)
        dla = readout.part_logits(vec, s, readout.direction(ctx.target_id, ctx.foil_id))
        return {"promoted": [{"token": ctx.token_text(i), "id": int(i), "value": _r(v)}
                             for v, i in zip(up.values.tolist(), up.indices.tolist())],
                "suppressed": [{"token": ctx.token_text(i), "id": int(i), "value": _r(-v)}
                               for v, i in zip(down.values.tolist(), down.indices.tolist())],
                "dla": _r(dla)}

    def _head_patch(self, ckey: tuple, ctx: ReportContext, layer: int, head: int) -> dict:
        from ..interventions.patching import activation_patching

        pkey = ckey + ("patch",)
        res = self.extras.get(pkey)
        if res is None:
            res = activation_patching(ctx.lm, ctx.text, ctx.corrupted, ctx.target_id, ctx.foil_id, what="heads",
                                      noising=True)
            self.extras.put(pkey, res)
        clean, patched = float(res.clean_metric), float(res.raw[layer, head])
        return {"clean": _r(clean), "corrupted": _r(res.corrupted_metric), "patched": _r(patched),
                "effect": _r(patched - clean)}

    # ------------------------------------------------------------------------------------------- token

    def token(self, name: str, text: str, position: int, target=None, foil=None) -> dict:
        """``POST /api/token``: every attribution method's explanation of the prediction at ``position``."""
        from ..models.runtime.request import Request

        entry = self.context(name, text)
        ctx = entry.ctx
        lm = ctx.lm
        P = len(ctx.ids)
        if not -P <= position < P:
            raise InputError(f"position {position} is outside the text's {P} tokens (0..{P - 1})")
        p = position % P
        tkey = (name, text, None, None, None, "token", p, target, foil)
        hit = self.extras.get(tkey)
        if hit is not None:
            return hit
        A = lm.anatomy
        has_logits = A.unembed is not None
        if (target is not None or foil is not None) and not has_logits:
            raise InputError(f"{name} has no language-model head, so there is no target to explain; leave out "
                             "target and foil")
        tr = ctx.trace
        tid = fid = None
        if has_logits:
            top = None
            if target is None:  # the model's own top prediction
                top = tr.logits[p] if tr.logits is not None else A.logits(tr.site("ln_final.in")[p:p + 1])[0]
            req = Request.of(lm, target, foil, top=top)
            tid, fid = req.target, req.foil
        out = {"position": p, "token": ctx.tokens[p], "target": _tok(ctx, tid), "foil": _tok(ctx, fid),
               "methods": {}, "notes": {}}
        with entry.lock:
            for m, e in Attribution.explain_each(lm, ctx.ids, tr, tid, fid, position=p, has_logits=has_logits):
                if isinstance(e, NotApplicableError):
                    out["notes"][m] = _line(e)
                else:
                    out["methods"][m] = explanation_record(e)
        self.extras.put(tkey, out)
        return out

    # ---------------------------------------------------------------------------------------- features

    def _need_dicts(self, name: str):
        if self.dict_dir is None:
            raise InputError("this server has no sparse dictionaries: start it with --dict DIR")
        lm, _ = self.pool.get(name)
        dicts = self.dictionaries(name, lm)
        if dicts is None:
            raise InputError(f"no dictionary of {self.dict_dir} fits {name}")
        return lm, dicts

    def features(self, name: str, text: str, position: int) -> dict:
        """``POST /api/features``: the active features of every dictionary at one token of ``text``, each with its
        label where cached (None elsewhere)."""
        from ..features.dictionaries.result import active_features
        from ..viz.views.feature import feature_label

        lm, dicts = self._need_dicts(name)
        entry = self.context(name, text)
        P = len(entry.ctx.ids)
        if not -P <= position < P:
            raise InputError(f"position {position} is outside the text's {P} tokens (0..{P - 1})")
        p = position % P
        fkey = (name, text, None, None, None, "features")
        fa = self.extras.get(fkey)
        if fa is None:
            with entry.lock:
                fa = active_features(lm, entry.ctx.ids, dicts)
            fa = {"sites": fa.sites, "widths": fa.widths, "l0": fa.l0.tolist(),
                  "active": [[[[i, _r(v)] for i, v in zip(ids, vals) if i >= 0]
                              for ids, vals in zip(fa.ids[j].tolist(), fa.values[j].tolist())]
                             for j in range(len(fa.sites))]}
            self.extras.put(fkey, fa)
        labels = self.labels()
        return {"position": p, "token": entry.card.tokens[p], "sites": fa["sites"], "widths": fa["widths"],
                "l0": {s: fa["l0"][j][p] for j, s in enumerate(fa["sites"])},
                "features": {s: [{"feature": i, "activation": v,
                                  "label": feature_label(labels, s, i, fa["widths"][j])} for i, v in fa["active"][j][p]]
                             for j, s in enumerate(fa["sites"])}}

    def feature(self, name: str, site: str, feature: int) -> dict:
        """``POST /api/feature``: one feature's card (the ``feature`` view's data, with its label where cached),
        measured on the held-out part of ``--dict-data``."""
        from ..features.dictionaries.cards import feature_card
        from ..viz.views.feature import feature_payload

        lm, dicts = self._need_dicts(name)
        by_site = {d.site: d for d in dicts}
        if site not in by_site:
            raise InputError(f"no dictionary for site {site!r}; this server has {', '.join(by_site)}")
        if self.dict_data is None:
            raise InputError("a feature's card is measured on held-out text: start the server with --dict-data FILE")
        key = (name, "feature", site, int(feature))
        hit = self.extras.get(key)
        if hit is None:
            hit = feature_payload(feature_card(lm, by_site[site], int(feature), self.dict_data,
                                               tokens=self.dict_tokens), self.labels())
            self.extras.put(key, hit)
        return hit

    # ------------------------------------------------------------------------------------------- graph

    def _graph(self, gkey: tuple, entry: Entry):
        """The attribution graph of ``gkey = (model, text, target)`` (the target as given: None for the most probable
        tokens), computed once and kept while cached, with the supernodes grouped on it."""
        g = self.graphs.get(gkey)
        if g is None:
            checkpoint()
            with entry.lock:
                g = section_class("graph")().graph(entry.ctx, target=gkey[2])
            self.graphs.put(gkey, g)
        return g

    def _graph_section(self, ckey: tuple, entry: Entry) -> tuple[dict, list, float]:
        """The ``graph`` view of an input as :meth:`_section` answers it, its data drawn from the kept graph (so its
        supernodes are the latest)."""
        sec = section_class("graph")()
        ctx = entry.ctx
        rec = {"key": sec.key, "title": sec.title, "blurb": sec.blurb}
        reason = sec.skip_reason(ctx)
        if reason is not None:
            return {**rec, "note": reason}, [], 0.0
        t = time.perf_counter()
        g = self._graph(ckey[:3], entry)
        with entry.lock:
            n0 = len(ctx.checks)
            try:
                rec["data"] = sec.payload(ctx, g)
            finally:
                checks = [c.to_dict() for c in ctx.checks[n0:]]
                del ctx.checks[n0:]
        return rec, checks, round(time.perf_counter() - t, 3)

    def _graph_entry(self, name: str, text: str, target) -> Entry:
        from ..report.sections import transcoders

        self._need_dicts(name)
        entry = self.context(name, text, target)
        if not transcoders(entry.ctx):
            raise InputError(f"no dictionary of {self.dict_dir} for {name} is a transcoder; an attribution graph "
                             "needs transcoders (lenscope dict train --transcoder --site 'mlp_out.*')")
        return entry

    def graph(self, name: str, text: str, target=None) -> dict:
        """``POST /api/graph``: the attribution graph of the prediction after ``text`` (the ``graph`` view's data,
        with the supernodes grouped so far) and its checks; ``target``: the one logit node (default the most
        probable tokens)."""
        entry = self._graph_entry(name, text, target)
        rec, checks, secs = self._graph_section((name, text, target, None, None), entry)
        if "note" in rec:
            raise NotApplicableError(rec["note"])
        return {"model": name, "text": text, "tokens": entry.card.tokens, "graph": rec["data"], "checks": checks,
                "seconds": secs}

    def supernode(self, name: str, text: str, target, label: str, ids: list[str]) -> dict:
        """``POST /api/supernode``: group nodes of the input's graph (:meth:`AttributionGraph.group`) into a
        supernode named ``label``; kept with the graph, and in every later answer of its view."""
        entry = self._graph_entry(name, text, target)
        reason = section_class("graph")().skip_reason(entry.ctx)
        if reason is not None:
            raise NotApplicableError(reason)
        g = self._graph((name, text, target), entry)
        sn = g.group(label, ids)
        return {"supernode": list(sn), "supernodes": [list(x) for x in g.supernodes]}

    # --------------------------------------------------------------------------------------- alignment

    def alignment(self, name: str, source: str, target: str, methods=None, gold: dict | None = None) -> dict:
        """``POST /api/alignment``: a translation model's source-target alignment of ``target`` given ``source`` (the
        report's alignment view: :func:`lenscope.report.alignment.alignment_view`): every target token's scores over
        the source and the target prefix by each of ``methods`` (default every method that reads a source), the word
        links and, with ``gold`` (``{"sure": [[i, j], ...], "possible": [...]}``), each method's AER."""
        from ..models.loading.load import target_prefix_ids
        from ..models.runtime.trace import source_ids
        from ..report.alignment import alignment_view, check_pair, gold_of, normalized, view_methods
        from ..report.context import Check

        lm, _ = self.pool.get(name)
        check_pair(lm, source)
        source, target = normalized(source, "source"), normalized(target, "target")
        methods = view_methods(methods)
        for what, n in (("source", len(source_ids(lm, source))), ("target", len(target_prefix_ids(lm, target)))):
            if n > self.max_tokens:
                raise ApiError(413, f"the {what} is {n} tokens long, more than this server's limit of "
                                    f"{self.max_tokens} (--max-tokens); shorten it")
        pair = None if gold is None else gold_of(source, target, gold.get("sure"), gold.get("possible"), "gold")
        key = (name, "alignment", source, target, methods,
               None if pair is None else (tuple(sorted(pair.sure)), tuple(sorted(pair.possible))))
        hit = self.extras.get(key)
        if hit is not None:
            return hit
        checkpoint()
        t = time.perf_counter()
        data, checks = alignment_view(lm, source, target, methods, pair)
        A = lm.anatomy
        out = {"model": name, "source": source, "target": target, "methods": list(data["methods"]),
               "notes": data["notes"],
               "n_source": data["n_source"], "source_tokens": data["source_tokens"],
               "prefix_tokens": data["prefix_tokens"], "links": data["links"], "gold": data["gold"],
               "aer": data["aer"], "alignment": data,
               "checks": [Check("alignment", n, v, tol).to_dict() for n, v, tol in checks],
               "meta": {"model": name, "family": A.family, "model_type": A.model_type, "n_layers": A.n_layers,
                        "d_model": A.d_model, "encoder_decoder": True, "source": source, "text": target},
               "seconds": round(time.perf_counter() - t, 3)}
        self.extras.put(key, out)
        return out

    def close(self) -> None:
        self.jobs.close()


__all__ = ["Service", "ApiError", "Jobs", "FIRST_VIEWS", "section_class"]
