"""``lenscope eval alignment``: how well do explanations rank the tokens that linguistically decide target
versus foil? (Yin & Neubig 2022; Ferrando et al. 2023, §3-5.)

The run is organised so that it can be resumed and, later, distributed:

1. datasets -> a list of :class:`~lenscope.data.datasets.Example` with stable ids;
2. :func:`evaluate_examples` (importable, no global state): examples -> one JSON-able record each. Examples of
   equal token length share batched passes: one trace per example (cut from one batched forward pass) serves
   Logit, ALTI-Logit, the model's logit difference and the per-layer attention/MLP updates; gradients,
   integrated gradients and erasure run batched over examples;
3. records are appended to ``records.jsonl`` (one line per example); a rerun skips ids already there;
4. :func:`summarise`: records -> :class:`AlignmentSummary` (means, bootstrap intervals, groups, per-layer
   contributions, timing).
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..data.datasets import Example, expand_specs, load_dataset
from ..errors import InputError, LenscopeError, NotApplicableError
from .evidence import prepare
from .metrics import alignment, mean_ci, paired_difference, random_rr

EVAL_METHODS = ("logit", "alti-logit", "grad-norm", "grad-x-input", "ig", "erasure", "first", "recent")
POSITIONAL = ("first", "recent")  # trivial rankings by position: no model computation beyond the tokenisation
TIMERS = ("trace", "logit", "alti-logit", "gradients", "ig", "erasure", "forward")


def check_methods(methods) -> list[str]:
    methods = [m.strip() for m in (methods.split(",") if isinstance(methods, str) else methods) if m.strip()]
    if not methods:
        raise InputError(f"give at least one method ({', '.join(EVAL_METHODS)})")
    bad = [m for m in methods if m not in EVAL_METHODS]
    if bad:
        raise InputError(f"unknown method {bad[0]!r} for eval alignment; choose from {', '.join(EVAL_METHODS)}")
    return list(dict.fromkeys(methods))


def positional_scores(n: int, method: str) -> list[float]:
    """The ranking score vector of a positional method over ``n`` context positions: ``first`` scores position
    ``j`` with ``n - j`` (the earliest token first), ``recent`` with ``j + 1`` (the token nearest the prediction
    first). Both are positive, so their dot product with the evidence is the evidence's share of the total
    score; there are no ties."""
    if method == "first":
        return [float(n - j) for j in range(n)]
    if method == "recent":
        return [float(j + 1) for j in range(n)]
    raise ValueError(f"not a positional method: {method!r}")


def positional_metrics(rec: dict, method: str) -> dict:
    """``alignment`` of a positional ranking from a record's own fields (``tokens``, ``evidence``, ``rankable``):
    what :func:`evaluate_examples` stores, recomputed for records written before these methods existed."""
    return alignment(positional_scores(len(rec["tokens"]), method), rec["evidence"], rec["rankable"])


def check_model(lm) -> None:
    A = lm.anatomy
    if not A.causal or A.unembed is None or A.final_norm is None:
        raise NotApplicableError(f"eval alignment explains a next-word prediction and needs a causal decoder with a "
                                 f"language-model head; {lm.name} ({A.family}) is not one (use e.g. smollm2)")


def _floats(t) -> list:
    return [None if not math.isfinite(v) else round(v, 7) for v in torch.as_tensor(t).double().tolist()]


# ----------------------------------------------------------------------------------------------
# the per-example function


def evaluate_examples(lm, examples: list[Example], methods=EVAL_METHODS, *, ig_steps: int = 16,
                      max_tokens: int = 1024, baseline: str = "zero") -> list[dict]:
    """One JSON-able record per example (same order). Nothing global is read or written: the result depends
    only on the model, the examples and the options, so batches can run anywhere (another process, a Ray
    worker) and their records be merged.

    Record fields: ``id, dataset, group, prefix, target, foil, methods``; ``usable`` (False when target and
    foil cannot be told apart) and ``skip`` (why the example is left out of the alignment, or None);
    ``tokens, target_token, foil_token, shared, evidence, rankable, missing`` (positions are token indices of
    ``tokens``); ``logit_diff`` and ``correct`` (target logit > foil logit); for alignment examples
    ``scores[method]`` (per token), ``metrics[method] = {rr, probes, dot, rank}``, ``errors[method]`` (a
    method that refused, e.g. an invariant check), ``layers`` (per-layer attention and MLP updates of the
    logit difference, Ferrando et al. §5), ``time[stage]`` and ``cpu[stage]`` (wall-clock and process CPU
    seconds, this example's share of each batch); with ``ig``, ``info`` holds ``ig_completeness_error``
    (relative: ``|sum of scores - (f(x) - f(baseline))| / max(|f(x) - f(baseline)|, 1e-6)``),
    ``ig_completeness_abs`` (the numerator), ``ig_f_input``, ``ig_f_baseline`` and ``ig_baseline``;
    ``version`` is the code version (:func:`lenscope.version.code_version`). The positional methods
    ``first``/``recent`` score position ``j`` with ``n - j`` / ``j + 1`` (:func:`positional_scores`).
    """
    from ..attribution.baselines import ig_baseline
    from ..attribution.context import alti_logit_explanation, logit_explanation
    from ..version import code_version
    from . import batched

    check_model(lm)
    methods = check_methods(methods)
    base = ig_baseline(lm, baseline)[0] if "ig" in methods else None  # once per call (the mean is a vocab pass)
    version = code_version()
    preps = [prepare(lm, ex) for ex in examples]
    recs: list[dict] = []
    for ex, p in zip(examples, preps):
        r = {"id": ex.id, "dataset": ex.dataset, "group": ex.group, "prefix": ex.prefix, "target": ex.target,
             "foil": ex.foil, "methods": methods, "usable": p.usable, "skip": p.skip, "version": version}
        if ex.info.get("sentence_pair"):
            r["pair"] = True
        elif p.usable:
            r.update(tokens=p.tokens, target_token=lm.tokenizer.decode([p.target_id]),
                     foil_token=lm.tokenizer.decode([p.foil_id]), shared=p.shared, evidence=p.evidence,
                     rankable=p.rankable, missing=p.missing)
        recs.append(r)

    def timed(name, idx, fn, *args, **kwargs):
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn(*args, **kwargs)
        dt, dc = (time.perf_counter() - t0) / len(idx), (time.process_time() - c0) / len(idx)
        for i in idx:
            for key, d in (("time", dt), ("cpu", dc)):
                slot = recs[i].setdefault(key, {})
                slot[name] = slot.get(name, 0.0) + d
        return out

    from .evidence import sentence_ids

    groups: dict = defaultdict(list)
    for i, (ex, p) in enumerate(zip(examples, preps)):
        if p.usable and ex.info.get("sentence_pair"):
            good = timed("forward", [i], batched.sentence_logprob, lm, sentence_ids(lm.tokenizer, ex.target))
            bad = timed("forward", [i], batched.sentence_logprob, lm, sentence_ids(lm.tokenizer, ex.foil))
            diff = good - bad
            recs[i]["logit_diff"] = diff  # log p(good sentence) - log p(bad sentence)
            recs[i]["correct"] = bool(diff > 0)
        elif p.usable:
            groups[(p.skip is None, p.n)].append(i)
    for (align, n), idx in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        ids = torch.tensor([preps[i].ids for i in idx], dtype=torch.long)
        t = torch.tensor([preps[i].target_id for i in idx])
        f = torch.tensor([preps[i].foil_id for i in idx])
        if not align:
            diff = timed("forward", idx, batched.last_logit_diff, lm, ids, t, f)
            for k, i in enumerate(idx):
                recs[i]["logit_diff"] = float(diff[k])
                recs[i]["correct"] = bool(diff[k] > 0)
            continue
        for i in idx:
            recs[i].update(scores={}, metrics={}, errors={}, info={})
        trs = timed("trace", idx, batched.traces, lm, ids)
        f_full = torch.stack([tr.logits[-1, tt] - tr.logits[-1, ff] for tr, tt, ff in zip(trs, t, f)])
        for k, i in enumerate(idx):
            recs[i]["logit_diff"] = float(f_full[k])
            recs[i]["correct"] = bool(f_full[k] > 0)
        for k, i in enumerate(idx):  # trace-based methods, one example at a time on its own trace
            tr, p = trs[k], preps[i]
            try:
                lg = timed("logit", [i], logit_explanation, lm, tr.input_ids, p.target_id, p.foil_id, tr=tr)
                recs[i]["layers"] = {"attention": _floats(lg.attention_update), "mlp": _floats(lg.mlp_update),
                                     "embed": lg.info["embed_update"], "bias": lg.info["bias_update"],
                                     "logit": lg.info["logit"]}
                if "logit" in methods:
                    recs[i]["scores"]["logit"] = lg.scores
            except LenscopeError as e:
                recs[i]["errors"]["logit"] = str(e).splitlines()[0]
            if "alti-logit" in methods:
                try:
                    al = timed("alti-logit", [i], alti_logit_explanation, lm, tr.input_ids, p.target_id, p.foil_id,
                               tr=tr)
                    recs[i]["scores"]["alti-logit"] = al.scores
                except LenscopeError as e:
                    recs[i]["errors"]["alti-logit"] = str(e).splitlines()[0]
        del trs
        if "grad-norm" in methods or "grad-x-input" in methods:
            g = timed("gradients", idx, batched.gradients, lm, ids, t, f)
            for k, i in enumerate(idx):
                for m in ("grad-norm", "grad-x-input"):
                    if m in methods:
                        recs[i]["scores"][m] = g[m][k]
        if "ig" in methods:
            ig = timed("ig", idx, batched.integrated_gradients, lm, ids, t, f, steps=ig_steps,
                       max_tokens=max_tokens, baseline=baseline if base is None else base)
            for k, i in enumerate(idx):
                recs[i]["scores"]["ig"] = ig["ig"][k]
                recs[i]["info"]["ig_completeness_error"] = float(ig["completeness_error"][k])
                recs[i]["info"].update(ig_completeness_abs=float(ig["completeness_abs"][k]),
                                       ig_f_input=float(ig["f_input"][k]), ig_f_baseline=float(ig["f_baseline"][k]),
                                       ig_baseline=baseline)
        if "erasure" in methods:
            er = timed("erasure", idx, batched.erasure, lm, ids, t, f, f_full=f_full, max_tokens=4 * max_tokens)
            for k, i in enumerate(idx):
                recs[i]["scores"]["erasure"] = er["erasure"][k]
        for m in POSITIONAL:
            if m in methods:
                for i in idx:
                    recs[i]["scores"][m] = positional_scores(n, m)
        for i in idx:
            r, p = recs[i], preps[i]
            for m in methods:
                if m in r["scores"]:
                    try:
                        r["metrics"][m] = alignment(r["scores"][m], p.evidence, p.rankable)
                    except ValueError as e:
                        r["errors"][m] = str(e)
                    r["scores"][m] = _floats(r["scores"][m])
    return recs


def batch_job(lm, item) -> list[dict]:
    """A sweep job (:func:`lenscope.distributed.run_sweep`): one batch of examples -> their records."""
    batch, methods, ig_steps, max_tokens, baseline = item
    return evaluate_examples(lm, batch, methods, ig_steps=ig_steps, max_tokens=max_tokens, baseline=baseline)


def evaluate_example(lm, example: Example, methods=EVAL_METHODS, **options) -> dict:
    """The record of one example (:func:`evaluate_examples` on a batch of one)."""
    return evaluate_examples(lm, [example], methods, **options)[0]


# ----------------------------------------------------------------------------------------------
# the summary


@dataclass(repr=False)
class AlignmentSummary:
    """Dataset-level results of ``eval alignment``.

    ``datasets[name]`` (one per dataset, in the order given)::

        {"rows", "evaluated", "n_accuracy", "accuracy", "accuracy_ci", "n", "skipped", "skip_reasons", "random_mrr",
         "methods": {method: {"mrr", "mrr_ci", "probes", "probes_ci", "dot", "dot_ci", "n", "skipped",
                              "errors", "accuracy", "correct": {"n", "mrr", "mrr_ci", "probes", ...}}},
         "groups": {group: {"n", "n_accuracy", "accuracy", "accuracy_ci", "methods": {method: {...}}}},
         "layers": {"n", "attention": [per layer], "mlp": [per layer], "embed", "bias", "logit"},
         "paired": {method: {"mean", "ci", "n"}},       # ALTI-Logit's reciprocal rank minus method's
         "ig_completeness": {"baseline", "n", "median", "max", "median_abs", "max_abs"}}   # with ig only

    ``n`` counts examples in the alignment, ``skipped`` those left out (reasons in ``skip_reasons``);
    ``random_mrr`` is the MRR a uniformly random ranking would get on the same examples; the methods ``first``
    and ``recent`` are the positional rankings (earliest token first, nearest token first), other trivial
    answers reported like every method;
    ``accuracy`` is over all examples with a usable target/foil pair (``n_accuracy``). Intervals are 95%
    percentile bootstraps (1000 resamples, seed 0). ``timing``: wall-clock (``seconds``, ``per_example``) and
    process CPU (``cpu_seconds``, ``cpu_per_example``) seconds per stage over the examples computed in the runs
    that produced the records (CPU time is the better measure on a shared machine). ``info["versions"]``
    counts the records of each code version (``"unrecorded"``: written before records carried one).
    """

    model: str
    methods: list
    datasets: dict
    timing: dict = field(default_factory=dict)
    info: dict = field(default_factory=dict)
    machine: dict = field(default_factory=dict)  # set by a benchmark script (benchmarks/machine.py record())

    def to_dict(self) -> dict:
        d = {"model": self.model, "methods": self.methods, "datasets": self.datasets, "timing": self.timing,
             "info": self.info}
        if self.machine:
            d["machine"] = self.machine
        return d

    def to_frame(self):
        """One row per (dataset, method) with n, skipped, accuracy and every metric (all and correct-only)."""
        import pandas as pd

        rows = []
        for d, ds in self.datasets.items():
            for m in self.methods:
                e = ds["methods"].get(m, {})
                row = {"dataset": d, "method": m, "n": e.get("n", 0), "skipped": e.get("skipped", ds["skipped"]),
                       "accuracy": ds["accuracy"]}
                for k in ("mrr", "probes", "dot"):
                    row[k] = e.get(k)
                    ci = e.get(f"{k}_ci") or [None, None]
                    row[f"{k}_lo"], row[f"{k}_hi"] = ci
                    row[f"{k}_correct"] = (e.get("correct") or {}).get(k)
                rows.append(row)
        return pd.DataFrame(rows)

    def table(self, metric: str = "mrr", *, ci: bool = True, correct: bool = False) -> str:
        """A markdown table: rows datasets, columns methods (``metric`` with its interval)."""
        head = ["dataset", "n", "skipped", "accuracy"] + self.methods + (["random"] if metric == "mrr" else [])
        lines = ["| " + " | ".join(head) + " |", "| --- | " + " | ".join(["---:"] * (len(head) - 1)) + " |"]
        for d, ds in self.datasets.items():
            cells = [d, str(ds["n"]), str(ds["skipped"]), _fmt(ds["accuracy"])]
            vals = {m: ((ds["methods"].get(m) or {}).get("correct") if correct else ds["methods"].get(m)) or {}
                    for m in self.methods}
            # the best explanation in bold; the positional rankings are references, like random
            cand = [m for m in self.methods if m not in POSITIONAL] or self.methods
            best = max((vals[m].get(metric) for m in cand if vals[m].get(metric) is not None), default=None)
            for m in self.methods:
                v = vals[m].get(metric)
                if v is None:
                    cells.append("—")
                    continue
                s = _fmt(v)
                if ci and vals[m].get(f"{metric}_ci"):
                    lo, hi = vals[m][f"{metric}_ci"]
                    s += f" [{_fmt(lo)}, {_fmt(hi)}]"
                if metric != "probes" and best is not None and v == best and m in cand and len(cand) > 1:
                    s = f"**{s}**"
                cells.append(s)
            if metric == "mrr":
                cells.append(_fmt(ds.get("random_mrr")))
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)

    def claim(self, method: str = "alti-logit") -> dict:
        """On how many datasets ``method``'s MRR is above each other method's (and significantly so: the
        paired bootstrap interval of the difference excludes 0)."""
        out = {}
        for m in self.methods:
            if m == method:
                continue
            above = sig_above = sig_below = total = 0
            for ds in self.datasets.values():
                a, b = ds["methods"].get(method, {}).get("mrr"), ds["methods"].get(m, {}).get("mrr")
                if a is None or b is None:
                    continue
                total += 1
                above += a > b
                ci = (ds.get("paired", {}).get(m) or {}).get("ci")
                if ci:
                    sig_above += ci[0] > 0
                    sig_below += ci[1] < 0
            out[m] = {"datasets": total, "above": above, "significantly_above": sig_above,
                      "significantly_below": sig_below}
        return out

    def plot(self):
        """The MLP analysis (Ferrando et al. §5): mean per-layer attention and MLP updates of the contrastive
        logit difference, one panel per dataset."""
        from ..viz.eval_plots import plot_layer_contributions

        return plot_layer_contributions(self)

    def save(self, out_dir: str | Path) -> Path:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "summary.json").write_text(json.dumps(_clean(self.to_dict()), indent=1))
        (out / "table.md").write_text(self.markdown())
        self.to_frame().to_csv(out / "table.csv", index=False)
        if any(ds["layers"]["n"] for ds in self.datasets.values()):
            from ..viz.eval_plots import plot_mrr
            from ..viz.plots import save_figure

            save_figure(self.plot(), str(out / "layers.png"))
            if any(ds["n"] for ds in self.datasets.values()):
                save_figure(plot_mrr(self), str(out / "mrr.png"))
        return out

    def markdown(self) -> str:
        parts = [f"# eval alignment: {self.model}", "", "MRR (95% bootstrap interval), all examples:", "",
                 self.table("mrr"), "", "MRR, examples the model gets right:", "", self.table("mrr", correct=True),
                 "", "Probes needed (lower is better):", "", self.table("probes"), "",
                 "Dot product with the evidence (L1-normalised scores):", "", self.table("dot")]
        comp = {d: ds["ig_completeness"] for d, ds in self.datasets.items()
                if (ds.get("ig_completeness") or {}).get("n")}
        if comp:
            parts += ["", "Integrated gradients' completeness error per example, relative "
                      "(|sum of scores - (f(x) - f(baseline))| / max(|f(x) - f(baseline)|, 1e-6)) and absolute "
                      "(logit units):", "", "| dataset | baseline | n | median | max | median abs | max abs |",
                      "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
            for d, c in comp.items():
                parts.append(f"| {d} | {c['baseline']} | {c['n']} | {_sci(c['median'])} | {_sci(c['max'])} | "
                             f"{_sci(c['median_abs'])} | {_sci(c['max_abs'])} |")
        groups = [(d, ds["groups"]) for d, ds in self.datasets.items() if ds.get("groups")]
        for d, gs in groups:
            parts += ["", f"Groups of {d}:", "", "| group | n | accuracy | " + " | ".join(self.methods) + " |",
                      "| --- | ---: | ---: | " + " | ".join(["---:"] * len(self.methods)) + " |"]
            for g, e in gs.items():
                parts.append(f"| {g} | {e['n']} | {_fmt(e['accuracy'])} | " + " | ".join(
                    _fmt((e["methods"].get(m) or {}).get("mrr")) for m in self.methods) + " |")
        if self.timing.get("seconds"):
            parts += ["", "Time per stage (seconds per example):", "",
                      "| " + " | ".join(self.timing["per_example"]) + " |",
                      "|" + "---:|" * len(self.timing["per_example"]),
                      "| " + " | ".join(f"{v:.3f}" for v in self.timing["per_example"].values()) + " |"]
        return "\n".join(parts) + "\n"

    @classmethod
    def load(cls, out_dir: str | Path) -> AlignmentSummary:
        p = Path(out_dir) / "summary.json"
        if not p.exists():
            raise InputError(f"no alignment summary in {out_dir} (summary.json missing)")
        return cls(**json.loads(p.read_text()))

    def __repr__(self) -> str:
        return f"AlignmentSummary({self.model}, {len(self.datasets)} datasets, methods={','.join(self.methods)})"


def _fmt(v) -> str:
    if v is None:
        return "—"
    return f"{v:.2f}" if isinstance(v, float) else str(v)


def _sci(v) -> str:
    return "—" if v is None else f"{v:.2g}"


def _clean(x):
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def _method_stats(recs: list[dict], m: str, n_total: int, accuracy) -> dict:
    vals = [r["metrics"][m] for r in recs if m in r.get("metrics", {})]
    e: dict = {"n": len(vals), "skipped": n_total - len(vals), "accuracy": accuracy,
               "errors": sum(1 for r in recs if m in r.get("errors", {}))}
    for k, name in (("rr", "mrr"), ("probes", "probes"), ("dot", "dot")):
        e[name], e[f"{name}_ci"] = mean_ci([v[k] for v in vals])
    ok = [r["metrics"][m] for r in recs if m in r.get("metrics", {}) and r["correct"]]
    c: dict = {"n": len(ok)}
    for k, name in (("rr", "mrr"), ("probes", "probes"), ("dot", "dot")):
        c[name], c[f"{name}_ci"] = mean_ci([v[k] for v in ok])
    e["correct"] = c
    return e


def summarise(model: str, datasets: dict[str, list[Example]], records: dict[str, dict], methods) -> AlignmentSummary:
    """Dataset means (with bootstrap intervals), groups, per-layer contributions and timing from the records
    of ``datasets`` (examples without a record are reported as not evaluated)."""
    methods = list(methods)
    pos = [m for m in POSITIONAL if m in methods]
    if pos:  # positional metrics from the records' own fields where a record predates these methods
        records = dict(records)
        for k, r in records.items():
            if r.get("usable") and r.get("skip") is None and "metrics" in r and any(m not in r["metrics"] for m in pos):
                r = records[k] = {**r, "metrics": dict(r["metrics"])}
                for m in pos:
                    r["metrics"].setdefault(m, positional_metrics(r, m))
    versions: Counter = Counter()
    out = {}
    seconds: Counter = Counter()
    cpu: Counter = Counter()
    n_timed = n_cpu = 0
    for name, exs in datasets.items():
        recs = [records[ex.id] for ex in exs if ex.id in records]
        versions.update(r.get("version") or "unrecorded" for r in recs)
        for r in recs:
            if r.get("time"):
                seconds.update(r["time"])
                n_timed += 1
            if r.get("cpu"):
                cpu.update(r["cpu"])
                n_cpu += 1
        usable = [r for r in recs if r["usable"]]
        align = [r for r in usable if r["skip"] is None]
        acc, acc_ci = mean_ci([float(r["correct"]) for r in usable])
        reasons = Counter(r["skip"] for r in recs if r["skip"])
        ds = {"rows": len(exs), "evaluated": len(recs), "n_accuracy": len(usable), "accuracy": acc,
              "accuracy_ci": acc_ci, "n": len(align), "skipped": len(recs) - len(align),
              "skip_reasons": dict(reasons),
              "methods": {m: _method_stats(align, m, len(recs), acc) for m in methods}}
        gnames = sorted({r["group"] for r in recs if r.get("group") is not None}, key=_natural)
        groups = {}
        for g in gnames:
            gr = [r for r in recs if r.get("group") == g]
            gu = [r for r in gr if r["usable"]]
            ga = [r for r in gu if r["skip"] is None]
            gacc, gci = mean_ci([float(r["correct"]) for r in gu])
            groups[g] = {"n": len(ga), "n_accuracy": len(gu), "accuracy": gacc, "accuracy_ci": gci,
                         "methods": {m: _method_stats(ga, m, len(gr), gacc) for m in methods}}
        ds["groups"] = groups
        ds["random_mrr"] = mean_ci([random_rr(len(r["rankable"]), len(r["evidence"])) for r in align])[0]
        lay = [r["layers"] for r in align if r.get("layers")]
        ds["layers"] = {"n": len(lay)}
        if lay:
            for k in ("attention", "mlp"):
                ds["layers"][k] = np.mean(np.array([x[k] for x in lay], dtype=np.float64), 0).tolist()
            for k in ("embed", "bias", "logit"):
                ds["layers"][k] = float(np.mean([x[k] for x in lay]))
        paired = {}
        if "alti-logit" in methods:
            for m in methods:
                if m == "alti-logit":
                    continue
                both = [r for r in align if "alti-logit" in r["metrics"] and m in r["metrics"]]
                if both:
                    paired[m] = paired_difference([r["metrics"]["alti-logit"]["rr"] for r in both],
                                                  [r["metrics"][m]["rr"] for r in both])
        ds["paired"] = paired
        if "ig" in methods:
            ig = [r for r in align if "ig" in r.get("metrics", {})]
            rel = [r["info"]["ig_completeness_error"] for r in ig if r.get("info", {}).get("ig_completeness_error")
                   is not None]
            ab = [r["info"]["ig_completeness_abs"] for r in ig if r["info"].get("ig_completeness_abs") is not None]
            bases = sorted({r["info"].get("ig_baseline", "zero") for r in ig})
            ds["ig_completeness"] = {
                "baseline": ",".join(bases) if bases else None, "n": len(rel),
                "median": float(np.median(rel)) if rel else None, "max": float(np.max(rel)) if rel else None,
                "median_abs": float(np.median(ab)) if ab else None, "max_abs": float(np.max(ab)) if ab else None}
        out[name] = ds
    timing = {}
    if n_timed:
        timing = {"examples": n_timed, "seconds": dict(seconds),
                  "per_example": {k: seconds[k] / n_timed for k in TIMERS if k in seconds}}
    if n_cpu:
        timing.update(cpu_examples=n_cpu, cpu_seconds=dict(cpu),
                      cpu_per_example={k: cpu[k] / n_cpu for k in TIMERS if k in cpu})
    return AlignmentSummary(model=model, methods=methods, datasets=out, timing=timing,
                            info={"versions": dict(versions)})


def _natural(s: str):
    return (0, int(s), "") if s.isdigit() else (1, 0, s)


# ----------------------------------------------------------------------------------------------
# the resumable run


def read_records(path: Path) -> dict[str, dict]:
    """``{id: record}`` from an append-only ``records.jsonl`` (a later line for the same id wins). A last
    line cut short by an interruption is dropped (and removed from the file)."""
    if not path.exists():
        return {}
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines(keepends=True)
    recs: dict = {}
    good = 0
    for k, line in enumerate(lines):
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            if k == len(lines) - 1:  # interrupted while writing: drop it
                with path.open("r+", encoding="utf-8") as fh:
                    fh.truncate(good)
                break
            raise InputError(f"{path}: line {k + 1} is not a JSON record; the file is damaged (remove it, or use "
                             "another --out)") from None
        good += len(line.encode("utf-8"))
        recs[r["id"]] = r
    return recs


def _done(rec: dict | None, ex: Example, methods) -> bool:
    if rec is None or rec.get("prefix") != ex.prefix or rec.get("target") != ex.target or rec.get("foil") != ex.foil:
        return False
    if not rec["usable"] or rec["skip"] is not None:
        return True
    # the positional rankings need no model: summarise derives them from the record's tokens and evidence
    return set(methods) - set(POSITIONAL) <= set(rec["methods"])


def load_datasets(specs, limit: int | None = None) -> dict[str, list[Example]]:
    """``{dataset name: examples}`` for every spec (``blimp:all11`` expands to the 11 subsets)."""
    if isinstance(specs, str):
        specs = [specs]
    out = {}
    for spec in expand_specs(list(specs)):
        exs = load_dataset(spec, limit)
        out[exs[0].dataset if exs else spec] = exs
    return out


def run_alignment(lm, specs, methods=EVAL_METHODS, *, out: str | Path | None = None, limit: int | None = None,
                  ig_steps: int = 16, batch_size: int = 16, max_tokens: int = 1024, progress: bool = True,
                  restart: bool = False, block: int = 50, ray=None, workers: int = 2, baseline: str = "zero",
                  force: bool = False) -> AlignmentSummary:
    """Evaluate ``methods`` on the datasets ``specs`` (see :func:`~lenscope.data.datasets.load_dataset`).

    With ``out``, every example's record is appended to ``out/records.jsonl`` as soon as its batch finishes,
    and a rerun with the same model skips the examples already there (``restart=True`` starts afresh); the
    summary (``summary.json``, ``table.md``, ``table.csv``, ``layers.png``, ``mrr.png``) is written at the end.
    Examples run in blocks of ``block`` rows per dataset (rows 0..block-1 of every dataset first), so the
    records of an interrupted run hold complete ``--limit`` prefixes of every dataset. ``ray`` (True for a local
    Ray, or a cluster address) hands the batches to ``workers`` Ray workers; records and files are the same.
    ``baseline``: integrated gradients' baseline (``zero``, ``pad`` or ``mean``, see
    :func:`lenscope.attribution.baselines.ig_baseline`); a folder holds one baseline.

    Every record carries the code version (:func:`lenscope.version.code_version`). A resume that would add
    records to a folder holding records of another version (or records from before versions were recorded) is
    refused with an :class:`InputError` unless ``force=True``; a rerun with nothing left to compute only
    rewrites the summary, whose ``info["versions"]`` counts the records of each version.
    """
    from tqdm.auto import tqdm

    from ..attribution.baselines import IG_BASELINES
    from ..version import code_version

    check_model(lm)
    methods = check_methods(methods)
    if baseline not in IG_BASELINES:
        raise InputError(f"unknown --baseline {baseline!r}; choose from {', '.join(IG_BASELINES)}")
    if isinstance(ig_steps, bool) or not isinstance(ig_steps, int) or ig_steps < 1:
        raise InputError("--ig-steps must be a positive integer")
    if batch_size < 1:
        raise InputError("--batch-size must be at least 1")
    datasets = load_datasets(specs, limit)
    records: dict[str, dict] = {}
    rec_path = None
    meta = {"model": lm.name, "ig_steps": ig_steps}
    if baseline != "zero":  # a zero-baseline folder's run.json stays as it always was
        meta["baseline"] = baseline
    if out is not None:
        outp = Path(out)
        outp.mkdir(parents=True, exist_ok=True)
        rec_path, run_path = outp / "records.jsonl", outp / "run.json"
        if restart:
            for p in (rec_path, run_path):
                if p.exists():
                    p.unlink()
        if run_path.exists():
            old = json.loads(run_path.read_text())
            if old != meta:
                raise InputError(f"{outp} holds results for {old}, not {meta}; use another --out, or --restart to "
                                 "discard them")
        run_path.write_text(json.dumps(meta))
        records = read_records(rec_path)

    every = [ex for exs in datasets.values() for ex in exs]
    ids = [ex.id for ex in every]
    if len(set(ids)) != len(ids):
        dup = next(i for i, c in Counter(ids).items() if c > 1)
        raise InputError(f"example id {dup!r} occurs twice; give each dataset once")
    row = {ex.id: k for exs in datasets.values() for k, ex in enumerate(exs)}
    pending = [ex for ex in every if not _done(records.get(ex.id), ex, methods)]
    version = code_version()
    others = Counter(r.get("version") or "unrecorded" for r in records.values() if r.get("version") != version)
    if pending and others and not force:
        have = ", ".join(f"{n} of version {v}" for v, n in others.most_common())
        raise InputError(f"{out} holds records of another code version ({have}; this is {version}): resuming "
                         "would mix versions in one table. Use another --out, --restart to discard them, or --force "
                         "to add to them anyway")
    # rows 0-49 of every dataset first, then 50-99, ... (an interrupted run leaves complete --limit blocks);
    # within a block, batches of equal token length, alignment examples and accuracy-only ones apart
    keyed = []
    for ex in pending:
        p = prepare(lm, ex)
        keyed.append(((row[ex.id] // block, p.usable and p.skip is None, p.n), ex))
    keyed.sort(key=lambda kv: kv[0])
    batches, cur, cur_key = [], [], None
    for key, ex in keyed:
        if cur and (key != cur_key or len(cur) >= (batch_size if key[1] else 8 * batch_size)):
            batches.append(cur)
            cur = []
        cur, cur_key = cur + [ex], key
    if cur:
        batches.append(cur)

    t0 = time.perf_counter()
    bar = tqdm(total=len(every), initial=len(every) - len(pending), desc=f"eval alignment {lm.name}", unit="ex",
               disable=not progress)
    try:
        from ..distributed import run_sweep

        items = [(batch, methods, ig_steps, max_tokens, baseline) for batch in batches]
        for k, recs in run_sweep(batch_job, items, lm=lm, ray=ray, workers=workers):
            batch = batches[k]
            for r in recs:
                records[r["id"]] = r
            if rec_path is not None:
                with rec_path.open("a", encoding="utf-8") as fh:
                    fh.write("".join(json.dumps(_clean(r)) + "\n" for r in recs))
            bar.update(len(batch))
    finally:
        bar.close()
    summary = summarise(lm.name, datasets, records, methods)
    summary.info = {"limit": limit, "ig_steps": ig_steps, "batch_size": batch_size, "computed_now": len(pending),
                    "wall_seconds_now": time.perf_counter() - t0, "specs": list(specs) if not isinstance(specs, str)
                    else [specs], "baseline": baseline, "version": version, **summary.info}
    if out is not None:
        summary.save(out)
    return summary
