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
    restore_from: Annotated[Path | None, typer.Option(
        help="first rebuild under --out the finished cells whose raw results this folder "
             "holds (experiments/results/ID, or --collect-to of a run elsewhere); it must "
             "come from the same config, which may add seeds but not drop any",
    )] = None,
    restore_shared_from: Annotated[list[Path] | None, typer.Option(
        help="first rebuild under --out the finished cells of another experiment's "
             "results folder that are cells of this config with the same settings (the "
             "shared solo__* cells); repeatable",
    )] = None,
    run: Annotated[bool, typer.Option(
        "--run/--no-run", help="--no-run: restore only, run no cell (e.g. to fill the "
                               "folder of a run started from a pinned checkout)",
    )] = True,
) -> None:
    """Methods × seeds × pairings × local/external mixes, each cell a real local swarm
    (resumable, also from committed raw results)."""
    from pydantic import ValidationError

    from ftis.lab.experiment.matrix import (
        ExperimentConfig,
        cells_dropped,
        collect_finished,
        restore_finished,
        restore_shared,
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
        lost = cells_dropped(collect_to, rows)
        if lost:
            console.print(f"[red]not collected:[/red] {collect_to} holds rows of {len(lost)} "
                          f"cells not finished under {out} (e.g. {lost[0]}); restore them "
                          "first (--restore-from) or collect to another folder")
            raise typer.Exit(ExitCode.USAGE)
        write_results(cfg, rows, evals, collect_to)
        console.print(f"{done} finished cells of {cfg.id or cfg.name}: {collect_to}")
        return
    restores = [(restore_finished, restore_from, "")] if restore_from is not None else []
    restores += [(restore_shared, src, " shared") for src in restore_shared_from or []]
    for restore, src, kind in restores:
        try:
            done = restore(cfg, src, out)
        except ValueError as exc:
            console.print(f"[red]cannot restore{kind} cells from {src}:[/red] {exc}")
            raise typer.Exit(ExitCode.USAGE) from exc
        console.print(f"restored {done}{kind} finished cells from {src}")
    if not run:
        return
    summary = run_experiment(cfg, out)
    console.print(f"summary: {summary}")
