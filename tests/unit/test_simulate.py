"""``ftis-lab simulate``'s parts that need no flwr: the comparison that the parity test
(tests/flower/) relies on must see differences; the learner's message connection must
refuse calls the server did not answer; the CLI must say how to get flwr; and flwr must
stay out of the proto, coordinator and client packages (docs/protocol.md)."""

from __future__ import annotations

import ast
import copy
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ftis.lab.simulate.learner import MessageConnection, SimulationError
from ftis.lab.simulate.spec import LearnerRound, SwarmSpec, SwarmSummary, compare
from ftis.v1 import swarm_pb2

ROOT = Path(__file__).resolve().parents[2]


def _summary() -> SwarmSummary:
    return SwarmSummary(
        rounds=[LearnerRound("a" * 32, 1, {"reward_mean": 0.25, "generated_tokens": 90.0,
                                           "loss": -0.004, "samples": 16.0}),
                LearnerRound("b" * 32, 1, {"reward_mean": 0.0, "generated_tokens": 96.0,
                                           "loss": 0.0, "samples": 0.0})],
        bundles_accepted=2, verified_rewards={"a" * 32: [1.0, 0.0], "b" * 32: [0.0, 0.0]},
        reputations={"a" * 32: 0.75, "b" * 32: 0.7})


def test_compare_agrees_within_tolerance_and_names_each_difference() -> None:
    a = _summary()
    b = copy.deepcopy(a)
    b.reputations["a" * 32] += 5e-4  # wall-clock decay: within 1e-3
    b.rounds[0].metrics["loss"] += 5e-5  # float order: within 1e-4
    assert compare(a, b) == []
    b.rounds[0].metrics["reward_mean"] = 0.125
    b.verified_rewards["b" * 32] = [1.0, 0.0]
    b.bundles_accepted = 3
    b.reputations["b" * 32] = 0.69
    diffs = compare(a, b)
    assert len(diffs) == 4, diffs
    assert any("reward_mean: 0.25 != 0.125" in d for d in diffs)
    assert any(d.startswith("bundles_accepted: 2 != 3") for d in diffs)
    b = copy.deepcopy(a)
    b.rounds.pop()
    assert compare(a, b) == ["different learner rounds: 2 vs 1"]


def test_identities_are_derived_from_the_seed() -> None:
    spec = SwarmSpec(seed=3)
    assert spec.identity(0).node_id == SwarmSpec(seed=3).identity(0).node_id
    assert len({spec.identity(i).node_id for i in range(4)} |
               {SwarmSpec(seed=4).identity(0).node_id}) == 5


def test_message_connection_serves_only_what_the_server_answered() -> None:
    conn = MessageConnection(SwarmSpec().identity(0))
    conn.heartbeat_reply = swarm_pb2.HeartbeatResponse(reputation=0.5).SerializeToString()
    assert conn.heartbeat(0).reputation == 0.5
    with pytest.raises(SimulationError, match="heartbeat"):
        conn.heartbeat(0)  # answered once
    page = swarm_pb2.PullBundlesResponse(next_cursor=9).SerializeToString()
    conn.pages, conn.page_cursor = [page, page], 4
    with pytest.raises(SimulationError, match="cursor 3"):
        conn.pull_bundles(3, 64, "")
    assert conn.pull_bundles(4, 64, "").next_cursor == 9 and conn.page_cursor == 9
    with pytest.raises(SimulationError):
        conn.submit_bundle(swarm_pb2.TaskLease())  # type: ignore[arg-type]
    conn.report_metrics(2, {"loss": 0.5})
    assert swarm_pb2.ReportMetricsRequest.FromString(conn.report or b"").values["loss"] == 0.5


def test_simulate_without_flwr_says_how_to_get_it(monkeypatch) -> None:
    from ftis.lab.cli import simulate
    from ftis.lab.cli.main import app

    monkeypatch.setattr(simulate, "flower_available", lambda: False)
    result = CliRunner().invoke(app, ["simulate", "--learners", "2"])
    assert result.exit_code == 2
    assert "make flower-env" in result.output


def _flwr_importers(root: Path) -> list[str]:
    found: set[str] = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n == "flwr" or n.startswith("flwr.") for n in names):
                found.add(str(path.relative_to(ROOT)))
    return sorted(found)


def test_flwr_is_imported_only_by_the_lab_simulate_package() -> None:
    for package in ("proto", "coordinator", "client"):
        assert _flwr_importers(ROOT / package) == [], package
    assert _flwr_importers(ROOT / "lab") == ["lab/ftis/lab/simulate/flower.py"]
    assert "flwr" not in (ROOT / "lab" / "pyproject.toml").read_text()
