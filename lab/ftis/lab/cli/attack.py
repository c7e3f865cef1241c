"""``ftis-lab attack --kind KIND``: a misbehaving volunteer for security experiments.

Takes every flag of ``ftis-client start`` (the signature is copied from it, so the two
never drift) plus kind-specific options; logs what it sends and the codes it gets back
to ``OUT/attack.jsonl``. Only point it at a coordinator you operate.
"""

from __future__ import annotations

import inspect
import logging
import os
import typing
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from ftis.client.cli import start
from ftis.client.learner.config import LossConfig
from ftis.lab.attack import KINDS
from ftis.protocol.exit_codes import ExitCode

console = Console(stderr=True)


def _attack(
    kind: Annotated[str, typer.Option(help="attack kind: " + ", ".join(KINDS))],
    attack_log: Annotated[Path | None, typer.Option(
        help="JSONL log of what was sent and the codes received (default OUT/attack.jsonl)")
    ] = None,
    inflate_factor: Annotated[float, typer.Option(
        help="logprob_inflate: sampler log-probs are multiplied by this")] = 0.05,
    deflate_nats: Annotated[float, typer.Option(
        help="logprob_deflate: nats subtracted from every sampler log-prob")] = 5.0,
    fake_question: Annotated[str, typer.Option(
        help="fabricated_prompt: the made-up question")] =
        "How many times does the letter z appear in 'pizzazz'?",
    flood_seconds: Annotated[float, typer.Option(
        help="flooder: seconds of flooding per round")] = 3.0,
    flood_lease_count: Annotated[int, typer.Option(
        help="flooder: tasks asked for per lease request")] = 16,
    oversized_bytes: Annotated[int, typer.Option(
        help="flooder: payload size of the oversized envelope")] = 4 * 1024 * 1024 + 65536,
    sybils: Annotated[int, typer.Option(help="sybil_burst: identities per burst (round)")] = 60,
    false_log_ratio: Annotated[float, typer.Option(
        help="false_reporter: mean log-ratio claimed about every sender")] = 25.0,
    replay_foreign: Annotated[int, typer.Option(
        help="replay: a victim's relayed envelopes resubmitted as-is per round")] = 8,
    frame_per_round: Annotated[int, typer.Option(
        help="replay_frame: a victim's envelopes resubmitted as-is per round")] = 40,
    shade_truncation: Annotated[float, typer.Option(
        help="logprob_shade: log-probs lowered by ln C with this C (> 1; the learner's "
             "truncation default)")] = LossConfig.model_fields["truncation"].default,
    sybil_ring: Annotated[int, typer.Option(
        help="sybil_feedback: fresh identities sending negative feedback")] = 2,
    wait_for: Annotated[Path | None, typer.Option(
        help="register, then wait until this file exists before the first round")] = None,
    **start_flags: Any,
) -> None:
    """Run a misbehaving volunteer (same flags as `start`) against YOUR coordinator."""
    verbose = bool(start_flags.pop("verbose", False))
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from pydantic import ValidationError

    from ftis.client.node.config import ClientConfig
    from ftis.lab.attack.nodes import AttackOptions
    from ftis.lab.attack.runner import run_attack

    if kind not in KINDS:
        console.print(f"[red]unknown kind {kind!r}[/red]; one of {', '.join(KINDS)}")
        raise typer.Exit(ExitCode.USAGE)
    flags = {k: v for k, v in start_flags.items() if v is not None}
    try:
        cfg = ClientConfig(**flags)
    except ValidationError as exc:
        console.print(f"[red]invalid configuration:[/red] {exc}")
        raise typer.Exit(ExitCode.USAGE) from exc
    options = AttackOptions(inflate_factor=inflate_factor, deflate_nats=deflate_nats,
                            fake_question=fake_question, flood_seconds=flood_seconds,
                            flood_lease_count=flood_lease_count, oversized_bytes=oversized_bytes,
                            sybils=sybils, false_log_ratio=false_log_ratio, seed=cfg.seed,
                            wait_for=str(wait_for or ""), replay_foreign=replay_foreign,
                            frame_per_round=frame_per_round,
                            shade_truncation=shade_truncation, sybil_ring=sybil_ring)
    console.print(f"attacker {kind} against {cfg.coordinator}")
    raise typer.Exit(run_attack(cfg, kind, options, attack_log))


