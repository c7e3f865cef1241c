"""``ftis-client service status|enable|disable``: the background service the installer
registered (a ``systemd --user`` unit, a LaunchAgent, or the Windows Run value; see
:mod:`ftis.client.service`). ``enable`` starts it now and at every login, ``disable``
stops it now and at login; neither touches the node's key, checkpoints or settings.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import typer
from rich.console import Console

from ftis.client import service as svc
from ftis.protocol.exit_codes import ExitCode

console = Console()
app = typer.Typer(help="The background service the installer registered: status, enable "
                       "(start now and at login), disable (stop now and at login).",
                  no_args_is_help=True)

def _run(argv: list[str]) -> tuple[int, str, str]:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    except FileNotFoundError:
        return 127, "", f"{argv[0]}: not found"
    except subprocess.TimeoutExpired:
        return 124, "", f"{' '.join(argv)}: no answer within 30 s"
    return done.returncode, done.stdout.strip(), done.stderr.strip()


#: Runs one command line, returns (exit status, stdout, stderr); replaced in tests.
runner: Callable[[list[str]], tuple[int, str, str]] = _run


def _die(message: str) -> NoReturn:
    console.print(f"[red]ftis-client service:[/red] {message}")
    raise typer.Exit(ExitCode.CLIENT_SERVICE)


def _location() -> svc.ServiceLocation:
    try:
        platform = svc.platform_of(sys.platform)
    except svc.UnsupportedPlatformError as exc:
        _die(str(exc))
    return svc.locate(platform, Path.home())


def _require_file(location: svc.ServiceLocation) -> None:
    if location.file is not None and not location.file.exists():
        _die(f"no service file {location.file}: install with install.sh --autostart "
             "(docs/volunteers.md)")


def _uid() -> int:
    """The user's id (the launchd domain ``gui/UID``; 0 where there is none)."""
    return os.getuid() if hasattr(os, "getuid") else 0


def _first_line(text: str) -> str:
    return text.splitlines()[0] if text else ""


def _run_all(location: svc.ServiceLocation, action: svc.Action) -> None:
    for argv in svc.commands(location, action, _uid()):
        code, out, err = runner(argv)
        if code != 0:
            _die(f"`{' '.join(argv)}` exited {code}: {_first_line(err or out)}")


@app.command("status")
def status() -> None:
    """Whether the service is installed, enabled at login and running."""
    location = _location()
    if location.platform == "windows":
        value = _windows().run_value()
        console.print(f"service: Run value {svc.WINDOWS_APP!r} "
                      f"{'set: starts at login' if value else 'not set: not started at login'}")
        if value:
            console.print(f"command: {value}")
        return
    _require_file(location)
    console.print(f"service file: {location.file}")
    if location.platform == "linux":
        answers = [runner(argv) for argv in svc.commands(location, "status", _uid())]
        (enabled_code, enabled, enabled_err), (_, active, active_err) = answers
        if enabled_code not in (0, 1) or not enabled:
            _die("systemd --user is not reachable here "
                 f"({_first_line(enabled_err or active_err) or 'no answer'}); the file above "
                 "is used once you log in to a session with systemd")
        console.print(f"at login: {enabled}\nnow: {active or 'unknown'}")
        return
    ((code, out, err),) = [runner(argv) for argv in svc.commands(location, "status", _uid())]
    state = next((line.split("=", 1)[1].strip() for line in out.splitlines()
                  if line.strip().startswith("state =")), None)
    console.print(f"loaded: {'yes' if code == 0 else 'no'}\nnow: {state or 'not running'}")


def _switch(action: svc.Action, done: str) -> None:
    location = _location()
    if location.platform == "windows":
        windows = _windows()
        windows.enable() if action == "enable" else windows.disable()
    else:
        _require_file(location)
        _run_all(location, action)
    console.print(done)


@app.command("enable")
def enable() -> None:
    """Start the service now and at every login."""
    _switch("enable", "service enabled: running now and at every login")


@app.command("disable")
def disable() -> None:
    """Stop the service now and at login (the node's key and checkpoints stay)."""
    _switch("disable", "service disabled: stopped, and not started at login")


class _WindowsService:
    """The Run value and the launcher ``setup.exe`` installed (``winreg``, Windows only)."""

    def __init__(self) -> None:
        import winreg  # type: ignore[import-not-found, unused-ignore]

        self.winreg = winreg

    def _read(self, key: str, name: str) -> str | None:
        w = self.winreg
        try:
            with w.OpenKey(w.HKEY_CURRENT_USER, key) as handle:  # type: ignore[attr-defined, unused-ignore]
                return str(w.QueryValueEx(handle, name)[0])  # type: ignore[attr-defined, unused-ignore]
        except OSError:
            return None

    def run_value(self) -> str | None:
        return self._read(svc.WINDOWS_RUN_KEY, svc.WINDOWS_APP)

    def install_dir(self) -> str:
        found = self._read(svc.WINDOWS_APP_KEY, "InstallDir")
        if not found:
            _die("no FTIS Client installation found for this user (run setup.exe)")
        return str(found)

    def enable(self) -> None:
        w, root = self.winreg, self.install_dir()
        with w.CreateKey(w.HKEY_CURRENT_USER, svc.WINDOWS_RUN_KEY) as handle:  # type: ignore[attr-defined, unused-ignore]
            w.SetValueEx(handle, svc.WINDOWS_APP, 0, w.REG_SZ,  # type: ignore[attr-defined, unused-ignore]
                         svc.windows_run_value(root))
        flags = getattr(subprocess, "DETACHED_PROCESS", 0)
        subprocess.Popen(svc.windows_launcher(root), creationflags=flags, close_fds=True)

    def disable(self) -> None:
        w, root = self.winreg, self.install_dir()
        try:
            with w.OpenKey(w.HKEY_CURRENT_USER, svc.WINDOWS_RUN_KEY, 0,  # type: ignore[attr-defined, unused-ignore]
                           w.KEY_SET_VALUE) as handle:  # type: ignore[attr-defined, unused-ignore]
                w.DeleteValue(handle, svc.WINDOWS_APP)  # type: ignore[attr-defined, unused-ignore]
        except FileNotFoundError:
            pass
        code, out, err = runner(svc.windows_launcher(root, "--stop"))
        if code != 0:
            _die(f"the launcher's --stop exited {code}: {_first_line(err or out)}")


def _windows() -> _WindowsService:
    return _WindowsService()
