"""The slim volunteer package (issue 14, part 4): ``ftis-client`` exposes exactly the
volunteer commands and never imports the research and security tooling of ``ftis-lab``;
the lab's swarms start honest nodes with ``ftis-client start`` and attackers with
``ftis-lab attack``."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from importlib.metadata import requires
from pathlib import Path

import typer
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[2]
CLIENT_SOURCES = ROOT / "client" / "ftis" / "client"


def _commands(app: typer.Typer) -> set[str]:
    return set(typer.main.get_command(app).commands)  # type: ignore[attr-defined]


def test_volunteer_cli_has_exactly_the_volunteer_commands():
    from ftis.client.cli.main import VOLUNTEER_COMMANDS, app

    assert VOLUNTEER_COMMANDS == ("start", "models", "settings", "status", "service")
    assert _commands(app) == set(VOLUNTEER_COMMANDS)
    result = CliRunner().invoke(app, ["demo"])
    assert result.exit_code == 2 and "No such command 'demo'" in result.output


def test_lab_cli_has_the_research_commands():
    from ftis.lab.cli.main import LAB_COMMANDS, app

    assert _commands(app) == {"demo", "experiment", "attack", "security-experiment", "merit",
                                "simulate"}
    assert set(LAB_COMMANDS) == _commands(app)
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.startswith("ftis-lab ")


def test_client_sources_never_import_the_lab_or_matplotlib():
    offenders = []
    for path in sorted(CLIENT_SOURCES.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.relative_to(ROOT)}: {n}" for n in names
                          if n.split(".")[:2] == ["ftis", "lab"] or n.startswith("matplotlib")]
    assert offenders == []


def test_importing_the_client_loads_no_lab_module():
    """Every module of ftis.client imported in a fresh interpreter: no ``ftis.lab`` module
    in ``sys.modules`` afterwards. (matplotlib may be there: reasoning-gym, a dependency of
    ftis-proto, imports cellpylib, which imports it; the client's own code does not.)"""
    code = (
        "import importlib, json, pkgutil, sys\n"
        "import ftis.client\n"
        "mods = [m.name for m in pkgutil.walk_packages(ftis.client.__path__, 'ftis.client.')]\n"
        "for m in mods:\n"
        "    importlib.import_module(m)\n"
        "print(json.dumps({'imported': len(mods), 'lab': sorted(m for m in sys.modules\n"
        "    if m == 'ftis.lab' or m.startswith('ftis.lab.'))}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["imported"] >= 30  # every module, not just the package
    assert result["lab"] == []


def test_client_distribution_does_not_depend_on_the_lab():
    deps = " ".join(requires("ftis-client") or [])
    assert "ftis-lab" not in deps and "matplotlib" not in deps
    lab = " ".join(requires("ftis-lab") or [])
    assert "ftis-client" in lab and "matplotlib" in lab


def test_swarm_nodes_run_the_right_programs(tmp_path, monkeypatch):
    """The launcher starts honest nodes with ``ftis-client start`` and attackers with
    ``ftis-lab attack``, commands both CLIs have."""
    from ftis.client.cli.main import app as client_app
    from ftis.lab.cli.main import app as lab_app
    from ftis.lab.experiment import launcher

    started: list[list[str]] = []

    class Proc:
        def __init__(self, cmd, **kwargs):
            started.append(cmd)

    monkeypatch.setattr(launcher.subprocess, "Popen", Proc)
    swarm = launcher.Swarm(out=tmp_path, coordinator=None, listen="127.0.0.1:1", admin="")
    (tmp_path / "logs").mkdir()
    launcher.start_client(swarm, launcher.ClientSpec("honest", ["--rounds", "1"]))
    launcher.start_attacker(swarm, launcher.ClientSpec("bad", []), "reward_liar")
    honest, bad = started
    assert honest[1:4] == ["-m", "ftis.client.cli.main", "start"]
    assert bad[1:6] == ["-m", "ftis.lab.cli.main", "attack", "--kind", "reward_liar"]
    assert "start" in _commands(client_app) and "attack" in _commands(lab_app)
