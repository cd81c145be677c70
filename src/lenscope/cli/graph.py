"""``lenscope graph``: the attribution graph of a prediction through transcoders (``docs/graphs.md``)."""

from __future__ import annotations

import typer

from .common import fail, handle_errors, load_model, one_of, print_json
from .options import DEVICE_MAP_OPTION, DTYPE_OPTION, JSON_OPTION, MAX_MEMORY_OPTION, MODEL_OPTION


def register(app: typer.Typer) -> None:
    @app.command("graph")
    @handle_errors
    def graph_cmd(
        text: str = typer.Argument(..., help="The prompt; the graph explains its next token."),
        model: str = MODEL_OPTION,
        dict_dir: str = typer.Option(..., "--dict", help="Transcoders: a dictionary folder or a folder of them, one "
                                     "per block (lenscope dict train --transcoder --site 'mlp_out.*'), or a cross-layer"
                                     " transcoder's folder (dict train --clt; circuit-tracer's CLT layout too)."),
        target: str = typer.Option(None, "--target", "-t", help="Target token (its text, e.g. ' Paris', or #ID) as "
                                   "the only logit node (default: the most probable tokens up to p = 0.95, at most "
                                   "10)."),
        foil: str = typer.Option(None, "--foil", "-f", help="Foil token (with --target): one contrastive logit node, "
                                 "the target's logit minus the foil's."),
        max_feature_nodes: int = typer.Option(7500, "--max-feature-nodes", help="Compute the edges into at most this "
                                              "many features, the most influential first (0: none)."),
        node_threshold: float = typer.Option(0.8, "--node-threshold", help="Pruning: keep the nodes making up this "
                                             "share of the influence on the logits."),
        edge_threshold: float = typer.Option(0.98, "--edge-threshold", help="Pruning: keep the edges making up this "
                                             "share of the edge influence."),
        batch_size: int = typer.Option(256, "--batch-size", help="Targets per backward pass (lowered as far as "
                                       "--max-memory needs)."),
        max_memory: str = MAX_MEMORY_OPTION,
        heads: bool = typer.Option(True, "--heads/--no-heads", help="Split each kept edge over the attention heads "
                                   "that carry it (exact; each link's `heads`)."),
        supernodes: int = typer.Option(0, "--supernodes", help="Automatic supernodes: merge the pruned graph's "
                                       "feature nodes by their edge profiles (and labels) into this many clusters, "
                                       "each of 2+ a supernode (one position, a band of blocks; 0: none)."),
        supernode_threshold: float = typer.Option(0.0, "--supernode-threshold", help="The least average similarity "
                                                  "(in [-1, 1]) two clusters need to merge."),
        check_sn: bool = typer.Option(False, "--check-supernodes", help="Ablate each supernode in the real model and "
                                      "compare the target logit's change with the graph's prediction (JSON: "
                                      "supernode_check)."),
        prediction: str = typer.Option("direct", "--prediction", help="What --check-supernodes compares with: "
                                       "direct or frozen_total."),
        as_json: bool = JSON_OPTION,
        html: str = typer.Option(None, "--html", help="Write the graph's page to this file."),
        first_token: str = typer.Option("auto", "--first-token", help="The page's first-token switch at first: hide "
                                        "or show the first position's feature and error nodes; auto: hidden when "
                                        "they carry at least half the influence (the attention sink of a model "
                                        "without a BOS)."),
        out: str = typer.Option(None, "--out", help="Save the graph to this folder (graph.safetensors, reloadable "
                                "with AttributionGraph.load, and graph.json, circuit-tracer's JSON)."),
        export: str = typer.Option(None, "--export-circuit-tracer", help="Write circuit-tracer's JSON (its viewer "
                                   "and Neuronpedia open it) to this file."),
        dtype: str = DTYPE_OPTION,
        device_map: str = DEVICE_MAP_OPTION,
    ):
        """The attribution graph of TEXT's next token: transcoder features, error nodes, tokens and logits, each
        edge a direct effect through the model frozen at the real run, exact (checked on every call), pruned as
        circuit-tracer prunes."""
        from pathlib import Path

        from ..features.dictionaries.labels import labels_for
        from ..features.graphs.export import write_circuit_tracer
        from ..features.graphs.graph import attribution_graph
        from ..memory import parse_size
        from ..models.dictionaries.clt import load_transcoders

        for name, v in (("--node-threshold", node_threshold), ("--edge-threshold", edge_threshold)):
            if not 0.0 <= v <= 1.0:
                fail(f"{name} must lie in [0, 1]; got {v}")
        if max_feature_nodes < 0 or batch_size < 1:
            fail("--max-feature-nodes must be at least 0 and --batch-size at least 1")
        from ..viz.views.graph import FIRST_TOKEN

        one_of("--first-token", first_token, FIRST_TOKEN)
        if supernodes < 0 or not -1.0 <= supernode_threshold <= 1.0:
            fail(f"--supernodes must be at least 0 and --supernode-threshold in [-1, 1]; got {supernodes}, "
                 f"{supernode_threshold}")
        if check_sn and not supernodes:
            fail("--check-supernodes needs supernodes: add --supernodes N")
        one_of("--prediction", prediction, ("direct", "frozen_total"))
        budget = parse_size(max_memory) if max_memory is not None else None
        dicts = load_transcoders(dict_dir)
        lm = load_model(model, dtype=dtype, device_map=device_map)
        g = attribution_graph(lm, text, dicts, target=target, foil=foil, max_feature_nodes=max_feature_nodes,
                              batch_size=batch_size, max_memory=budget, progress=not as_json)
        th = {"node_threshold": node_threshold, "edge_threshold": edge_threshold}
        labels = labels_for(dict_dir) or None  # the features' labels where `dict label` cached them
        if heads:
            from ..features.graphs.heads import edge_heads

            g.set_heads(edge_heads(lm, g, dicts, max_memory=budget, progress=not as_json, **th))
        check = None
        if supernodes:
            from ..features.graphs.supernodes import auto_supernodes, check_supernodes

            auto_supernodes(g, n_groups=supernodes, threshold=supernode_threshold, labels=labels, **th)
            if check_sn and g.supernodes:
                check = check_supernodes(lm, g, dicts, prediction=prediction)
        if out:
            Path(out).mkdir(parents=True, exist_ok=True)
            g.save(Path(out) / "graph.safetensors")
            write_circuit_tracer(g, Path(out) / "graph.json", labels=labels, **th)
            if check is not None:
                check.save(Path(out) / "supernode-check.safetensors")
        if export:
            write_circuit_tracer(g, export, labels=labels, **th)
        if html:
            from ..viz.views import standalone

            standalone(g, html, labels=labels, first_token=first_token, **th)
        d = g.to_dict(labels=labels, **th)
        if check_sn:
            d["supernode_check"] = None if check is None else check.to_dict()
        if as_json:
            print_json(d)
            return
        from rich.console import Console
        from rich.table import Table

        con = Console()
        con.print(f"{lm.name}: attribution graph of {''.join(g.tokens)!r} -> "
                  + ", ".join(f"{t!r} ({p:.3f})" for t, p in zip(g.logit_tokens, g.logit_probs.tolist())))
        con.print(f"{g.n_features} of {g.n_active} active features, {len(d['nodes'])} nodes and {len(d['links'])} "
                  f"edges after pruning; replacement score {d['replacement_score']:.3f}, completeness "
                  f"{d['completeness_score']:.3f}; exactness error {g.exactness_error:.1e}; {g.seconds:.1f} s"
                  + (f"; heads on the edges: error {g.head_error:.1e}" if g.head_error is not None else ""))
        table = Table()
        for c in ("node", "kind", "token", "activation", "influence"):
            table.add_column(c)
        feats = sorted((n for n in d["nodes"] if n["kind"] in ("feature", "error")), key=lambda n: n["influence"])
        for n in feats[:20]:
            a = "" if n["activation"] is None else f"{n['activation']:.3f}"
            table.add_row(n["id"], n["kind"], repr(n["token"]), a, f"{n['influence']:.3f}")
        con.print(table)
        if supernodes:
            con.print(f"{len(g.supernodes)} supernodes: "
                      + "; ".join(f"{sn[0]} ({len(sn) - 1})" for sn in g.supernodes))
        if check is not None:
            con.print(f"supernodes ablated: Spearman {check.spearman:.3f} between the real change of "
                      f"{check.logit_token!r} and the graph's {check.prediction} prediction; "
                      f"{len(check.flagged)} flagged")
            for f in check.flagged:
                con.print(f"  {f['label']}: {f['reason']} (real {f['real']:.3g}, predicted {f['predicted']:.3g})")
        for what, path in (("graph saved to", out), ("circuit-tracer JSON written to", export), ("page written to",
                                                                                               html)):
            if path:
                con.print(f"{what} {path}")
