"""The interval ``make bench-attack`` puts on each honest p99 ratio
(``bench/coordinator_under_attack.py``: ``p99_ratio_ci`` over 1-second blocks)."""

from __future__ import annotations

import math

from script_loader import load_script

bench = load_script("bench/coordinator_under_attack.py")


def test_blocks_group_latencies_by_completion_second() -> None:
    finished = [10.0, 10.4, 11.2, 13.9, 13.95]
    latencies = [1.0, 2.0, 3.0, 4.0, 5.0]
    assert bench._blocks(finished, latencies, 1.0) == [[1.0, 2.0], [3.0], [4.0, 5.0]]
    assert bench._blocks([], [], 1.0) == []


def test_ratio_interval_is_exact_when_every_block_is_alike() -> None:
    """Blocks that are all the same give the same p99 in every resample: the interval
    is the ratio itself, [2, 2] for doubled latencies and [1, 1] for equal ones."""
    reference = [[0.01, 0.02, 0.03]] * 20
    doubled = [[0.02, 0.04, 0.06]] * 20
    assert bench.p99_ratio_ci(doubled, reference) == (2.0, 2.0)
    assert bench.p99_ratio_ci(reference, reference) == (1.0, 1.0)


def test_one_stalled_second_widens_the_interval_across_the_bound() -> None:
    """One block in 20 holding a 10x stall: the p99 of a resample depends on whether
    that block was drawn, so the interval spans from no effect to the stall."""
    reference = [[0.01] * 10 for _ in range(20)]
    attack = [[0.01] * 10 for _ in range(19)] + [[0.1] * 10]
    low, high = bench.p99_ratio_ci(attack, reference)
    assert low == 1.0 and high == 10.0
    assert all(math.isnan(x) for x in bench.p99_ratio_ci([], reference))
