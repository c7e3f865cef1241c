"""MERIT branches over the real servers: ``ftis-coordinator serve`` as a subprocess,
``ftis-admin branches ...`` as subprocesses against its admin listener, and signed
LeaseTasks / SubmitBundle calls from registered nodes on its swarm listener."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
from serve_process import start_serve, stop_serve

from ftis.coordinator.state.sql import SqlState
from ftis.lab.harness.coordinator import (
    build_bundle,
    model_card,
    register_envelope,
    seal_bundle,
    signed,
)
from ftis.protocol.exit_codes import ExitCode
from ftis.protocol.identity import NodeIdentity
from ftis.v1 import swarm_pb2, swarm_pb2_grpc

pytestmark = pytest.mark.integration

PLAN = (Path(__file__).resolve().parents[2] / "experiments" / "results"
        / "merit-plans-2026-11-24" / "plan-easy-seed0.json")
# the plan's four families, with its easy configs (experiments/merit/families_easy.json)
ONE_DIGIT = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
MIX = [
    {"dataset": "products", "config": ONE_DIGIT},
    {"dataset": "chain_sum", "config": ONE_DIGIT},
    {"dataset": "gcd", "config": {"min_numbers": 2, "max_numbers": 2, "max_value": 30}},
    {"dataset": "letter_counting"},
]


@pytest.fixture
def server(tmp_path: Path):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"tasks": MIX, "require_tokenizer": False,
                               "heldout_fraction": 0.2, "max_outstanding_leases": 200,
                               "registrations_per_host_per_minute": 1e6,
                               "registrations_per_minute": 1e6}))
    db = tmp_path / "coord.db"
    proc, ready = start_serve(tmp_path, "--config", str(cfg), "--log-level", "WARNING",
                              "--http-listen", "none", db=db, stdout=subprocess.DEVNULL)
    try:
        yield ready, f"sqlite:///{db}"
    finally:
        stop_serve(proc)


def _admin(address: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ftis.coordinator.admin_cli.main", "--admin", address, *args],
        capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})


def _admin_json(address: str, *args: str) -> dict:
    result = _admin(address, *args, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def _now() -> int:
    return int(time.time() * 1000)


def test_branches_plan_assign_show_and_leases_over_grpc(server, tmp_path: Path) -> None:
    ready, url = server
    admin = ready["admin"]
    channel = grpc.insecure_channel(ready["listen"])
    stub = swarm_pb2_grpc.SwarmStub(channel)
    alice, bob, carol = (NodeIdentity.generate() for _ in range(3))
    for who in (alice, bob, carol):
        reply = stub.Register(swarm_pb2.RegisterRequest(
            envelope=register_envelope(who, model_card(), _now())), timeout=30)
        assert reply.error.code == 0, reply.error

    # a family outside the task mix is refused with its code, and nothing is defined
    bad = tmp_path / "bad-plan.json"
    bad.write_text(json.dumps({"branches": {"conflict_aware": [["products"],
                                                              ["leg_counting"]]}}))
    refused = _admin(admin, "branches", "plan", str(bad), "--apply")
    assert refused.returncode == ExitCode.ADMIN_ERROR_RESPONSE
    assert "BRANCH_INVALID (146)" in refused.stderr and "leg_counting" in refused.stderr
    assert _admin_json(admin, "branches", "show")["branches"] == []

    applied = _admin_json(admin, "branches", "plan", str(PLAN), "--apply")
    assert [(b["name"], b["families"], b["tokens"]) for b in applied["branches"]] == [
        ("b0", ["products"], 1000), ("b1", ["chain_sum", "gcd", "letter_counting"], 3277)]
    got = _admin_json(admin, "branches", "assign", alice.node_id[:12], "b0")
    assert got["assignments"] == [{"node_id": alice.node_id, "branch": "b0"}]
    _admin_json(admin, "branches", "assign", bob.node_id, "b1")
    unknown = _admin(admin, "branches", "assign", carol.node_id, "b7")
    assert unknown.returncode == ExitCode.ADMIN_ERROR_RESPONSE
    assert "BRANCH_UNKNOWN (145)" in unknown.stderr
    no_node = _admin(admin, "branches", "assign", "f" * 32, "b0")
    assert no_node.returncode == ExitCode.ADMIN_ERROR_RESPONSE
    assert "NODE_UNKNOWN (110)" in no_node.stderr
    shown = _admin(admin, "nodes", "show", alice.node_id, "--json")
    assert json.loads(shown.stdout)["node"]["branch"] == "b0"

    def lease(who: NodeIdentity, count: int) -> list[swarm_pb2.TaskLease]:
        request = signed(swarm_pb2.LeaseTasksRequest(
            node_id=who.node_id, count=count, group_size=2, max_new_tokens=16),
            "LeaseTasks", who, _now())
        reply = stub.LeaseTasks(request, timeout=30)
        assert reply.error.code == 0, reply.error
        return list(reply.leases)

    leased = {who.node_id: [x for _ in range(4) for x in lease(who, 16)]
              for who in (alice, bob, carol)}
    assert {x.dataset for x in leased[alice.node_id]} == {"products"}
    assert {x.dataset for x in leased[bob.node_id]} == {"chain_sum", "gcd", "letter_counting"}
    assert {x.dataset for x in leased[carol.node_id]} == {
        "products", "chain_sum", "gcd", "letter_counting"}
    tasks = [x.task_id for leases in leased.values() for x in leases]
    assert len(set(tasks)) == len(tasks) == 3 * 64

    # alice answers one of her leases: verification finds the task from the lease
    first = leased[alice.node_id][0]
    state = SqlState(url)
    try:
        stored = state.get_lease_by_task(first.task_id)
        assert stored.branch == "b0" and stored.dataset == "products"
        assert state.get_lease_by_task(leased[carol.node_id][0].task_id).branch is None
    finally:
        state.close()
    record = SimpleNamespace(task_id=first.task_id, lease_id=first.lease_id, group_size=2,
                             max_new_tokens=16,
                             entry=SimpleNamespace(answer=stored.entry.answer,
                                                   question=first.question))
    reply = stub.SubmitBundle(swarm_pb2.SubmitBundleRequest(
        envelope=seal_bundle(build_bundle(record, alice), alice)), timeout=30)
    assert reply.error.code == 0, reply.error
    assert list(reply.verified_rewards) == [1.0, 0.0]

    shown = _admin_json(admin, "branches", "show")
    assert [(b["name"], b["node_ids"], b["bundles_accepted"]) for b in shown["branches"]] == [
        ("b0", [alice.node_id], 1), ("b1", [bob.node_id], 0)]
    assert shown["task_mix"] == ["products", "chain_sum", "gcd", "letter_counting"]
    assert shown["unassigned_nodes"] == 1
    table = _admin(admin, "branches", "show")
    assert table.returncode == 0 and "chain_sum, gcd, letter_counting" in table.stdout

    # unassign alice: the whole mix again; round robin then places alice and carol
    assert _admin_json(admin, "branches", "unassign", alice.node_id)["assignments"] == [
        {"node_id": alice.node_id, "branch": ""}]
    assert len({x.dataset for x in lease(alice, 32)}) > 1
    spread = _admin_json(admin, "branches", "assign", "--round-robin")["assignments"]
    # b0 is empty, b1 has bob: the first goes to b0, the second ties (1:1) -> b0
    assert sorted(a["node_id"] for a in spread) == sorted([alice.node_id, carol.node_id])
    assert [a["branch"] for a in spread] == ["b0", "b0"]
    # clear: no branches, every node on the whole mix
    assert _admin_json(admin, "branches", "clear")["branches"] == []
    shown = _admin_json(admin, "branches", "show")
    assert shown["branches"] == [] and shown["unassigned_nodes"] == 3
    assert len({x.dataset for x in lease(bob, 32)}) > 1
    channel.close()
