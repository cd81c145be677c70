"""``lenscope report``: the main job, one self-contained HTML page with every view of one prediction."""

from __future__ import annotations

import time

import typer

from ..errors import InputError
from .common import MODEL_OPTION, ModelChoice, handle_errors, model_options, print_json

SAMPLE = "When Mary and John went to the store, John gave a drink to"


@handle_errors
@model_options
def report_cmd(
    text: str = typer.Argument(SAMPLE, help="The text whose next-token prediction to explain (with --source: the "
                                            "target of the translation)."),
    model: ModelChoice = MODEL_OPTION,
    target: str = typer.Option(None, "--target", help="Token to explain (default: the model's top prediction)."),
    foil: str = typer.Option(None, "--foil", help="A contrasting token (explain target rather than foil)."),
    corrupted: str = typer.Option(None, "--corrupted",
                                  help="A corrupted prompt with as many tokens as TEXT (needs --target and --foil): "
                                       "adds the circuit view (EAP-IG edges, a k slider, the faithfulness curve)."),
    generate: int = typer.Option(None, "--generate",
                                 help="Generate N tokens after TEXT (greedy) and add the generation view: each "
                                      "generated token's probability, depth and explanation (ALTI-Logit, Logit, "
                                      "ALTI over every earlier token), a clickable strip and a matrix."),
    lens: str = typer.Option(None, "--lens", help="'patchscope' or a tuned-lens directory, shown beside the logit "
                                                  "lens."),
    dict_dir: str = typer.Option(None, "--dict", help="Sparse dictionaries (a dictionary folder or a folder of them): "
                                                      "adds the features view (active features per token) and, "
                                                      "with transcoders, the attribution graph."),
    dict_data: str = typer.Option(None, "--dict-data",
                                  help="Text (a file or the corpus folder) whose held-out part the features view's "
                                       "cards are measured on (the strongest features at the last position)."),
    source: str = typer.Option(None, "--source",
                               help="An encoder-decoder (translation) model's source; TEXT is then the target and "
                                    "the page is the source-target alignment of every target token."),
    gold: str = typer.Option(None, "--gold",
                             help="Gold word alignments (JSONL, docs/encoder-decoder.md) holding this pair: shown on "
                                  "the alignment and each method's AER (needs --source)."),
    methods: str = typer.Option(None, "--methods",
                                help="Comma-separated methods of the alignment view (default every method that reads "
                                     "a source)."),
    out: str = typer.Option("report.html", "--out", "-o", help="Where to write the page."),
    sections: str = typer.Option(None, "--sections",
                                 help="Comma-separated views (default all): prediction, trajectory, components, "
                                      "attribution, mixing, flow, circuit with --corrupted, generation with "
                                      "--generate, features with --dict, graph with --dict of transcoders."),
    open_page: bool = typer.Option(False, "--open", help="Open the page in a web browser when written."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON summary (checks, timings, sections)."),
):
    """One self-contained HTML page (works offline) with every view of how the model arrives at its prediction."""
    from rich.console import Console

    if corrupted is not None and (target is None or foil is None):
        raise InputError("--corrupted needs --target and --foil (the circuit is scored on logit(target) - "
                         "logit(foil))")
    if generate is not None and generate < 1:
        raise InputError(f"--generate must be at least 1 (tokens to generate), not {generate}")
    if dict_data is not None and dict_dir is None:
        raise InputError("--dict-data measures the features view's cards: give --dict DIR as well")
    if gold is not None and source is None:
        raise InputError("--gold shows gold word alignments on a translation's alignment view: give --source too")
    if methods is not None and source is None:
        raise InputError("--methods chooses the alignment view's methods: give --source too (a translation model)")
    gold_rows = None
    if gold is not None:
        from ..data.alignments import read_gold_alignments

        gold_rows = read_gold_alignments(gold)  # a bad file is refused before the model is loaded
    method_list = None if methods is None else [m.strip() for m in methods.split(",") if m.strip()]
    dictionaries = labels = None
    if dict_dir is not None:
        from ..features.dictionaries.labels import labels_for
        from ..models.dictionaries.dictionary import load_dictionaries

        dictionaries = load_dictionaries(dict_dir)
        labels = labels_for(dict_dir)  # the features' labels where `lenscope dict label` cached them
    con = Console(stderr=True, soft_wrap=True)
    t0 = time.perf_counter()
    con.print(f"lenscope report: loading [bold]{model.name}[/] "
              "(an embedded model is converted once on first use, about a minute)")
    lm = model.load()
    tuned = None
    if lens is not None and lens != "logit":
        from .lens import get_lens

        tuned = get_lens(lm, lens)
    keys = None
    if sections:
        keys = [s.strip() for s in sections.split(",") if s.strip()]
        if not keys:
            raise InputError("--sections is empty")
        if generate is not None and "generation" not in keys:
            keys.append("generation")  # --generate asks for its view
        if dictionaries is not None and "features" not in keys:
            keys.append("features")  # --dict asks for its view
        if any(d.transcoder for d in dictionaries or ()) and "graph" not in keys:
            keys.append("graph")  # and, with transcoders, for the attribution graph
    from ..report import build_report

    pair = None
    if gold_rows is not None:
        from ..report.alignment import check_pair, gold_pair, normalized

        check_pair(lm, source)
        pair = gold_pair(gold_rows, normalized(source, "source"), normalized(text, "target"), gold)
    with con.status("computing") as status:
        def progress(key, title):
            status.update(f"computing: {title}")

        rep = build_report(lm, text, target, foil, corrupted=corrupted, lens=tuned, sections=keys,
                           progress=progress, generate=generate, dictionaries=dictionaries, dict_data=dict_data,
                           source=source, gold=pair, methods=method_list, labels=labels)
    path = rep.write(out)
    size = path.stat().st_size
    if as_json:
        d = rep.summary()
        d.update(out=str(path), bytes=size, seconds=round(time.perf_counter() - t0, 2))
        print_json(d)
    else:
        t = rep.timings
        con.print("  " + " · ".join(f"{k} {v:.1f} s" for k, v in t.items() if k != "total"))
        for sec in rep.sections:
            for m, a in ((sec.get("data") or {}).get("aer") or {}).items():
                typer.echo(f"  {m}: AER {a['aer']:.3f} · precision {a['precision']:.3f} · recall {a['recall']:.3f}")
        failed = [c for c in rep.checks if c["ok"] is False]
        verdict = "every exactness check passed" if not failed else f"{len(failed)} exactness check(s) FAILED"
        typer.echo(f"report written: {path.resolve()} ({size / 1e6:.1f} MB, {t['total']:.1f} s; {verdict})")
        typer.echo(f"open it with: xdg-open {path}  (or any browser; it needs no network)")
    if open_page:
        import webbrowser

        webbrowser.open(path.resolve().as_uri())
    if not rep.ok:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    """Add the ``report`` command."""
    app.command("report")(report_cmd)
