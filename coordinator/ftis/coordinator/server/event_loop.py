"""A ``grpc.aio`` server on its own event-loop thread, driven from synchronous code.

:class:`AioServerThread` has the part of ``grpc.Server``'s interface that
:class:`~ftis.coordinator.server.app.CoordinatorServer` uses (``add_insecure_port``,
``start``, ``stop``, ``wait_for_termination``), so that the coordinator keeps its
synchronous API (tests, the CLI, ``serve --workers N``) while the volunteer listener runs
as coroutines: a request waiting out a refusal delay is a sleeping coroutine, not a held
worker thread.

Every call crosses into the loop with ``asyncio.run_coroutine_threadsafe`` and blocks
until it is done there; the server object itself is only touched in the loop's thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import grpc

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Seconds the loop thread gets to finish after the server stopped.
LOOP_JOIN_S = 10.0


class AioServerThread:
    """A ``grpc.aio`` server and the thread that runs its event loop.

    Args:
        options: gRPC channel arguments of the server.
        register: called once in the loop's thread with the new ``grpc.aio.Server``
            (add the services there).
        name: name of the loop's thread.

    The loop thread starts in the constructor and ends in :meth:`stop` (call it even
    when binding failed; it is idempotent).
    """

    def __init__(self, options: Sequence[tuple[str, Any]],
                 register: Callable[[grpc.aio.Server], None], name: str = "ftis-aio") -> None:
        self._stopped = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

        async def create() -> grpc.aio.Server:
            server = grpc.aio.server(options=list(options))
            register(server)
            return server

        try:
            self._server = self._call(create())
        except BaseException:
            self._close_loop()
            raise

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def _call(self, coro: Awaitable[T], timeout: float | None = None) -> T:
        """Run ``coro`` in the loop and return its result (its exception is raised)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)  # type: ignore[arg-type]

    def add_insecure_port(self, address: str) -> int:
        """Bind ``address`` (``HOST:PORT``, port 0 = any free port); returns the port.

        Raises:
            RuntimeError: the address cannot be bound (as ``grpc.Server`` does).
        """
        async def bind() -> int:
            return self._server.add_insecure_port(address)

        return self._call(bind())

    def start(self) -> None:
        """Start serving the bound ports."""
        self._call(self._server.start())

    def stop(self, grace: float | None) -> threading.Event:
        """Stop accepting calls, give running ones ``grace`` seconds (``None``: cancel
        them now), then end the loop thread. Blocks until done; returns a set event
        (``grpc.Server.stop`` returns one to wait on). Idempotent."""
        if not self._stopped.is_set():
            try:
                self._call(self._server.stop(grace))
            except Exception:  # the loop is still closed below
                log.exception("stopping the grpc.aio server failed")
            finally:
                self._close_loop()
        return self._stopped

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        """Block until :meth:`stop` finished or ``timeout`` seconds passed; True if the
        timeout passed first (as ``grpc.Server.wait_for_termination``)."""
        return not self._stopped.wait(timeout)

    def _close_loop(self) -> None:
        """Cancel what is left in the loop, stop it and join its thread."""
        async def cancel_rest() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            if self._loop.is_running():
                self._call(cancel_rest(), timeout=LOOP_JOIN_S)
        except Exception:
            log.exception("cancelling the event loop's tasks failed")
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(LOOP_JOIN_S)
        if not self._thread.is_alive():
            self._loop.close()
        self._stopped.set()
