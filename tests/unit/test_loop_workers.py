"""Worker processes served from the event loop (``coordinator/loop_workers.py``): calls
from handler greenlets on a running loop get their own answers, errors come back as
raised, a dead worker is replaced and the call tried again, a call past its timeout
kills its worker, and the re-scoring pool uses these workers when its handler is inline.

Worker functions are from the standard library, so the spawned workers can unpickle
them without importing this module."""

from __future__ import annotations

import asyncio
import math
import operator
import os
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy.util import greenlet_spawn

from ftis.coordinator.loop_workers import LoopWorkers
from ftis.coordinator.rescoring import RescoringPool
from ftis.coordinator.worker_pool import PoolFailed


def run_inline(*fns: Callable[[], Any]) -> list[Any]:
    """Run each ``fn`` as a handler inline on one event loop (a ``greenlet_spawn``
    greenlet each, concurrently) and return their results or exceptions, in order."""

    async def main() -> list[Any]:
        return await asyncio.gather(*(greenlet_spawn(fn) for fn in fns),
                                    return_exceptions=True)

    return asyncio.run(main())


@pytest.fixture
def workers() -> LoopWorkers:
    pool = LoopWorkers(2)
    pool.start(wait_s=60, warm=os.getpid)
    yield pool
    pool.close()


def test_concurrent_calls_get_their_own_answers(workers: LoopWorkers) -> None:
    got = run_inline(*[lambda i=i: workers.call(operator.mul, i, 7, timeout=30)
                       for i in range(40)])
    assert got == [i * 7 for i in range(40)]
    pids = set(run_inline(*[lambda: workers.call(os.getpid, timeout=30)] * 8))
    assert pids <= set(workers.worker_pids()) and len(workers.worker_pids()) == 2
    assert os.getpid() not in pids


def test_an_exception_in_the_worker_is_raised_to_the_caller(workers: LoopWorkers) -> None:
    (error,) = run_inline(lambda: workers.call(math.sqrt, -1.0, timeout=30))
    assert isinstance(error, ValueError) and "math domain error" in str(error)
    assert run_inline(lambda: workers.call(math.sqrt, 16.0, timeout=30)) == [4.0]


def test_a_killed_worker_is_replaced_and_the_call_tried_again(workers: LoopWorkers) -> None:
    before = set(workers.worker_pids())
    for pid in before:
        os.kill(pid, signal.SIGKILL)
    time.sleep(0.2)
    assert run_inline(lambda: workers.call(operator.add, 2, 3, timeout=60)) == [5]
    after = set(workers.worker_pids())
    assert after and not after & before


def test_a_call_past_its_timeout_kills_its_worker_and_others_go_on(
        workers: LoopWorkers) -> None:
    slow, fast = run_inline(lambda: workers.call(time.sleep, 30, timeout=0.5),
                            lambda: workers.call(operator.add, 1, 1, timeout=30))
    assert isinstance(slow, TimeoutError) and fast == 2
    assert len(workers.worker_pids()) <= 2
    assert run_inline(*[lambda: workers.call(operator.neg, 4, timeout=60)] * 3) == [-4] * 3


def test_a_worker_that_keeps_dying_fails_the_call() -> None:
    pool = LoopWorkers(1)
    try:
        (error,) = run_inline(lambda: pool.call(os._exit, 3, timeout=60))
        assert isinstance(error, PoolFailed)
    finally:
        pool.close()


def test_closed_workers_refuse_calls() -> None:
    pool = LoopWorkers(1)
    pool.close()
    (error,) = run_inline(lambda: pool.call(operator.add, 1, 1, timeout=5))
    assert isinstance(error, RuntimeError) and "closed" in str(error)
    with pytest.raises(ValueError):
        LoopWorkers(0)


def test_rescoring_inline_uses_the_loop_workers_and_threads_the_pool() -> None:
    from test_rescoring import _bundle, _lease

    pool = RescoringPool(workers=1, budget_s=5.0, loop_served=True)
    try:
        pool.start(wait_s=60)
        bundle = _bundle(["<answer>3</answer>", "<answer>4</answer>", "3"], [1.0, 1.0, None])
        assert run_inline(lambda: pool.rescore(_lease(), bundle)) == [([1.0, 0.0, 1.0], 1)]
        assert pool._pool._pool is None  # noqa: SLF001 - the executor never started
        assert len(pool._loop_workers.worker_pids()) == 1  # noqa: SLF001
        assert pool.rescore(_lease(), bundle) == ([1.0, 0.0, 1.0], 1)  # from a thread
        assert pool._pool._pool is not None  # noqa: SLF001
    finally:
        pool.close()


def test_an_unreadable_reply_fails_only_its_call(workers: LoopWorkers,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A reply that cannot be unpickled here (say an exception class that cannot be
    rebuilt) fails its call with RuntimeError; the worker goes on serving."""
    import pickle as real

    from ftis.coordinator import loop_workers

    class Once:
        dumps = staticmethod(real.dumps)
        HIGHEST_PROTOCOL = real.HIGHEST_PROTOCOL
        broken = True

        @classmethod
        def loads(cls, data: bytes):
            if cls.broken:
                cls.broken = False
                raise TypeError("__init__() missing 1 required positional argument")
            return real.loads(data)

    monkeypatch.setattr(loop_workers, "pickle", Once)
    (error,) = run_inline(lambda: workers.call(operator.add, 1, 2, timeout=30))
    assert isinstance(error, RuntimeError) and "unreadable reply" in str(error)
    assert run_inline(*[lambda: workers.call(operator.add, 1, 2, timeout=30)] * 4) == [3] * 4
    assert len(workers.worker_pids()) == 2
