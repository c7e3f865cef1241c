"""``ftis-lab merit plan|merge``: MERIT's conflict-aware split and one-shot merge
(issue 16; :mod:`ftis.lab.merit`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from ftis.client.models.peft import PeftKind
from ftis.protocol.exit_codes import ExitCode

app = typer.Typer(help="MERIT: conflict-aware branches of a task mix and their one-shot "
                       "merge (arXiv 2606.01717).", no_args_is_help=True)


@app.command("plan")
def plan_command(
    model: Annotated[str, typer.Option(help="the shared initialisation (alias, .gguf, dir)")],
    families: Annotated[str, typer.Option(
        help="comma-separated ReasoningGYM datasets, or a JSON file of task specs "
             '([{"dataset": ..., "config": {...}}, ...])')],
    out: Annotated[Path, typer.Option(help="the plan (JSON)")] = Path("merit-plan.json"),
    peft: Annotated[PeftKind, typer.Option(help="whose gradients")] = "lora",
    groups: Annotated[int, typer.Option(min=1, help="prompts per family")] = 4,
    group_size: Annotated[int, typer.Option(min=2, help="completions per prompt")] = 8,
    rounds: Annotated[int, typer.Option(min=0, help="splits: 2^rounds branches")] = 1,
    temperature: Annotated[float, typer.Option(min=0.01)] = 0.7,
    max_new_tokens: Annotated[int, typer.Option(min=1)] = 32,
    seed: Annotated[int, typer.Option()] = 0,
) -> None:
    """Per-family gradients, the conflict matrix, and the conflict-aware and random
    splits of the same shape."""
    from ftis.lab.merit.run import MeritError, plan
    from ftis.tasks import TaskSpec

    try:
        specs: list[str | TaskSpec]
        if families.endswith(".json"):
            specs = [TaskSpec.model_validate(t)
                     for t in json.loads(Path(families).read_text())]
        else:
            specs = [f.strip() for f in families.split(",") if f.strip()]
        result = plan(model, specs,
                      peft=peft, groups=groups, group_size=group_size, rounds=rounds,
                      temperature=temperature, max_new_tokens=max_new_tokens, seed=seed)
    except (MeritError, ValueError, OSError) as exc:
        typer.echo(f"merit plan: {exc}", err=True)
        raise typer.Exit(ExitCode.USAGE) from None
    out.write_text(json.dumps(result, indent=1))
    for kind, branches in result["branches"].items():
        typer.echo(f"{kind}: " + " | ".join(", ".join(b) for b in branches))
    typer.echo(f"plan: {out}")


@app.command("merge")
def merge_command(
    base: Annotated[str, typer.Option(help="the shared initialisation the branches left")],
    branch: Annotated[list[str], typer.Option(
        help="OUT_DIR:TOKENS of one trained branch (an ftis-client --out folder); repeat")],
    out: Annotated[Path, typer.Option(help="the merged model directory")],
    peft: Annotated[PeftKind, typer.Option(help="the branches' PEFT kind")] = "lora",
) -> None:
    """Merge the branches' weights, weighted by their training tokens, into one model
    directory (loadable with ``ftis-client start --model DIR``)."""
    from ftis.lab.merit.run import Branch, MeritError, merge

    try:
        branches = []
        for spec in branch:
            folder, _, tokens = spec.rpartition(":")
            branches.append(Branch(Path(folder), float(tokens)))
        record = merge(base, branches, out, peft=peft)
    except (MeritError, ValueError) as exc:
        typer.echo(f"merit merge: {exc}", err=True)
        raise typer.Exit(ExitCode.USAGE) from None
    typer.echo(f"merged {len(branches)} branches with weights "
               f"{', '.join(f'{w:.3f}' for w in record['weights'])} into {out}")


@app.command("experiment")
def experiment_command(
    config: Annotated[Path, typer.Option(help="the experiment (JSON, e.g. "
                                              "experiments/merit_fourway.json)")],
    out: Annotated[Path, typer.Option(help="its folder; finished cells there are kept")],
    restore_from: Annotated[Path | None, typer.Option(
        help="first rebuild under --out the finished cells whose rows this results folder "
             "holds (e.g. committed raw results, or --collect-to of a run elsewhere); "
             "it must come from the same config, which may add seeds but not drop "
             "any")] = None,
    collect_to: Annotated[Path | None, typer.Option(
        help="run nothing: copy config.json, results.jsonl and plans/ of --out (the rows "
             "of every cell finished so far) to this folder (a run in progress keeps "
             "going)")] = None,
) -> None:
    """Joint training vs the conflict-aware and random splits merged by tokens vs each
    branch alone, at equal total samples, each arm a real local swarm; held-out pass@1
    per family in OUT/results.jsonl (resumable, also from committed raw results)."""
    from pydantic import ValidationError

    from ftis.lab.experiment.matrix import CellMismatchError
    from ftis.lab.merit.experiment import (
        MeritExperimentConfig,
        collect_results,
        restore_cells,
        run_merit,
    )
    from ftis.lab.merit.report import tables
    from ftis.lab.merit.run import MeritError

    try:
        cfg = MeritExperimentConfig.load(config)
    except (ValidationError, OSError) as exc:
        typer.echo(f"merit experiment: {exc}", err=True)
        raise typer.Exit(ExitCode.USAGE) from None
    try:
        if collect_to is not None:
            typer.echo(f"{collect_results(out, collect_to)} rows of {out}: {collect_to}")
            return
        if restore_from is not None:
            typer.echo(f"restored {restore_cells(cfg, restore_from, out)} finished cells "
                       f"from {restore_from}")
        path = run_merit(cfg, out, on_cell=lambda c: typer.echo(f"cell {c.name}"))
    except (MeritError, ValueError, CellMismatchError) as exc:
        typer.echo(f"merit experiment: {exc}", err=True)
        raise typer.Exit(ExitCode.USAGE) from None
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    got = tables(cfg, rows)
    summary = out / "summary.md"
    summary.write_text("\n\n".join([f"# {cfg.name}", got["families"], got["samples"],
                                    got["contrasts"], got["power"]]) + "\n")
    typer.echo(f"results: {path}\nsummary: {summary}")
