"""A node paused by the volunteer settings between rounds holds no lease, and resumes
with the same identity and round counter; ``ftis-client status`` against a real
coordinator (reachable, while the node is paused, and unreachable)."""

from __future__ import annotations

import json
import sqlite3
from datetime import datetime

import pytest
from typer.testing import CliRunner

from ftis.client.cli.main import app
from ftis.client.node.config import ClientConfig
from ftis.client.node.runner import RoundResult, VolunteerNode
from ftis.client.settings.gate import RoundGate, node_state
from ftis.client.settings.model import VolunteerSettings, env_name, resolve_settings
from ftis.client.settings.schedule import Decision, MachineSnapshot
from ftis.client.swarm.connection import SwarmConnection
from ftis.lab.experiment.launcher import start_coordinator
from ftis.lab.experiment.report import read_metrics
from ftis.protocol.exit_codes import ExitCode
from ftis.protocol.identity import NodeIdentity

pytestmark = pytest.mark.integration


def _leases(db, node_id: str) -> tuple[int, int]:
    """(all leases, unanswered leases) of ``node_id`` in the coordinator's database."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
        total, = con.execute("SELECT count(*) FROM leases WHERE node_id = ?",
                             (node_id,)).fetchone()
        open_, = con.execute("SELECT count(*) FROM leases WHERE node_id = ? AND bundle_id "
                             "IS NULL", (node_id,)).fetchone()
    return total, open_


def _status(*args: str) -> tuple[int, dict]:
    result = CliRunner().invoke(app, ["status", "--json", *args])
    return result.exit_code, json.loads(result.stdout)


def test_paused_node_holds_no_lease_and_resumes(tmp_path, tiny_model_dir, tiny_policy_factory,
                                                monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    for key in VolunteerSettings.keys():
        monkeypatch.delenv(env_name(key), raising=False)
    config = tmp_path / "coordinator.json"
    config.write_text(json.dumps({"tasks": [{"dataset": "letter_counting"}], "task_seed": 1}))
    swarm = tmp_path / "swarm"
    proc, listen, _ = start_coordinator(swarm, ["--config", str(config)])
    out, key = tmp_path / "node", tmp_path / "node" / "node_key.pem"
    flags = ["--coordinator", listen, "--out", str(out), "--key-file", str(key)]
    try:
        policy = tiny_policy_factory()
        identity = NodeIdentity.load_or_create(key)
        cfg = ClientConfig(coordinator=listen, model=str(tiny_model_dir), rounds=3,
                           local_groups=2, external_groups=0, group_size=4,
                           max_new_tokens=8, learning_rate=1e-3, out=out, key_file=key)
        conn = SwarmConnection(listen, identity, policy.card,
                               tokenizer_json=policy.tokenizer_json)
        conn.register()
        node = VolunteerNode(cfg, policy, conn)

        battery = {"on": False}
        paused_at: list[dict] = []

        def probe(need_idle: bool) -> MachineSnapshot:
            return MachineSnapshot(now=datetime.now(), on_battery=battery["on"])

        def on_round(result: RoundResult) -> None:
            assert result.metrics.get("bundles_rejected", 0) == 0
            if result.round == 1:
                battery["on"] = True  # unplugged during round 1: it finishes, then pauses

        def on_change(decision: Decision) -> None:
            node_state(out, gate, "running" if decision.may_run else "paused", decision,
                       node_id=identity.node_id, coordinator=listen, model=cfg.model,
                       round=node.round)

        def sleep(seconds: float) -> None:  # called only while paused
            if not battery["on"]:
                # the rest of a poll interval the gate sleeps out after the plug-in below
                # (the status call can take less than the 0.01 s poll): not a new pause
                return
            code, status = _status(*flags)
            paused_at.append({"round": node.round, "leases": _leases(
                swarm / "coordinator.db", identity.node_id), "status": status, "code": code})
            battery["on"] = False  # plugged in again

        gate = RoundGate(lambda: resolve_settings(env={}), probe, on_change=on_change,
                         sleep=sleep, poll_seconds=0.01)
        node.run(on_round, before_round=gate)
        conn.close()

        # paused once, after round 1, holding no lease (round 1 leased and answered some)
        assert len(paused_at) == 1, paused_at
        pause = paused_at[0]
        assert pause["round"] == 1
        total, unanswered = pause["leases"]
        assert total == cfg.local_groups and unanswered == 0
        # status while paused: the state file's reason and the coordinator's numbers
        assert pause["code"] == ExitCode.OK, pause["status"]
        st = pause["status"]
        assert st["node_id"] == identity.node_id and st["state"] == "paused"
        assert "on battery" in st["reason"]
        assert st["swarm"]["reachable"] and st["swarm"]["quarantined"] is False
        assert 0.0 <= st["swarm"]["reputation"] <= 1.0
        assert st["rounds_done"] == 1 and st["coordinator"] == listen

        # resumed with the same identity and round counter, and finished
        records = read_metrics(out / "metrics.jsonl")
        assert [r["round"] for r in records] == [1, 2, 3]
        assert {r["node_id"] for r in records} == {identity.node_id}
        assert node.round == 3 and (out / "checkpoints" / "latest").read_text() == "step-000003"
        assert _leases(swarm / "coordinator.db", identity.node_id) == (3 * cfg.local_groups, 0)

        code, st = _status(*flags)
        assert code == ExitCode.OK and st["rounds_done"] == 3
        assert st["last_reward"] == records[-1]["reward_mean"]
        assert st["checkpoint"] == "step-000003" and st["model"] == cfg.model
    finally:
        proc.terminate()
        proc.wait(30)

    # the coordinator is gone: status says so and still shows the local numbers
    code, st = _status(*flags, "--timeout", "2")
    assert code == ExitCode.CLIENT_COORDINATOR_UNREACHABLE
    assert st["swarm"]["reachable"] is False and "unreachable" in st["swarm"]["error"]
    assert st["rounds_done"] == 3 and st["node_id"] == identity.node_id
