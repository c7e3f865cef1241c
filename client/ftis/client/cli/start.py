"""``ftis-client start``: the volunteer's long-running client."""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ftis.client.cli.config_flags import with_config_flags
from ftis.client.settings.options import with_setting_flags
from ftis.protocol.exit_codes import ExitCode

if TYPE_CHECKING:  # imported lazily, where used
    from collections.abc import Callable

    from ftis.client.node.config import ClientConfig
    from ftis.client.node.memory import RoundMemoryGuard
    from ftis.client.node.runner import RoundResult
    from ftis.client.settings.schedule import Decision

console = Console(stderr=True)


@with_setting_flags
@with_config_flags
def start(
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
    config_flags: dict[str, Any] | None = None,
    setting_flags: dict[str, Any] | None = None,
) -> None:
    """Join a swarm: lease tasks, generate, submit signed bundles, learn with F-TIS.

    Every flag also reads FTIS_CLIENT_<FLAG> from the environment (a flag wins); the
    defaults are those of the client's settings models.

    The volunteer settings (idle, battery, CPU, memory, GPU, upload rate, time windows,
    finish-then-pause) pause and resume the node between rounds; see
    docs/volunteer-settings.md.
    """
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from pydantic import ValidationError

    from ftis.client.node.config import ClientConfig
    from ftis.client.settings.model import SettingsError, resolve_settings

    flags = {k: v for k, v in (config_flags or {}).items() if v is not None}
    try:
        resolved = resolve_settings(setting_flags)
    except SettingsError as exc:
        console.print(f"[red]invalid setting:[/red] {exc}", soft_wrap=True)
        raise typer.Exit(ExitCode.USAGE) from exc
    for key in ("max_memory", "threads"):  # the settings that ClientConfig also carries
        if getattr(resolved.settings, key) is not None:
            flags[key] = getattr(resolved.settings, key)
    try:
        cfg = ClientConfig(**flags)
    except ValidationError as exc:
        console.print(f"[red]invalid configuration:[/red] {exc}")
        raise typer.Exit(ExitCode.USAGE) from exc
    if cfg.max_memory is not None:
        code = check_memory(cfg)
        if code != ExitCode.OK:
            raise typer.Exit(code)
    raise typer.Exit(run(cfg, setting_flags))


def check_memory(cfg: ClientConfig) -> int:
    """Estimate the peak memory of ``cfg`` before loading anything (``--max-memory``).

    Returns ``CLIENT_MEMORY_BUDGET`` (message printed) when the estimate exceeds the budget,
    otherwise ``OK``; a model that cannot be resolved is left to :func:`run` to report.
    """
    from ftis.client.models.registry import ModelNotFoundError
    from ftis.client.node.memory import (
        MemoryBudgetError,
        check_memory_budget,
        estimate_for_config,
        format_size,
    )

    try:
        estimate = estimate_for_config(cfg)
    except ModelNotFoundError:
        return ExitCode.OK
    try:
        check_memory_budget(estimate, cfg.max_memory_bytes)
    except MemoryBudgetError as exc:
        console.print(f"[red]memory budget exceeded:[/red] {exc}", soft_wrap=True)
        return ExitCode.CLIENT_MEMORY_BUDGET
    console.print(f"estimated peak memory {format_size(estimate.total)} "
                  f"({estimate.phase}) fits --max-memory {cfg.max_memory}")
    return ExitCode.OK


def device_need(cfg: ClientConfig) -> int | None:
    """Estimated bytes a round of ``cfg`` needs on a GPU
    (:func:`~ftis.client.node.memory.device_round_peak`), for ``--device auto``'s choice;
    ``None`` when the device is given, no GPU is visible, or the model's config cannot
    be read."""
    import torch

    from ftis.client.models.registry import ModelNotFoundError
    from ftis.client.node.memory import device_round_peak, estimate_for_config

    if cfg.device != "auto" or not torch.cuda.is_available():
        return None
    try:
        return device_round_peak(estimate_for_config(cfg))
    except (ModelNotFoundError, OSError, ValueError):
        return None


