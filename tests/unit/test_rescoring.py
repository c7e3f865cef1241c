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


def _lease(entry: TaskEntry = ENTRY) -> LeaseRecord:
    return LeaseRecord(lease_id="l", task_id="t", node_id="n", dataset=entry.dataset,
                       spec_index=0, entry=entry, group_size=3, max_new_tokens=8,
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


class _Recorder:
    """Stands in for a worker set's ``call``: records the texts it was handed."""

    def __init__(self) -> None:
        self.texts: list[list[str]] = []

    def __call__(self, fn, entry_json, texts, claimed, budget_s, timeout):  # noqa: ANN001
        self.texts.append(list(texts))
        return ([0.5] * len(texts), 0)


def _recorded_pool(monkeypatch: pytest.MonkeyPatch, inline_chars: int
                   ) -> tuple[RescoringPool, _Recorder]:
    pool = RescoringPool(workers=1, budget_s=5.0, inline_chars=inline_chars)
    recorder = _Recorder()
    assert pool._pool is not None and pool._loop_workers is not None  # noqa: SLF001
    monkeypatch.setattr(pool._pool, "call", recorder)  # noqa: SLF001
    monkeypatch.setattr(pool._loop_workers, "call", recorder)  # noqa: SLF001
    return pool, recorder


def test_small_bundles_on_linear_scorers_score_inline(monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    """At most ``inline_chars`` characters on a linear scorer: scored in the calling
    thread (the workers never see it) with the verdict of ``verify.rescore``; one
    character more, a scorer that parses its answer, or ``inline_chars`` = 0: the
    workers score it."""
    texts = ["<answer>3</answer>", "<answer>4</answer>", "3"]  # 37 characters
    bundle = _bundle(texts, [1.0, 1.0, None])
    pool, recorder = _recorded_pool(monkeypatch, inline_chars=37)
    try:
        assert pool.rescore(_lease(), bundle) == ([1.0, 0.0, 1.0], 1)  # inline
        assert recorder.texts == []
        longer = _bundle([*texts[:2], "3 "], [1.0, 1.0, None])  # 38 characters
        assert pool.rescore(_lease(), longer) == ([0.5, 0.5, 0.5], 0)  # the workers'
        sympy = TaskEntry("polynomial_equations", 0, "Solve x - 3 = 0", "3", {}, "gym")
        assert pool.rescore(_lease(sympy), bundle) == ([0.5, 0.5, 0.5], 0)
        assert recorder.texts == [[*texts[:2], "3 "], texts]
    finally:
        pool.close()
    off, recorder = _recorded_pool(monkeypatch, inline_chars=0)
    try:
        assert off.rescore(_lease(), bundle) == ([0.5, 0.5, 0.5], 0)
        assert recorder.texts == [texts]
    finally:
        off.close()
    with pytest.raises(ValueError):
        RescoringPool(inline_chars=-1)


def test_the_coordinator_scores_small_bundles_inline_by_default(tmp_path) -> None:  # noqa: ANN001
    """``rescoring_inline_chars`` reaches the pool; its default covers a G = 8 bundle of
    1024 tokens at 4 characters per token."""
    from ftis.coordinator.config import CoordinatorConfig
    from ftis.coordinator.handlers.context import Context
    from ftis.coordinator.state.sql import open_state

    assert CoordinatorConfig().rescoring_inline_chars == 32_768 >= 8 * 1024 * 4
    state = open_state(f"sqlite:///{tmp_path / 'c.db'}")
    ctx = Context.create(CoordinatorConfig(rescoring_inline_chars=100), state)
    try:
        assert ctx.rescoring.inline_chars == 100
    finally:
        ctx.rescoring.close()
        state.close()
