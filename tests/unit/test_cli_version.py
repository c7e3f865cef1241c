"""``ftis-client --version`` prints the installed distribution's version (issue 14)."""

from __future__ import annotations

import tomllib
from pathlib import Path

from typer.testing import CliRunner

from ftis.client.cli.main import app

ROOT = Path(__file__).resolve().parents[2]


def test_version_flag_prints_the_client_version() -> None:
    expected = tomllib.loads((ROOT / "client/pyproject.toml").read_text())["project"]["version"]
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == f"ftis-client {expected}"


def test_commands_still_listed_without_arguments() -> None:
    result = CliRunner().invoke(app, [])
    assert "start" in result.output and "models" in result.output
    assert "--version" in result.output
