"""``ftis-coordinator`` command line.

``ftis-coordinator serve [--listen HOST:PORT] [--admin-listen HOST:PORT]
[--http-listen HOST:PORT|none] [--db PATH|URL] [--config FILE] [--ready-file PATH]
[--workers N] [--set FIELD=VALUE ...]``; ``--http-listen`` serves ``/metrics`` and the
status page (default :data:`DEFAULT_HTTP_LISTEN`; if that default address is taken the
coordinator serves without it, an explicit address must bind); ``--set`` overrides any
:class:`~ftis.coordinator.config.CoordinatorConfig` field (VALUE parsed as JSON when it
parses, e.g. ``--set bundles_per_minute=60 --set require_tokenizer=false
--set reputation.half_life_s=3600``); also runnable as
``python -m ftis.coordinator.cli.main serve ...``. Exit codes:
:class:`ftis.protocol.exit_codes.ExitCode` (docs/exit-codes.md).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Annotated, Any

import pydantic
import typer

from ftis.coordinator.config import ConfigError, load_config
from ftis.protocol.exit_codes import ExitCode, exit_code_name

app = typer.Typer(
    name="ftis-coordinator",
    help="FTIS coordinator: task leases, bundle verification and relay, admin service.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
log = logging.getLogger("ftis.coordinator")

#: Default address of the HTTP listener (``/metrics``, status page).
DEFAULT_HTTP_LISTEN = "127.0.0.1:7002"


@app.callback()
def _main() -> None:
    """FTIS coordinator."""


def write_ready_file(path: Path, listen: str, admin: str, http: str | None = None) -> None:
    """Atomically write ``{"listen": "host:port", "admin": "host:port", "pid": N}``, with
    ``"http": "host:port"`` when the HTTP listener is bound."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    info: dict[str, Any] = {"listen": listen, "admin": admin, "pid": os.getpid()}
    if http:
        info["http"] = http
    tmp.write_text(json.dumps(info))
    os.replace(tmp, path)


