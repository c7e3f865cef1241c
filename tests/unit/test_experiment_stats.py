"""Paired tests of ftis.lab.experiment.stats against hand-computed values."""

from __future__ import annotations

import math

import pytest

from ftis.lab.experiment.stats import (
    holm,
    mcnemar_exact,
    paired_bootstrap_ci,
    paired_comparison,
    paired_permutation_test,
    pairs_for_power,
    sign_flip_floor,
    sign_flip_interval,
)


# ------------------------------------------------------------------------ McNemar
def test_mcnemar_eight_gained_one_lost():
    # 8 wrong -> right, 1 right -> wrong, 3 concordant; X ~ Bin(9, 1/2):
    # p = 2 P[X <= 1] = 2 (C(9,0) + C(9,1)) / 2^9 = 2 * 10 / 512
    before = [0] * 8 + [1] + [1, 1, 0]
    after = [1] * 8 + [0] + [1, 1, 0]
    res = mcnemar_exact(before, after)
    assert (res.gained, res.lost, res.n) == (8, 1, 12)
    assert res.p_value == pytest.approx(2 * (1 + 9) / 512) == 0.0390625
    assert res.before == pytest.approx(3 / 12)
    assert res.after == pytest.approx(10 / 12)


def test_mcnemar_symmetric_and_capped():
    a = mcnemar_exact([0, 1, 0, 1], [1, 0, 1, 0])  # gained 2, lost 2: 2 * 11/16 > 1
    assert a.p_value == 1.0
    b = mcnemar_exact([1, 1, 0], [1, 1, 0])  # no discordant pair
    assert (b.gained, b.lost, b.p_value) == (0, 0, 1.0)
    # swapping before/after swaps gained/lost, same p
    c = mcnemar_exact([1] * 5 + [0], [0] * 5 + [0])
    d = mcnemar_exact([0] * 5 + [0], [1] * 5 + [0])
    assert c.p_value == d.p_value == pytest.approx(2 / 32)


def test_mcnemar_rejects_bad_input():
    with pytest.raises(ValueError):
        mcnemar_exact([0, 1], [1])
    with pytest.raises(ValueError):
        mcnemar_exact([], [])
    with pytest.raises(ValueError):
        mcnemar_exact([0.5], [1])


# ------------------------------------------------------------------ sign-flip test
def test_sign_flip_exact_three_pairs():
    # differences 1, 2, 3: |sum| over the 8 sign patterns is 6, 4, 2, 0, 0, 2, 4, 6;
    # only the two patterns with all signs equal reach the observed 6: p = 2/8
    assert paired_permutation_test([0, 0, 0], [1, 2, 3]) == pytest.approx(0.25)
    # differences 1, 1, -1: |sum| in {3, 1, 1, 1, 1, 1, 1, 3}, all >= 1: p = 1
    assert paired_permutation_test([0, 0, 1], [1, 1, 0]) == pytest.approx(1.0)
    # differences 3, 1, 1: patterns give |sum| 5, 3, 3, 1, 1, 3, 3, 5 -> >= 5 twice
    assert paired_permutation_test([0, 0, 0], [3, 1, 1]) == pytest.approx(0.25)
    # differences 2, 1, 1: |sum| 4, 2, 2, 0, 0, 2, 2, 4 -> >= 4 twice
    assert paired_permutation_test([0, 0, 0], [2, 1, 1]) == pytest.approx(0.25)


def test_sign_flip_zero_differences_and_smallest_p():
    assert paired_permutation_test([0.3, 0.5], [0.3, 0.5]) == 1.0
    # six positive differences: the smallest exact p, 2 / 2^6
    assert paired_permutation_test([0] * 6, [1] * 6) == pytest.approx(2 / 64)
    # a zero difference doubles the patterns but not the share
    assert paired_permutation_test([0] * 4, [1, 2, 3, 0]) == pytest.approx(0.25)


def test_sign_flip_monte_carlo_is_seeded_and_close():
    before = [0.0] * 20
    after = [0.1 * (i % 3 + 1) for i in range(20)]  # all positive: exact p = 2 / 2^20
    p1 = paired_permutation_test(before, after, rounds=2000, seed=1)
    p2 = paired_permutation_test(before, after, rounds=2000, seed=1)
    assert p1 == p2 == pytest.approx(1 / 2001)  # no hit in 2000 draws: (0 + 1) / 2001
    with pytest.raises(ValueError):
        paired_permutation_test([0.0], [1.0], rounds=0)
    with pytest.raises(ValueError):
        paired_permutation_test([0.0], [math.inf])


# ----------------------------------------------------------------------- bootstrap
def test_bootstrap_interval_bounds():
    lo, hi = paired_bootstrap_ci([0, 0, 0], [0.1, 0.1, 0.2], rounds=4000, seed=0)
    # resampled means lie in {0.1, 0.133, 0.167, 0.2}; P(mean = 0.1) = (2/3)^3 = 0.30 and
    # P(mean = 0.2) = (1/3)^3 = 0.037, both above 2.5 %: the interval is [0.1, 0.2]
    assert lo == pytest.approx(0.1)
    assert hi == pytest.approx(0.2)
    lo, hi = paired_bootstrap_ci([1, 2], [1.5, 2.5])  # constant difference 0.5
    assert lo == hi == pytest.approx(0.5)
    with pytest.raises(ValueError):
        paired_bootstrap_ci([0], [1], level=1.0)


