"""``ftis-client service``: where the installers put the background service, the
service manager's command lines, and the CLI over a fake service manager."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ftis.client import service as svc
from ftis.client.cli import service as service_cli
from ftis.client.cli.main import app
from ftis.protocol.exit_codes import ExitCode

ROOT = Path(__file__).resolve().parents[2]


def test_platforms() -> None:
    assert [svc.platform_of(p) for p in ("linux", "darwin", "win32")] == [
        "linux", "macos", "windows"]
    with pytest.raises(svc.UnsupportedPlatformError):
        svc.platform_of("freebsd14")


def test_locations_are_the_installers(tmp_path: Path) -> None:
    """The same paths as packaging/linux/install.sh (which also serves macOS)."""
    home = tmp_path
    linux = svc.locate("linux", home, {})
    assert linux.file == home / ".config/systemd/user/ftis-client.service"
    assert svc.locate("linux", home, {"XDG_CONFIG_HOME": "/x/cfg"}).file == \
        Path("/x/cfg/systemd/user/ftis-client.service")
    assert svc.locate("macos", home).file == home / "Library/LaunchAgents/org.ftis.client.plist"
    script = (ROOT / "packaging/linux/install.sh").read_text()
    assert "SERVICE_FILE=${XDG_CONFIG_HOME:-$HOME/.config}/systemd/user/ftis-client.service" \
        in script
    assert "SERVICE_FILE=$HOME/Library/LaunchAgents/org.ftis.client.plist" in script
    plist = (ROOT / "packaging/macos/org.ftis.client.plist.in").read_text()
    assert f"<string>{svc.LAUNCH_AGENT_LABEL}</string>" in plist


def test_command_lines() -> None:
    linux = svc.locate("linux", Path("/h"), {})
    assert svc.commands(linux, "enable") == [
        ["systemctl", "--user", "daemon-reload"],
        ["systemctl", "--user", "enable", "--now", "ftis-client.service"]]
    assert svc.commands(linux, "disable") == [
        ["systemctl", "--user", "disable", "--now", "ftis-client.service"]]
    mac = svc.locate("macos", Path("/Users/v"))
    assert svc.commands(mac, "enable", uid=501) == [
        ["launchctl", "enable", "gui/501/org.ftis.client"],
        ["launchctl", "bootstrap", "gui/501",
         "/Users/v/Library/LaunchAgents/org.ftis.client.plist"]]
    assert svc.commands(mac, "disable", uid=501) == [
        ["launchctl", "bootout", "gui/501/org.ftis.client"],
        ["launchctl", "disable", "gui/501/org.ftis.client"]]
    assert svc.commands(svc.locate("windows", Path("C:/")), "enable") == []


def test_windows_run_value_is_the_one_setup_exe_writes() -> None:
    nsi = (ROOT / "packaging/windows/ftis-client.nsi").read_text()
    written = re.search(r'WriteRegStr HKCU "\$\{RUN_KEY\}" "\$\{APPNAME\}" \'(.+)\'', nsi)
    assert written is not None
    expected = written[1].replace("$INSTDIR", r"C:\Users\v\AppData\Local\Programs\FTIS Client")
    assert svc.windows_run_value(r"C:\Users\v\AppData\Local\Programs\FTIS Client") == expected
    assert f'!define APPNAME "{svc.WINDOWS_APP}"' in nsi
    assert f'!define RUN_KEY "{svc.WINDOWS_RUN_KEY}"' in nsi


class FakeManager:
    """Answers command lines from a table; records what ran."""

    def __init__(self, answers: dict[str, tuple[int, str, str]]) -> None:
        self.answers, self.ran = answers, []

    def __call__(self, argv: list[str]) -> tuple[int, str, str]:
        self.ran.append(argv)
        return self.answers.get(" ".join(argv[2:3]), (0, "", ""))


@pytest.fixture
def linux_home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setattr("sys.platform", "linux")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    return tmp_path


def _unit(home: Path) -> Path:
    unit = home / ".config/systemd/user/ftis-client.service"
    unit.parent.mkdir(parents=True)
    unit.write_text("[Service]\n")
    return unit


def test_no_service_installed(linux_home, monkeypatch) -> None:
    fake = FakeManager({})
    monkeypatch.setattr(service_cli, "runner", fake)
    result = CliRunner().invoke(app, ["service", "status"])
    assert result.exit_code == ExitCode.CLIENT_SERVICE == 56
    assert "no service file" in result.output and fake.ran == []


def test_status_enable_disable_on_linux(linux_home, monkeypatch) -> None:
    _unit(linux_home)
    fake = FakeManager({"is-enabled": (0, "enabled", ""), "is-active": (0, "active", "")})
    monkeypatch.setattr(service_cli, "runner", fake)
    result = CliRunner().invoke(app, ["service", "status"])
    assert result.exit_code == 0, result.output
    assert "at login: enabled" in result.output and "now: active" in result.output
    fake.ran.clear()
    assert CliRunner().invoke(app, ["service", "enable"]).exit_code == 0
    assert fake.ran == [["systemctl", "--user", "daemon-reload"],
                        ["systemctl", "--user", "enable", "--now", "ftis-client.service"]]
    fake.ran.clear()
    assert CliRunner().invoke(app, ["service", "disable"]).exit_code == 0
    assert fake.ran == [["systemctl", "--user", "disable", "--now", "ftis-client.service"]]


def test_no_systemd_user_session(linux_home, monkeypatch) -> None:
    """As in a container or over plain ssh: systemctl cannot reach the user bus."""
    _unit(linux_home)
    bus = (1, "", "Failed to connect to bus: No medium found")
    monkeypatch.setattr(service_cli, "runner", FakeManager(
        {"is-enabled": bus, "is-active": bus, "daemon-reload": bus}))
    result = CliRunner().invoke(app, ["service", "status"])
    assert result.exit_code == 56 and "not reachable" in result.output
    result = CliRunner().invoke(app, ["service", "enable"])
    assert result.exit_code == 56
    assert "systemctl --user daemon-reload` exited 1: Failed to connect to bus" in \
        " ".join(result.output.split())
