"""``lenscope eval ...``: evaluate explanations against linguistic evidence."""

from __future__ import annotations

import typer

from .common import ModelChoice, at_least_one, command, fail, print_json, stage_progress
from .options import MODEL_OPTION, table_option
from .sweeps import ray_address_option, ray_option, ray_target, workers_option

DATASET_HELP = ("blimp:SUBSET (one of the 11 with evidence, or any BLiMP paradigm for accuracy only), blimp:all11, "
                "ioi, ioi-gen[:SEED], sva:FILE (prefix<TAB>correct<TAB>wrong[<TAB>evidence[<TAB>group]]) or a CSV "
                "FILE (one_prefix_prefix, one_prefix_word_good, one_prefix_word_bad, target). Repeatable.")


POSITIONAL = "first,recent"  # the positional rankings (lenscope.evaluate.metrics.POSITIONAL)


def default_methods() -> str:
    """``--methods``'s default: every method of the table with an eval alignment form, then the positional ones."""
    from ..attribution.methods import eval_methods

    return ",".join(eval_methods()) + "," + POSITIONAL


def methods_help() -> str:
    from ..attribution.methods import eval_methods

    return (f"Comma-separated: {', '.join(eval_methods())}, and the positional rankings first (earliest token "
            "first) and recent (nearest token first), which need no model computation.")


def _gold_aer(model: ModelChoice, gold: str, methods: str | None, target_token: str, out: str | None,
              as_json: bool, progress: bool, batch_size: int = 16, null_eos: bool = True,
              token_rows: str = "output") -> None:
    """``eval alignment --gold``: each method's word alignments on the gold pairs and their AER."""
    from pathlib import Path

    from ..attribution import methods as table
    from ..data.alignments import read_gold_alignments, write_predicted_alignments
    from ..evaluate.aer import alignment_error_rate, model_alignments

    rows = read_gold_alignments(gold)  # a malformed file fails before the model loads
    # by default the methods that explain the reference token's logit from each pair's one trace (logit,
    # alti-logit); the rollouts (alti, value-zeroing) and the gradient and erasure baselines with --methods
    names = [m.strip() for m in methods.split(",") if m.strip()] if methods is not None else [
        m for m in table.source_readers() if table.get(m).uses_trace and table.get(m).needs_target]
    for n in names:
        table.get(n)
    if target_token not in ("first", "mean"):
        fail(f"unknown --target-token {target_token!r}; choose first or mean")
    if token_rows not in ("output", "input"):
        fail(f"unknown --rows {token_rows!r}; choose output or input")
    lm = model.load()
    done = {}
    show = stage_progress("eval alignment --gold") if progress else None
    every = model_alignments(lm, rows, names, target_token=target_token, null_eos=null_eos, rows=token_rows,
                             batch_size=batch_size,
                             progress=None if show is None else lambda i, n: show("sentence pairs", i, n))
    for name, links in every.items():
        done[name] = alignment_error_rate(rows, links, method=name)
        if out:
            Path(out).mkdir(parents=True, exist_ok=True)
            write_predicted_alignments(Path(out) / f"predicted-{name}.jsonl", rows, links)
    if as_json:
        from ..results import finite_json

        print_json(finite_json({"model": lm.name, "gold": gold, "target_token": target_token, "null_eos": null_eos,
                                "rows": token_rows,
                                "methods": {k: v.to_dict() for k, v in done.items()}}))
        return
    for name, res in done.items():
        typer.echo(f"{lm.name} {name}: AER {res.aer:.4f}  precision {res.precision:.4f}  recall {res.recall:.4f}  "
                   f"({len(res.ids)} sentence pairs)")
    if out:
        typer.echo(f"predicted alignments in {Path(out) / 'predicted-<method>.jsonl'} (lenscope eval aer --predicted "
                   "reads them)")


