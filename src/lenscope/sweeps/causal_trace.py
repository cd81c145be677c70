"""Causal tracing over a set of facts (Meng et al. 2022, Fig. 2-style averages), resumable, here or on Ray.

Each fact is ``{"prompt", "subject", "target"[, "relation"]}``. Every trace is aligned to ROME's six position
groups (:data:`GROUPS`) and the average indirect effects are averaged per (layer, group) over the facts.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from ..data.jsonl import jsonl_rows
from ..data.shared import shared_file
from ..errors import InputError
from ..interventions.tracing import KINDS, causal_trace, embedding_std
from ..results import Result, field_values

GROUPS = ["first subject token", "middle subject tokens", "last subject token", "first subsequent token",
          "further tokens", "last token"]


def position_groups(subject_positions: list[int], n_pos: int) -> list[list[int]]:
    """The positions of one prompt in each of :data:`GROUPS`. Each position is in one group only: the last
    token is always "last token" (so in "The capital of France is" the token after the subject is the last
    token and "first subsequent token" is empty), and a one-token subject is its "last subject token"."""
    s0, s1 = min(subject_positions), max(subject_positions)
    last = n_pos - 1
    after = s1 + 1
    return [[s0] if s0 < s1 else [], list(range(s0 + 1, s1)), [s1] if s1 < last else [],
            [after] if after < last else [], list(range(after + 1, last)), [last]]


def grouped(m: Tensor, groups: list[list[int]]) -> Tensor:
    """``(layer, pos) -> (layer, group)``: the mean over each group's positions; NaN for an empty group."""
    out = torch.full((m.shape[0], len(groups)), math.nan, dtype=torch.float64)
    for g, ps in enumerate(groups):
        if ps:
            out[:, g] = m[:, ps].double().mean(1)
    return out


def load_facts(spec: str = "facts", limit: int | None = None) -> list[dict]:
    """Facts from ``facts`` (the shared fact set, ../shared/data/facts/facts.jsonl) or a JSON-lines file, taken
    round-robin over relations (so a ``limit`` covers every relation). A bad line is an error naming it."""
    if spec == "facts":
        path = shared_file("facts/facts.jsonl")
        if path is None:
            raise InputError("the shared fact set was not found (set LENSCOPE_DATA to the shared data folder, "
                             "or give a JSON-lines file of {prompt, subject, target})")
    else:
        path = Path(spec)
        if not path.is_file():
            raise InputError(f"no such fact file: {spec}")
    facts = []
    for n, f in jsonl_rows(path):
        missing = [k for k in ("prompt", "subject", "target") if not isinstance(f.get(k), str) or not f.get(k)]
        if missing:
            raise InputError(f"{path}, line {n}: missing or empty {', '.join(missing)}")
        if f["subject"] not in f["prompt"]:
            raise InputError(f"{path}, line {n}: the subject {f['subject']!r} is not in the prompt")
        facts.append({"prompt": f["prompt"], "subject": f["subject"], "target": f["target"],
                      "relation": str(f.get("relation", ""))})
    if not facts:
        raise InputError(f"{path} holds no facts")
    by_rel: dict[str, list] = {}
    for f in facts:
        by_rel.setdefault(f["relation"], []).append(f)
    rounds = max(map(len, by_rel.values()))
    facts = [fs[k] for k in range(rounds) for fs in by_rel.values() if k < len(fs)]
    return facts[:limit] if limit else facts


def fact_job(lm, item: tuple[int, dict, dict]) -> dict:
    """One fact's trace as a JSON-able record (a sweep job; see :func:`lenscope.distributed.run_sweep`)."""
    idx, fact, settings = item
    try:
        tr = causal_trace(lm, fact["prompt"], fact["subject"], fact["target"], **settings)
    except InputError as e:
        return {"index": idx, "prompt": fact["prompt"], "skipped": str(e)}
    groups = position_groups(tr.subject_positions, len(tr.tokens))
    rec = {"index": idx, "prompt": fact["prompt"], "relation": fact["relation"], "skipped": None,
           "p_clean": tr.p_clean, "p_corrupted": tr.p_corrupted, "n_tokens": len(tr.tokens)}
    for k in KINDS:
        g = grouped(getattr(tr, k), groups)
        rec[k] = [[None if math.isnan(v) else round(v, 7) for v in row] for row in g.tolist()]
    return rec


