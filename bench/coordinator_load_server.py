"""The coordinator side of ``bench/coordinator_load.py``: its configuration, the
``serve`` subprocess (ready-file protocol of ``ftis.lab.experiment.launcher``), the
databases (a fresh SQLite file, or a fresh PostgreSQL database, per run) and a psutil
sampler of the process tree's CPU time and RSS."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

from ftis.tasks.source import DEFAULT_TASKS

if TYPE_CHECKING:
    from sqlalchemy import Engine

#: Quotas lifted far beyond any load this benchmark makes: only throughput limits it.
UNLIMITED = 1_000_000_000


def coordinator_settings() -> dict:
    """The ``--config`` JSON: the default task mix (written out, so the pre-built
    completions are checked against the same tasks), ``require_tokenizer`` on (every
    bundle's text and prompt are decoded and compared), every per-node quota lifted."""
    return {
        "tasks": [t.model_dump() for t in DEFAULT_TASKS],
        "require_tokenizer": True,
        "bundles_per_minute": UNLIMITED,
        "bundle_bytes_per_minute": UNLIMITED * 1024,
        "pulls_per_minute": UNLIMITED,
        "pull_bytes_per_minute": UNLIMITED * 1024,
        "max_outstanding_leases": UNLIMITED,
        "registrations_per_minute": UNLIMITED,
        "registrations_per_host_per_minute": UNLIMITED,
    }


def _env(source: Path | None = None) -> dict[str, str]:
    """The coordinator's environment; with ``source`` (a source tree holding
    ``coordinator/`` and ``proto/``, e.g. an export of ``git archive HEAD``) those two
    packages are imported from there instead of the installed (editable) ones."""
    env = dict(os.environ)
    if source is not None:
        paths = [str(source / "coordinator"), str(source / "proto")]
        env["PYTHONPATH"] = os.pathsep.join(
            [*paths, *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def serve_cmd() -> list[str]:
    return [sys.executable, "-m", "ftis.coordinator.cli.main", "serve"]


def serve_supports_workers(source: Path | None = None) -> bool:
    """Whether ``serve --help`` lists ``--workers``."""
    out = subprocess.run([*serve_cmd(), "--help"], capture_output=True, text=True,
                         env={**_env(source), "COLUMNS": "200", "NO_COLOR": "1"},
                         timeout=120)
    return re.search(r"--workers\b", out.stdout + out.stderr) is not None


# ---------------------------------------------------------------------- databases
class Database:
    """Where one run's coordinator stores its state; :meth:`fresh` gives a new, empty one."""

    name = "?"
    label = "?"
    workers: int | None = None

    def fresh(self, workdir: Path, tag: str) -> str:
        raise NotImplementedError

    def drop(self) -> None:
        """Remove the last database :meth:`fresh` made (best effort)."""


class SqliteDatabase(Database):
    name = "sqlite"

    def __init__(self, workers: int = 1) -> None:
        self._path: Path | None = None
        self.workers = workers if workers > 1 else None
        self.label = f"sqlite, {workers} worker{'s' if workers > 1 else ''}"

    def fresh(self, workdir: Path, tag: str) -> str:
        path = workdir / f"sqlite-{tag}.db"
        for suffix in ("", "-wal", "-shm"):
            Path(f"{path}{suffix}").unlink(missing_ok=True)
        self._path = path
        return f"sqlite:///{path.resolve()}"


class PostgresDatabase(Database):
    """A new database per run, on ``server`` (a started
    :class:`ftis.coordinator.testing.postgres.PostgresServer`, stopped by :meth:`close`)
    or else on the server of ``base_url`` (``CREATE DATABASE`` through SQLAlchemy)."""

    name = "postgresql"

    def __init__(self, base_url: str = "", workers: int = 2, server: object = None) -> None:
        self.base_url = base_url
        self.workers = workers
        self.label = f"postgresql, {workers} workers"
        self.server = server
        self._current: str | None = None

    @property
    def server_pid(self) -> int | None:
        """The PID of the server this benchmark started (``None`` for ``base_url``)."""
        process = getattr(self.server, "process", None)
        return process.pid if process is not None else None

    def _admin_engine(self) -> Engine:
        from sqlalchemy import create_engine
        from sqlalchemy.engine import make_url

        url = make_url(self.base_url).set(database="postgres")
        return create_engine(url, isolation_level="AUTOCOMMIT")

    def check(self) -> None:
        """Connect once (raises with the driver's message when it cannot)."""
        if self.server is not None:
            return
        from sqlalchemy import text

        engine = self._admin_engine()
        try:
            with engine.connect() as conn:
                conn.execute(text("SELECT 1"))
        finally:
            engine.dispose()

    def fresh(self, workdir: Path, tag: str) -> str:
        name = f"ftis_bench_{re.sub(r'[^a-z0-9_]', '_', tag.lower())}_{uuid.uuid4().hex[:6]}"
        if self.server is not None:
            self._current = self.server.create_database(name)
            return self.server.url(self._current)
        from sqlalchemy import text
        from sqlalchemy.engine import make_url

        engine = self._admin_engine()
        try:
            with engine.connect() as conn:
                conn.execute(text(f'CREATE DATABASE "{name}"'))
        finally:
            engine.dispose()
        self._current = name
        return make_url(self.base_url).set(database=name).render_as_string(hide_password=False)

    def drop(self) -> None:
        name, self._current = self._current, None
        if name is None:
            return
        try:
            if self.server is not None:
                self.server.drop_database(name)
                return
            from sqlalchemy import text

            engine = self._admin_engine()
            try:
                with engine.connect() as conn:
                    conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
            finally:
                engine.dispose()
        except Exception:  # noqa: BLE001 - best effort
            pass

    def close(self) -> None:
        stop = getattr(self.server, "stop", None)
        if callable(stop):
            stop()


class FloorTarget(Database):
    """No database: the run's server is :class:`FloorProcess`, the listener with canned
    replies (``bench/coordinator_floor_server.py``), the transport's share of the cost."""

    name = "floor"
    label = "floor: the listener with canned replies (no auth, verification or storage)"

    def fresh(self, workdir: Path, tag: str) -> str:
        return ""


# ---------------------------------------------------------------------- the process
class CoordinatorProcess:
    """``python -m ftis.coordinator.cli.main serve`` on free loopback ports.

    Args:
        workdir: holds the config, the ready file and ``coordinator-<tag>.log``.
        db_url: the database.
        workers: ``--workers`` (only passed when not ``None``).
        source: run the coordinator from this source tree (see :func:`_env`).
        settings: the ``--config`` JSON (default :func:`coordinator_settings`).
    """

    def __init__(self, workdir: Path, db_url: str, tag: str, workers: int | None = None,
                 source: Path | None = None, settings: dict | None = None) -> None:
        self.source = source
        self.settings = settings if settings is not None else coordinator_settings()
        self.workdir = workdir
        self.db_url = db_url
        self.tag = tag
        self.workers = workers
        self.proc: subprocess.Popen | None = None
        self.listen = ""
        self.log_path = workdir / f"coordinator-{tag}.log"

    def start(self, timeout_s: float = 180.0) -> str:
        """Start and wait for the ready file; returns the volunteer listener address.

        Raises:
            RuntimeError: the process exited or did not get ready in time.
        """
        config = self.workdir / "coordinator.json"
        config.write_text(json.dumps(self.settings, indent=1))
        ready = self.workdir / f"coordinator-{self.tag}.ready.json"
        ready.unlink(missing_ok=True)
        cmd = self.command(ready, config)
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the process
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                     env=_env(self.source))
        log.close()
        deadline = time.monotonic() + timeout_s
        while not ready.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"coordinator exited with {self.proc.returncode}: "
                                   f"{self.log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"coordinator not ready after {timeout_s:.0f} s")
            time.sleep(0.05)
        self.listen = json.loads(ready.read_text())["listen"]
        return self.listen

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def command(self, ready: Path, config: Path) -> list[str]:
        cmd = [*serve_cmd(), "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0",
               "--db", self.db_url, "--ready-file", str(ready), "--config", str(config)]
        if self.workers is not None:
            cmd += ["--workers", str(self.workers)]
        return cmd

    def log_tail(self, lines: int = 5) -> str:
        try:
            return " | ".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM (the serve command's graceful stop), then SIGKILL after ``grace_s``."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:  # worker processes (--workers) must not outlive the run
            children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            children = []
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        _, alive = psutil.wait_procs(children, timeout=5)
        for child in alive:
            with contextlib.suppress(psutil.Error):
                child.kill()


class FloorProcess(CoordinatorProcess):
    """``bench/coordinator_floor_server.py`` (the listener with canned replies) in place
    of ``serve``, answering ``group_size`` rewards per bundle; same start, stop and
    sampling."""

    def __init__(self, workdir: Path, tag: str, group_size: int,
                 source: Path | None = None) -> None:
        super().__init__(workdir, "", tag, source=source)
        self.group_size = group_size

    def command(self, ready: Path, config: Path) -> list[str]:
        return [sys.executable, str(Path(__file__).resolve().parent
                                    / "coordinator_floor_server.py"),
                "--listen", "127.0.0.1:0", "--ready-file", str(ready),
                "--group-size", str(self.group_size)]


# ---------------------------------------------------------------------- psutil sampler
@dataclass
class TreeSample:
    t: float  # time.perf_counter()
    rss_mb: float
    cpu_s: float
    #: context switches (voluntary + involuntary), summed over every thread of the tree
    #: (threads that exited keep their last count); NaN off Linux
    ctx_switches: float = float("nan")


def thread_context_switches(pid: int) -> dict[int, int]:
    """Context switches (voluntary + involuntary) of each live thread of ``pid``, from
    ``/proc/PID/task/TID/status`` (Linux; ``/proc/PID/status`` and psutil's
    ``num_ctx_switches`` count the main thread only). Empty where /proc is missing."""
    counts: dict[int, int] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return counts
    for tid in tids:
        try:
            text = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except OSError:
            continue
        counts[int(tid)] = sum(int(line.split()[1]) for line in text.splitlines()
                               if "ctxt_switches:" in line)
    return counts


@dataclass
class TreeSampler:
    """Samples RSS (sum over the process and all its descendants) and CPU time (user +
    system, same tree) every ``interval_s`` in a thread.

    CPU time is cumulative over every process ever seen in the tree (a process that
    exited keeps the CPU time of its last sample), so processes that come and go (e.g.
    PostgreSQL backends) neither vanish from nor subtract from a difference of samples.
    """

    pid: int
    interval_s: float = 0.5
    samples: list[TreeSample] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._procs: dict[int, psutil.Process] = {}
        self._cpu: dict[tuple[int, float], float] = {}  # (pid, create_time) -> CPU s
        self._switches: dict[tuple[int, int], int] = {}  # (pid, tid) -> context switches
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="tree-sampler", daemon=True)

    def _tree(self) -> list[psutil.Process]:
        try:
            root = self._procs.get(self.pid) or psutil.Process(self.pid)
            self._procs[self.pid] = root
            procs = [root]
            for child in root.children(recursive=True):
                procs.append(self._procs.setdefault(child.pid, child))
            return procs
        except psutil.Error:
            return []

    def sample(self) -> TreeSample:
        """One sample now (also called from other threads: window marks)."""
        with self._lock:
            rss = 0.0
            for p in self._tree():
                try:
                    with p.oneshot():
                        rss += p.memory_info().rss
                        times = p.cpu_times()
                        self._cpu[(p.pid, p.create_time())] = times.user + times.system
                    for tid, n in thread_context_switches(p.pid).items():
                        self._switches[(p.pid, tid)] = n
                except psutil.Error:
                    continue
            switches = float(sum(self._switches.values())) if self._switches else float("nan")
            s = TreeSample(time.perf_counter(), rss / 2**20, sum(self._cpu.values()),
                           switches)
            self.samples.append(s)
            return s

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def start(self) -> TreeSampler:
        self.sample()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def in_window(self, start: float, end: float) -> list[TreeSample]:
        return [s for s in self.samples if start <= s.t <= end]


def rss_slope_mb_per_min(samples: list[TreeSample]) -> float:
    """Least-squares slope of RSS over time, MB per minute (nan with < 2 samples)."""
    if len(samples) < 2:
        return float("nan")
    ts = [s.t / 60.0 for s in samples]
    ys = [s.rss_mb for s in samples]
    mt, my = sum(ts) / len(ts), sum(ys) / len(ys)
    var = sum((t - mt) ** 2 for t in ts)
    if var == 0:
        return float("nan")
    return sum((t - mt) * (y - my) for t, y in zip(ts, ys, strict=True)) / var
