"""Re-scoring outside the serving process, with a time budget (issue 13, class 8).

The submit path's re-score (``verify.rescore``: ReasoningGYM's scorer on every
completion's text) is CPU work a node can make expensive. In the serving process it
holds the GIL that every other node's request needs. :class:`RescoringPool` runs it in
worker processes (``spawn``: no fork of a threaded gRPC server) and bounds it:

* inside a worker, ``SIGALRM`` (``setitimer``) interrupts a score that runs past
  ``budget_s``; the bundle is then rejected with SCORING_TIMEOUT (the node pays −1, as
  for any rejection);
* the serving thread waits at most ``budget_s`` + :data:`GRACE_S` for its result (a
  worker stuck inside C code cannot be interrupted by the alarm), then answers
  VERIFICATION_BUSY, which is charged to no one: that wait includes the queue behind
  other nodes' bundles (an attacker's expensive ones among them) and, right after a
  start, the worker's own start-up, neither of which is the sender's doing;
* :meth:`RescoringPool.start` can wait for the workers to import the scorer, so that a
  coordinator serves only once they are ready;
* a broken pool (a worker killed) is replaced, and the bundle is scored once more in a
  fresh pool.

Handlers inline on the event loop (``swarm_server = "aio-inline"``) reach their workers
through :class:`~ftis.coordinator.loop_workers.LoopWorkers` (the loop writes to and
reads from each worker's pipe, no thread in between); handlers in threads through
:class:`~ftis.coordinator.worker_pool.WorkerPool`. Each set of processes starts on first
use; :meth:`RescoringPool.start` starts the set the listener will use. Paired A/B in
docs/benchmarks.md ("Re-scoring workers served from the event loop").

**Small bundles on linear scorers run inline** (``inline_chars`` > 0, the config's
``rescoring_inline_chars``): a bundle whose completions hold at most ``inline_chars``
characters together, on a task whose scorer is linear in the text
(:func:`ftis.tasks.scoring.linear_scoring`: the ``exact`` reward, ReasoningGYM's default
``score_answer`` and ``compute_decimal_reward``), is scored in the calling thread. Its
cost is then bounded by its size, not by an alarm: the adversarial texts of
``tests/unit/test_scoring_linear.py`` cut to the default 32,768 characters took at most
3.0 ms a bundle (docs/benchmarks.md, one probe), the same order as the text check's
decode that already runs there, and it saves each bundle the hand-off to a worker (the
pipe both ways and the wake-ups on both sides: 5.8 % of the coordinator's rate in a
paired A/B, docs/benchmarks.md). Larger bundles and other scorers go to the workers.

With ``workers = 0`` every score runs inline in the calling thread (tests, tiny setups),
still bounded by nothing but the linear-time scorer. The maths is unchanged: the same
``verify.rescore`` runs in either place, so pooled and inline verdicts are identical.
"""

from __future__ import annotations

import logging
import signal
from concurrent.futures import TimeoutError as FutureTimeout

from ftis.coordinator.loop_workers import LoopWorkers
from ftis.coordinator.state.base import LeaseRecord
from ftis.coordinator.waiting import inline
from ftis.coordinator.worker_pool import PoolFailed, WorkerPool
from ftis.protocol.errors import ErrorCode, FtisError
from ftis.tasks.scoring import linear_scoring
from ftis.tasks.source import TaskEntry
from ftis.v1 import bundle_pb2

log = logging.getLogger(__name__)

#: Extra seconds the serving thread waits beyond the budget for a worker's answer.
GRACE_S = 1.0


class _Overrun(Exception):
    """Raised in a worker by the alarm when a score runs past its budget."""


def _alarm(_signum: int, _frame: object) -> None:
    raise _Overrun


def _init_worker() -> None:
    """Worker start-up: the alarm handler, and the scorer imported once (ReasoningGYM
    takes about a second to import)."""
    signal.signal(signal.SIGALRM, _alarm)
    import ftis.tasks.scoring  # noqa: F401


def _warm() -> None:
    """A no-op task: makes the executor start its worker processes."""


