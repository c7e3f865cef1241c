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
    collect_to: Annotated[Path | None, typer.Option(
        help="run nothing: write config.json, results.jsonl and evals.jsonl of the cells "
             "already finished under --out to this folder (a run in progress keeps going)",
    )] = None,
) -> None:
    """Methods × seeds × pairings × local/external mixes, each cell a real local swarm."""
    from pydantic import ValidationError

    from ftis.lab.experiment.matrix import (
        ExperimentConfig,
        collect_finished,
        run_experiment,
        write_results,
    )

    try:
        cfg = ExperimentConfig.load(config)
    except (ValidationError, OSError, ValueError) as exc:
        console.print(f"[red]invalid experiment config {config}:[/red] {exc}")
        raise typer.Exit(ExitCode.USAGE) from exc
    if collect_to is not None:
        rows, evals, done = collect_finished(cfg, out)
        write_results(cfg, rows, evals, collect_to)
        console.print(f"{done} finished cells of {cfg.id or cfg.name}: {collect_to}")
        return
    summary = run_experiment(cfg, out)
    console.print(f"summary: {summary}")
