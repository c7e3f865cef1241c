"""Runs spot checks (:mod:`ftis.coordinator.spot_check`) in worker processes that hold
the models, within a time budget and a bound on waiting callers.

A check that cannot run (the workers are busy, the budget ran out, the pool broke) is
never charged to the sender, since a slow coordinator is not its fault, but the bundle is
not stored unchecked either: it is refused with VERIFICATION_BUSY, which a client treats
like any transient refusal. Otherwise a flood of probation bundles could push another
node's fabricated ones through unchecked.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import Counter, deque
from concurrent.futures import TimeoutError as FutureTimeout

from ftis.coordinator.observe import metrics
from ftis.coordinator.spot_check import (
    HeldModel,
    LogprobDiscrepancy,
    SpotCheckSettings,
    check_rate,
    failure_reason,
    logprob_discrepancy,
    selected,
    spot_check_failed,
    tolerance,
)
from ftis.coordinator.worker_pool import PoolFailed, WorkerPool
from ftis.protocol.errors import ErrorCode, FtisError
from ftis.v1 import bundle_pb2

log = logging.getLogger(__name__)


def _held_keys() -> list[HeldModel]:
    """In a worker: the models its initializer loaded."""
    from ftis.coordinator.spot_check_worker import _POLICIES

    return list(_POLICIES)


def _load(names: list[str]) -> None:
    """Worker initializer: load the held models (one torch thread per worker)."""
    from ftis.coordinator.spot_check_worker import load_models

    load_models(names, threads=1)


class SpotCheckLoadError(RuntimeError):
    """The held models did not load (missing files or packages, or too slow)."""


class SpotChecker:
    """Checks a selected share of bundles against held weights.

    Args:
        settings: the ``spot_checks`` section (must name at least one model).
        key: secret of the sample draw (:func:`~ftis.coordinator.spot_check.selected`);
            random per process by default, so no sender can predict it.

    Raises:
        ValueError: ``settings.models`` is empty.
    """

    def __init__(self, settings: SpotCheckSettings, key: bytes | None = None) -> None:
        if not settings.enabled:
            raise ValueError("spot checks need at least one model")
        self.settings = settings
        self._key = key if key is not None else os.urandom(32)
        self._pool = WorkerPool(settings.workers, initializer=_load,
                                initargs=(list(settings.models),))
        self._held: frozenset[HeldModel] | None = None
        self._slots = threading.BoundedSemaphore(2 * settings.workers)
        self._lock = threading.Lock()
        #: outcome counts: passed, failed, busy, skipped_card (also ``ftis_spot_checks``)
        self.counts: Counter[str] = Counter()
        #: the last checks run: ``(policy_version, discrepancy)`` (bench/spot_check_margin.py)
        self.recent: deque[tuple[int, LogprobDiscrepancy]] = deque(maxlen=10_000)

    def start(self) -> frozenset[HeldModel]:
        """Start the workers (each loads the models as it starts) and return the checkable
        cards once one of them holds the models; blocks up to ``load_timeout_s``.

        Raises:
            SpotCheckLoadError: a model failed to load (its error is in the log and the
                message), or loading took longer than ``load_timeout_s``.
        """
        with self._lock:
            if self._held is not None:
                return self._held
            try:
                keys = self._pool.call(_held_keys, timeout=self.settings.load_timeout_s)
            except Exception as err:  # noqa: BLE001 - any load failure stops start-up
                raise SpotCheckLoadError(f"spot-check models {self.settings.models} did not "
                                   f"load: {err!r}") from err
            self._held = frozenset(keys)
            log.info("spot checks hold %d model(s): %s", len(keys),
                     ", ".join(k.base_model for k in keys))
            return self._held

    def holds(self, card: bundle_pb2.ModelCard) -> bool:
        """Whether ``card``'s log-probs can be checked (starts the workers if needed)."""
        return HeldModel.of_card(card) in self.start()

    def check(self, bundle: bundle_pb2.Bundle, bundle_id: str, on_probation: bool,
              bundles_accepted: int) -> LogprobDiscrepancy | None:
        """Check ``bundle`` if it is drawn and its card is held; ``None`` when not checked.

        Args:
            on_probation: the sender is on probation (sets the draw's rate).
            bundles_accepted: the sender's verified bundles so far (caps the training it
                may claim, :func:`~ftis.coordinator.spot_check.tolerance`).

        Raises:
            FtisError: LOGPROB_SPOT_CHECK_FAILED when the claimed log-probs differ from
                the held weights' by more than the tolerance; VERIFICATION_BUSY when a
                drawn check could not run (never charged to the sender).
        """
        s = self.settings
        if not selected(bundle_id, self._key, check_rate(on_probation, s)):
            return None
        key = HeldModel.of_card(bundle.model_card)
        if key not in self.start():
            self._count("skipped_card")
            return None
        if not self._slots.acquire(blocking=False):
            self._count("busy")
            raise FtisError(ErrorCode.VERIFICATION_BUSY,
                            "spot-check capacity exhausted; retry later")
        try:
            from ftis.coordinator.spot_check_worker import recompute_logprobs

            sampling = bundle.sampling
            recomputed = self._pool.call(
                recompute_logprobs, key, list(bundle.prompt_token_ids),
                [list(c.token_ids) for c in bundle.completions],
                float(sampling.temperature), float(sampling.top_p or 1.0),
                int(sampling.top_k), timeout=s.budget_s)
        except (FutureTimeout, PoolFailed) as err:
            self._count("busy")
            log.warning("spot check of %s not run: %r", bundle_id[:16], err)
            raise FtisError(ErrorCode.VERIFICATION_BUSY,
                            f"spot check did not finish within {s.budget_s:g} s; retry "
                            "later") from err
        finally:
            self._slots.release()
        d = logprob_discrepancy([list(c.logprobs) for c in bundle.completions], recomputed)
        self.recent.append((int(bundle.policy_version), d))
        limit = tolerance(s, bundle.policy_version, bundles_accepted,
                          bundle.model_card.dtype)
        failed = spot_check_failed(d, limit, s.min_tokens)
        self._count("failed" if failed else "passed", d.mean_abs)
        if failed:
            raise FtisError(ErrorCode.LOGPROB_SPOT_CHECK_FAILED, failure_reason(d, limit))
        return d

    def _count(self, outcome: str, mean_abs: float | None = None) -> None:
        self.counts[outcome] += 1
        metrics.spot_check(outcome, mean_abs)

    def close(self) -> None:
        """Stop the worker processes (idempotent)."""
        self._pool.close()
