"""The State contract under concurrency: the lost race for a lease writes nothing, and
``lease_block`` never reserves a task number twice nor exceeds ``max_outstanding``,
with threads sharing one SqlState and with processes each opening their own."""

from __future__ import annotations

import multiprocessing
import threading
from collections import Counter
from typing import Any

import pytest
from state_records import T0, Recorder, add_node, lease, make_leases, new_bundle, rows

from ftis.coordinator.reputation import Evidence
from ftis.coordinator.state.base import Verdict
from ftis.coordinator.state.sql import TASK_BLOCK, BundleRow, EvidenceRow, SqlState, VerdictRow
from ftis.coordinator.testing.postgres import PostgresServer
from ftis.protocol.errors import ErrorCode, FtisError


def _run_threads(n: int, target: Any) -> list[Any]:
    """Run ``target(i, barrier)`` in ``n`` threads; returns results (or exceptions)."""
    barrier = threading.Barrier(n)
    results: list[Any] = [None] * n

    def run(i: int) -> None:
        try:
            results[i] = target(i, barrier)
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return results


@pytest.mark.parametrize("optimistic", [False, True])
def test_lost_race_for_a_lease_writes_nothing(state: SqlState, optimistic: bool) -> None:
    """Also with ``expected`` (the optimistic commit): both threads hold the same
    snapshot, the loser's compare-and-swap fails and its locked retry finds the lease
    answered."""
    a = add_node(state, "alice").node_id
    leases = [lease(a, n) for n in range(4)]
    state.insert_leases(leases)
    event = Evidence("bundle_verified", 1.0)
    for the_lease in leases:
        def commit(i: int, barrier: threading.Barrier, the_lease=the_lease) -> Any:
            bundle = new_bundle(the_lease, tag=f"thread {i}")
            verdict = Verdict(a, bundle.bundle_id, 0, "accepted", bundle=bundle,
                              evidence=(event,))
            expected = state.get_node(a) if optimistic else None
            barrier.wait()
            return state.commit_submission(verdict, T0, Recorder([event], T0),
                                           expected=expected)

        results = _run_threads(2, commit)
        won = [r for r in results if not isinstance(r, BaseException)]
        lost = [r for r in results if isinstance(r, BaseException)]
        assert len(won) == 1 and len(lost) == 1, results
        assert isinstance(lost[0], FtisError) and lost[0].code == ErrorCode.BUNDLE_REPLAYED
        assert state.get_lease_by_task(the_lease.task_id).bundle_id == won[0].bundle.bundle_id
    # exactly one bundle, one verdict and one evidence row per lease
    assert len(rows(state, BundleRow)) == 4
    assert len(rows(state, VerdictRow)) == 4
    assert len(rows(state, EvidenceRow)) == 4
    node = state.get_node(a)
    assert (node.bundles_accepted, node.bundles_rejected, node.rep_good) == (4, 0, 4.0)


def _check_blocks(state: SqlState, owners: list[str], got: list[tuple[str, str]],
                  max_outstanding: int) -> None:
    numbers = [int(task.split("-")[1]) for _, task in got]
    assert len(numbers) == len(set(numbers)), "a task number was handed out twice"
    # every number handed out was reserved from the counter (in blocks of TASK_BLOCK)
    assert max(numbers) < state.task_numbers_reserved()
    per_owner = Counter(owner for owner, _ in got)
    for owner in owners:
        assert per_owner[owner] == max_outstanding, per_owner
        assert state.count_outstanding_leases(owner, T0) == max_outstanding


def test_lease_block_threads(state: SqlState) -> None:
    owners = [add_node(state, name).node_id for name in ("alice", "bob")]

    def lease_many(i: int, barrier: threading.Barrier) -> list[tuple[str, str]]:
        got: list[tuple[str, str]] = []
        barrier.wait()
        for k in range(8):
            owner = owners[(i + k) % 2]
            try:
                block = state.lease_block(owner, 2, T0, 6, make_leases(owner, 2))
            except FtisError as exc:
                assert exc.code == ErrorCode.LEASE_LIMIT
                continue
            got += [(owner, x.task_id) for x in block]
        return got

    results = _run_threads(4, lease_many)
    assert not [r for r in results if isinstance(r, BaseException)], results
    got = [x for r in results for x in r]
    _check_blocks(state, owners, got, 6)
    # threads that find no block left may each reserve one (at most one per thread
    # here: a thread takes at most 16 numbers)
    assert state.task_numbers_reserved() <= 4 * TASK_BLOCK


