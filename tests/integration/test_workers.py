"""``ftis-coordinator serve --workers 2`` on PostgreSQL and on SQLite: two processes on
one port hand out each task number once and keep every node's lease limit, because
leases, the draw counter and quotas live in the database (on SQLite the workers' writers
queue on one file lock, ``state/write_lock.py``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from ftis.coordinator.config import CoordinatorConfig
from ftis.coordinator.state.sql import SqlState
from ftis.lab.harness.coordinator import (
    build_bundle,
    model_card,
    register_envelope,
    seal_bundle,
    signed,
)
from ftis.protocol.errors import ErrorCode
from ftis.protocol.identity import NodeIdentity
from ftis.tasks import HeldoutSplit, TaskSource
from ftis.v1 import swarm_pb2, swarm_pb2_grpc

LIMIT = 6  # max_outstanding_leases
QUOTA = 3  # bundles_per_minute
BLOCK = 4  # task_number_block: small, so that both workers go through several blocks


@pytest.fixture(params=["postgresql", "sqlite"])
def two_workers(request, tmp_path):
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'workers.db'}"
    else:
        url = request.getfixturevalue("postgres_database")()
    yield from _two_workers(tmp_path, url, {})


def _two_workers(tmp_path, url: str, extra: dict):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"max_outstanding_leases": LIMIT, "require_tokenizer": False,
                               "bundles_per_minute": QUOTA, "task_number_block": BLOCK,
                               "registrations_per_host_per_minute": 1e6,
                               "registrations_per_minute": 1e6, **extra}))
    ready = tmp_path / "ready.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ftis.coordinator.cli.main", "serve", "--workers", "2",
         "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0", "--db", url,
         "--config", str(cfg), "--ready-file", str(ready), "--log-level", "WARNING",
         "--http-listen", "none"],
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 120
    while not ready.exists():
        assert proc.poll() is None, f"serve --workers 2 exited with {proc.returncode}"
        assert time.monotonic() < deadline, "workers not ready"
        time.sleep(0.1)
    yield json.loads(ready.read_text())["listen"], url, proc
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0


def _worker_pids(proc: subprocess.Popen) -> set[int]:
    import psutil

    return {c.pid for c in psutil.Process(proc.pid).children()}


def test_two_workers_share_leases_counter_and_limits(two_workers):
    listen, url, proc = two_workers
    assert len(_worker_pids(proc)) == 2
    identities = [NodeIdentity.generate() for _ in range(4)]

    def run(identity: NodeIdentity, k: int) -> tuple[list[str], list[int]]:
        # a fresh channel per call: SO_REUSEPORT spreads connections over both workers
        granted, codes = [], []
        for _ in range(6):
            with grpc.insecure_channel(listen) as channel:
                stub = swarm_pb2_grpc.SwarmStub(channel)
                if not granted and not codes:
                    reply = stub.Register(swarm_pb2.RegisterRequest(envelope=register_envelope(
                        identity, model_card(), int(time.time() * 1000))), timeout=30)
                    assert reply.error.code == 0, reply.error
                request = signed(swarm_pb2.LeaseTasksRequest(
                    node_id=identity.node_id, count=2, group_size=2, max_new_tokens=16),
                    "LeaseTasks", identity, int(time.time() * 1000))
                reply = stub.LeaseTasks(request, timeout=30)
                codes.append(reply.error.code)
                granted += [x.task_id for x in reply.leases]
        return granted, codes

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(run, identities, range(4)))
    for granted, codes in results:
        # 6 requests of 2 against a limit of 6: exactly 3 granted, 3 refused, on any worker
        assert len(granted) == LIMIT
        assert sorted(codes) == [0, 0, 0] + [ErrorCode.LEASE_LIMIT] * 3
    state = SqlState(url)
    try:
        reserved = state.task_numbers_reserved()
        tasks = [t for granted, _ in results for t in granted]
        assert len(set(tasks)) == len(tasks) == 4 * LIMIT
        # each lease's task number, recovered from its task (number n is tasks.at(n))
        config = CoordinatorConfig(db=url, task_number_block=BLOCK)
        source = TaskSource(list(config.tasks), seed=config.task_seed,
                            split=HeldoutSplit(config.heldout_fraction), part="train")
        by_task = {}
        for n in range(reserved):
            k, entry = source.at(n)
            by_task[(k, entry.dataset, entry.index)] = n
        assert len(by_task) == reserved  # the mapping is one to one here
        leases = [state.get_lease_by_task(t) for t in tasks]
        numbers = [by_task[(x.spec_index, x.entry.dataset, x.entry.index)] for x in leases]
        # no task number handed out twice, by either worker, and every one reserved
        assert len(set(numbers)) == 4 * LIMIT
        assert max(numbers) < reserved
        # blocks of BLOCK (workers still running: no rest given back): 12 granted
        # requests of 2 reserved at least 6 blocks and at most one block each
        assert reserved % BLOCK == 0 and 4 * LIMIT <= reserved <= BLOCK * (4 * LIMIT // 2)
    finally:
        state.close()


def test_the_bundle_quota_holds_across_workers(two_workers):
    """Bundle quotas are counted from the database's verdict rows: a node that sends
    its bundles over fresh connections (spread over both workers) still gets exactly
    ``bundles_per_minute`` accepted."""
    from types import SimpleNamespace

    listen, _url, _proc = two_workers
    node = NodeIdentity.generate()
    with grpc.insecure_channel(listen) as channel:
        stub = swarm_pb2_grpc.SwarmStub(channel)
        reply = stub.Register(swarm_pb2.RegisterRequest(envelope=register_envelope(
            node, model_card(), int(time.time() * 1000))), timeout=30)
        assert reply.error.code == 0, reply.error
        leased = stub.LeaseTasks(signed(swarm_pb2.LeaseTasksRequest(
            node_id=node.node_id, count=LIMIT, group_size=2, max_new_tokens=16),
            "LeaseTasks", node, int(time.time() * 1000)), timeout=30)
    assert leased.error.code == 0 and len(leased.leases) == LIMIT
    codes = []
    for k, lease in enumerate(leased.leases):
        record = SimpleNamespace(task_id=lease.task_id, lease_id=lease.lease_id,
                                 group_size=2, max_new_tokens=16,
                                 entry=SimpleNamespace(answer="1", question=lease.question))
        envelope = seal_bundle(build_bundle(record, node, seed=k), node)
        with grpc.insecure_channel(listen) as channel:  # a new connection each time
            reply = swarm_pb2_grpc.SwarmStub(channel).SubmitBundle(
                swarm_pb2.SubmitBundleRequest(envelope=envelope), timeout=30)
        codes.append(reply.error.code)
    assert sorted(codes) == [0] * QUOTA + [ErrorCode.RATE_LIMITED] * (LIMIT - QUOTA), codes


MIX = [{"dataset": "chain_sum"}, {"dataset": "products"}, {"dataset": "gcd"}]


def test_two_workers_lease_each_node_its_branch_from_one_counter(tmp_path, postgres_database):
    """Branches defined before start: both workers read them (each its own cache), every
    assigned node gets only its branch's datasets on either worker, and no task number
    is handed out twice across branches and workers."""
    from ftis.coordinator.state.base import BranchRecord

    url = postgres_database()
    state = SqlState(url)
    state.define_branches([BranchRecord("b0", ("chain_sum",)),
                           BranchRecord("b1", ("products", "gcd"))], 0)
    state.close()
    fixture = _two_workers(tmp_path, url, {"tasks": MIX, "max_outstanding_leases": 64})
    listen, url, _proc = next(fixture)
    try:
        identities = [NodeIdentity.generate() for _ in range(3)]
        for identity in identities:
            with grpc.insecure_channel(listen) as channel:
                reply = swarm_pb2_grpc.SwarmStub(channel).Register(swarm_pb2.RegisterRequest(
                    envelope=register_envelope(identity, model_card(),
                                               int(time.time() * 1000))), timeout=30)
                assert reply.error.code == 0, reply.error
        state = SqlState(url)
        state.assign_branches({identities[0].node_id: "b0", identities[1].node_id: "b1"})
        state.close()

        def run(identity: NodeIdentity) -> list[str]:
            got = []
            for _ in range(6):  # fresh connections: both workers serve each node
                with grpc.insecure_channel(listen) as channel:
                    reply = swarm_pb2_grpc.SwarmStub(channel).LeaseTasks(signed(
                        swarm_pb2.LeaseTasksRequest(node_id=identity.node_id, count=8,
                                                    group_size=2, max_new_tokens=16),
                        "LeaseTasks", identity, int(time.time() * 1000)), timeout=30)
                assert reply.error.code == 0, reply.error
                got += [x.task_id for x in reply.leases]
            return got

        with ThreadPoolExecutor(3) as pool:
            granted = list(pool.map(run, identities))
        state = SqlState(url)
        try:
            leases = [[state.get_lease_by_task(t) for t in ids] for ids in granted]
        finally:
            state.close()
        assert {x.dataset for x in leases[0]} == {"chain_sum"}
        assert {x.branch for x in leases[0]} == {"b0"}
        assert {x.dataset for x in leases[1]} == {"products", "gcd"}
        assert {x.dataset for x in leases[2]} == {"chain_sum", "products", "gcd"}
        assert {x.branch for x in leases[2]} == {None}
        everything = [x for group in leases for x in group]
        assert len(everything) == 3 * 48
        # each task number maps to one (position, entry index): none handed out twice
        assert len({(x.spec_index, x.entry.index) for x in everything}) == len(everything)
    finally:
        next(fixture, None)
