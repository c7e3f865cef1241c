"""Probes of the machine for :func:`ftis.client.settings.schedule.decide` (all the I/O).

* Battery: :func:`psutil.sensors_battery` (Linux, Windows, macOS, FreeBSD).
* Idle time (seconds since the last keyboard or mouse input) has no portable library:
  Windows ``GetLastInputInfo`` (ctypes); macOS ``ioreg -c IOHIDSystem`` (``HIDIdleTime``,
  nanoseconds); Linux/BSD ``xprintidle`` (X11, milliseconds) if installed, else
  systemd-logind's ``IdleHint``/``IdleSinceHint`` of the user's graphical session
  (``loginctl show-session``; GNOME and KDE set it, also on Wayland). Where none
  answers, the probe says why and the idle rule is not applied (``status`` shows it).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from datetime import datetime

from ftis.client.settings.schedule import MachineSnapshot

_TIMEOUT_S = 2.0


def on_battery() -> bool | None:
    """True on battery, False on mains, ``None`` with no battery or no sensor support."""
    try:
        import psutil

        battery = psutil.sensors_battery()
    except (ImportError, AttributeError, OSError, RuntimeError):
        return None
    if battery is None or battery.power_plugged is None:
        return None
    return not battery.power_plugged


def _run(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=_TIMEOUT_S,
                             check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def _idle_windows() -> tuple[float | None, str | None]:
    import ctypes
    from ctypes import wintypes

    class LastInputInfo(ctypes.Structure):
        _fields_ = [("cbSize", wintypes.UINT), ("dwTime", wintypes.DWORD)]

    info = LastInputInfo()
    info.cbSize = ctypes.sizeof(info)
    windll = ctypes.windll  # type: ignore[attr-defined]
    if not windll.user32.GetLastInputInfo(ctypes.byref(info)):
        return None, "GetLastInputInfo failed (no interactive session?)"
    ticks = windll.kernel32.GetTickCount() & 0xFFFFFFFF
    return ((ticks - info.dwTime) & 0xFFFFFFFF) / 1000.0, None


def _idle_macos() -> tuple[float | None, str | None]:
    out = _run(["ioreg", "-c", "IOHIDSystem"])
    m = re.search(r'"HIDIdleTime"\s*=\s*(\d+)', out or "")
    if m is None:
        return None, "ioreg -c IOHIDSystem gave no HIDIdleTime"
    return int(m.group(1)) / 1e9, None


def parse_loginctl(text: str, now_us: int) -> float | None:
    """Idle seconds from ``loginctl show-session -p IdleHint -p IdleSinceHint``'s output
    at ``now_us`` (realtime microseconds); 0 when not idle, ``None`` if unreadable."""
    props = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
    hint = props.get("IdleHint")
    if hint == "no":
        return 0.0
    since = props.get("IdleSinceHint", "")
    if hint != "yes" or not since.isdigit() or int(since) == 0:
        return None
    return max(now_us - int(since), 0) / 1e6


def _idle_linux() -> tuple[float | None, str | None]:
    if os.environ.get("DISPLAY") and shutil.which("xprintidle"):
        out = _run(["xprintidle"])
        if out and out.strip().isdigit():
            return int(out.strip()) / 1000.0, None
    if not shutil.which("loginctl"):
        return None, "no xprintidle (X11) and no loginctl (systemd-logind)"
    session = os.environ.get("XDG_SESSION_ID")
    if not session:
        return None, ("no graphical session (XDG_SESSION_ID unset: a service or SSH "
                      "login); install xprintidle under X11 or run in the desktop session")
    out = _run(["loginctl", "show-session", session, "-p", "Type", "-p", "IdleHint",
                "-p", "IdleSinceHint"])
    if out is None:
        return None, f"loginctl show-session {session} failed"
    if "Type=tty" in out:
        return None, "the session is a text console (loginctl Type=tty)"
    idle = parse_loginctl(out, time.time_ns() // 1000)
    if idle is None:
        return None, "logind gives no idle hint for this session (the desktop does not set it)"
    return idle, None


def idle_seconds() -> tuple[float | None, str | None]:
    """``(seconds since the last input, None)`` or ``(None, why it is unknown)``."""
    try:
        if sys.platform == "win32":
            return _idle_windows()
        if sys.platform == "darwin":
            return _idle_macos()
        return _idle_linux()
    except Exception as exc:  # a probe never stops the node
        return None, f"idle probe failed: {exc}"


def snapshot(need_idle: bool = True) -> MachineSnapshot:
    """The machine now: local time, battery and (if ``need_idle``) idle time."""
    idle, why = idle_seconds() if need_idle else (None, None)
    return MachineSnapshot(now=datetime.now(), idle_seconds=idle, on_battery=on_battery(),
                           idle_unavailable=why)
