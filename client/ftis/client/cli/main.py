"""``ftis-client``: the volunteer CLI (one command per module).

Volunteers get only :data:`VOLUNTEER_COMMANDS`; the research and security tooling (demo,
experiment matrices, attackers) is the separate ``ftis-lab`` distribution, which this
package never imports.
"""

from __future__ import annotations

from typing import Annotated

import typer

from ftis.client.cli import models, service, settings, start, status

#: Every command of ``ftis-client`` (a test holds the CLI to exactly these).
VOLUNTEER_COMMANDS = ("start", "models", "settings", "status", "service")

app = typer.Typer(help="FTIS volunteer client.", no_args_is_help=True,
                  pretty_exceptions_enable=False)


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"ftis-client {version('ftis-client')}")
        raise typer.Exit()


@app.callback()
def _main(version: Annotated[bool, typer.Option(
        "--version", callback=_print_version, is_eager=True,
        help="print the installed version and exit")] = False) -> None:
    """FTIS volunteer client."""


app.command("start")(start.start)
app.add_typer(models.app, name="models")
app.add_typer(settings.app, name="settings")
app.command("status")(status.status)
app.add_typer(service.app, name="service")

if __name__ == "__main__":
    app()