def round_memory_guard(cfg: ClientConfig, on_wait: Callable[..., Any] | None = None,
                       device: str = "cpu") -> RoundMemoryGuard | None:
    """A :class:`~ftis.client.node.memory.RoundMemoryGuard` for ``cfg``'s round shape
    (the larger of its generation and learning peaks, ``--max-memory`` as the cap), or
    ``None`` (logged) when the model's config cannot be read for an estimate, or when
    the model runs on a GPU (``device`` not ``"cpu"``): the estimate is of the host
    memory a CPU round holds, while on a GPU the weights, activations and optimizer
    state live in its memory, and torch raises ``OutOfMemoryError`` there."""
    from ftis.client.models.registry import ModelNotFoundError
    from ftis.client.node.memory import RoundMemoryGuard, estimate_for_config, round_peak

    if device != "cpu":
        logging.getLogger(__name__).info("the model runs on %s: rounds start without the "
                                         "host-memory check", device)
        return None
    try:
        needed, phase = round_peak(estimate_for_config(cfg))
    except (ModelNotFoundError, OSError, ValueError) as exc:
        logging.getLogger(__name__).warning("no memory estimate of a round (%s); rounds "
                                            "start without a memory check", exc)
        return None
    return RoundMemoryGuard(needed, phase, cfg.max_memory_bytes, on_wait=on_wait)


