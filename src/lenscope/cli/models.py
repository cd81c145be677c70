"""``lenscope models`` and ``lenscope verify``."""

from __future__ import annotations

import typer

from .common import ModelChoice, command, print_json
from .options import JSON_OPTION, MODEL_OPTION, SOURCE_OPTION


def register(app: typer.Typer) -> None:
    @command(app, "models")
    def models_cmd(
        as_json: bool = typer.Option(False, "--json", help="Print JSON: a list of rows (embedded, tiny, family)."),
    ):
        """List the model names lenscope knows (and whether each is installed), and every model family it reads with
        what the family supports (read from the Anatomies of its tiny models)."""
        from ..models.families import family_rows, tiny_names
        from ..models.loading.load import EMBEDDED, installed

        rows = [{"name": m.name, "kind": "embedded", "installed": installed(m.name), "description": m.description,
                 "install": m.install} for m in EMBEDDED.values()]
        for name, fam in sorted(tiny_names().items()):
            rows.append({"name": f"tiny:{name}", "kind": "tiny", "installed": True, "family": fam.name,
                         "description": f"small random {name} ({fam.name} family) for tests and demos", "install": ""})
        fams = family_rows()
        if as_json:
            # one list, as before families were listed: a family's row has kind "family", its name and what it supports
            # (the family's decoder/encoder is its "architecture")
            print_json(rows + [{**f, "name": f["family"], "kind": "family", "architecture": f["kind"],
                                "installed": True, "install": "",
                                "description": f"{f['kind']} family reading {', '.join(f['model_types'])}"}
                               for f in fams])
            return
        from rich.console import Console
        from rich.table import Table

        table = Table(title="lenscope models")
        for col in ("name", "installed", "description"):
            table.add_column(col)
        for r in rows:
            inst = "yes" if r["installed"] else f"no — {r['install']}"
            table.add_row(r["name"], inst, r["description"])
        con = Console()
        con.print(table)
        con.print("model families lenscope reads (config.model_type), with what each supports as read from its tiny "
                  "models:", highlight=False)
        for f in fams:
            parts = [f"{f['kind']}, {' / '.join(f['block'])} block"] + [
                f"{k}: {', '.join(f[k]) or '-'}" for k in ("norms", "attention", "mlp", "head")]
            con.print(f"  {f['family']} ({', '.join(f['model_types'])}): " + "; ".join(parts), highlight=False,
                      soft_wrap=True)

    @command(app, "verify", model=True)
    def verify_cmd(
        model: ModelChoice = MODEL_OPTION,
        text: str = typer.Option(None, "--text", help="Text to run (default: a built-in sentence)."),
        source: str = SOURCE_OPTION,
        as_json: bool = JSON_OPTION,
    ):
        """Recompute every sub-layer with lenscope's own math and compare with the real model (exit 1 if not ok)."""
        from ..models.runtime.verify import DEFAULT_TEXT, PATTERN_KEY, verify

        lm = model.load()
        rep = verify(lm, text if text is not None else DEFAULT_TEXT, source=source)
        if as_json:
            print_json(rep.to_dict())
        else:
            from rich.console import Console
            from rich.table import Table

            con = Console()
            where = "" if rep.dtype == "float32" else f", {rep.dtype}"
            if lm.device_map:
                where += (f", placed on {', '.join(sorted({str(v) for v in lm.device_map.values()}))}; "
                          f"recomputed on {', '.join(sorted(set(rep.devices)))}")
            table = Table(
                title=f"verify {rep.model}: {rep.family}, {rep.n_layers} layers, {rep.n_tokens} tokens{where}")
            for col in ("layer", "norms", "attn probs", "attn out", "mlp", "block"):
                table.add_column(col, justify="right")
            for r in rep.layers:
                norms = max(v for k, v in r.items() if k.startswith("ln_"))
                mlp = max(v for k, v in r.items() if k.startswith("mlp_"))
                block = max(v for k, v in r.items() if k.startswith("resid_"))
                table.add_row(str(r["layer"]),
                              *(f"{v:.1e}" for v in (norms, r[PATTERN_KEY], r["attn_out"], mlp, block)))
            con.print(table)
            logit = "n/a (no LM head)" if rep.max_abs_logit_error is None else f"{rep.max_abs_logit_error:.2e}"
            if rep.nonfinite:
                con.print(f"[red]the model itself produced inf/NaN in {', '.join(rep.nonfinite)} "
                          f"({rep.dtype} overflow?); try --dtype bfloat16 or float32[/red]")
            per = "max |element|" if rep.error_scale == "max" else "RMS"
            con.print(f"max |logit error| {logit} (tol {rep.logit_tol:g}); max residual error / {per} "
                      f"{rep.max_rel_resid_error:.2e}, max sub-layer error {rep.max_rel_sublayer_error:.2e} "
                      f"(tol {rep.resid_tol:g}) -> {'[green]OK[/green]' if rep.ok else '[red]MISMATCH[/red]'}")
        if not rep.ok:
            raise typer.Exit(1)
