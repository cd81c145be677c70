"""``lenscope components``: direct logit attribution from the command line."""

from __future__ import annotations

import typer

from .common import ModelChoice, command, emit
from .options import FOIL_DECOMPOSE_OPTION, JSON_OPTION, MODEL_OPTION, SAVE_OPTION, SOURCE_OPTION


def register(app: typer.Typer) -> None:
    @command(app, "components", model=True)
    def components_cmd(
        text: str = typer.Argument(..., help="The text; the logit at its last token is decomposed."),
        model: ModelChoice = MODEL_OPTION,
        target: str = typer.Option(..., "--target", "-t", help="Target token: its text (e.g. ' Paris') or #ID."),
        foil: str = FOIL_DECOMPOSE_OPTION,
        by_head: bool = typer.Option(False, "--by-head", help="Split each attention layer into its heads (and each "
                                     "mixture-of-experts block into its experts)."),
        position: int = typer.Option(-1, "--position", help="Token position to explain (default: last)."),
        top: int = typer.Option(None, "--top", help="Show only the largest components in the table/plot."),
        png: str = typer.Option(None, "--png", help="Save a bar plot to this PNG file."),
        save: str = SAVE_OPTION,
        source: str = SOURCE_OPTION,
        as_json: bool = JSON_OPTION,
    ):
        """Write the logit of TARGET (minus FOIL) as an exact sum over embeddings, layers and heads."""
        from ..attribution.dla import direct_logit_attribution

        lm = model.load()
        res = direct_logit_attribution(lm, text, target, foil, by_head=by_head, position=position, source=source)
        if emit(res, png=png, save=save, as_json=as_json, figure=lambda: res.plot(top=top)):
            return
        from rich.console import Console
        from rich.table import Table

        con = Console()
        what = repr(res.target) + (f" − {res.foil!r}" if res.foil is not None else "")
        recs = res.to_records() if top is None else res.top(top)
        scale = max(abs(r["value"]) for r in recs) or 1.0
        con.print(f"{lm.name}: direct logit attribution of {what} after {''.join(res.tokens)!r}")
        table = Table()
        table.add_column("component")
        table.add_column("value", justify="right")
        table.add_column("")
        for r in recs:
            bar = "█" * int(round(12 * abs(r["value"]) / scale))
            color = "green" if r["value"] >= 0 else "red"
            table.add_row(r["name"], f"{r['value']:+.3f}", f"[{color}]{bar}[/{color}]")
        con.print(table)
        con.print(f"sum {res.total:+.4f}  model logit {res.logit:+.4f}  "
                  f"completeness error {res.completeness_error:.1e}")
        if png:
            con.print(f"plot saved to {png}")
