"""``ftis-client``: the volunteer CLI (one command per module)."""

from __future__ import annotations

import typer

from ftis.client.cli import attack, demo, experiment, models, start

app = typer.Typer(help="FTIS volunteer client.", no_args_is_help=True,
                  pretty_exceptions_enable=False)
app.command("start")(start.start)
app.command("demo")(demo.demo)
app.command("attack")(attack.attack)
app.command("security-experiment")(attack.security_experiment)
app.command("experiment")(experiment.experiment)
app.add_typer(models.app, name="models")

if __name__ == "__main__":
    app()
