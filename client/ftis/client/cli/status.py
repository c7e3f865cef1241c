"""``ftis-client status``: this machine's node, from its local state and a signed Heartbeat.

Local: the node id (key file), ``OUT/metrics.jsonl`` (rounds done, last reward, model),
``OUT/checkpoints/latest`` and ``OUT/node_state.json`` (written by a running
``start``: running or paused, and why; the settings it runs under). Remote: a signed
Heartbeat gives the node's reputation and quarantine state. When the coordinator
cannot be reached the local part is still shown, and the exit status says so.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from ftis.protocol.exit_codes import ExitCode

console = Console()


def last_record(path: Path, chunk: int = 1 << 16) -> dict[str, Any] | None:
    """The last complete JSON line of ``path`` (read from the end); ``None`` if none."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, 2)
            size = fh.tell()
            fh.seek(max(size - chunk, 0))
            lines = fh.read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            return json.loads(line)
        except ValueError:
            continue  # a line being written, or cut by the chunk boundary
    return None


def local_status(out: Path, key_file: Path) -> dict[str, Any]:
    """What the files of a node say (nothing is created or contacted)."""
    from ftis.client.settings.gate import read_node_state

    info: dict[str, Any] = {"out": str(out), "key_file": str(key_file), "node_id": None}
    if key_file.exists():
        from ftis.protocol.identity import NodeIdentity

        info["node_id"] = NodeIdentity.load_or_create(key_file).node_id
    record = last_record(out / "metrics.jsonl") or {}
    info["rounds_done"] = int(record.get("round", 0))
    info["last_reward"] = record.get("reward_mean")
    info["last_round_at"] = record.get("time")
    info["model"] = record.get("model")
    latest = out / "checkpoints" / "latest"
    info["checkpoint"] = latest.read_text().strip() if latest.exists() else None
    info["node"] = read_node_state(out)
    if info["node"] and not info["model"]:
        info["model"] = info["node"].get("model")
    info["device"] = (info["node"] or {}).get("device")  # where the model runs (cuda, cpu)
    return info


def settings_status(node: dict[str, Any] | None) -> dict[str, Any]:
    """The settings in force and the pause state: the running node's (which include its
    flags) if it runs, else what a node started now would do."""
    from ftis.client.settings import probes
    from ftis.client.settings.model import resolve_settings
    from ftis.client.settings.schedule import decide

    if node and node.get("alive") and node.get("state") != "stopped":
        return {"running": True, "state": node.get("state"), "reason": node.get("reason"),
                "notes": node.get("notes", []), "settings": node.get("settings", {}),
                "sources": node.get("sources", {})}
    resolved = resolve_settings()
    decision = decide(resolved.settings, probes.snapshot(resolved.settings.idle_minutes > 0))
    return {"running": False, "state": "not running", "reason": decision.reason,
            "notes": list(decision.notes),
            "settings": {k: v for k, v, _ in resolved.rows()}, "sources": resolved.sources}


def heartbeat(coordinator: str, key_file: Path, policy_version: int,
              timeout_s: float) -> dict[str, Any]:
    """A signed Heartbeat; ``{"reachable", "reputation", "quarantined", "error"}``."""
    import grpc

    from ftis.client.swarm.connection import SwarmConnection
    from ftis.protocol.errors import FtisError
    from ftis.protocol.identity import NodeIdentity
    from ftis.v1 import bundle_pb2

    conn = SwarmConnection(coordinator, NodeIdentity.load_or_create(key_file),
                           bundle_pb2.ModelCard(), timeout_s=timeout_s, retries=1)
    try:
        reply = conn.heartbeat(policy_version)
    except grpc.RpcError as exc:
        return {"reachable": False, "error": f"unreachable ({exc.code().name})"}
    except FtisError as exc:
        return {"reachable": True, "error": str(exc)}
    finally:
        conn.close()
    return {"reachable": True, "reputation": reply.reputation,
            "quarantined": reply.quarantined, "error": None}


def _fmt(value: Any) -> str:
    from ftis.client.settings.model import format_value

    if isinstance(value, float):
        return f"{value:.3f}"
    return "none" if value is None else format_value(value)


def status(
    coordinator: Annotated[str | None, typer.Option(
        help="HOST:PORT (default: the running node's, else start's default)")] = None,
    out: Annotated[Path | None, typer.Option(help="the node's output folder (start --out)")
                   ] = None,
    key_file: Annotated[Path | None, typer.Option(help="the node's key (start --key-file)")
                        ] = None,
    timeout: Annotated[float, typer.Option(help="seconds to wait for the coordinator")] = 5.0,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """Node id, coordinator, reputation, quarantine, rounds, last reward, model, settings
    in force and why the node is paused."""
    import time

    from ftis.client.node.config import ClientConfig
    from ftis.client.settings.model import SettingsError

    given: dict[str, Any] = {k: v for k, v in (("out", out), ("key_file", key_file))
                             if v is not None}
    cfg = ClientConfig(**given)
    info = local_status(Path(cfg.out), Path(cfg.key_file))
    node = info["node"] or {}
    info["coordinator"] = coordinator or node.get("coordinator") or cfg.coordinator
    try:
        info.update(settings_status(info["node"]))
    except SettingsError as exc:  # a bad settings file: say so, show the rest
        info.update(running=False, state="not running", reason="", settings={}, sources={},
                    notes=[f"settings cannot be read: {exc}"])
    code = ExitCode.OK
    if info["node_id"] is None:
        info["swarm"] = {"reachable": None, "error": "no node key yet (run ftis-client start)"}
    else:
        info["swarm"] = heartbeat(info["coordinator"], Path(cfg.key_file),
                                  info["rounds_done"], timeout)
        if info["swarm"]["reachable"] is False:
            code = ExitCode.CLIENT_COORDINATOR_UNREACHABLE
        elif info["swarm"]["error"]:
            code = ExitCode.CLIENT_REJECTED
    if as_json:
        print(json.dumps(info, indent=1, default=str))
        raise typer.Exit(code)
    swarm = info["swarm"]
    table = Table(show_header=False, box=None)
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    table.add_row("node", info["node_id"] or "none yet")
    table.add_row("coordinator", f"{info['coordinator']}"
                  + (f"  [red]{swarm['error']}[/red]" if swarm.get("error") else ""))
    if swarm.get("error") is None and info["node_id"]:
        table.add_row("reputation", f"{swarm['reputation']:.3f}")
        table.add_row("quarantined", "[red]yes[/red]" if swarm["quarantined"] else "no")
    table.add_row("rounds done", str(info["rounds_done"]))
    table.add_row("last reward", _fmt(info["last_reward"]))
    if info["last_round_at"]:
        ago = time.time() - float(info["last_round_at"])
        table.add_row("last round", f"{ago / 60:.0f} min ago")
    table.add_row("model", _fmt(info["model"]))
    table.add_row("device", _fmt(info["device"]))
    table.add_row("checkpoint", _fmt(info["checkpoint"]))
    table.add_row("out", info["out"])
    state, reason = info["state"], info["reason"]
    if state == "paused":
        state = f"[yellow]paused: {reason}[/yellow]"
    elif state == "not running" and reason:
        state = f"not running (a node started now would pause: {reason})"
    table.add_row("state", state)
    for note in info["notes"]:
        table.add_row("note", note)
    settings = ", ".join(f"{k}={_fmt(v)}" + ("" if info["sources"].get(k) == "default"
                                               else f" ({info['sources'].get(k)})")
                         for k, v in info["settings"].items())
    table.add_row("settings", settings)
    console.print(table)
    raise typer.Exit(code)
