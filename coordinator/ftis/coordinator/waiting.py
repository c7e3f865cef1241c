"""Waiting for work done elsewhere (a worker process, the group commit's leader thread)
without holding up the requests that do not need it.

A handler runs either in a thread of its own (the thread-pool listener, or the ``grpc.aio``
listener's handler pool), where waiting blocks that thread, or inline on the ``grpc.aio``
event loop inside a greenlet (``swarm_server = "aio-inline"``: SQLAlchemy's
``greenlet_spawn``), where it must not block the loop. :func:`wait_future` serves both:
in such a greenlet it suspends the handler and lets the event loop serve other requests
until the future is done (SQLAlchemy's ``await_only``, the mechanism of its asyncio
extension); elsewhere it is ``future.result(timeout)``.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Future
from typing import Any, TypeVar

from sqlalchemy.util import await_only
from sqlalchemy.util.concurrency import in_greenlet

T = TypeVar("T")


def inline() -> bool:
    """True in a handler run inline on the event loop (a ``greenlet_spawn`` greenlet)."""
    return in_greenlet()


def wait_future(future: Future[T], timeout: float | None = None) -> T:
    """The result of ``future``, waiting at most ``timeout`` seconds (``None``: no limit).

    Raises:
        TimeoutError: not done within ``timeout`` (``concurrent.futures.TimeoutError`` and
            ``asyncio.TimeoutError`` are this class since Python 3.11).
        Exception: whatever the work behind ``future`` raised.
    """
    if not inline():
        return future.result(timeout=timeout)
    waiting: Any = asyncio.wrap_future(future)
    if timeout is not None:
        waiting = asyncio.wait_for(waiting, timeout)
    return await_only(waiting)
