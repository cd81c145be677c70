"""The summary of ``lenscope eval alignment``: records -> :class:`AlignmentSummary` (dataset means with
bootstrap intervals, groups, per-layer contributions, integrated gradients' completeness, timing), its tables,
plots and files."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..attribution.methods import DEFAULT as REFERENCE
from ..attribution.methods import eval_timers
from ..attribution.methods import methods as methods_table
from ..data.datasets import Example
from ..errors import InputError
from ..results import finite_json
from .metrics import POSITIONAL, mean_ci, paired_difference, positional_metrics, random_rr


def timers() -> tuple[str, ...]:
    """The timing stages of the records, in the summary's order: the trace, each method's (the method table's),
    the forward passes."""
    return ("trace",) + eval_timers() + ("forward",)



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

    def claim(self, method: str = REFERENCE) -> dict:
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


_clean = finite_json  # the one home: lenscope.results.finite_json


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
        if REFERENCE in methods:
            for m in methods:
                if m == REFERENCE:
                    continue
                both = [r for r in align if REFERENCE in r["metrics"] and m in r["metrics"]]
                if both:
                    paired[m] = paired_difference([r["metrics"][REFERENCE]["rr"] for r in both],
                                                  [r["metrics"][m]["rr"] for r in both])
        ds["paired"] = paired
        for m in methods_table():  # a method's own summary of its records (integrated gradients' completeness)
            if m.name in methods and m.summarize is not None:
                ds.update(m.summarize(align))
        out[name] = ds
    timing = {}
    if n_timed:
        timing = {"examples": n_timed, "seconds": dict(seconds),
                  "per_example": {k: seconds[k] / n_timed for k in timers() if k in seconds}}
    if n_cpu:
        timing.update(cpu_examples=n_cpu, cpu_seconds=dict(cpu),
                      cpu_per_example={k: cpu[k] / n_cpu for k in timers() if k in cpu})
    return AlignmentSummary(model=model, methods=methods, datasets=out, timing=timing,
                            info={"versions": dict(versions)})


def _natural(s: str):
    return (0, int(s), "") if s.isdigit() else (1, 0, s)
