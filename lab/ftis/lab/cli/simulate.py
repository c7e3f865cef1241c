"""``ftis-lab simulate``: N FTIS learners in Flower's simulation engine
(:mod:`ftis.lab.simulate`; docs/simulate.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from ftis.protocol.exit_codes import ExitCode

#: What to do when ``flwr`` is not installed.
FLOWER_MISSING = ("ftis-lab simulate needs flwr[simulation] 1.41, which the project keeps "
                  "out of its main environment: run `make flower-env` and use "
                  ".venv-flower/bin/ftis-lab simulate ...")


def flower_available() -> bool:
    """Whether ``flwr`` (with its simulation engine, Ray) can be imported."""
    import importlib.util

    return (importlib.util.find_spec("flwr") is not None
            and importlib.util.find_spec("ray") is not None)


def simulate(
    learners: Annotated[int, typer.Option(min=1, help="N: learners (Flower ClientApps)")] = 2,
    rounds: Annotated[int, typer.Option(min=1, help="rounds every learner runs")] = 3,
    model: Annotated[str, typer.Option(
        help="'tiny' (a tiny random Llama), or what `ftis-client start --model` takes")
    ] = "tiny",
    local_groups: Annotated[int, typer.Option(min=1, help="I: own groups per round")] = 1,
    external_groups: Annotated[int, typer.Option(min=0, help="J: relayed groups per round")
                               ] = 2,
    group_size: Annotated[int, typer.Option(min=2, help="G: completions per prompt")] = 8,
    max_new_tokens: Annotated[int, typer.Option(min=1)] = 12,
    method: Annotated[str, typer.Option(help="on_policy|nois|vis|tis|ftis")] = "ftis",
    seed: Annotated[int, typer.Option(help="learner i samples with seed+i")] = 0,
    model_seed: Annotated[int, typer.Option(help="the tiny model's weights")] = 1,
    tasks: Annotated[str, typer.Option(
        help="comma-separated ReasoningGYM datasets of the coordinator's task mix")
    ] = "letter_counting",
    coordinator_config: Annotated[Path | None, typer.Option(
        help="coordinator settings (JSON/TOML, as `ftis-coordinator serve --config`); "
             "overrides --tasks")] = None,
    client_cpus: Annotated[float, typer.Option(help="CPUs per ClientApp actor")] = 1.0,
    client_gpus: Annotated[float, typer.Option(
        help="GPUs per ClientApp actor (0.25: four learners' actors per GPU)")] = 0.0,
    ray_address: Annotated[str | None, typer.Option(
        help="a running Ray cluster to join ('auto' after `ray start --head`)")] = None,
    ray_cpus: Annotated[int | None, typer.Option(help="CPUs of the local Ray instance")
                        ] = None,
    snapshots: Annotated[bool, typer.Option(
        help="learners keep their state in their Flower context (needed with more than "
             "one actor)")] = True,
    native: Annotated[bool, typer.Option(
        help="also run the same swarm natively (gRPC coordinator, lock step) and compare")
    ] = False,
    out: Annotated[Path, typer.Option(help="output folder")] = Path("runs/simulate"),
) -> None:
    """Run N FTIS learners as Flower ClientApps (Ray backend) against one ServerApp
    that plays the coordinator with ftis-coordinator's own handlers, verification and
    reputation; signed bundles travel in Flower messages, never weights. Writes
    OUT/summary.json (and OUT/native-summary.json with --native)."""
    if not flower_available():
        typer.echo(FLOWER_MISSING, err=True)
        raise typer.Exit(ExitCode.USAGE)
    from ftis.coordinator.config import read_config_file
    from ftis.lab.simulate.flower import run_flower
    from ftis.lab.simulate.learner import SimulationError
    from ftis.lab.simulate.spec import SwarmSpec, compare

    coordinator = ({"tasks": [{"dataset": t.strip()} for t in tasks.split(",") if t.strip()]}
                   if coordinator_config is None else read_config_file(coordinator_config))
    spec = SwarmSpec(learners=learners, rounds=rounds, model=model, model_seed=model_seed,
                     seed=seed, local_groups=local_groups, external_groups=external_groups,
                     group_size=group_size, max_new_tokens=max_new_tokens, method=method,
                     coordinator=coordinator, out=out)
    try:
        summary = run_flower(spec, client_cpus=client_cpus, client_gpus=client_gpus,
                             ray_address=ray_address, ray_cpus=ray_cpus, snapshots=snapshots)
    except SimulationError as exc:
        typer.echo(f"simulate: {exc}", err=True)
        raise typer.Exit(ExitCode.UNEXPECTED) from None
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(summary.to_json())
    typer.echo(json.dumps({
        "learners": learners, "rounds": rounds, "setup_s": round(summary.setup_s, 2),
        "wall_s": round(summary.wall_s, 2),
        "learner_rounds_per_min": round(summary.learner_rounds_per_minute(), 1),
        "bundles_accepted": summary.bundles_accepted,
        "bundles_rejected": summary.bundles_rejected}))
    if native:
        from ftis.lab.simulate.native import run_native

        reference = run_native(spec)
        (out / "native-summary.json").write_text(reference.to_json())
        diffs = compare(reference, summary)
        typer.echo("native: agrees" if not diffs else "native: differs\n" + "\n".join(diffs))
        if diffs:
            raise typer.Exit(ExitCode.UNEXPECTED)
