"""Several coordinator worker processes serving one database on one port.

``ftis-coordinator serve --workers N`` (N > 1) runs this supervisor: it opens the
database once (so schema migrations run exactly once), reserves the two ports, starts N
``serve`` child processes that bind the same ports with ``SO_REUSEPORT`` (the Linux
kernel spreads incoming connections across them; a client's connection stays with one
worker), writes the ready file once every child is ready, forwards SIGINT/SIGTERM, and
stops all of them if any one exits.

Everything that must hold across workers lives in the database: leases and the task
draw counter (:meth:`State.lease_block`), bundle quotas (counted from verdict rows),
reputation (rows locked while updated). Per-process: pull, registration and tokenizer
upload rate limiters, tokenizer caches, last-seen buffers; docs/coordinator.md says
what that means for the limits.

``SO_REUSEPORT`` is Linux (3.9+) and BSD/macOS behaviour; on other systems use one
worker per port behind a TCP load balancer.

Metrics: the children run prometheus-client's multiprocess mode
(``PROMETHEUS_MULTIPROC_DIR`` set by the supervisor to a folder of its temporary
directory; each child marks itself dead when it stops, and the supervisor does too when
it sees one exit). The children bind no HTTP listener (``--http-listen none``): the
supervisor serves ``/metrics`` (the sum over the children's files plus the database
gauges) and the status page (database reads only) on ``http_listen``, so one scrape
target gives the whole coordinator and no scrape lands on a single worker.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ftis.coordinator.config import CoordinatorConfig, parse_host_port

if TYPE_CHECKING:
    from ftis.coordinator.observe.http import StatusHttpServer
    from ftis.coordinator.state.sql import SqlState

log = logging.getLogger(__name__)

#: Seconds a child may take to bind its ports and write its ready file.
CHILD_START_S = 120.0


class WorkerError(RuntimeError):
    """A worker process failed to start or exited."""


def reserve_port(address: str) -> tuple[socket.socket, str]:
    """Bind (not listen) a ``SO_REUSEPORT`` socket on ``address`` (port 0 = any free
    port) so that the workers can all bind the same port; returns the socket (close it
    once the workers listen) and ``host:port``.

    Raises:
        WorkerError: the address cannot be bound or SO_REUSEPORT is unavailable.
    """
    host, port = parse_host_port(address)
    if not hasattr(socket, "SO_REUSEPORT"):
        raise WorkerError("--workers needs SO_REUSEPORT (Linux, BSD, macOS)")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise WorkerError(f"cannot bind {address}: {exc}") from None
    bound = sock.getsockname()[1]
    shown = f"[{host}]" if family == socket.AF_INET6 else host
    return sock, f"{shown}:{bound}"


def _start_http(config: CoordinatorConfig, address: str, optional: bool,
                metrics_dir: Path) -> tuple[StatusHttpServer, SqlState] | None:
    """The supervisor's HTTP listener over the children's metrics files; returns
    ``(server, state)`` or ``None`` (off, or an optional address that is taken).

    Raises:
        WorkerError: an explicit address cannot be bound.
    """
    from ftis.coordinator.handlers.context import wall_clock_ms
    from ftis.coordinator.observe import metrics
    from ftis.coordinator.observe.http import HttpBindError, StatusHttpServer
    from ftis.coordinator.state.sql import SqlState

    state = SqlState(config.db_url)
    registry = metrics.exposition_registry(state, wall_clock_ms,
                                           multiprocess_dir=str(metrics_dir))
    server = StatusHttpServer(address, state, wall_clock_ms, config.reputation, registry)
    try:
        server.start()
    except HttpBindError as exc:
        state.close()
        if not optional:
            raise WorkerError(str(exc)) from None
        log.warning("%s; serving without the status page and /metrics", exc)
        return None
    return server, state


def _mark_dead(pid: int, metrics_dir: Path) -> None:
    """prometheus-client's ``mark_process_dead`` for an exited child (its live gauges
    go; its counters and histograms stay in the sum)."""
    from prometheus_client import multiprocess

    try:
        multiprocess.mark_process_dead(pid, str(metrics_dir))
    except OSError:
        log.exception("marking worker %d dead for metrics failed", pid)


def run_workers(config: CoordinatorConfig, workers: int, *, log_level: str = "INFO",
                ready_file: Path | None = None, stop: threading.Event | None = None,
                http_listen: str | None = None, http_optional: bool = False) -> int:
    """Run ``workers`` child ``serve`` processes until ``stop`` is set (or a child
    exits); returns the first non-zero child exit code (0 when stopped cleanly). With
    ``http_listen`` the supervisor serves ``/metrics`` (summed over the children) and
    the status page there.

    Raises:
        WorkerError: a port cannot be reserved or a child does not become ready.
    """
    from ftis.coordinator.observe.metrics import MULTIPROC_ENV

    stop = stop or threading.Event()
    swarm_sock, listen = reserve_port(config.listen)
    admin_sock, admin = reserve_port(config.admin_listen)
    tmp = Path(tempfile.mkdtemp(prefix="ftis-workers-"))
    metrics_dir = tmp / "metrics"
    metrics_dir.mkdir()
    http = None
    cfg_file = tmp / "config.json"
    values = config.model_dump(mode="json")
    values.update(listen=listen, admin_listen=admin)
    cfg_file.write_text(json.dumps(values))
    children: list[subprocess.Popen] = []
    try:
        if http_listen:
            http = _start_http(config, http_listen, http_optional, metrics_dir)
        for k in range(workers):
            cmd = [sys.executable, "-m", "ftis.coordinator.cli.main", "serve",
                   "--config", str(cfg_file), "--reuse-port", "--log-level", log_level,
                   "--ready-file", str(tmp / f"worker-{k}.json"), "--http-listen", "none"]
            children.append(subprocess.Popen(cmd, env={
                **os.environ, "FTIS_WORKER": str(k), MULTIPROC_ENV: str(metrics_dir)}))
        deadline = time.monotonic() + CHILD_START_S
        for k, child in enumerate(children):
            while not (tmp / f"worker-{k}.json").exists():
                if child.poll() is not None:
                    raise WorkerError(f"worker {k} exited with {child.returncode} at start")
                if time.monotonic() > deadline:
                    raise WorkerError(f"worker {k} not ready after {CHILD_START_S:.0f} s")
                time.sleep(0.05)
        swarm_sock.close()
        admin_sock.close()
        if ready_file is not None:
            from ftis.coordinator.cli.main import write_ready_file

            write_ready_file(ready_file, listen, admin,
                             http[0].address if http is not None else None)
        log.info("%d workers serving %s (admin %s)", workers, listen, admin)
        while not stop.wait(0.2):
            for k, child in enumerate(children):
                if child.poll() is not None:
                    log.error("worker %d exited with %d; stopping the others", k,
                              child.returncode)
                    return child.returncode or 1
        return 0
    finally:
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        for child in children:
            try:
                child.wait(15)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        for child in children:
            _mark_dead(child.pid, metrics_dir)
        if http is not None:
            http[0].stop()
            http[1].close()
        swarm_sock.close()
        admin_sock.close()
        shutil.rmtree(tmp, ignore_errors=True)