def http_address(value: str | None) -> tuple[str | None, bool]:
    """``--http-listen`` -> ``(address or None when off, optional)``: the default address
    (no flag) is optional, an explicit one must bind.

    Raises:
        ValueError: not ``HOST:PORT`` nor ``none``.
    """
    from ftis.coordinator.config import parse_host_port

    if value is None:
        return DEFAULT_HTTP_LISTEN, True
    if value.strip().lower() in ("none", "off", ""):
        return None, False
    parse_host_port(value.strip())
    return value.strip(), False


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``["a=1", "reputation.half_life_s=60"]`` -> ``{"a": 1, "reputation": {...}}``.

    Raises:
        ValueError: an item without ``=``.
    """
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ValueError(f"expected FIELD=VALUE, got {item!r}")
        try:
            value: Any = json.loads(text)
        except ValueError:
            value = text
        *parents, leaf = key.strip().split(".")
        target = out
        for part in parents:
            target = target.setdefault(part, {})
        target[leaf] = value
    return out


def _fail(code: int, message: str) -> typer.Exit:
    first = message.splitlines()[0] if message else exit_code_name(code)
    print(f"ftis-coordinator: {first}", file=sys.stderr)
    return typer.Exit(code)


@app.command()
def serve(
    listen: Annotated[
        str | None, typer.Option(help="HOST:PORT of the volunteer service (port 0 = any).")
    ] = None,
    admin_listen: Annotated[
        str | None, typer.Option(help="HOST:PORT of the admin service (keep on loopback).")
    ] = None,
    http_listen: Annotated[
        str | None,
        typer.Option(envvar="FTIS_COORDINATOR_HTTP_LISTEN",
                     help=f"HOST:PORT of /metrics and the status page (default "
                          f"{DEFAULT_HTTP_LISTEN}; 'none' turns it off).")
    ] = None,
    db: Annotated[
        str | None, typer.Option(help="SQLite file path or SQLAlchemy database URL.")
    ] = None,
    config: Annotated[
        Path | None, typer.Option(help="JSON or TOML settings file (flags override it).")
    ] = None,
    ready_file: Annotated[
        Path | None,
        typer.Option(help="Write {listen, admin, pid} as JSON here once both ports are bound."),
    ] = None,
    log_level: Annotated[str, typer.Option(help="Logging level.")] = "INFO",
    set_: Annotated[
        list[str] | None,
        typer.Option("--set", help="FIELD=VALUE override of any setting (repeatable)."),
    ] = None,
    workers: Annotated[
        int, typer.Option(min=1, help="Worker processes serving one database on one port "
                          "(SO_REUSEPORT); use PostgreSQL for more than one.")
    ] = 1,
    reuse_port: Annotated[
        bool, typer.Option(hidden=True, help="Bind with SO_REUSEPORT (set for workers).")
    ] = False,
) -> None:
    """Run the coordinator until SIGINT or SIGTERM."""
    logging.basicConfig(
        level=getattr(logging, log_level.upper(), logging.INFO),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        overrides = parse_overrides(set_ or [])
        overrides.update(
            {
                k: v
                for k, v in (("listen", listen), ("admin_listen", admin_listen), ("db", db))
                if v is not None
            }
        )
        cfg = load_config(config, **overrides)
        http, http_optional = http_address(http_listen)
    except (ConfigError, pydantic.ValidationError, ValueError) as exc:
        raise _fail(ExitCode.USAGE, f"invalid configuration: {exc}".replace("\n", " ")) from None

    from ftis.coordinator.server.app import BindError, CoordinatorServer
    from ftis.coordinator.state.base import DatabaseError

    if workers > 1:
        _serve_workers(cfg, workers, log_level, ready_file, http, http_optional)
        return
    try:
        server = CoordinatorServer(cfg, reuse_port=reuse_port, http_listen=http,
                                   http_optional=http_optional)
    except DatabaseError as exc:
        raise _fail(ExitCode.COORDINATOR_DATABASE, str(exc)) from None
    except ValueError as exc:  # e.g. a task config ReasoningGYM refuses
        raise _fail(ExitCode.USAGE, f"invalid configuration: {exc}") from None
    from ftis.coordinator.spot_check_pool import SpotCheckLoadError

    try:
        server.start()
    except BindError as exc:
        server.stop(None)
        raise _fail(ExitCode.COORDINATOR_BIND, str(exc)) from None
    except SpotCheckLoadError as exc:
        server.stop(None)
        raise _fail(ExitCode.COORDINATOR_SPOT_CHECK_MODELS, str(exc)) from None

    stop = _stop_on_signals()
    try:
        if ready_file is not None:
            write_ready_file(ready_file, server.address, server.admin_address,
                             server.http_address)
        while not stop.wait(0.5):
            pass
    finally:
        server.stop(grace=5.0)
        log.info("stopped")


def _stop_on_signals() -> threading.Event:
    """An event that SIGINT and SIGTERM set (the serve loops wait on it)."""
    stop = threading.Event()

    def _on_signal(signum: int, _frame: object) -> None:
        log.info("received %s, stopping", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    return stop


def _serve_workers(cfg: Any, workers: int, log_level: str, ready_file: Path | None,
                   http: str | None = None, http_optional: bool = False) -> None:
    """``serve --workers N``: migrate the database once, then supervise N workers
    (:mod:`ftis.coordinator.server.workers`) until SIGINT or SIGTERM; the supervisor
    serves ``http`` (the workers' summed metrics and the status page)."""
    from ftis.coordinator.server.workers import WorkerError, run_workers
    from ftis.coordinator.state.base import DatabaseError
    from ftis.coordinator.state.sql import SqlState

    if cfg.db_url.startswith("sqlite"):
        log.info("--workers %d on SQLite: the workers' writers queue on one lock file "
                 "beside the database (docs/coordinator.md, Workers)", workers)
    try:
        SqlState(cfg.db_url).close()  # schema migrations run here, exactly once
    except DatabaseError as exc:
        raise _fail(ExitCode.COORDINATOR_DATABASE, str(exc)) from None
    stop = _stop_on_signals()
    try:
        code = run_workers(cfg, workers, log_level=log_level, ready_file=ready_file, stop=stop,
                           http_listen=http, http_optional=http_optional)
    except WorkerError as exc:
        raise _fail(ExitCode.COORDINATOR_BIND, str(exc)) from None
    if code:
        raise _fail(ExitCode.COORDINATOR_WORKER, f"a worker exited with {code}")


def main() -> None:
    """Entry point that maps unexpected exceptions to exit code 1."""
    try:
        app()
    except SystemExit:
        raise
    except Exception:
        logging.getLogger("ftis.coordinator").exception("unexpected error")
        sys.exit(ExitCode.UNEXPECTED)


if __name__ == "__main__":
    main()
