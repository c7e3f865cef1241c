"""``ftis-client demo``: a coordinator and two SmolLM2-135M clients (full fine-tune and
LoRA) on one machine, then ``OUT/report.md`` and ``OUT/rewards.png``."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from ftis.client.cli import exit_codes

console = Console(stderr=True)


def demo(
    rounds: Annotated[int, typer.Option(help="rounds per client")] = 10,
    out: Annotated[Path, typer.Option(help="output folder (wiped first)")] = Path("runs/demo"),
    model: Annotated[str, typer.Option()] = "smollm2-135m",
    local_groups: Annotated[int, typer.Option(help="I")] = 2,
    external_groups: Annotated[int, typer.Option(help="J")] = 2,
    group_size: Annotated[int, typer.Option(help="G")] = 8,
    max_new_tokens: Annotated[int, typer.Option()] = 48,
    method: Annotated[str, typer.Option()] = "ftis",
    lr_full: Annotated[float, typer.Option(help="learning rate, full fine-tune")] = 2e-6,
    lr_lora: Annotated[float, typer.Option(help="learning rate, LoRA")] = 5e-5,
    threads: Annotated[int, typer.Option(help="torch threads per client")] = 1,
    timeout_min: Annotated[float, typer.Option(help="give up after this many minutes")] = 60,
) -> None:
    """Run the two-client demo swarm and write the report."""
    from ftis.client.experiment.launcher import ClientSpec, LaunchError, launch

    t0 = time.time()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    common = ["--model", model, "--rounds", str(rounds), "--local-groups", str(local_groups),
              "--external-groups", str(external_groups), "--group-size", str(group_size),
              "--max-new-tokens", str(max_new_tokens), "--method", method]
    specs = [
        ClientSpec("full", [*common, "--peft", "none", "--learning-rate", str(lr_full),
                            "--seed", "1", "--display-name", "smollm2-full"]),
        ClientSpec("lora", [*common, "--peft", "lora", "--learning-rate", str(lr_lora),
                            "--seed", "2", "--display-name", "smollm2-lora"]),
    ]
    _warm_model_cache(model)
    console.print(f"starting coordinator and clients; logs in {out / 'logs'}")
    swarm = launch(out, specs, threads_per_client=threads)
    try:
        codes = _follow(swarm, out, rounds, timeout_min * 60)
        stats = _admin_stats(swarm.admin)
    except LaunchError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(exit_codes.UNEXPECTED) from exc
    finally:
        swarm.stop()
    wall = time.time() - t0
    report = write_report(out, ["full", "lora"], stats, wall, " ".join(common),
                          {"full": lr_full, "lora": lr_lora})
    console.print(f"report: {report}")
    if any(codes.values()):
        console.print(f"[red]client exit codes: {codes}[/red]")
        raise typer.Exit(exit_codes.UNEXPECTED)


def _warm_model_cache(model: str) -> None:
    """Convert an embedded GGUF once, before two clients race to do it."""
    import transformers

    from ftis.client.models.registry import materialize, resolve

    transformers.utils.logging.disable_progress_bar()
    with console.status(f"preparing {model} (first run converts the GGUF, ~20 s)"):
        materialize(resolve(model))


def _follow(swarm, out: Path, rounds: int, timeout_s: float) -> dict[str, int]:  # noqa: ANN001
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ftis.client.experiment.launcher import LaunchError
    from ftis.client.experiment.report import read_metrics

    deadline = time.monotonic() + timeout_s
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), TextColumn("{task.fields[info]}"), console=console) as pg:
        tasks = {n: pg.add_task(n, total=rounds, info="") for n in swarm.clients}
        while True:
            for name, task in tasks.items():
                recs = read_metrics(out / name / "metrics.jsonl")
                info = f"reward {recs[-1]['reward_mean']:.3f}" if recs else ""
                pg.update(task, completed=len(recs), info=info)
            if all(p.poll() is not None for p in swarm.clients.values()):
                break
            if time.monotonic() > deadline:
                raise LaunchError(f"demo did not finish within {timeout_s:.0f}s")
            time.sleep(1.0)
    return {n: p.returncode for n, p in swarm.clients.items()}


def _admin_stats(admin: str) -> dict:
    import grpc
    from google.protobuf.json_format import MessageToDict

    from ftis.v1 import admin_pb2, admin_pb2_grpc

    with grpc.insecure_channel(admin) as ch:
        resp = admin_pb2_grpc.AdminStub(ch).Stats(admin_pb2.StatsRequest(), timeout=30)
    stats = MessageToDict(resp, preserving_proto_field_name=True)
    # proto3 JSON writes int64 as strings; the report wants numbers
    return {k: int(v) if isinstance(v, str) and v.isdigit() else v for k, v in stats.items()}


def write_report(out: Path, names: list[str], stats: dict, wall_s: float, flags: str,
                 lrs: dict[str, float]) -> Path:
    """Write ``report.md`` and ``rewards.png`` for the clients ``names`` under ``out``."""
    from ftis.client.experiment.report import (
        markdown_table,
        plot_rewards,
        read_metrics,
        reward_side_by_side,
    )

    runs = {n: read_metrics(out / n / "metrics.jsonl") for n in names}
    plot_rewards(runs, out / "rewards.png", "SmolLM2-135M: full fine-tune vs LoRA (F-TIS swarm)")
    tokens = int(stats.get("completion_tokens", 0))
    size = int(stats.get("bundle_bytes", 0))
    lines = [
        "# FTIS demo report",
        "",
        f"Wall time of the swarm run (coordinator start to report): {wall_s:.0f} s.",
        "",
        f"Client flags: `{flags}`; learning rates: "
        + ", ".join(f"{n} {lr:g}" for n, lr in lrs.items()) + ".",
        "",
        "Tasks: ReasoningGYM `chain_sum`, two 1-digit terms; answers are extracted "
        "leniently (answer tags, then `\\boxed{}`, then the last number in the text) and "
        "scored with ReasoningGYM's `score_answer`. Rewards below are the coordinator's "
        "re-scored (verified) rewards.",
        "",
        "## Mean verified reward per round",
        "",
        reward_side_by_side(runs),
        "",
        "![reward curves](rewards.png)",
        "",
    ]
    lines += [
        "IS weights and the filtered share are over all samples of the step (local ones "
        "have weights of ~1: they come from the learner's own policy); the `ext.` columns "
        "cover only the external groups (– when none was used that round). Rounds whose "
        "groups all had equal rewards make no update.",
        "",
    ]
    for n, recs in runs.items():
        lines += [f"## Client `{n}`", "", markdown_table(recs), ""]
    lines += [
        "## Coordinator",
        "",
        "```json",
        json.dumps(stats, indent=2),
        "```",
        "",
        f"Wire size: {size} bytes of bundle payload for {tokens} completion tokens = "
        f"**{size / max(tokens, 1):.1f} bytes per completion token** (token ids, sampler "
        "log-probs, text, prompt ids and metadata).",
        "",
    ]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path
