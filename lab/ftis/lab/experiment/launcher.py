"""Start a coordinator and volunteer clients as separate processes on loopback.

Used by ``ftis-lab demo`` and the integration tests. Each process writes its log to
``OUT/logs/NAME.log``; the coordinator binds port 0 and reports its ports through a
ready file, so several swarms can run side by side.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path


class LaunchError(RuntimeError):
    """A swarm process failed to start or exited with an error."""


@dataclass
class ClientSpec:
    """One client process: a name (folder under OUT) and its ``ftis-client start`` flags."""

    name: str
    args: list[str] = field(default_factory=list)


@dataclass
class Swarm:
    """Handles to a running coordinator and its clients."""

    out: Path
    coordinator: subprocess.Popen
    listen: str
    admin: str
    clients: dict[str, subprocess.Popen] = field(default_factory=dict)

    def wait_clients(self, timeout_s: float | None = None) -> dict[str, int]:
        """Wait for every client to exit; returns exit codes by name."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        codes = {}
        for name, proc in self.clients.items():
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0.1)
            try:
                codes[name] = proc.wait(remaining)
            except subprocess.TimeoutExpired as exc:
                raise LaunchError(f"client {name} still running after {timeout_s}s") from exc
        return codes

    def stop(self) -> None:
        """Terminate every process that is still running (clients first)."""
        for proc in [*self.clients.values(), self.coordinator]:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in [*self.clients.values(), self.coordinator]:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _env(threads: int | None) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONUNBUFFERED"] = "1"
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def start_coordinator(out: Path, extra_args: list[str] | None = None,
                      timeout_s: float = 60.0) -> tuple[subprocess.Popen, str, str]:
    """Start ``ftis-coordinator serve`` on free loopback ports; returns (proc, listen, admin)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    ready = out / "coordinator.ready.json"
    ready.unlink(missing_ok=True)
    extra = list(extra_args or [])
    if not any(a.startswith("--http-listen") for a in extra):
        # the status page on a free port (its address is in the ready file), so that
        # several swarms run side by side without fighting over the default port
        extra += ["--http-listen", "127.0.0.1:0"]
    cmd = [sys.executable, "-m", "ftis.coordinator.cli.main", "serve",
           "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0",
           "--db", str(out / "coordinator.db"), "--ready-file", str(ready), *extra]
    log = open(out / "logs" / "coordinator.log", "ab")  # noqa: SIM115 - owned by the process
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(None))
    deadline = time.monotonic() + timeout_s
    while not ready.exists():
        if proc.poll() is not None:
            raise LaunchError(f"coordinator exited with {proc.returncode}; see {log.name}")
        if time.monotonic() > deadline:
            proc.kill()
            raise LaunchError(f"coordinator not ready after {timeout_s}s; see {log.name}")
        time.sleep(0.1)
    info = json.loads(ready.read_text())
    return proc, info["listen"], info["admin"]


#: The CLI module of each program a swarm node runs: honest volunteers are the
#: volunteers' own ``ftis-client``; attackers are ``ftis-lab attack``.
CLIENT_CLI, LAB_CLI = "ftis.client.cli.main", "ftis.lab.cli.main"


def _start_node(swarm: Swarm, spec: ClientSpec, cli: str, command: list[str],
                threads: int | None) -> subprocess.Popen:
    """Start ``python -m CLI COMMAND...`` (``cli``: :data:`CLIENT_CLI` or :data:`LAB_CLI`)
    for ``spec``: ``OUT/NAME/`` holds its key and outputs, ``OUT/logs/NAME.log`` its log."""
    out = swarm.out / spec.name
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", cli, *command,
           "--coordinator", swarm.listen, "--out", str(out),
           "--key-file", str(out / "node_key.pem"), *spec.args]
    if threads:
        cmd += ["--threads", str(threads)]
    log = open(swarm.out / "logs" / f"{spec.name}.log", "ab")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_env(threads))
    swarm.clients[spec.name] = proc
    return proc


def start_client(swarm: Swarm, spec: ClientSpec, threads: int | None = 1) -> subprocess.Popen:
    """Start ``ftis-client start`` for ``spec`` against ``swarm``'s coordinator."""
    return _start_node(swarm, spec, CLIENT_CLI, ["start"], threads)


def launch(out: Path, clients: list[ClientSpec], threads_per_client: int | None = 1,
           coordinator_args: list[str] | None = None) -> Swarm:
    """Start a coordinator and all ``clients``; the caller must call :meth:`Swarm.stop`."""
    proc, listen, admin = start_coordinator(out, coordinator_args)
    swarm = Swarm(out=out, coordinator=proc, listen=listen, admin=admin)
    try:
        for spec in clients:
            start_client(swarm, spec, threads_per_client)
    except Exception:
        swarm.stop()
        raise
    return swarm


def start_attacker(swarm: Swarm, spec: ClientSpec, kind: str,
                   threads: int | None = 1) -> subprocess.Popen:
    """Start ``ftis-lab attack --kind KIND`` for ``spec`` against ``swarm``'s coordinator.

    Same layout as :func:`start_client`: ``OUT/NAME/`` (key, metrics, ``attack.jsonl``)
    and ``OUT/logs/NAME.log``; ``spec.args`` takes ``start`` flags and attack options.
    """
    return _start_node(swarm, spec, LAB_CLI, ["attack", "--kind", kind], threads)
