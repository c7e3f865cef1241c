"""Start or stop the FTIS volunteer client on Windows (installed by setup.exe/install.ps1).

    pythonw.exe ftis-launch.py            background run (start menu, HKCU Run at login);
                                          output goes to <user log dir>/ftis-client.log
    python.exe  ftis-launch.py --console  the same in a console window, with live progress
    pythonw.exe ftis-launch.py --stop     stop the background run

Settings come from client.env in the user config folder (platformdirs:
%LOCALAPPDATA%\\ftis\\ftis\\client.env): FTIS_CLIENT_<FLAG>=value lines, the flags of
``ftis-client start``.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import platformdirs

CONFIG_FILE = Path(platformdirs.user_config_dir("ftis")) / "client.env"
PID_FILE = Path(platformdirs.user_data_dir("ftis")) / "client.pid"
LOG_FILE = Path(platformdirs.user_log_dir("ftis")) / "ftis-client.log"


def load_settings(path: Path = CONFIG_FILE) -> dict[str, str]:
    """KEY=VALUE lines (``#`` comments, optional double quotes), as in install.sh."""
    env: dict[str, str] = {}
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            line = line.strip()
            if line and not line.startswith("#") and "=" in line:
                key, value = line.split("=", 1)
                env[key.strip()] = value.strip().strip('"')
    return env


def stop() -> int:
    try:
        pid = int(PID_FILE.read_text().strip())
    except (OSError, ValueError):
        return 0
    try:
        os.kill(pid, signal.SIGTERM)  # TerminateProcess on Windows
    except OSError:
        pass
    PID_FILE.unlink(missing_ok=True)
    return 0


def main(argv: list[str]) -> int:
    if "--stop" in argv:
        return stop()
    console = "--console" in argv
    stop()  # one background client at a time
    os.environ.update(load_settings())
    if not console or sys.stdout is None:
        LOG_FILE.parent.mkdir(parents=True, exist_ok=True)
        log = open(LOG_FILE, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
        sys.stdout = sys.stderr = log
    PID_FILE.parent.mkdir(parents=True, exist_ok=True)
    PID_FILE.write_text(str(os.getpid()))
    from ftis.client.cli.main import app

    code = 0
    try:
        app(["start"], prog_name="ftis-client")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    finally:
        PID_FILE.unlink(missing_ok=True)
    if console:
        input(f"ftis-client exited ({code}); press Enter to close")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