def _build_signature() -> tuple[inspect.Signature, dict[str, Any]]:
    own = inspect.signature(_attack, eval_str=True)
    own_hints = typing.get_type_hints(_attack, include_extras=True)
    start_sig = inspect.signature(start.start, eval_str=True)
    params = [p for p in own.parameters.values() if p.kind is not p.VAR_KEYWORD]
    names = {p.name for p in params}
    for p in start_sig.parameters.values():
        if p.name not in names:
            params.append(p.replace(kind=inspect.Parameter.KEYWORD_ONLY))
    params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in params]
    hints = {k: v for k, v in own_hints.items() if k != "start_flags"}
    hints.update({p.name: p.annotation for p in start_sig.parameters.values()})
    return inspect.Signature(params, return_annotation=None), hints


def attack(**kwargs: Any) -> None:
    """Run a misbehaving volunteer (same flags as `start`) against YOUR coordinator."""
    _attack(**kwargs)


attack.__signature__, attack.__annotations__ = _build_signature()  # type: ignore[attr-defined]


def security_experiment(
    out: Annotated[Path, typer.Option(help="output folder (runs are replaced)")] = Path(
        "runs/security"),
    rounds: Annotated[int, typer.Option(help="honest rounds per run")] = 8,
    kinds: Annotated[str, typer.Option(
        help="comma-separated attack kinds, one swarm each; 'all' = every kind; "
             "KIND+KIND puts several attackers in one swarm")] = "all",
    model: Annotated[str | None, typer.Option(
        help="client model (default: a tiny random model built under OUT)")] = None,
    config: Annotated[Path | None, typer.Option(
        help="coordinator --config JSON (default: letter_counting, task_seed 1)")] = None,
    local_groups: Annotated[int, typer.Option(help="I")] = 3,
    external_groups: Annotated[int, typer.Option(help="J")] = 3,
    group_size: Annotated[int, typer.Option(help="G")] = 8,
    max_new_tokens: Annotated[int, typer.Option()] = 12,
    learning_rate: Annotated[float, typer.Option()] = 1e-3,
    baseline: Annotated[bool, typer.Option(help="also run an attack-free swarm")] = True,
    threads: Annotated[int, typer.Option(help="torch threads per client")] = 1,
    reanalyze: Annotated[bool, typer.Option(
        help="run nothing: rebuild the table and plot from the runs already in OUT")] = False,
    audit_reporters: Annotated[int, typer.Option(
        min=0, help="audit-based probation with k reporters, the honest nodes as seeds "
                    "(0: the config's own setting)")] = 0,
) -> None:
    """Attack a local swarm kind by kind; write results.jsonl, results.md and rewards.png."""
    from ftis.lab.attack import ATTACK_KINDS
    from ftis.lab.experiment import security

    names = list(ATTACK_KINDS) if kinds.strip() == "all" else [
        k.strip() for k in kinds.split(",") if k.strip()]
    groups = [g.split("+") for g in names]
    unknown = sorted({k for g in groups for k in g} - set(ATTACK_KINDS))
    if unknown:
        console.print(f"[red]unknown kinds {unknown}[/red]; one of {', '.join(ATTACK_KINDS)}")
        raise typer.Exit(ExitCode.USAGE)
    settings = security.SecuritySettings(out=out, groups=groups, rounds=rounds, model=model,
                                config=config, local_groups=local_groups,
                                external_groups=external_groups, group_size=group_size,
                                max_new_tokens=max_new_tokens, learning_rate=learning_rate,
                                threads=threads, baseline=baseline,
                                audit_reporters=audit_reporters)
    records = (security.reanalyze(settings) if reanalyze
               else security.run_security_experiment(settings, console=console))
    console.print((out / "results.md").read_text())
    fp = sum(r["false_positives"] for r in records)
    if fp:
        console.print(f"[red]{fp} honest node(s) quarantined or banned[/red]")
        raise typer.Exit(ExitCode.CLIENT_FALSE_POSITIVE)
