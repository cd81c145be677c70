"""Sub-commands of ``lenscope lens`` (placeholder; filled in by its issue)."""

from __future__ import annotations

import typer


def register(lens_app: typer.Typer) -> None:
    """Add this module's commands to the ``lens`` group."""
