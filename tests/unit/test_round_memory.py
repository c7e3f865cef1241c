"""The memory check before each round (issue 14, part 6): the pure decision with hand
numbers (MiB), the round's peak from an estimate, and the guard that waits or refuses."""

from __future__ import annotations

import pytest

from ftis.client.node.memory import (
    MemoryEstimate,
    MiB,
    RoundMemoryError,
    RoundMemoryGuard,
    decide_round_memory,
    round_peak,
)

R = 256 * MiB  # the reserve used in these tests (the default, spelled out)


def decide(needed, rss, available, total, cap=None, phase="learning"):  # noqa: ANN001
    return decide_round_memory(needed * MiB, rss * MiB, available * MiB, total * MiB,
                               None if cap is None else cap * MiB, phase, reserve=R)


def test_fits_when_the_extra_is_available():
    # needs 1500 MiB, holds 1000 already: 500 more; 800 available - 256 reserve = 544
    d = decide(1500, 1000, 800, 8000)
    assert d.action == "run" and d.reason == ""
    assert d.extra == 500 * MiB and d.needed == 1500 * MiB and d.available == 800 * MiB
    # exactly at the line still runs: 500 extra vs 756 - 256 = 500
    assert decide(1500, 1000, 756, 8000).action == "run"


def test_waits_when_other_programs_hold_the_memory():
    d = decide(1500, 1000, 755, 8000)  # 500 extra, 499 to spare
    assert d.action == "wait"
    assert d.reason == ("round needs ~500 MiB more (1,500 MiB at its peak, learning), "
                        "499 MiB available (256 MiB kept free); waiting for memory, or "
                        "lower --micro-batch-size or --max-new-tokens")
    # less available than the reserve: 0 to spare, never negative in the message
    d = decide(1500, 1000, 100, 8000, phase="generation")
    assert d.action == "wait" and "0 MiB available" in d.reason
    assert "lower --local-groups, --group-size or --max-new-tokens" in d.reason


def test_a_process_larger_than_the_estimate_needs_nothing_extra():
    d = decide(1500, 2000, 0, 8000)  # the estimate is below what it already holds
    assert d.action == "run" and d.extra == 0


def test_exits_above_the_cap_or_the_machine():
    d = decide(3000, 1000, 6000, 8000, cap=2048)
    assert d.action == "exit"
    assert d.reason == ("round needs ~3,000 MiB at its peak (learning), above --max-memory "
                        "2,048 MiB; lower --micro-batch-size or --max-new-tokens, or raise "
                        "--max-memory")
    assert decide(2048, 1000, 6000, 8000, cap=2048).action == "run"  # at the cap: fits
    # 4000 MiB machine, 256 kept free: 3745 never fits even with everything free
    d = decide(3745, 1000, 3900, 4000, phase="generation")
    assert d.action == "exit" and "this machine has 4,000 MiB in all" in d.reason
    assert decide(3744, 1000, 3900, 4000).action == "run"


def test_round_peak_is_the_larger_round_phase():
    est = MemoryEstimate(phases={
        "load": {"baseline": 500, "weights": 9000},  # once, before the first round
        "generation": {"baseline": 500, "weights": 100, "kv_cache": 700},
        "learning": {"baseline": 500, "weights": 100, "activations": 600}},
        phase="load")
    assert round_peak(est) == (1300, "generation")


class Probe:
    """``(rss, available, total)`` bytes from a list, the last repeated."""

    def __init__(self, *snapshots: tuple[int, int, int]) -> None:
        self.snapshots = [tuple(v * MiB for v in s) for s in snapshots]
        self.calls = 0

    def __call__(self) -> tuple[int, int, int]:
        self.calls += 1
        return self.snapshots[min(self.calls, len(self.snapshots)) - 1]


def test_guard_waits_until_memory_frees_up():
    sleeps, waits = [], []
    probe = Probe((1000, 300, 8000), (1000, 300, 8000), (1000, 200, 8000), (1000, 900, 8000))
    guard = RoundMemoryGuard(1500 * MiB, "learning", probe=probe, on_wait=waits.append,
                             sleep=sleeps.append, poll_s=30.0, reserve=R)
    d = guard()
    assert d.action == "run" and probe.calls == 4
    assert sleeps == [30.0, 30.0, 30.0] and guard.waited_s == 90.0
    # told once per distinct reason (300 MiB -> 44 to spare, then 200 -> 0), then resumed
    assert [w.available // MiB if w else None for w in waits] == [300, 200, None]
    assert "44 MiB available" in waits[0].reason


def test_a_wait_for_memory_rechecks_the_pause_settings_after_every_poll():
    events: list[str] = []
    probe = Probe((1000, 300, 8000), (1000, 300, 8000), (1000, 900, 8000))
    guard = RoundMemoryGuard(1500 * MiB, "learning", probe=probe,
                             sleep=lambda s: events.append("sleep"), poll_s=30.0, reserve=R,
                             recheck=lambda: events.append("gate"))
    assert guard().action == "run"
    # the pause gate runs after each poll, so the last word before the round is its
    assert events == ["sleep", "gate", "sleep", "gate"] and probe.calls == 3
    # no wait, no gate call (the caller checked it just before)
    events.clear()
    assert RoundMemoryGuard(1500 * MiB, "learning", probe=Probe((1000, 4000, 8000)),
                            recheck=lambda: events.append("gate"))().action == "run"
    assert events == []


def test_guard_runs_at_once_when_it_fits_and_refuses_what_never_fits():
    sleeps = []
    guard = RoundMemoryGuard(1500 * MiB, "learning", probe=Probe((1000, 4000, 8000)),
                             sleep=sleeps.append, reserve=R)
    assert guard().action == "run" and sleeps == []
    guard = RoundMemoryGuard(3000 * MiB, "generation", cap=2048 * MiB,
                             probe=Probe((1000, 6000, 8000)), sleep=sleeps.append, reserve=R)
    with pytest.raises(RoundMemoryError, match="above --max-memory 2,048 MiB"):
        guard()
    assert sleeps == []
