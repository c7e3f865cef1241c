"""``ftis-coordinator serve`` as a subprocess for integration tests: start it on free
ports and wait for its ready file; stop it with SIGTERM (killed after 20 s)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

START_TIMEOUT_S = 60


def start_serve(tmp_path: Path, *extra: str, db: Path | None = None,
                stdout: int | None = subprocess.PIPE) -> tuple[subprocess.Popen, dict]:
    """``serve --listen 127.0.0.1:0 --admin-listen 127.0.0.1:0 --db DB --ready-file ...
    EXTRA``; returns the process and its ready file's contents (the bound addresses).

    Raises:
        AssertionError: the server exited or was not ready within START_TIMEOUT_S.
    """
    ready = tmp_path / "ready.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ftis.coordinator.cli.main", "serve", "--listen", "127.0.0.1:0",
         "--admin-listen", "127.0.0.1:0", "--db", str(db or tmp_path / "coord.db"),
         "--ready-file", str(ready), *extra],
        stdout=stdout, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + START_TIMEOUT_S
    while not ready.exists():
        if proc.poll() is not None:
            raise AssertionError(f"server exited {proc.returncode}: {proc.stderr.read()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("server did not become ready")
        time.sleep(0.05)
    return proc, json.loads(ready.read_text())


def stop_serve(proc: subprocess.Popen) -> int:
    """SIGTERM, then SIGKILL after 20 s; returns the exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    proc.communicate()
    return proc.returncode
