"""``lenscope dict train|eval|show|label``: sparse dictionaries (``docs/features.md``). One module per command."""

from __future__ import annotations

import typer

dict_app = typer.Typer(help="Train, evaluate and look at sparse dictionaries (SAEs, transcoders).",
                       no_args_is_help=True)


def register(app: typer.Typer) -> None:
    from . import dict_eval, dict_label, dict_show, dict_train

    dict_train.register(dict_app)  # dict train
    dict_eval.register(dict_app)   # dict eval
    dict_show.register(dict_app)   # dict show
    dict_label.register(dict_app)  # dict label
    app.add_typer(dict_app, name="dict")
