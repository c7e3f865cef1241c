"""``ftis-lab experiment --config FILE``: run an experiment matrix on this machine."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from ftis.protocol.exit_codes import ExitCode

console = Console(stderr=True)


def experiment(
    config: Annotated[Path, typer.Option(help="experiment matrix (JSON or TOML)")],
    out: Annotated[Path, typer.Option(help="output folder; finished cells are reused")] = Path(
        "runs/experiment"),
) -> None:
    """Methods × seeds × pairings × local/external mixes, each cell a real local swarm."""
    from pydantic import ValidationError

    from ftis.lab.experiment.matrix import ExperimentConfig, run_experiment

    try:
        cfg = ExperimentConfig.load(config)
    except (ValidationError, OSError, ValueError) as exc:
        console.print(f"[red]invalid experiment config {config}:[/red] {exc}")
        raise typer.Exit(ExitCode.USAGE) from exc
    summary = run_experiment(cfg, out)
    console.print(f"summary: {summary}")