@dataclass
class FactSweep(Result):
    """Average indirect effects over facts: ``resid, mlp, attn (layer, group)`` (NaN where no fact has a
    position in the group); ``facts_per_group`` counts the facts that have one. ``resid`` row ``l`` restores
    the residual stream entering block ``l``."""

    model: str
    data: str
    n_facts: int
    skipped: int
    groups: list[str]
    facts_per_group: list[int]
    resid: Tensor
    mlp: Tensor
    attn: Tensor
    mean_p_clean: float
    mean_p_corrupted: float
    settings: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = field_values(self)
        for k in KINDS:
            d[k] = [[None if math.isnan(v) else v for v in row] for row in getattr(self, k).tolist()]
        return d

    def to_frame(self):
        import pandas as pd

        rows = [{"kind": k, "layer": layer, "group": g, "aie": float(getattr(self, k)[layer, gi])}
                for k in KINDS for layer in range(self.resid.shape[0]) for gi, g in enumerate(self.groups)]
        return pd.DataFrame(rows)

    def plot(self):
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
        cmaps = {"resid": "Purples", "mlp": "Greens", "attn": "Reds"}
        for ax, k in zip(axes, KINDS):
            m = getattr(self, k).numpy().T
            im = ax.imshow(m, aspect="auto", cmap=cmaps.get(k, "viridis"))
            ax.set_yticks(range(len(self.groups)), self.groups if k == KINDS[0] else [""] * len(self.groups))
            ax.set_xlabel("layer")
            ax.set_title(k)
            fig.colorbar(im, ax=ax, label="average indirect effect")
        fig.suptitle(f"{self.model}: causal tracing over {self.n_facts} facts; mean p_clean {self.mean_p_clean:.3f}, "
                     f"p_corrupted {self.mean_p_corrupted:.3f}")
        fig.tight_layout()
        return fig

    def __repr__(self) -> str:
        return f"FactSweep({self.model}, {self.data}, {self.n_facts} facts, skipped={self.skipped})"


def causal_trace_sweep(lm, facts: list[dict], out_dir: str | Path | None = None, *, data: str = "facts",
                       samples: int = 10, window: int = 10, noise: float | None = None, seed: int = 0,
                       batch_size: int = 64, resume: bool = False, ray=None, workers: int = 2,
                       progress: bool = True) -> FactSweep:
    """Causal-trace every fact and average. With ``out_dir`` each fact's record is appended to
    ``records.jsonl`` as it finishes (in order) and ``resume=True`` continues from there. ``ray`` (True or a
    cluster address) spreads the facts over ``workers`` Ray workers with the same records. The noise scale is
    fixed once for the whole sweep (default: 3 × the std of the model's input embeddings)."""
    from tqdm.auto import tqdm

    from ..distributed.records import RECORDS, Records
    from ..distributed.sweep import sweep_map

    if not facts:
        raise InputError("no facts to trace")
    nu = 3.0 * embedding_std(lm) if noise is None else float(noise)
    settings = {"samples": samples, "window": window, "noise": nu, "seed": seed, "batch_size": batch_size}
    meta = {"model": lm.name, "data": data, "n": len(facts), **settings}
    recs = Records(None)
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        meta_path = out / "sweep.json"
        resuming = resume and meta_path.exists()
        if resuming:
            saved = json.loads(meta_path.read_text())
            if saved != meta:
                raise InputError(f"{out} holds a sweep with other settings ({saved}); resume with the same model, "
                                 "data, limit and settings, or use a new --out folder")
        recs = Records(out / RECORDS, key="index", resume=resuming)
        meta_path.write_text(json.dumps(meta))
    items = [(i, f, settings) for i, f in enumerate(facts)]
    todo = recs.todo(list(range(len(facts))))
    bar = tqdm(total=len(facts), initial=len(facts) - len(todo), desc=f"causal tracing {lm.name}", unit="fact",
               disable=not progress)
    for _ in recs.run(todo, lambda t: sweep_map(fact_job, items, t, lm=lm, ray=ray, workers=workers)):
        bar.update(1)
    bar.close()
    have = recs.by_key()
    records = [have[i] for i in range(len(facts))]
    return summarize(lm.name, data, records, settings)


def summarize(model: str, data: str, records: list[dict], settings: dict) -> FactSweep:
    done = [r for r in records if not r["skipped"]]
    if not done:
        raise InputError("no fact could be traced (see the records' 'skipped' reasons)")

    def mean(k):
        x = torch.tensor([[[math.nan if v is None else v for v in row] for row in r[k]] for r in done],
                         dtype=torch.float64)
        return x.nanmean(0), (~torch.isnan(x[:, 0, :])).sum(0)

    out = {k: mean(k) for k in KINDS}
    return FactSweep(model=model, data=data, n_facts=len(done), skipped=len(records) - len(done), groups=GROUPS,
                     facts_per_group=out["resid"][1].tolist(), resid=out["resid"][0].float(),
                     mlp=out["mlp"][0].float(), attn=out["attn"][0].float(),
                     mean_p_clean=sum(r["p_clean"] for r in done) / len(done),
                     mean_p_corrupted=sum(r["p_corrupted"] for r in done) / len(done), settings=settings)
