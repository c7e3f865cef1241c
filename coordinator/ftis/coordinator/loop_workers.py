"""Worker processes served straight from the event loop, one pipe each, no thread between.

:class:`~ftis.coordinator.worker_pool.WorkerPool` (``concurrent.futures``'
``ProcessPoolExecutor``) hands every call through two threads of the serving process: its
manager thread and its queue's feeder thread, each taking the GIL and waking the next. For
the handlers that run inline on the ``grpc.aio`` event loop (``swarm_server =
"aio-inline"``) that is three thread hand-offs per call on a process whose GIL is the
bottleneck. Here the event loop's thread writes the request to an idle worker's pipe and
the loop reads the reply when the pipe becomes readable (``loop.add_reader``); the
handler's greenlet waits on an asyncio future meanwhile (:mod:`.waiting`).

* One call at a time per worker (so a write never waits on a worker busy with another
  call, and the loop never blocks on a full pipe); further calls wait in order, in memory.
* A worker whose call is not answered within the caller's ``timeout`` is killed and
  replaced (a stuck worker cannot hold its slot forever); a call still waiting for a
  worker is simply dropped.
* A worker that dies (EOF on its pipe) fails its call with :class:`WorkerDied` and is
  replaced; :meth:`LoopWorkers.call` tries the call once more in the fresh worker.
* Workers are started with ``spawn`` (never a fork of a threaded gRPC server) and exit
  when the serving process closes their pipe (or dies).

Every method but :meth:`start` and :meth:`close` must run on the event loop's thread,
inside a handler's greenlet (:func:`~ftis.coordinator.waiting.inline`); calls from other
threads use :class:`~ftis.coordinator.worker_pool.WorkerPool`.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import multiprocessing
import pickle
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from sqlalchemy.util import await_only

from ftis.coordinator.worker_pool import PoolFailed, ProcessSet

log = logging.getLogger(__name__)


class WorkerDied(RuntimeError):
    """The worker process serving a call exited before answering it."""


def _serve(conn: Connection, initializer: Callable[..., Any] | None,
           initargs: tuple[Any, ...]) -> None:
    """A worker's main loop: ``(fn, args)`` in, ``(ok, result or exception)`` out, one
    pickled message each, until the serving process closes the pipe."""
    if initializer is not None:
        initializer(*initargs)
    while True:
        try:
            request = conn.recv_bytes()
        except (EOFError, OSError):
            return
        try:
            fn, args = pickle.loads(request)
            reply: tuple[bool, Any] = (True, fn(*args))
        except BaseException as exc:  # noqa: BLE001 - sent back to the caller
            reply = (False, exc)
        try:
            payload = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # noqa: BLE001 - an unpicklable result or exception
            payload = pickle.dumps((False, RuntimeError(f"unpicklable reply: {exc!r}")))
        try:
            conn.send_bytes(payload)
        except (EOFError, OSError):
            return


@dataclass(eq=False)
class _Worker:
    """One worker process, its end of the pipe and the call it serves (``None``: idle)."""

    process: Any
    conn: Connection
    current: asyncio.Future | None = None
    reading: bool = False  # registered with the loop's reader callbacks


@dataclass(eq=False)
class _Call:
    payload: bytes
    future: asyncio.Future
    worker: _Worker | None = field(default=None)


class LoopWorkers(ProcessSet):
    """``workers`` processes called from the event loop (module docstring;
    :class:`~ftis.coordinator.worker_pool.ProcessSet`: ``ValueError`` when
    ``workers < 1``). ``start`` and ``close`` hold the lock against each other only."""

    def __init__(self, workers: int, initializer: Callable[..., Any] | None = None,
                 initargs: tuple[Any, ...] = ()) -> None:
        super().__init__(workers, initializer, initargs)
        self._context = multiprocessing.get_context("spawn")
        self._idle: list[_Worker] = []
        self._all: list[_Worker] = []
        self._waiting: collections.deque[_Call] = collections.deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    # -- processes -----------------------------------------------------------------
    def _spawn(self, idle: bool = True) -> _Worker:
        """A new worker process, listed as idle unless ``idle`` is False."""
        ours, theirs = self._context.Pipe(duplex=True)
        process = self._context.Process(
            target=_serve, args=(theirs, self._initializer, self._initargs),
            name="ftis-loop-worker", daemon=True)
        process.start()
        theirs.close()
        worker = _Worker(process, ours)
        self._all.append(worker)
        if idle:
            self._idle.append(worker)
        return worker

    def start(self, wait_s: float = 0.0, warm: Callable[[], Any] | None = None) -> None:
        """Start the worker processes now (idempotent; from any thread, before the loop
        uses them). With ``warm`` (a picklable no-argument function) and ``wait_s`` > 0,
        wait up to ``wait_s`` seconds in total for each worker to have run ``warm``
        (that is, finished its ``initializer``)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("LoopWorkers closed")
            fresh = [self._spawn() for _ in range(self.workers - len(self._all))]
            if warm is None or wait_s <= 0:
                return
            deadline = time.monotonic() + wait_s
            for worker in fresh:
                worker.conn.send_bytes(pickle.dumps((warm, ())))
            for worker in fresh:
                left = max(deadline - time.monotonic(), 0.0)
                if worker.conn.poll(left):
                    worker.conn.recv_bytes()
                else:
                    log.warning("a worker did not start within %.1f s", wait_s)
                    self._retire(worker)
                    self._spawn()

    def worker_pids(self) -> list[int]:
        """Process ids of the live workers."""
        return [w.process.pid for w in self._all if w.process.pid is not None]

    def _retire(self, worker: _Worker) -> None:
        """Forget ``worker``, kill its process and close its pipe (idempotent)."""
        if worker.conn.closed:
            return
        if worker in self._all:
            self._all.remove(worker)
        if worker in self._idle:
            self._idle.remove(worker)
        if worker.reading and self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(worker.conn.fileno())
        worker.reading = False
        try:
            worker.process.kill()
        except (OSError, AttributeError, ValueError):
            pass
        worker.conn.close()
        # reap it if it is gone already; never wait on the loop (the next start of a
        # process reaps what is left)
        worker.process.join(timeout=0)

    # -- calls (event loop thread only) ------------------------------------------------
    def _bind(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # a new loop (tests): readers belong to the old one
            for worker in self._all:
                worker.reading = False
            self._loop = loop
        return loop

    def _dispatch(self) -> None:
        """Hand waiting calls to idle workers (one found dead is retired and replaced)."""
        if self._closed:
            while self._waiting:
                call = self._waiting.popleft()
                if not call.future.done():
                    call.future.set_exception(RuntimeError("LoopWorkers closed"))
            return
        while self._waiting and (self._idle or len(self._all) < self.workers):
            call = self._waiting.popleft()
            if call.future.done():
                continue
            worker = self._idle.pop() if self._idle else self._spawn(idle=False)
            try:
                worker.conn.send_bytes(call.payload)
            except OSError as exc:  # it died while idle: not this call's doing
                log.warning("an idle worker's pipe is closed (%s); replacing it", exc)
                self._retire(worker)
                self._waiting.appendleft(call)
                continue
            worker.current = call.future
            call.worker = worker
            if not worker.reading:
                assert self._loop is not None  # bound by _call_once before any call waits
                self._loop.add_reader(worker.conn.fileno(), self._on_reply, worker)
                worker.reading = True

    def _on_reply(self, worker: _Worker) -> None:
        """The loop's reader callback: ``worker``'s pipe is readable (a reply, or EOF)."""
        future, worker.current = worker.current, None
        try:
            reply = worker.conn.recv_bytes()
        except (EOFError, OSError) as exc:
            self._retire(worker)
            if future is not None and not future.done():
                future.set_exception(WorkerDied(f"worker exited: {exc!r}"))
            self._dispatch()
            return
        try:  # a whole message was read: the pipe stays in step whatever it holds
            ok, value = pickle.loads(reply)
        except Exception as exc:  # noqa: BLE001 - e.g. an exception class that cannot be rebuilt
            ok, value = False, RuntimeError(f"unreadable reply from a worker: {exc!r}")
        if future is not None and not future.done():
            if ok:
                future.set_result(value)
            else:
                future.set_exception(value)
        self._idle.append(worker)
        self._dispatch()

    def _expire(self, call: _Call, timeout: float) -> None:
        """The loop's timer for ``call``: no answer within ``timeout`` seconds."""
        if call.future.done():
            return
        if call.worker is not None and call.worker.current is call.future:
            log.warning("a worker did not answer within %.1f s; replacing it", timeout)
            self._retire(call.worker)
        call.future.set_exception(TimeoutError(f"no answer within {timeout:g} s"))
        self._dispatch()

    def _call_once(self, payload: bytes, timeout: float) -> Any:
        loop = self._bind()
        call = _Call(payload, loop.create_future())
        self._waiting.append(call)
        self._dispatch()
        timer = loop.call_later(timeout, self._expire, call, timeout)
        try:
            return await_only(call.future)
        finally:
            timer.cancel()

    def call(self, fn: Callable[..., Any], *args: Any, timeout: float) -> Any:
        """``fn(*args)`` in a worker (``fn`` and ``args`` picklable), waiting at most
        ``timeout`` seconds, including the wait for a free worker. Must run inline on
        the event loop (:func:`~ftis.coordinator.waiting.inline`).

        Raises:
            TimeoutError: no answer within ``timeout`` (the worker serving the call, if
                any, is killed and replaced).
            PoolFailed: the worker died on this call and again in its replacement.
            RuntimeError: closed.
            Exception: whatever ``fn`` raised in the worker.
        """
        if self._closed:
            raise RuntimeError("LoopWorkers closed")
        payload = pickle.dumps((fn, args), protocol=pickle.HIGHEST_PROTOCOL)
        for attempt in (1, 2):
            try:
                return self._call_once(payload, timeout)
            except WorkerDied as exc:
                log.warning("%s; trying once more in a fresh worker (attempt %d)",
                            exc, attempt)
        raise PoolFailed("worker died twice on one call")

    def close(self) -> None:
        """Stop every worker (idempotent; from any thread). Calls in flight fail with
        :class:`WorkerDied`, calls waiting for a worker with ``RuntimeError``."""
        with self._lock:
            self._closed = True
            workers, self._all = list(self._all), []
            self._idle = []
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is loop:
                self._detach(workers)
            elif loop.is_running():  # let the loop drop its readers before the fds close
                done = threading.Event()

                def detach() -> None:
                    try:
                        self._detach(workers)
                    finally:
                        done.set()

                loop.call_soon_threadsafe(detach)
                done.wait(2.0)
        for worker in workers:
            try:
                worker.conn.close()  # EOF: the worker's loop returns
            except OSError:
                pass
        for worker in workers:
            worker.process.join(timeout=2.0)
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join(timeout=1.0)

    def _detach(self, workers: list[_Worker]) -> None:
        """On the loop: stop reading the workers' pipes and fail their calls."""
        for worker in workers:
            if worker.reading and self._loop is not None:
                self._loop.remove_reader(worker.conn.fileno())
            worker.reading = False
            future, worker.current = worker.current, None
            if future is not None and not future.done():
                future.set_exception(WorkerDied("worker stopped: LoopWorkers closed"))
        self._dispatch()
