"""Re-scoring in worker processes with a time budget (``coordinator/rescoring.py``):
the pooled verdict equals the inline one, a re-score past its budget is a coded
rejection, and a broken pool is replaced."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest

from ftis.coordinator import rescoring
from ftis.coordinator.rescoring import RescoringPool, score_texts
from ftis.coordinator.state.base import LeaseRecord
from ftis.coordinator.verify import rescore
from ftis.protocol.errors import ErrorCode, FtisError
from ftis.tasks import TaskEntry
from ftis.v1 import bundle_pb2

ENTRY = TaskEntry("chain_sum", 0, "State the final answer: 4 - 1 =", "3", {}, "exact")


def _lease() -> LeaseRecord:
    return LeaseRecord(lease_id="l", task_id="t", node_id="n", dataset="chain_sum",
                       spec_index=0, entry=ENTRY, group_size=3, max_new_tokens=8,
                       issued_at_ms=0, deadline_ms=1)


def _bundle(texts: list[str], claims: list[float | None]) -> bundle_pb2.Bundle:
    out = bundle_pb2.Bundle()
    for text, claim in zip(texts, claims, strict=True):
        c = out.completions.add(text=text)
        if claim is not None:
            c.claimed_reward = claim
    return out


@pytest.fixture(scope="module")
def pool() -> Iterator[RescoringPool]:
    p = RescoringPool(workers=1, budget_s=5.0)
    yield p
    p.close()


def test_pooled_rescore_equals_inline(pool: RescoringPool) -> None:
    bundle = _bundle(["<answer>3</answer>", "<answer>4</answer>", "3"], [1.0, 1.0, None])
    assert rescore(_lease(), bundle) == ([1.0, 0.0, 1.0], 1)  # one wrong claim
    assert pool.rescore(_lease(), bundle) == ([1.0, 0.0, 1.0], 1)
    assert RescoringPool(workers=0).rescore(_lease(), bundle) == ([1.0, 0.0, 1.0], 1)


def test_a_rescore_past_its_budget_is_a_coded_rejection() -> None:
    slow = RescoringPool(workers=1, budget_s=1e-4)
    slow.start(wait_s=60)  # a warm worker: the alarm, not the wait, must decide
    try:
        texts = ["1 " * 65_000] * 3  # ~ms each: far past 0.1 ms
        with pytest.raises(FtisError) as info:
            slow.rescore(_lease(), _bundle(texts, [None] * 3))
        assert info.value.code == ErrorCode.SCORING_TIMEOUT
    finally:
        slow.close()


def test_the_worker_alarm_interrupts_a_score() -> None:
    old = signal.signal(signal.SIGALRM, rescoring._alarm)  # noqa: SLF001 - the worker's
    try:
        assert score_texts(ENTRY.to_json(), ["1 " * 65_000] * 50, [None] * 50, 1e-4) is None
        assert score_texts(ENTRY.to_json(), ["<answer>3</answer>"], [None], 5.0) == ([1.0], 0)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_a_broken_pool_is_replaced(pool: RescoringPool) -> None:
    bundle = _bundle(["<answer>3</answer>"], [None])
    assert pool.rescore(_lease(), bundle) == ([1.0], 0)
    assert pool._pool is not None  # noqa: SLF001
    for pid in pool._pool.worker_pids():  # kill the worker
        os.kill(pid, signal.SIGKILL)
    assert pool.rescore(_lease(), bundle) == ([1.0], 0)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        RescoringPool(workers=-1)
    with pytest.raises(ValueError):
        RescoringPool(budget_s=0)


def test_no_answer_in_time_is_busy_and_never_charged(monkeypatch: pytest.MonkeyPatch) -> None:
    """The serving thread's wait covers the queue and a cold worker's start-up, which
    are not the sender's doing: past it the answer is VERIFICATION_BUSY, not the
    charged SCORING_TIMEOUT."""
    monkeypatch.setattr(rescoring, "GRACE_S", 0.0)
    cold = RescoringPool(workers=1, budget_s=1e-3)  # not started: spawning takes > 1 ms
    try:
        with pytest.raises(FtisError) as info:
            cold.rescore(_lease(), _bundle(["<answer>3</answer>"], [None]))
        assert info.value.code == ErrorCode.VERIFICATION_BUSY
    finally:
        cold.close()
    from ftis.coordinator.handlers.bundles import _UNCHARGED

    assert ErrorCode.VERIFICATION_BUSY in _UNCHARGED
