"""A process pool for verification work that must not run on the serving process's GIL.

Shared by :class:`~ftis.coordinator.rescoring.RescoringPool` (re-scoring completions) and
:class:`~ftis.coordinator.spot_check_pool.SpotChecker` (forward passes of held models).
Workers are started with ``spawn`` (never a fork of a threaded gRPC server); a pool broken
by a dead worker is replaced and the call tried once more in the fresh pool.
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from ftis.coordinator.waiting import wait_future

log = logging.getLogger(__name__)


class PoolFailed(RuntimeError):
    """The pool broke twice in a row on one call (a worker keeps dying)."""


class ProcessSet:
    """What every set of ``workers`` spawned processes shares: their number and their
    one-time set-up ``initializer(*initargs)`` (:class:`WorkerPool`,
    :class:`~ftis.coordinator.loop_workers.LoopWorkers`).

    Raises:
        ValueError: ``workers < 1``.
    """

    def __init__(self, workers: int, initializer: Callable[..., Any] | None = None,
                 initargs: tuple[Any, ...] = ()) -> None:
        if workers < 1:
            raise ValueError("workers must be >= 1")
        self.workers = workers
        self._initializer = initializer
        self._initargs = initargs
        self._lock = threading.Lock()


class WorkerPool(ProcessSet):
    """``workers`` processes of a ``ProcessPoolExecutor`` (:class:`ProcessSet`)."""

    def __init__(self, workers: int, initializer: Callable[..., Any] | None = None,
                 initargs: tuple[Any, ...] = ()) -> None:
        super().__init__(workers, initializer, initargs)
        self._pool: ProcessPoolExecutor | None = None

    def _executor(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ProcessPoolExecutor(
                    self.workers, mp_context=multiprocessing.get_context("spawn"),
                    initializer=self._initializer, initargs=self._initargs)
            return self._pool

    def _replace(self, broken: ProcessPoolExecutor) -> None:
        with self._lock:
            if self._pool is broken:
                self._pool = None
        broken.shutdown(wait=False, cancel_futures=True)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Start ``fn(*args)`` in a worker (the pool's processes start on first use)."""
        return self._executor().submit(fn, *args)

    def call(self, fn: Callable[..., Any], *args: Any, timeout: float) -> Any:
        """``fn(*args)`` in a worker, waiting at most ``timeout`` seconds
        (:func:`~ftis.coordinator.waiting.wait_future`: a handler inline on the event loop
        lets the loop serve other requests meanwhile).

        Raises:
            concurrent.futures.TimeoutError: no answer within ``timeout``.
            PoolFailed: the pool broke on this call and again in its replacement.
            Exception: whatever ``fn`` raised in the worker.
        """
        for attempt in (1, 2):
            pool = self._executor()
            try:
                return wait_future(pool.submit(fn, *args), timeout)
            except BrokenProcessPool:
                log.warning("worker pool broken; replacing it (attempt %d)", attempt)
                self._replace(pool)
        raise PoolFailed("worker pool failed twice")

    def worker_pids(self) -> list[int]:
        """Process ids of the running workers (empty before the first call)."""
        with self._lock:
            pool = self._pool
        return list(getattr(pool, "_processes", None) or {}) if pool is not None else []

    def close(self) -> None:
        """Stop the worker processes (idempotent)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
