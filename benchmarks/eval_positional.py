"""Add the positional rankings ``first`` and ``recent`` to an ``eval alignment`` results folder without
recomputing anything: they need only each record's ``tokens``, ``evidence`` and ``rankable`` fields, which
every record holds. The summary (``summary.json``, ``table.md``, ``table.csv``, figures) is rewritten from
``records.jsonl`` by :func:`lenscope.evaluate.alignment.summarise` for the run's own datasets and ``--limit``
(read from the old ``summary.json``); the records are not touched and no model is loaded.

Every other method's numbers are checked to come out exactly as in the old summary (the script stops if not).
The new ``summary.json`` says how it was made under ``info.positional`` and ``machine`` (this command, the date,
the machine)
and holds two counts per dataset set under ``info.positional.counts``:

- ``beats_every_method``: datasets where the positional ranking's MRR is above every attribution method's;
- ``alti_logit_claim``: ALTI-Logit vs each other method (above / significantly above / significantly below,
  the paired bootstrap of :meth:`AlignmentSummary.claim`), the verdict table of docs/evaluation.md.

    .venv/bin/python benchmarks/eval_positional.py docs/results/evaluation/smollm2
    .venv/bin/python benchmarks/eval_positional.py docs/results/evaluation/gemma3-270m
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import record

from lenscope.evaluate.alignment import POSITIONAL, load_datasets, read_records, summarise


def counts(summary) -> dict:
    explain = [m for m in summary.methods if m not in POSITIONAL]
    out: dict = {"beats_every_method": {}}
    for p in [m for m in POSITIONAL if m in summary.methods]:
        names = []
        for d, ds in summary.datasets.items():
            v = (ds["methods"].get(p) or {}).get("mrr")
            others = [(ds["methods"].get(m) or {}).get("mrr") for m in explain]
            if v is not None and all(o is not None and v > o for o in others):
                names.append(d)
        out["beats_every_method"][p] = {"count": len(names), "of": len(summary.datasets), "datasets": names}
    either = [d for d in summary.datasets if any(d in out["beats_every_method"][p]["datasets"]
                                                 for p in out["beats_every_method"])]
    out["beats_every_method"]["first_or_recent"] = {"count": len(either), "of": len(summary.datasets),
                                                    "datasets": either}
    if "alti-logit" in summary.methods:
        out["alti_logit_claim"] = summary.claim("alti-logit")
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", help="an eval alignment --out folder (records.jsonl and summary.json)")
    a = ap.parse_args(argv)
    folder = Path(a.folder)
    old = json.loads((folder / "summary.json").read_text())
    info = dict(old["info"])
    datasets = load_datasets(info["specs"], info["limit"])
    records = read_records(folder / "records.jsonl")
    methods = list(dict.fromkeys([m for m in old["methods"] if m not in POSITIONAL] + list(POSITIONAL)))
    s = summarise(old["model"], datasets, records, methods)
    for d, ds in old["datasets"].items():  # nothing else may move
        for m, e in ds["methods"].items():
            if m not in POSITIONAL:
                assert json.loads(json.dumps(s.datasets[d]["methods"][m])) == e, (d, m)
        assert s.datasets[d]["random_mrr"] == ds["random_mrr"] and s.datasets[d]["accuracy"] == ds["accuracy"], d
    info.pop("positional", None)
    info.update(s.info)
    s.machine = record()
    info["positional"] = {**s.machine, "how": "first/recent derived from the records' tokens, evidence and rankable "
                          "fields by benchmarks/eval_positional.py (no model run); every other number as computed "
                          "by the run", "counts": counts(s)}
    s.info = info
    s.save(folder)
    c = info["positional"]["counts"]
    for p, e in c["beats_every_method"].items():
        print(f"{old['model']}: {p} beats every attribution method on {e['count']} of {e['of']} datasets")
    for m, e in c.get("alti_logit_claim", {}).items():
        print(f"  alti-logit vs {m}: above {e['above']}, sig. above {e['significantly_above']}, sig. below "
              f"{e['significantly_below']} of {e['datasets']}")
    print(s.table("mrr", ci=False))


if __name__ == "__main__":
    main()
