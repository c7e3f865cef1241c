"""``ftis-client models list``: models available on this machine."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(help="Models available locally.", no_args_is_help=True)


@app.command("list")
def list_models(json_out: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Embedded aliases and converted models in the cache."""
    from ftis.client.models.registry import list_local

    rows = list_local()
    if json_out:
        print(json.dumps(rows, indent=2))
        return
    table = Table("name", "kind", "available")
    for r in rows:
        table.add_row(r["name"], r["kind"], r["available"])
    Console().print(table)
