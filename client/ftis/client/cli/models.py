"""``ftis-client models list``: models available on this machine."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(help="Models available locally.", no_args_is_help=True)


def _size(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def _params(n: int | None) -> str:
    if n is None:
        return "?"
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


@app.command("list")
def list_models(json_out: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Embedded aliases, converted models in the cache and models in the HF hub cache.

    Parameter counts come from safetensors headers (weights are not loaded); "?" means
    unknown until the model is converted or downloaded.
    """
    from ftis.client.models.registry import cache_dir, hub_cache_dir, list_local

    rows = list_local()
    if json_out:
        print(json.dumps(rows, indent=2))
        return
    table = Table(title=f"cache {cache_dir()}  |  hub cache {hub_cache_dir()}")
    for col in ("name", "kind", "family", "parameters", "state", "size"):
        table.add_column(col, justify="right" if col in ("parameters", "size") else "left",
                         overflow="fold" if col == "name" else "ellipsis")
    table.add_column("path", overflow="fold")
    for r in rows:
        table.add_row(r["name"], r["kind"], r["family"] or "?", _params(r["parameters"]),
                      r["state"], _size(r["size_bytes"]), r["path"] or "-")
    Console().print(table)
