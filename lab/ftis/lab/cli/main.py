"""``ftis-lab``: research and security tooling around the volunteer client.

``demo`` (a local swarm and its report), ``experiment`` (experiment matrices), ``attack``
(one misbehaving volunteer), ``security-experiment`` (every attacker against a local
swarm), ``merit`` (MERIT's conflict-aware split and one-shot merge) and ``simulate``
(N learners in Flower's simulation engine; needs ``make flower-env``). Honest nodes
are still ``ftis-client start`` processes; only attackers run here.
"""

from __future__ import annotations

from typing import Annotated

import typer

from ftis.lab.cli import attack, demo, experiment, merit, simulate

#: Every command of ``ftis-lab``.
LAB_COMMANDS = ("demo", "experiment", "attack", "security-experiment", "merit", "simulate")

app = typer.Typer(help="FTIS research and security tooling (not for volunteers).",
                  no_args_is_help=True, pretty_exceptions_enable=False)


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        typer.echo(f"ftis-lab {version('ftis-lab')}")
        raise typer.Exit()


@app.callback()
def _main(version: Annotated[bool, typer.Option(
        "--version", callback=_print_version, is_eager=True,
        help="print the installed version and exit")] = False) -> None:
    """FTIS research and security tooling (not for volunteers)."""


app.command("demo")(demo.demo)
app.command("experiment")(experiment.experiment)
app.command("attack")(attack.attack)
app.command("security-experiment")(attack.security_experiment)
app.add_typer(merit.app, name="merit")
app.command("simulate")(simulate.simulate)

if __name__ == "__main__":
    app()
