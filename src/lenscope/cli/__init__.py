"""The ``lenscope`` command line (typer). One module per command group."""

from __future__ import annotations

import typer

from . import (
    circuit,
    components,
    dictionary,
    evaluate,
    explain,
    features,
    generate,
    graph,
    interventions,
    lens,
    mixing,
    models,
    report,
    serve,
    steer,
)

app = typer.Typer(
    rich_markup_mode=None,
    name="lenscope",
    help="See how a transformer language model builds its prediction.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
models.register(app)
components.register(app)
explain.register(app)
lens.register(app)
mixing.register(app)
interventions.register(app)
circuit.register(app)
evaluate.register(app)
report.register(app)
generate.register(app)
steer.register(app)
dictionary.register(app)
features.register(app)
graph.register(app)
serve.register(app)


def main() -> None:
    import sys

    from .sweeps import split_ray_address

    app(args=split_ray_address(sys.argv[1:]))
