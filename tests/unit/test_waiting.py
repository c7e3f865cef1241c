"""ftis.coordinator.waiting: a handler inline on the event loop waits for a future
without blocking the loop; elsewhere the wait is ``Future.result``."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
from sqlalchemy.util import greenlet_spawn

from ftis.coordinator.waiting import inline, wait_future


def _later(value: object, delay_s: float, pool: ThreadPoolExecutor) -> Future:
    def work() -> object:
        time.sleep(delay_s)
        if isinstance(value, Exception):
            raise value
        return value
    return pool.submit(work)


def test_in_a_thread_it_is_future_result() -> None:
    with ThreadPoolExecutor(1) as pool:
        assert not inline()
        assert wait_future(_later(7, 0.01, pool)) == 7
        with pytest.raises(ValueError, match="bad"):
            wait_future(_later(ValueError("bad"), 0.0, pool))
        with pytest.raises(TimeoutError):
            wait_future(_later(1, 0.5, pool), timeout=0.01)


def test_in_a_greenlet_on_the_loop_the_loop_runs_meanwhile() -> None:
    pool = ThreadPoolExecutor(2)
    loop_thread: list[int] = []

    def handler(value: object, delay_s: float, timeout: float | None = None) -> object:
        assert inline()
        loop_thread.append(threading.get_ident())  # runs on the loop's own thread
        return wait_future(_later(value, delay_s, pool), timeout)

    async def main() -> tuple[list[object], int]:
        ticks = 0
        done = asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not done.is_set():
                ticks += 1
                await asyncio.sleep(0.001)

        async def call(value: object, delay_s: float, timeout: float | None = None) -> object:
            try:
                return await greenlet_spawn(handler, value, delay_s, timeout)
            except (ValueError, TimeoutError) as exc:
                return type(exc).__name__

        tick = asyncio.create_task(ticker())
        results = await asyncio.gather(call(1, 0.05), call(ValueError("x"), 0.01),
                                       call(3, 0.3, 0.02))
        done.set()
        await tick
        return list(results), ticks

    try:
        results, ticks = asyncio.run(main())
    finally:
        pool.shutdown(wait=True)
    assert results == [1, "ValueError", "TimeoutError"]
    assert len(set(loop_thread)) == 1 and loop_thread[0] == loop_thread[-1]
    assert ticks >= 10  # 50 ms of waiting: the loop was not blocked
