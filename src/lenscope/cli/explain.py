"""``lenscope explain``: which context tokens made the model predict the target (rather than the foil)."""

from __future__ import annotations

import typer

from .common import ModelChoice, command, emit, fail, one_of
from .options import IG_STEPS_OPTION, JSON_OPTION, MODEL_OPTION, SAVE_OPTION, SOURCE_OPTION, table_option


def method_help() -> str:
    """``--method``'s help: the method table's names (:mod:`lenscope.attribution.methods`, no torch imported)."""
    from ..attribution import methods as table

    return (f"{' | '.join(table.names())} ({' and '.join(table.without_target())} need no target: they give the "
            "rollout row of --position)")


def register(app: typer.Typer) -> None:
    @command(app, "explain", model=True)
    def explain_cmd(
        text: str = typer.Argument(
            ..., help="The text; the prediction at its last token (or --position) is explained."),
        model: ModelChoice = MODEL_OPTION,
        target: str = typer.Option(None, "--target", "-t", help="Target token: its text (e.g. ' are') or #ID."),
        foil: str = typer.Option(None, "--foil", "-f", help="Foil token: explain target versus foil (contrastive)."),
        method: str = table_option("alti-logit", "--method", help=method_help),
        position: int = typer.Option(
            -1, "--position", help="Token position whose prediction is explained (default: last)."),
        steps: int = IG_STEPS_OPTION,
        baseline: str = typer.Option(
            None, "--baseline", help="Integrated gradients: the baseline embedding, zero | pad | mean (default zero)."),
        html: str = typer.Option(None, "--html", help="Write a page with the tokens coloured by score."),
        png: str = typer.Option(
            None, "--png", help="Write a layer × token heat map (bars for methods without layers)."),
        save: str = SAVE_OPTION,
        source: str = SOURCE_OPTION,
        as_json: bool = JSON_OPTION,
    ):
        """Score every input token by how much it made the model predict TARGET (rather than FOIL)."""
        from ..attribution import methods as table
        from ..attribution.explain import explain

        one_of("method", method, table.names())
        m = table.get(method)
        for flag, option, value in (("--steps", "steps", steps), ("--baseline", "baseline", baseline)):
            if value is None:
                continue
            if option not in m.options:
                fail(f"{flag} applies to --method {' or '.join(table.taking(option))} only")
            if option == "steps" and value < 1:
                fail("--steps must be at least 1")
            allowed = m.allowed(option)
            if allowed is not None and value not in allowed:
                fail(f"unknown {flag} {value!r}; choose one of {', '.join(allowed)}")
        lm = model.load()
        options = {k: v for k, v in (("steps", steps), ("baseline", baseline)) if v is not None}
        res = explain(lm, text, target, foil, method=method, position=position, source=source, **options)
        if html:
            res.to_html(html)
        if emit(res, png=png, save=save, as_json=as_json):
            return
        _table(lm, res, html, png)


def _table(lm, res, html, png) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    con.print(f"{lm.name}: {res.method} explanation of {res.what()} at position {res.position} "
              f"({res.tokens[res.position]!r})")
    scores = res.scores.tolist()
    scale = max((abs(v) for v in scores), default=0.0) or 1.0
    table = Table()
    for c, j in (("#", "right"), ("token", "left"), ("score", "right"), ("", "left")):
        table.add_column(c, justify=j)
    if res.n_source:
        table.add_column("part")
    for i, (tok, v) in enumerate(zip(res.tokens, scores)):
        bar = "█" * int(round(12 * abs(v) / scale))
        color = "green" if v >= 0 else "red"
        part = ["source" if i < res.n_source else "target"] if res.n_source else []
        table.add_row(str(i), repr(tok), f"{v:+.4f}", f"[{color}]{bar}[/{color}]", *part)
    con.print(table)
    extra = []
    if res.invariant_error is not None:
        extra.append(f"invariant error {res.invariant_error:.1e}")
    if "logit" in res.info:
        extra.append(f"logit difference {res.info['logit']:+.4f}")
    if "completeness_error" in res.info and res.reports_completeness:
        from ..attribution.methods import get

        m = get(res.method)
        extra.append(f"{m.label or m.name} completeness error {res.info['completeness_error']:.1e}")
    if extra:
        con.print("  ".join(extra))
    if res.info.get("note"):
        con.print(f"[yellow]note:[/yellow] {res.info['note']}")
    for what, p in (("page", html), ("plot", png)):
        if p:
            con.print(f"{what} saved to {p}")