def test_paired_comparison_fields():
    res = paired_comparison([0.5, 0.4, 0.6], [0.6, 0.5, 0.8])
    assert res.n == 3
    assert res.before == pytest.approx(0.5)
    assert res.after == pytest.approx(0.6333333)
    assert res.diff == pytest.approx(0.1333333)
    assert res.sd_diff == pytest.approx(0.0577350, rel=1e-5)
    assert res.p_value == pytest.approx(0.25)
    assert res.ci_low <= res.diff <= res.ci_high
    one = paired_comparison([0.0], [1.0])
    assert one.sd_diff == 0.0 and one.p_value == 1.0


# ---------------------------------------------------------------------------- Holm
def test_holm_hand_values():
    # sorted 0.01, 0.03, 0.04 -> 3 * 0.01, 2 * 0.03, max(0.06, 1 * 0.04)
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert holm([0.5, 0.6]) == pytest.approx([1.0, 1.0])  # capped at 1
    assert holm([0.2]) == pytest.approx([0.2])
    assert holm([]) == []
    with pytest.raises(ValueError):
        holm([1.5])


# --------------------------------------------------------------------------- power
def test_pairs_for_power_hand_values():
    # (1.959964 + 0.841621)^2 * (0.1 / 0.1)^2 = 7.849 -> 8, + 1 for the sd estimate
    assert pairs_for_power(0.1, 0.1) == 9
    # sd 0.2: 7.849 * 4 = 31.40 -> 32 + 1
    assert pairs_for_power(0.2, 0.1) == 33
    # a tiny sd never goes below 6 pairs (the exact test's floor for p < 0.05)
    assert pairs_for_power(0.01, 0.1) == 6
    # Holm over 21 contrasts: z_{1 - 0.05/42} = 3.0381; (3.0381 + 0.8416)^2 = 15.05 -> 16 + 1
    assert pairs_for_power(0.1, 0.1, alpha=0.05 / 21) == 17
    # ... and a small sd never below the exact test's floor at that level: 2 / 2^10 =
    # 0.00195 <= 0.05 / 21 = 0.00238 < 2 / 2^9
    assert pairs_for_power(0.01, 0.1, alpha=0.05 / 21) == 10
    assert [sign_flip_floor(a) for a in (0.05, 0.05 / 3, 0.05 / 7, 0.5)] == [6, 7, 9, 2]
    with pytest.raises(ValueError):
        pairs_for_power(0.0, 0.1)
    with pytest.raises(ValueError):
        pairs_for_power(0.1, 0.1, power=1.0)


# ------------------------------------------------------------- sign-flip interval
def test_sign_flip_interval_hand_computed():
    """d = (1, 2, 3): the 7 subset means are 1, 1.5, 2, 2, 2, 2.5, 3. j = floor(alpha *
    8 / 2): at 0.5 the 2nd smallest/largest, at 0.25 the extremes, and below 0.25 (no
    test of 3 pairs reaches p <= 2/8) nothing is excluded."""
    assert sign_flip_interval([0, 0, 0], [1, 2, 3], alpha=0.5) == (1.5, 2.5)
    assert sign_flip_interval([0, 0, 0], [1, 2, 3], alpha=0.25) == (1.0, 3.0)
    assert sign_flip_interval([0, 0, 0], [1, 2, 3], alpha=0.2) == (-math.inf, math.inf)
    # pairs, not values: after - before
    assert sign_flip_interval([1, 1, 1], [2, 3, 4], alpha=0.5) == (1.5, 2.5)
    with pytest.raises(ValueError, match="n = 17"):
        sign_flip_interval([0.0] * 17, [1.0] * 17)
    with pytest.raises(ValueError, match="alpha"):
        sign_flip_interval([0], [1], alpha=0.0)


def _one_sided_p_greater(d: list[float], delta: float) -> float:
    """Brute force: share of the 2^n sign assignments of ``d - delta`` whose sum is at
    least the observed one (the test of "mean > delta")."""
    import itertools

    x = [v - delta for v in d]
    obs = sum(x)
    hits = sum(sum(s * v for s, v in zip(signs, x, strict=True)) >= obs - 1e-12
               for signs in itertools.product((1, -1), repeat=len(x)))
    return hits / 2 ** len(x)


def test_sign_flip_interval_is_the_inverted_test():
    """Just inside each end neither one-sided test rejects at alpha / 2; just outside
    one does (brute force over all 2^7 sign assignments)."""
    d = [0.31, -0.12, 0.05, 0.22, -0.04, 0.17, 0.09]
    alpha = 0.1  # j = floor(0.1 * 128 / 2) = 6
    low, high = sign_flip_interval([0.0] * 7, d, alpha=alpha)
    eps = 1e-9
    assert _one_sided_p_greater(d, low + eps) > alpha / 2
    assert _one_sided_p_greater(d, low - eps) <= alpha / 2
    neg = [-v for v in d]  # the test of "mean < delta" is the mirrored one
    assert _one_sided_p_greater(neg, -high + eps) > alpha / 2
    assert _one_sided_p_greater(neg, -high - eps) <= alpha / 2


def test_sign_flip_interval_coverage_is_exact_for_symmetric_data():
    """Hartigan's theorem: for continuous differences symmetric about mu, mu falls below
    the j-th smallest subset mean with probability j / 2^n. n = 6, alpha = 0.25: j = 8,
    coverage 1 - 16/64 = 0.75 exactly; 4000 draws give SE 0.0068."""
    import random

    rng = random.Random(7)
    mu, covered, draws = 0.3, 0, 4000
    for _ in range(draws):
        d = [mu + rng.gauss(0, 1) * rng.choice((0.2, 1.0)) for _ in range(6)]
        low, high = sign_flip_interval([0.0] * 6, d, alpha=0.25)
        covered += low <= mu <= high
    assert covered / draws == pytest.approx(0.75, abs=0.03)
