"""``lenscope circuit``: which components and connections carry a behaviour (attribution patching, AtP*, EAP,
EAP-IG or exact patching), how faithful the top-k circuits are, and how far the approximation can be trusted."""

from __future__ import annotations

import typer

from .common import ModelChoice, at_least_one, command, fail, one_of, print_json, stage_progress
from .options import JSON_OPTION, MODEL_OPTION

METHODS = ("atp", "atp-star", "eap", "eap-ig", "exact")


def _table(out: dict) -> None:
    typer.echo(f"{out['model']} · {out['method']} · {out['level']} · {out['n']} prompt pair(s) · "
               f"metric clean {out['metric_clean']:.4g}, corrupted {out['metric_corrupted']:.4g} · "
               f"{out['seconds']:.1f} s")
    rows = out["edges"] if out["level"] == "edges" else out["nodes"]
    for r in rows[:20]:
        name = f"{r['src']} -> {r['dst']}" if "src" in r else r["name"]
        typer.echo(f"  {r['score']:+.4g}  {name}")
    if out.get("faithfulness"):
        pts = ", ".join(f"k={p['k']}: {p['value']:.2f}" for p in out["faithfulness"])
        typer.echo(f"faithfulness ({out['ablation']} ablation): {pts}")
        typer.echo(f"smallest circuit reaching 0.8: {out['smallest']} of {out['total']} {out['level']}")
    if "check" in out:
        c = out["check"]
        typer.echo(f"check against exact patching: Spearman {c['spearman']:.3f}, top-10 recall "
                   f"{c['top10_recall']:.2f}, false negatives: {', '.join(c['false_negatives']) or 'none'}")


def register(app: typer.Typer) -> None:
    @command(app, "circuit", model=True)
    def circuit_cmd(
        clean: str = typer.Argument(None, help="The clean prompt (or give --data)."),
        corrupted: str = typer.Argument(None, help="The corrupted prompt (same number of tokens)."),
        model: ModelChoice = MODEL_OPTION,
        target: str = typer.Option(None, "--target", "-t", help="Target token: its text (e.g. ' Mary') or #ID."),
        foil: str = typer.Option(None, "--foil", "-f", help="Foil token (the metric is logit(target) - logit(foil))."),
        data: str = typer.Option(
            None, "--data", help="Prompt pairs: a CSV with columns clean,corrupted,target,foil, or ioi-gen "
                                 "(names swapped), ioi-gen:abc (three other names), sva-gen (subject number)."),
        limit: int = typer.Option(None, "--limit", help="Use the first N pairs of --data (generators: default 100)."),
        method: str = typer.Option("eap-ig", "--method", help="atp | atp-star | eap | eap-ig | exact"),
        level: str = typer.Option(None, "--level", help="nodes | edges (default: edges for eap/eap-ig, else nodes)"),
        check: str = typer.Option(None, "--check", help="exact: compare the scores with exact patching."),
        top: int = typer.Option(None, "--top", help="List only the K best-scored edges (or nodes)."),
        steps: int = typer.Option(5, "--steps", help="EAP-IG integration steps."),
        ablation: str = typer.Option("corrupted", "--ablation", help="corrupted | mean: what edges outside the "
                                                                     "circuit carry."),
        no_faithfulness: bool = typer.Option(False, "--no-faithfulness", help="Skip the faithfulness curve."),
        seed: int = typer.Option(0, "--seed", help="Seed of the generators and of the edges sampled by --check."),
        as_json: bool = JSON_OPTION,
        html: str = typer.Option(None, "--html", help="Write the circuit view as a self-contained HTML page."),
        png: str = typer.Option(None, "--png", help="Write the circuit and its faithfulness curve (PNG)."),
        out: str = typer.Option(None, "--out", help="Directory for circuit.json and scores / faithfulness / circuit "
                                                    ".safetensors (the smallest circuit reaching 0.8)."),
    ):
        """Find the circuit of a behaviour: score nodes or edges, measure faithfulness, check against exact."""
        one_of("--method", method, METHODS)
        level = level or ("edges" if method in ("eap", "eap-ig") else "nodes")
        if level not in ("nodes", "edges"):
            fail(f"unknown --level {level!r}; choose nodes or edges")
        if check not in (None, "exact"):
            fail(f"--check takes only 'exact' (got {check!r})")
        if ablation not in ("corrupted", "mean"):
            fail(f"unknown --ablation {ablation!r}; choose corrupted or mean")
        at_least_one(limit=limit, top=top, steps=steps)
        if data is None and (clean is None or corrupted is None):
            fail("give CLEAN and CORRUPTED prompts with --target and --foil, or --data FILE.csv|ioi-gen|sva-gen")
        if data is not None and clean is not None:
            fail("give either CLEAN CORRUPTED prompts or --data, not both")
        if data is None and (target is None or foil is None):
            fail("--target and --foil are needed with CLEAN CORRUPTED (the metric is their logit difference)")
        _prepare_outputs(out=out, png=png, html=html)  # before minutes of work, not after
        from ..circuits import circuit_json
        from ..data.contrast import ContrastPair, check_lengths, contrast_dataset, tokenize_with

        lm = model.load()
        tokenize = tokenize_with(lm)
        if data is None:
            pairs = [ContrastPair(clean, corrupted, target, foil)]
            check_lengths(pairs, tokenize)
        else:
            pairs = contrast_dataset(data, n=limit, seed=seed, tokenize=tokenize)
        res = circuit_json(lm, pairs, method=method, level=level, top=top, check=check == "exact",
                           faithfulness=not no_faithfulness or bool(html), steps=steps, ablation=ablation, seed=seed,
                           progress=stage_progress(f"{method} ({len(pairs)} pairs)"), keep=(kept := {}))
        _write(res, lm, pairs, out=out, png=png, html=html, kept=kept)
        if as_json:
            print_json(res)
            return
        _table(res)


def _prepare_outputs(*, out: str | None, png: str | None, html: str | None) -> None:
    """Create the folders the outputs go to, or fail in one line when that is impossible."""
    from pathlib import Path

    for path, is_dir in ((out, True), (png, False), (html, False)):
        if path is None:
            continue
        folder = Path(path) if is_dir else Path(path).parent
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            fail(f"cannot create {folder} for {path}: {e.strerror or e}")
        if not is_dir and Path(path).is_dir():
            fail(f"{path} is a folder; give a file name")


def _write(res: dict, lm, pairs, *, out: str | None, png: str | None, html: str | None, kept: dict) -> None:
    import json
    from pathlib import Path

    if out:
        d = Path(out)
        d.mkdir(parents=True, exist_ok=True)
        (d / "circuit.json").write_text(json.dumps(res, indent=1))
        for name, obj in kept.items():  # scores, faithfulness, circuit: each Cls.load(path)
            obj.save(d / f"{name}.safetensors")
    if png:
        from ..viz.circuit_plots import plot_summary
        from ..viz.plots import save_figure

        save_figure(plot_summary(res), png)
    if html:
        from ..report import build_report
        from ..viz.report import render

        p = pairs[0]  # the page shows the first pair's prompts; the circuit is the one of every pair
        rep = build_report(lm, p.clean, p.target, p.foil, corrupted=p.corrupted, sections=["prediction", "circuit"],
                           circuit=res)
        Path(html).write_text(render(rep.to_dict()), encoding="utf-8")
