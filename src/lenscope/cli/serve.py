"""``lenscope serve``: the local web app over every report view (and its HTTP API)."""

from __future__ import annotations

import typer

from .common import fail, handle_errors


@handle_errors
def serve_cmd(
    model: list[str] = typer.Option(None, "--model", "-m", metavar="NAME",
                                    help="A model the app offers (repeat for several; the first is the default). "
                                         "Default: every registered name. Loaded on first use."),
    port: int = typer.Option(8000, "--port", help="TCP port."),
    host: str = typer.Option("127.0.0.1", "--host",
                             help="Address to bind. Anything but localhost needs --token."),
    token: str = typer.Option(None, "--token",
                              help="Require 'Authorization: Bearer TOKEN' on every API request (the page reads it "
                                   "from its address, ?token=TOKEN)."),
    lens: str = typer.Option(None, "--lens", help="A tuned-lens directory, shown beside the logit lens."),
    dict_dir: str = typer.Option(None, "--dict", help="Sparse dictionaries (a folder, or a folder of them): the "
                                                      "features view; click a token for its active features."),
    dict_data: str = typer.Option(None, "--dict-data", help="Text (a file or the corpus folder) whose held-out part "
                                                            "a feature's card is measured on (click a feature)."),
    max_tokens: int = typer.Option(512, "--max-tokens", help="Most tokens in one request (413 above)."),
    max_resident: int = typer.Option(2, "--max-resident", help="Most models kept loaded at once."),
    max_queue: int = typer.Option(16, "--max-queue", help="Most jobs waiting in all (503 above)."),
):
    """A local web app over every report view: type a prompt, pick a target, click a head or a token."""
    if not 0 <= port <= 65535:
        fail("--port must lie in 0..65535")
    from ..serve import serve

    serve(host, port, models=list(model) if model else None, token=token, max_tokens=max_tokens,
          max_queue=max_queue, max_resident=max_resident, lens=lens, dicts=dict_dir, dict_data=dict_data)


def register(app: typer.Typer) -> None:
    """Add the ``serve`` command."""
    app.command("serve")(serve_cmd)
