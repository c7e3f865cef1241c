"""The background service an installer registered, and the commands that manage it.

The installers register the client to run in the user's session (docs/volunteers.md):

* Linux: a ``systemd --user`` unit, ``$XDG_CONFIG_HOME/systemd/user/ftis-client.service``
  (``packaging/linux/install.sh``);
* macOS: a LaunchAgent, ``~/Library/LaunchAgents/org.ftis.client.plist`` (the same
  script, or the ``.pkg``);
* Windows: the value ``FTIS Client`` under ``HKCU\\...\\CurrentVersion\\Run``, which
  starts ``pythonw.exe ftis-launch.py`` at login (``setup.exe``'s "Start at login").

This module only decides (paths, command lines); ``ftis.client.cli.service`` runs them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PureWindowsPath
from typing import Literal

Platform = Literal["linux", "macos", "windows"]
Action = Literal["status", "enable", "disable"]

SYSTEMD_UNIT = "ftis-client.service"
LAUNCH_AGENT_LABEL = "org.ftis.client"
#: The installer's Windows names (packaging/windows/ftis-client.nsi: APPNAME, RUN_KEY).
WINDOWS_APP = "FTIS Client"
WINDOWS_RUN_KEY = r"Software\Microsoft\Windows\CurrentVersion\Run"
WINDOWS_APP_KEY = r"Software\FTIS Client"


class UnsupportedPlatformError(ValueError):
    """No installer registers a service on this platform."""


def platform_of(sys_platform: str) -> Platform:
    """``sys.platform`` → the installer's platform.

    Raises:
        UnsupportedPlatformError: anything but Linux, macOS (``darwin``) and Windows.
    """
    if sys_platform.startswith("linux"):
        return "linux"
    if sys_platform == "darwin":
        return "macos"
    if sys_platform in ("win32", "cygwin"):
        return "windows"
    raise UnsupportedPlatformError(f"no background service is installed on {sys_platform}")


@dataclass(frozen=True)
class ServiceLocation:
    """Where the installer put the service.

    Attributes:
        platform: the installer's platform.
        file: the unit file (Linux) or the LaunchAgent plist (macOS); ``None`` on
            Windows, where the service is a registry value.
        name: the systemd unit, the LaunchAgent label or the Run value's name.
    """

    platform: Platform
    file: Path | None
    name: str


def locate(platform: Platform, home: Path, env: Mapping[str, str] = os.environ) -> ServiceLocation:
    """The service's location for ``platform`` and the user's ``home`` (the same
    paths as ``install.sh``; ``XDG_CONFIG_HOME`` honoured on Linux)."""
    if platform == "linux":
        config = Path(env.get("XDG_CONFIG_HOME") or home / ".config")
        return ServiceLocation("linux", config / "systemd" / "user" / SYSTEMD_UNIT, SYSTEMD_UNIT)
    if platform == "macos":
        plist = home / "Library" / "LaunchAgents" / f"{LAUNCH_AGENT_LABEL}.plist"
        return ServiceLocation("macos", plist, LAUNCH_AGENT_LABEL)
    return ServiceLocation("windows", None, WINDOWS_APP)


def commands(location: ServiceLocation, action: Action, uid: int = 0) -> list[list[str]]:
    """The service manager's command lines for ``action``, run in order (Linux and
    macOS; on Windows the CLI edits the Run value itself and this is empty).

    ``enable`` starts the service now and at every login; ``disable`` stops it now and
    at login; ``status`` asks whether it is enabled and whether it runs (Linux: two
    commands, ``is-enabled`` then ``is-active``; macOS: ``launchctl print``, which fails
    when the agent is not loaded).

    Args:
        uid: the user's id (macOS: the ``gui/UID`` launchd domain).
    """
    if location.platform == "linux":
        unit = location.name
        return {
            "enable": [["systemctl", "--user", "daemon-reload"],
                       ["systemctl", "--user", "enable", "--now", unit]],
            "disable": [["systemctl", "--user", "disable", "--now", unit]],
            "status": [["systemctl", "--user", "is-enabled", unit],
                       ["systemctl", "--user", "is-active", unit]],
        }[action]
    if location.platform == "macos":
        target = f"gui/{uid}/{location.name}"
        return {
            "enable": [["launchctl", "enable", target],
                       ["launchctl", "bootstrap", f"gui/{uid}", str(location.file)]],
            "disable": [["launchctl", "bootout", target],
                        ["launchctl", "disable", target]],
            "status": [["launchctl", "print", target]],
        }[action]
    return []


def windows_launcher(install_dir: str, *extra: str) -> list[str]:
    """The background launcher ``setup.exe`` installs, as a command line:
    ``pythonw.exe ftis-launch.py [extra]`` (``--stop`` stops a running client)."""
    root = PureWindowsPath(install_dir)
    return [str(root / "venv" / "Scripts" / "pythonw.exe"), str(root / "ftis-launch.py"), *extra]


def windows_run_value(install_dir: str) -> str:
    """The Run value ``setup.exe`` writes (both paths quoted)."""
    return " ".join(f'"{part}"' for part in windows_launcher(install_dir))