def sigterm_as_interrupt() -> Callable[[], None]:
    """From now on SIGTERM ends the node as Ctrl-C does (KeyboardInterrupt: the round in
    progress is dropped, the last checkpoint kept, the state file says "stopped", exit
    status 130); returns the function that puts the previous handler back.

    Service managers stop a node with SIGTERM (``systemctl --user stop``, ``launchctl
    bootout``), and Python's default for it ends the process at once, without any of
    that. Only the main thread can set a handler: elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)

    def restore() -> None:
        signal.signal(signal.SIGTERM, previous)

    return restore


def run(cfg: ClientConfig, setting_flags: dict[str, Any] | None = None) -> int:
    """Start a node from ``cfg`` (a ClientConfig) under the volunteer settings resolved
    from ``setting_flags`` (re-read between rounds); returns an exit code."""
    import grpc

    from ftis.client.models.loader import load_policy
    from ftis.client.models.registry import ModelNotFoundError
    from ftis.client.node.memory import RoundMemoryError
    from ftis.client.node.runner import VolunteerNode
    from ftis.client.node.runtime import (
        DeviceUnavailableError,
        configure_runtime,
        resolve_device,
        seconds_since_process_start,
    )
    from ftis.client.settings.gate import RoundGate, apply_settings, node_state
    from ftis.client.settings.model import resolve_settings
    from ftis.client.swarm.connection import RetryPolicy, SwarmConnection
    from ftis.protocol.errors import FtisError
    from ftis.protocol.identity import NodeIdentity

    configure_runtime(cfg, use_gpu=resolve_settings(setting_flags).settings.use_gpu)
    try:
        device, note = resolve_device(cfg.device, device_need(cfg))
    except DeviceUnavailableError as exc:
        console.print(f"[red]device unavailable:[/red] {exc}", soft_wrap=True)
        return ExitCode.CLIENT_DEVICE_UNAVAILABLE
    if note:
        console.print(f"[yellow]{note}[/yellow]", soft_wrap=True)
    identity = NodeIdentity.load_or_create(cfg.key_file)
    console.print(f"node [bold]{identity.node_id}[/bold] (key {cfg.key_file})")
    try:
        with console.status(f"loading {cfg.model} ({cfg.peft}) on {device}"):
            policy = load_policy(cfg.model, peft=cfg.peft, lora=cfg.lora_settings,
                                 double_quant=cfg.qlora_double_quant, device=device)
    except ModelNotFoundError as exc:
        console.print(f"[red]model not found:[/red] {exc}")
        return ExitCode.CLIENT_MODEL_NOT_FOUND
    startup_seconds = seconds_since_process_start()  # cold start includes GGUF conversion
    card = policy.card
    console.print(f"model {card.base_model}: {card.parameter_count:,} parameters, "
                  f"{card.trainable_parameter_count:,} trainable ({card.peft}), "
                  f"tokenizer {card.tokenizer_fingerprint[:12]}, on {device}")
    conn = SwarmConnection(cfg.coordinator, identity, card,
                           display_name=cfg.display_name or f"{cfg.model}/{cfg.peft}",
                           tokenizer_json=policy.tokenizer_json,
                           retry=RetryPolicy(max_outage_s=cfg.max_outage or None))
    restore_sigterm = sigterm_as_interrupt()
    try:
        conn.register()
        node = VolunteerNode(cfg, policy, conn)
        node.startup_seconds = startup_seconds
        if node.resume():
            console.print(f"resumed from round {node.round}")
        total = cfg.rounds or None
        node_info = {"node_id": identity.node_id, "coordinator": cfg.coordinator,
                     "model": cfg.model, "peft": cfg.peft, "device": device}
        with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), TextColumn("{task.fields[info]}"),
                      console=console, transient=False) as progress:
            task = progress.add_task(f"{cfg.model}/{cfg.peft} {cfg.method}", total=total,
                                     completed=node.round, info="")

            def on_round(result: RoundResult) -> None:
                m = result.metrics
                info = (f"reward {m['reward_mean']:.3f}  {m['tokens_per_second']:.0f} tok/s  "
                        f"ext {int(m['external_groups_used'])}  "
                        f"w̄ {m.get('is_weight_mean', 1.0):.3f}  "
                        f"filtered {m.get('filtered_frac', 0.0):.2f}")
                progress.update(task, completed=result.round, info=info)
                if not console.is_terminal:
                    console.print(f"round {result.round}: {info}")

            def on_pause(decision: Decision) -> None:
                state = "running" if decision.may_run else "paused"
                info = "resuming" if decision.may_run else f"[yellow]paused: {decision.reason}"
                progress.update(task, info=info)
                if not console.is_terminal:
                    console.print(f"{state}: {decision.reason or 'resuming'}")
                write_state(state, decision)

            def write_state(state: str, decision: Decision | None = None) -> None:
                node_state(cfg.out, gate, state, decision, round=node.round, **node_info)

            gate = RoundGate(lambda: resolve_settings(setting_flags), on_change=on_pause,
                             on_settings=lambda r: apply_settings(conn, r.settings))

            def on_memory_wait(decision) -> None:  # noqa: ANN001 - RoundMemoryDecision
                from ftis.client.settings.schedule import Decision

                if decision is None:
                    on_pause(Decision(may_run=True))
                else:
                    on_pause(Decision(may_run=False, reasons=(decision.reason,)))

            guard = round_memory_guard(cfg, on_memory_wait, device)
            if guard is not None:  # a long wait for memory re-checks the pause settings
                guard.recheck = gate

            def before_round() -> None:
                decision = gate()
                write_state("running", decision)
                if guard is not None:
                    guard()  # waits (holding no lease) or raises RoundMemoryError

            try:
                node.run(on_round, before_round=before_round)
            finally:
                write_state("stopped")
    except grpc.RpcError as exc:
        console.print(f"[red]coordinator {cfg.coordinator} unreachable:[/red] {exc.code().name}")
        return ExitCode.CLIENT_COORDINATOR_UNREACHABLE
    except FtisError as exc:
        console.print(f"[red]rejected by the coordinator:[/red] {exc}")
        return ExitCode.CLIENT_REJECTED
    except RoundMemoryError as exc:
        console.print(f"[red]not starting round {node.round + 1}:[/red] {exc}",
                      soft_wrap=True)
        return ExitCode.CLIENT_MEMORY_BUDGET
    except KeyboardInterrupt:
        console.print("interrupted; the last checkpoint is kept")
        return ExitCode.INTERRUPTED
    finally:
        restore_sigterm()
        conn.close()
    console.print(f"done: {node.round} rounds, metrics in {node.metrics_path}")
    return ExitCode.OK