def register(app: typer.Typer) -> None:
    """Add the ``eval`` group."""
    ev = typer.Typer(
        rich_markup_mode=None, help="Evaluate explanations against linguistic evidence (BLiMP, IOI, agreement).",
        no_args_is_help=True)
    app.add_typer(ev, name="eval")

    @command(ev, "alignment", model=True)
    def alignment_cmd(
        model: ModelChoice = MODEL_OPTION,
        dataset: list[str] | None = typer.Option(None, "--dataset", "-d", help=DATASET_HELP),  # noqa: B008
        gold: str = typer.Option(None, "--gold", help="Instead of --dataset: gold word alignments of translation "
                                 "pairs (JSON lines with source, target, sure, possible; docs/encoder-decoder.md): "
                                 "the alignment error rate of the words an encoder-decoder model's explanations "
                                 "link (each target word to its highest-scoring source word); methods: logit and "
                                 "alti-logit by default; --methods: also alti, value-zeroing, grad-norm, "
                                 "grad-x-input, ig, erasure."),
        target_token: str = typer.Option("mean", "--target-token", help="With --gold: a target word of several "
                                         "tokens is read as the mean of their rows (mean, as Ferrando et al. 2022) "
                                         "or at its first token (first)."),
        token_rows: str = typer.Option("output", "--rows", metavar="output|input", help="With --gold: a target "
                                       "token's row is the step that predicts it (output; Ferrando et al. 2022's "
                                       "AWO) or the step that reads it (input, AWI: the prediction of the next "
                                       "token, of the end token after the last)."),
        null_eos: bool = typer.Option(True, "--null-eos/--no-null-eos", help="With --gold: the source's end token "
                                      "competes with the source words and a target word it wins gets no link (as "
                                      "Ferrando et al. 2022); --no-null-eos links every target word."),
        methods: str = table_option(default_methods, "--methods", help=methods_help),
        limit: int = typer.Option(None, "--limit", help="Use the first N examples of each dataset."),
        out: str = typer.Option(None, "--out", help="Folder for per-example records, summary, tables and figures; "
                                "a rerun with the same folder resumes."),
        restart: bool = typer.Option(False, "--restart", help="Discard the records already in --out."),
        ig_steps: int = typer.Option(16, "--ig-steps", help="Integrated-gradients quadrature nodes."),
        baseline: str = typer.Option("zero", "--baseline", help="Integrated gradients' baseline: zero, pad (the pad "
                                     "token's input embedding, else the unk token's) or mean (the mean input "
                                     "embedding over the vocabulary)."),
        force: bool = typer.Option(False, "--force", help="Resume into a folder whose records were written by "
                                   "another code version (the table then mixes versions)."),
        batch_size: int = typer.Option(16, "--batch-size", help="Examples of equal length per batched pass (--gold: "
                                       "sentence pairs, padded)."),
        block: int = typer.Option(50, "--block", help="Rows per round: rows 0..BLOCK-1 of every dataset run first, "
                                  "so an interrupted run holds complete --limit BLOCK, 2*BLOCK, ... prefixes."),
        ray: bool = ray_option(),
        ray_address: str = ray_address_option(),
        workers: int = workers_option(),
        as_json: bool = typer.Option(False, "--json", help="Print the summary as one JSON object."),
        progress: bool = typer.Option(True, "--progress/--no-progress", help="Show a progress bar (stderr)."),
    ):
        """Rank each example's context tokens with every method and score the ranking against the evidence
        words (MRR, probes needed, dot product), with model accuracy and per-layer attention/MLP updates; with
        --gold, the alignment error rate of an encoder-decoder model's word alignments."""
        from ..data.datasets import load_dataset
        from ..evaluate.alignment import check_methods, check_model, run_alignment

        if gold is not None:
            if dataset:
                fail("--gold and --dataset are two evaluations; give one of them")
            at_least_one(batch_size=batch_size)
            _gold_aer(model, gold, None if methods == default_methods() else methods, target_token, out, as_json,
                      progress, batch_size, null_eos, token_rows)
            return

        if not dataset:
            fail("give at least one --dataset (" + DATASET_HELP.split(". Repeatable")[0] + ")")
        at_least_one(limit=limit, ig_steps=ig_steps, batch_size=batch_size, block=block)
        if restart and out is None:
            fail("--restart needs --out")
        from ..attribution.inputs import IG_BASELINES

        if baseline not in IG_BASELINES:
            fail(f"unknown --baseline {baseline!r}; choose from {', '.join(IG_BASELINES)}")
        meths = check_methods(methods)
        for spec in dataset:  # malformed files fail before the model loads
            if spec != "blimp:all11":
                load_dataset(spec, 1)
        lm = model.load()
        check_model(lm)
        summary = run_alignment(lm, dataset, meths, out=out, limit=limit, ig_steps=ig_steps, batch_size=batch_size,
                                progress=progress, restart=restart, block=block, ray=ray_target(ray, ray_address),
                                workers=workers, baseline=baseline, force=force)
        if as_json:
            from ..results import finite_json

            print_json(finite_json(summary.to_dict()))
            return
        typer.echo(f"{summary.model}: MRR by dataset and method (95% bootstrap interval in --out/table.md)")
        typer.echo(summary.table("mrr", ci=False))
        comp = {d: ds["ig_completeness"] for d, ds in summary.datasets.items()
                if (ds.get("ig_completeness") or {}).get("n")}
        if comp:
            typer.echo("integrated gradients' relative completeness error (median / max): " + ", ".join(
                f"{d} {c['median']:.2g} / {c['max']:.2g}" for d, c in comp.items()))
        t = summary.timing.get("per_example")
        if t:
            typer.echo("seconds per example: " + ", ".join(f"{k} {v:.3f}" for k, v in t.items()))
        if out:
            typer.echo(f"records, summary.json, table.md and figures in {out}")

    @command(ev, "aer")
    def aer_cmd(
        gold: str = typer.Option(..., "--gold", help="Gold alignments, JSON lines: {\"id\", \"source\", \"target\", "
                                 "\"sure\": [[i, j], ...], \"possible\": [...]} (i: source word, j: target word, "
                                 "0-based; docs/encoder-decoder.md)."),
        predicted: str = typer.Option(..., "--predicted", help="Predicted alignments, JSON lines: {\"id\", "
                                      "\"alignment\": [[i, j], ...]}, with the gold file's ids (by default the "
                                      "line numbers)."),
        as_json: bool = typer.Option(False, "--json", help="Print the result as one JSON object."),
    ):
        """The alignment error rate (Och & Ney 2003) of predicted word alignments against gold sure / possible
        links, with precision and recall, counted over the whole corpus."""
        from ..data.alignments import read_gold_alignments, read_predicted_alignments
        from ..evaluate.aer import alignment_error_rate

        res = alignment_error_rate(read_gold_alignments(gold), read_predicted_alignments(predicted))
        if as_json:
            from ..results import finite_json

            print_json(finite_json(res.to_dict()))
            return
        typer.echo(f"AER {res.aer:.4f}  precision {res.precision:.4f}  recall {res.recall:.4f}  "
                   f"({len(res.ids)} sentences, {res.totals['predicted']} predicted links, "
                   f"{res.totals['sure']} sure gold links)")
