"""``lenscope features``: which features of a set of sparse dictionaries fire at each token of a prompt, and with a
target, direct logit attribution over them (``docs/features.md``)."""

from __future__ import annotations

import typer

from .common import fail, handle_errors, load_model, print_json
from .options import DEVICE_MAP_OPTION, DTYPE_OPTION, FOIL_DECOMPOSE_OPTION, JSON_OPTION, MODEL_OPTION


def register(app: typer.Typer) -> None:
    @app.command("features")
    @handle_errors
    def features_cmd(
        text: str = typer.Argument(..., help="The text."),
        model: str = MODEL_OPTION,
        dict_dir: str = typer.Option(..., "--dict", help="A dictionary folder (cfg.json + sae_weights.safetensors) "
                                     "or a folder of them, one per site."),
        target: str = typer.Option(None, "--target", "-t", help="Target token (its text, e.g. ' Paris', or #ID): "
                                   "also decompose its logit over the features (direct logit attribution)."),
        foil: str = FOIL_DECOMPOSE_OPTION,
        position: int = typer.Option(-1, "--position", help="Token position of the attribution (default: last)."),
        top: int = typer.Option(8, "--top", help="Features kept per token and dictionary (the strongest)."),
        site: str = typer.Option(None, "--site", help="Use only the dictionaries at these sites (comma-separated, "
                                 "e.g. resid_post.5); one residual-stream dictionary per attribution."),
        html: str = typer.Option(None, "--html", help="Write the page of the prompt's features to this file."),
        as_json: bool = JSON_OPTION,
        dtype: str = DTYPE_OPTION,
        device_map: str = DEVICE_MAP_OPTION,
    ):
        """The features of sparse dictionaries (SAEs, transcoders) active at each token of TEXT; with --target, the
        logit of TARGET (minus FOIL) as an exact sum over those features, the dictionaries' biases and errors and the
        other components."""
        from ..features.dictionaries.attribution import feature_dla
        from ..features.dictionaries.result import active_features
        from ..models.dictionaries.dictionary import load_dictionaries
        from ..models.loading.load import token_ids
        from ..models.runtime.request import position_in

        if top < 1:
            fail("--top must be at least 1")
        if foil is not None and target is None:
            fail("a foil needs a target; give --target too")
        dicts = load_dictionaries(dict_dir)
        if site:
            want = [s.strip() for s in site.split(",") if s.strip()]
            missing = [s for s in want if s not in {d.site for d in dicts}]
            if missing:
                fail(f"--site {', '.join(missing)}: {dict_dir} has dictionaries at "
                     f"{', '.join(str(d.site) for d in dicts)}")
            dicts = [d for d in dicts if d.site in want]
        lm = load_model(model, dtype=dtype, device_map=device_map)
        for d in dicts:
            d.check(lm)
        ids = token_ids(lm, text)
        p = position_in(position, ids.numel())
        fa = active_features(lm, ids, dicts, top=top)
        dla = feature_dla(lm, text, dicts, target, foil, position=p) if target is not None else None
        from ..features.dictionaries.labels import labels_for

        labels = labels_for(dict_dir)  # each active feature's label where `dict label` cached them
        if html:
            from ..viz.views import standalone

            standalone(fa, html, labels=labels)
        if as_json:
            from ..viz.views.feature import feature_label

            width = dict(zip(fa.sites, fa.widths))
            active = [{**r, "label": feature_label(labels, r["site"], r["feature"], width[r["site"]])}
                      if r["site"] in labels else r for r in fa.to_records()]
            out = {"model": lm.name, "tokens": fa.tokens, "sites": fa.sites, "widths": fa.widths,
                   "active": active, "l0": fa.l0.tolist()}
            if dla is not None:
                out["dla"] = dla.to_dict()
            print_json(out)
            return
        from rich.console import Console
        from rich.table import Table

        con = Console()
        con.print(f"{lm.name}: features of {', '.join(fa.sites)} in {''.join(fa.tokens)!r}")
        table = Table()
        for c in ("pos", "token") + tuple(f"{s} (L0)" for s in fa.sites):
            table.add_column(c)
        for q, tok in enumerate(fa.tokens):
            cells = []
            for s, j in zip(fa.sites, range(len(fa.sites))):
                act = fa.active(q, s)
                cells.append(f"({int(fa.l0[j, q])}) " + " ".join(f"F{i}:{v:.2f}" for _, i, v in act))
            table.add_row(str(q), repr(tok), *cells)
        con.print(table)
        if dla is not None:
            what = repr(dla.target) + (f" − {dla.foil!r}" if dla.foil is not None else "")
            con.print(f"direct logit attribution of {what} at position {dla.position} ({dla.tokens[dla.position]!r})")
            t2 = Table()
            for c in ("part", "activation", "value"):
                t2.add_column(c, justify="left" if c == "part" else "right")
            for r in sorted(dla.to_records(), key=lambda r: -abs(r["value"]))[:max(top, 10)]:
                a = "" if r["activation"] is None else f"{r['activation']:.3f}"
                t2.add_row(r["name"], a, f"{r['value']:+.4f}")
            con.print(t2)
            con.print(f"sum {dla.total:+.4f}  model logit {dla.logit:+.4f}  "
                      f"completeness error {dla.completeness_error:.1e}")
        if html:
            con.print(f"page written to {html}")