def score_texts(entry_json: str, texts: list[str], claimed: list[float | None],
                budget_s: float) -> tuple[list[float], int] | None:
    """In a worker: ``verify.rescore`` of ``texts`` against the entry, or ``None`` when
    the alarm fired after ``budget_s`` seconds (wall time)."""
    from ftis.coordinator.verify import rescore_texts

    signal.setitimer(signal.ITIMER_REAL, budget_s)
    try:
        return rescore_texts(TaskEntry.from_json(entry_json), texts, claimed)
    except _Overrun:
        return None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


class RescoringPool:
    """Re-scores bundles in worker processes within a time budget (module docstring).

    Args:
        workers: worker processes; 0 scores inline in the calling thread.
        budget_s: seconds one bundle's re-score may take (> 0).
        loop_served: :meth:`start` starts the workers that handlers inline on the event
            loop use (``swarm_server = "aio-inline"``) rather than those of handlers in
            threads. Either set still starts on first use.
        inline_chars: a bundle of at most this many completion characters on a linear
            scorer is scored in the calling thread (module docstring); 0: never.

    Raises:
        ValueError: ``workers < 0``, ``budget_s <= 0`` or ``inline_chars < 0``.
    """

    def __init__(self, workers: int = 1, budget_s: float = 2.0, *,
                 loop_served: bool = False, inline_chars: int = 0) -> None:
        if workers < 0 or not budget_s > 0 or inline_chars < 0:
            raise ValueError("workers and inline_chars must be >= 0 and budget_s > 0")
        self.workers = workers
        self.budget_s = budget_s
        self.loop_served = loop_served
        self.inline_chars = inline_chars
        self._pool = WorkerPool(workers, initializer=_init_worker) if workers else None
        self._loop_workers = (LoopWorkers(workers, initializer=_init_worker)
                              if workers else None)

    def start(self, wait_s: float = 0.0) -> None:
        """Start the worker processes now (each imports the scorer, about a second)
        rather than on the first bundle; waits up to ``wait_s`` seconds for them to be
        ready (0: returns at once)."""
        if self._loop_workers is not None and self.loop_served:
            self._loop_workers.start(wait_s, warm=_warm)
        elif self._pool is not None:
            futures = [self._pool.submit(_warm) for _ in range(self.workers)]
            if wait_s > 0:
                from concurrent.futures import wait

                wait(futures, timeout=wait_s)

    def rescore(self, lease: LeaseRecord,
                bundle: bundle_pb2.Bundle) -> tuple[list[float], int]:
        """``(verified_rewards, reward_mismatches)`` as ``verify.rescore`` computes them.

        Raises:
            FtisError: SCORING_TIMEOUT when the re-score itself ran past ``budget_s``
                (the worker's alarm); VERIFICATION_BUSY (never charged) when no answer
                came within ``budget_s`` + :data:`GRACE_S`; INTERNAL when the pool broke
                twice.
        """
        from ftis.coordinator.verify import claims, rescore, rescore_texts

        if self._pool is None or self._loop_workers is None:
            return rescore(lease, bundle)
        texts = [c.text for c in bundle.completions]
        if self.scores_inline(lease, texts):
            return rescore_texts(lease.entry, texts, claims(bundle))
        workers = self._loop_workers if inline() else self._pool
        try:
            result = workers.call(score_texts, lease.entry.to_json(), texts,
                                  claims(bundle), self.budget_s,
                                  timeout=self.budget_s + GRACE_S)
        except FutureTimeout as err:
            raise FtisError(ErrorCode.VERIFICATION_BUSY,
                            f"re-scoring did not answer within {self.budget_s + GRACE_S:g} s "
                            "(coordinator busy); retry later") from err
        except PoolFailed as err:
            raise FtisError(ErrorCode.INTERNAL, "re-scoring pool failed twice") from err
        if result is None:
            raise FtisError(ErrorCode.SCORING_TIMEOUT,
                            f"re-scoring took longer than {self.budget_s:g} s")
        return result

    def scores_inline(self, lease: LeaseRecord, texts: list[str]) -> bool:
        """True when a bundle of ``texts`` under ``lease`` is small enough
        (``inline_chars``) and its scorer linear, so it is scored in the calling
        thread rather than by a worker."""
        return (self.inline_chars > 0 and sum(map(len, texts)) <= self.inline_chars
                and linear_scoring(lease.entry.dataset, lease.entry.reward))

    def close(self) -> None:
        """Stop the worker processes (idempotent)."""
        if self._pool is not None:
            self._pool.close()
        if self._loop_workers is not None:
            self._loop_workers.close()
