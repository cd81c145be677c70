"""``lenscope eval alignment``: how well do explanations rank the tokens that linguistically decide target
versus foil? (Yin & Neubig 2022; Ferrando et al. 2023, §3-5.)

The run is organised so that it can be resumed and, later, distributed:

1. datasets -> a list of :class:`~lenscope.data.datasets.Example` with stable ids;
2. :func:`evaluate_examples` (importable, no global state): examples -> one JSON-able record each. Examples of
   equal token length share batched passes: one trace per example (cut from one batched forward pass) serves
   Logit, ALTI-Logit, the model's logit difference and the per-layer attention/MLP updates; gradients,
   integrated gradients and erasure run batched over examples;
3. records are appended to ``records.jsonl`` (one line per example); a rerun skips ids already there;
4. :func:`~lenscope.evaluate.summary.summarise`: records -> :class:`~lenscope.evaluate.summary.AlignmentSummary`
   (means, bootstrap intervals, groups, per-layer contributions, timing).

The methods run through their batch forms (``lenscope.attribution.baselines.*_rows``, the same code as
``lenscope.explain``); the trace-based ones on :func:`lenscope.models.runtime.trace.batch_traces`.
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch

from ..data.datasets import Example, expand_specs, load_dataset
from ..errors import InputError, LenscopeError
from ..models.loading.load import require_decoder
from .evidence import prepare
from .metrics import POSITIONAL, alignment, positional_scores
from .summary import AlignmentSummary, _clean, summarise


def eval_methods() -> tuple[str, ...]:
    """The methods of eval alignment: the method table's (:func:`lenscope.attribution.methods.eval_methods`) and
    the positional rankings."""
    from ..attribution.methods import eval_methods as table_methods

    return table_methods() + POSITIONAL


def __getattr__(name: str):
    if name == "EVAL_METHODS":  # read from the method table when asked for
        return eval_methods()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def check_methods(methods) -> list[str]:
    if methods is None:
        return list(eval_methods())
    methods = [m.strip() for m in (methods.split(",") if isinstance(methods, str) else methods) if m.strip()]
    known = eval_methods()
    if not methods:
        raise InputError(f"give at least one method ({', '.join(known)})")
    bad = [m for m in methods if m not in known]
    if bad:
        raise InputError(f"unknown method {bad[0]!r} for eval alignment; choose from {', '.join(known)}")
    return list(dict.fromkeys(methods))


def check_model(lm) -> None:
    """:class:`NotApplicableError` unless ``lm`` is a causal decoder with a language-model head."""
    require_decoder(lm, "eval alignment", causal=True, instead="use e.g. smollm2")


def _floats(t) -> list:
    return [None if not math.isfinite(v) else round(v, 7) for v in torch.as_tensor(t).double().tolist()]


@torch.no_grad()
def sentence_logprob(lm, ids: list[int]) -> float:
    """``sum_k log p(ids[k] | ids[:k])`` for ``k >= 1`` (the first id is the start token)."""
    from ..attribution.baselines import eval_mode, model_logits
    from ..models.loading.devices import main_device

    x = torch.as_tensor(ids, dtype=torch.long, device=main_device(lm.model))[None]
    with eval_mode(lm.model):
        logp = torch.log_softmax(model_logits(lm, input_ids=x)[0, :-1].double(), -1)
    return float(logp.gather(-1, x[0, 1:, None]).sum())


# ----------------------------------------------------------------------------------------------
# the per-example function


def evaluate_examples(lm, examples: list[Example], methods=None, *, ig_steps: int = 16,
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
    from ..attribution import baselines as rows
    from ..attribution import methods as table
    from ..models.runtime.trace import batch_traces
    from ..version import code_version

    check_model(lm)
    methods = check_methods(methods)
    options = {"ig_steps": ig_steps, "max_tokens": max_tokens, "baseline": baseline}
    for m in table.methods():  # what a method prepares once per call (integrated gradients' baseline embedding)
        if m.name in methods and m.prepare is not None:
            options |= m.prepare(lm, options)
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
            good = timed("forward", [i], sentence_logprob, lm, sentence_ids(lm.tokenizer, ex.target))
            bad = timed("forward", [i], sentence_logprob, lm, sentence_ids(lm.tokenizer, ex.foil))
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
            diff = timed("forward", idx, rows.logit_diff_rows, lm, ids, t, f, last_only=True)
            for k, i in enumerate(idx):
                recs[i]["logit_diff"] = float(diff[k])
                recs[i]["correct"] = bool(diff[k] > 0)
            continue
        for i in idx:
            recs[i].update(scores={}, metrics={}, errors={}, info={})
        trs = timed("trace", idx, batch_traces, lm, ids)
        f_full = torch.stack([tr.logits[-1, tt] - tr.logits[-1, ff] for tr, tt, ff in zip(trs, t, f)])
        for k, i in enumerate(idx):
            recs[i]["logit_diff"] = float(f_full[k])
            recs[i]["correct"] = bool(f_full[k] > 0)
        chosen = [m for m in table.methods() if m.name in methods and m.texts is not None]
        job = table.Texts(lm, ids, t, f, trs, f_full, options)
        for k, i in enumerate(idx):  # trace-based methods, one example at a time on its own trace
            try:
                lg = timed(table.LOGIT, [i], job.logit, k)
                recs[i]["layers"] = {"attention": _floats(lg.attention_update), "mlp": _floats(lg.mlp_update),
                                     "embed": lg.info["embed_update"], "bias": lg.info["bias_update"],
                                     "logit": lg.info["logit"]}
            except LenscopeError as e:
                recs[i]["errors"][table.LOGIT] = str(e).splitlines()[0]
            for m in chosen:
                if m.uses_trace:
                    try:
                        recs[i]["scores"][m.name] = timed(m.group or m.name, [i], m.texts, job, k)
                    except LenscopeError as e:
                        recs[i]["errors"][m.name] = str(e).splitlines()[0]
        del trs
        job.trs = None
        for m in chosen:  # the others, batched over the examples
            if not m.uses_trace:
                scores, infos = timed(m.group or m.name, idx, m.texts, job)
                for k, i in enumerate(idx):
                    recs[i]["scores"][m.name] = scores[k]
                    if infos is not None:
                        recs[i]["info"].update(infos[k])
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


def evaluate_example(lm, example: Example, methods=None, **options) -> dict:
    """The record of one example (:func:`evaluate_examples` on a batch of one)."""
    return evaluate_examples(lm, [example], methods, **options)[0]


# ----------------------------------------------------------------------------------------------
# the resumable run


def read_records(path: Path) -> dict[str, dict]:
    """``{id: record}`` from an append-only ``records.jsonl`` (a later line for the same id wins), read by the
    records runner (:class:`lenscope.distributed.records.Records`): a last line cut short by an interruption is
    dropped (and cut from the file); a damaged line elsewhere is an error naming it."""
    from ..distributed.records import Records

    return Records(path, key="id").by_key()


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


def run_alignment(lm, specs, methods=None, *, out: str | Path | None = None, limit: int | None = None,
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
    from ..distributed.records import RECORDS, Records
    from ..distributed.sweep import sweep_map

    check_model(lm)
    methods = check_methods(methods)
    if baseline not in IG_BASELINES:
        raise InputError(f"unknown --baseline {baseline!r}; choose from {', '.join(IG_BASELINES)}")
    if isinstance(ig_steps, bool) or not isinstance(ig_steps, int) or ig_steps < 1:
        raise InputError("--ig-steps must be a positive integer")
    if batch_size < 1:
        raise InputError("--batch-size must be at least 1")
    datasets = load_datasets(specs, limit)
    store = Records(None, key="id")
    meta = {"model": lm.name, "ig_steps": ig_steps}
    if baseline != "zero":  # a zero-baseline folder's run.json stays as it always was
        meta["baseline"] = baseline
    if out is not None:
        outp = Path(out)
        outp.mkdir(parents=True, exist_ok=True)
        run_path = outp / "run.json"
        if restart and run_path.exists():
            run_path.unlink()
        if run_path.exists():
            old = json.loads(run_path.read_text())
            if old != meta:
                raise InputError(f"{outp} holds results for {old}, not {meta}; use another --out, or --restart to "
                                 "discard them")
        run_path.write_text(json.dumps(meta))
        store = Records(outp / RECORDS, key="id", resume=not restart)
    records = store.by_key()

    every = [ex for exs in datasets.values() for ex in exs]
    ids = [ex.id for ex in every]
    if len(set(ids)) != len(ids):
        dup = next(i for i, c in Counter(ids).items() if c > 1)
        raise InputError(f"example id {dup!r} occurs twice; give each dataset once")
    row = {ex.id: k for exs in datasets.values() for k, ex in enumerate(exs)}
    pending = [every[i] for i in store.todo(ids, done=lambda rec, i: _done(rec, every[i], methods))]
    version = store.check_version(bool(pending), force=force, where=out)
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
        items = [(batch, methods, ig_steps, max_tokens, baseline) for batch in batches]

        def compute(todo):  # sequentially or on Ray; the runner decides what is left, orders and writes
            return sweep_map(batch_job, items, todo, lm=lm, ray=ray, workers=workers)

        for k, recs in store.run(range(len(items)), compute, to_records=lambda rs: [_clean(r) for r in rs]):
            for r in recs:
                records[r["id"]] = r
            bar.update(len(batches[k]))
    finally:
        bar.close()
    summary = summarise(lm.name, datasets, records, methods)
    summary.info = {"limit": limit, "ig_steps": ig_steps, "batch_size": batch_size, "computed_now": len(pending),
                    "wall_seconds_now": time.perf_counter() - t0, "specs": list(specs) if not isinstance(specs, str)
                    else [specs], "baseline": baseline, "version": version, **summary.info}
    if out is not None:
        summary.save(out)
    return summary