def _lease_worker(url: str, owners: list[str], first: int, start: Any, out: Any) -> None:
    """Process body: its own SqlState; 8 blocks of 2 alternating between the owners."""
    try:
        state = SqlState(url)
        got, limited = [], 0
        start.wait()
        for k in range(8):
            owner = owners[(first + k) % 2]
            try:
                block = state.lease_block(owner, 2, T0, 6, make_leases(owner, 2))
            except FtisError as exc:
                if exc.code != ErrorCode.LEASE_LIMIT:
                    raise
                limited += 1
                continue
            got += [(owner, x.task_id) for x in block]
        state.close()  # gives back the rest of its block if nobody reserved after it
        out.put(("ok", got, limited))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        out.put(("error", repr(exc), 0))


PROCESSES = 4


def test_lease_block_processes(state: SqlState, state_url: str) -> None:
    """Four processes, each with its own SqlState (and, on SQLite, its own file handle:
    BEGIN IMMEDIATE queues them instead of deadlocking)."""
    owners = [add_node(state, name).node_id for name in ("alice", "bob")]
    state.engine.dispose()  # no pooled connection crosses the fork
    ctx = multiprocessing.get_context("fork")
    start, out = ctx.Event(), ctx.Queue()
    workers = [ctx.Process(target=_lease_worker, args=(state_url, owners, i, start, out))
               for i in range(PROCESSES)]
    for w in workers:
        w.start()
    start.set()
    results = [out.get(timeout=60) for _ in workers]
    for w in workers:
        w.join(timeout=30)
        assert w.exitcode == 0
    assert all(r[0] == "ok" for r in results), results
    got = [x for r in results for x in r[1]]
    assert sum(r[2] for r in results) == 8 * PROCESSES - len(got) // 2  # the rest hit the limit
    _check_blocks(state, owners, got, 6)
    # each process took its numbers from one block of its own: consecutive numbers
    for r in results:
        mine = sorted(int(task.split("-")[1]) for _, task in r[1])
        first = mine[0] if mine else 0
        assert mine == list(range(first, first + len(mine))), mine
    assert state.task_numbers_reserved() <= PROCESSES * TASK_BLOCK


def test_concurrent_first_open_migrates_once(postgres_server: PostgresServer) -> None:
    """Workers starting together on an empty PostgreSQL database: the advisory lock
    makes one of them migrate, the others find it at head."""
    url = postgres_server.url(postgres_server.create_database())

    def open_close(i: int, barrier: threading.Barrier) -> int:
        barrier.wait()
        opened = SqlState(url)
        try:
            return opened.task_numbers_reserved()
        finally:
            opened.close()

    assert _run_threads(3, open_close) == [0, 0, 0]


def test_hot_writes_from_handlers_on_the_event_loop_run_off_the_loop(state: SqlState) -> None:
    """Handlers inline on the event loop (``swarm_server = "aio-inline"``, one greenlet
    each): their lease blocks and submissions commit, each gets its own result, and no
    write transaction runs on the loop's thread (SQLite: the group commit's leader
    thread; PostgreSQL: the writer threads), so the loop serves others meanwhile."""
    import asyncio

    from sqlalchemy import event
    from sqlalchemy.util import greenlet_spawn

    owners = [add_node(state, name).node_id for name in ("alice", "bob", "carol")]
    writes_in: list[str] = []  # the thread of every INSERT / UPDATE / WITH statement

    def _record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.lstrip().split(None, 1)[0].upper() in ("INSERT", "UPDATE", "WITH"):
            writes_in.append(threading.current_thread().name)

    event.listen(state.engine, "before_cursor_execute", _record)
    loop_thread: list[str] = []

    def lease_and_submit(owner: str) -> tuple[int, int]:
        loop_thread.append(threading.current_thread().name)
        block = state.lease_block(owner, 2, T0, 6, make_leases(owner, 2))
        first = block[0]
        bundle = new_bundle(first, tag=owner)
        done = state.commit_submission(
            Verdict(owner, bundle.bundle_id, 0, "accepted", bundle=bundle), T0,
            expected=state.get_node(owner))
        assert done.bundle is not None
        return len(block), done.node.bundles_accepted

    async def main() -> list[tuple[int, int]]:
        return list(await asyncio.gather(
            *(greenlet_spawn(lease_and_submit, owner) for owner in owners)))

    assert asyncio.run(main()) == [(2, 1)] * 3
    assert len(set(loop_thread)) == 1
    assert len(writes_in) >= 6 and loop_thread[0] not in writes_in, writes_in
    assert len(rows(state, BundleRow)) == 3
