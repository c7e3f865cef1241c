"""Paired significance tests and intervals for held-out comparisons (pure, no I/O).

Every comparison FTIS reports is paired: the same held-out prompts before and after
training (the demo), or the same seeds under two methods (the experiment matrices).
Pairing removes the prompt-to-prompt (or seed-to-seed) variance from the comparison.

* :func:`mcnemar_exact` -- McNemar's test for paired binary outcomes (greedy pass@1),
  exact two-sided binomial form on the discordant pairs (McNemar 1947; Fagerland,
  Lydersen & Laake 2013, "The McNemar test for binary matched-pairs data", BMC Med Res
  Methodol 13:91, recommend the exact or mid-p form for small discordant counts).
* :func:`paired_permutation_test` -- the sign-flip (randomisation) test of a zero mean
  paired difference (Fisher 1935; Good, "Permutation Tests", 2nd ed., section 3.2):
  exact enumeration for up to 16 pairs, Monte Carlo otherwise. Used for sampled
  pass@1 (a mean of k samples per prompt) and for seed-paired method contrasts.
* :func:`paired_bootstrap_ci` -- percentile bootstrap interval of the mean paired
  difference (Efron & Tibshirani 1993, chapter 13).
* :func:`sign_flip_interval` -- the exact interval for the mean paired difference that
  inverts the sign-flip test (Hartigan 1969), at any level: with ``alpha / m`` it gives
  Bonferroni-simultaneous intervals for a family of ``m`` contrasts.
* :func:`holm` -- Holm's step-down adjustment for several contrasts (Holm 1979).
* :func:`pairs_for_power` -- paired sample size for a target difference (normal
  approximation, two-sided).

All p-values are two-sided. Monte Carlo p-values use ``(hits + 1) / (rounds + 1)``
(Phipson & Smyth 2010), so they are never 0.
"""

from __future__ import annotations

import itertools
import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "EXACT_MAX_PAIRS",
    "McNemarResult",
    "PairedResult",
    "holm",
    "mcnemar_exact",
    "paired_bootstrap_ci",
    "paired_comparison",
    "paired_permutation_test",
    "pairs_for_power",
    "sign_flip_interval",
]

#: the most pairs whose 2^n sign assignments (or subsets) are enumerated exactly
EXACT_MAX_PAIRS = 16


@dataclass(frozen=True)
class McNemarResult:
    """McNemar's exact test on paired binary outcomes.

    Attributes:
        n: number of pairs.
        before, after: share of successes before and after.
        gained: pairs wrong before and right after.
        lost: pairs right before and wrong after.
        p_value: two-sided exact p-value, ``min(1, 2 P[X <= min(gained, lost)])`` with
            ``X ~ Binomial(gained + lost, 1/2)``; 1.0 when there is no discordant pair.
    """

    n: int
    before: float
    after: float
    gained: int
    lost: int
    p_value: float


def _check_pairs(before: Sequence[float], after: Sequence[float]) -> None:
    if len(before) != len(after):
        raise ValueError(f"paired samples differ in length: {len(before)} vs {len(after)}")
    if not before:
        raise ValueError("no pairs")
    if not all(math.isfinite(float(x)) for x in (*before, *after)):
        raise ValueError("paired values must be finite")


def mcnemar_exact(before: Sequence[bool], after: Sequence[bool]) -> McNemarResult:
    """McNemar's exact test (see :class:`McNemarResult`).

    Args:
        before, after: paired binary outcomes (bool or 0/1), same length ``n >= 1``.

    Raises:
        ValueError: on different lengths, no pairs, or a value other than 0/1.
    """
    _check_pairs(before, after)
    if any(float(x) not in (0.0, 1.0) for x in (*before, *after)):
        raise ValueError("McNemar's test needs binary outcomes (0/1)")
    b = [bool(x) for x in before]
    a = [bool(x) for x in after]
    gained = sum(1 for x, y in zip(b, a, strict=True) if not x and y)
    lost = sum(1 for x, y in zip(b, a, strict=True) if x and not y)
    m = gained + lost
    if m == 0:
        p = 1.0
    else:
        k = min(gained, lost)
        tail = sum(math.comb(m, i) for i in range(k + 1)) / 2**m
        p = min(1.0, 2.0 * tail)
    n = len(b)
    return McNemarResult(n, sum(b) / n, sum(a) / n, gained, lost, p)


def paired_permutation_test(before: Sequence[float], after: Sequence[float],
                            rounds: int = 20_000, seed: int = 0) -> float:
    """Two-sided sign-flip test of ``mean(after - before) == 0``.

    Under the null each paired difference is as likely to have either sign, so the
    p-value is the share of the ``2^n`` sign assignments whose ``|mean|`` is at least the
    observed one (exact for ``n <= 16``; otherwise ``rounds`` random assignments from a
    ``random.Random(seed)``). Zero differences take part (they never change the mean).
    With ``n`` pairs the smallest exact p-value is ``2 / 2^n`` (0.031 for n = 6), so
    fewer than 6 pairs can never reach p < 0.05.

    Args:
        before, after: paired values, same length ``n >= 1``.
        rounds: Monte Carlo assignments when ``n > 16`` (``>= 1``).
        seed: seed of the Monte Carlo draws.

    Returns:
        p-value in ``(0, 1]``.

    Raises:
        ValueError: on different lengths, no pairs, non-finite values or ``rounds < 1``.
    """
    _check_pairs(before, after)
    if rounds < 1:
        raise ValueError("rounds must be >= 1")
    d = [float(y) - float(x) for x, y in zip(before, after, strict=True)]
    observed = abs(sum(d))
    tol = 1e-12 * max(1.0, observed)
    if len(d) <= EXACT_MAX_PAIRS:
        hits = total = 0
        for signs in itertools.product((1.0, -1.0), repeat=len(d)):
            total += 1
            if abs(sum(s * x for s, x in zip(signs, d, strict=True))) >= observed - tol:
                hits += 1
        return hits / total
    rng = random.Random(seed)
    hits = 0
    for _ in range(rounds):
        s = sum(x if rng.random() < 0.5 else -x for x in d)
        if abs(s) >= observed - tol:
            hits += 1
    return (hits + 1) / (rounds + 1)


def paired_bootstrap_ci(before: Sequence[float], after: Sequence[float],
                        level: float = 0.95, rounds: int = 10_000,
                        seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of ``mean(after - before)`` (pairs resampled whole).

    Args:
        before, after: paired values, same length ``n >= 1``.
        level: coverage in ``(0, 1)``.
        rounds: bootstrap resamples (``>= 1``).
        seed: seed of the resampling.

    Returns:
        ``(low, high)`` in the values' unit.

    Raises:
        ValueError: on different lengths, no pairs, non-finite values, a bad ``level``
            or ``rounds < 1``.
    """
    _check_pairs(before, after)
    if not 0 < level < 1:
        raise ValueError("level must be in (0, 1)")
    if rounds < 1:
        raise ValueError("rounds must be >= 1")
    d = [float(y) - float(x) for x, y in zip(before, after, strict=True)]
    n = len(d)
    rng = random.Random(seed)
    means = sorted(sum(d[rng.randrange(n)] for _ in range(n)) / n for _ in range(rounds))
    lo_i = int(math.floor((1 - level) / 2 * (rounds - 1)))
    hi_i = int(math.ceil((1 + level) / 2 * (rounds - 1)))
    return means[lo_i], means[hi_i]


def sign_flip_interval(before: Sequence[float], after: Sequence[float],
                       alpha: float = 0.05) -> tuple[float, float]:
    """Exact two-sided ``1 - alpha`` interval for the mean of ``after - before``, found
    by inverting the one-sided sign-flip tests (Hartigan 1969, "Using subsample values
    as typical values", JASA 64:1303-1317, Theorem 1).

    Shifting the differences ``d`` by ``delta``, the one-sided sign-flip p-value of
    "mean > delta" is ``(1 + c) / 2^n`` with ``c`` the number of non-empty subsets of
    ``d`` whose mean is at most ``delta``: flipping the signs of a subset ``S`` gives a
    sum at least as large as the observed one exactly when ``mean(d[S]) <= delta``. So
    the ``delta`` that neither one-sided test rejects at ``alpha / 2`` run from the
    ``j``-th smallest to the ``j``-th largest of the ``2^n - 1`` subset means, with
    ``j = floor(alpha * 2^n / 2)``. If the differences are independent and symmetric
    about their mean (the sign-flip test's own assumption, moved to the true mean),
    the interval covers it with probability at least ``1 - alpha``; Hartigan shows the
    subset means cut the line into ``2^n`` pieces, each holding the mean with
    probability ``2^-n``. With ``alpha / m`` for each of ``m`` contrasts the intervals
    hold together with probability at least ``1 - alpha`` (Bonferroni).

    Args:
        before, after: paired values, same length ``1 <= n <= 16``.
        alpha: two-sided level in ``(0, 1)``.

    Returns:
        ``(low, high)`` in the values' unit; ``(-inf, inf)`` when ``j = 0``, i.e. when
        ``2 / 2^n > alpha`` and no test of ``n`` pairs can reject at ``alpha`` (the
        floor of :func:`sign_flip_floor`).

    Raises:
        ValueError: on different lengths, no pairs, non-finite values, more than 16
            pairs (``2^n`` subsets are enumerated) or ``alpha`` outside ``(0, 1)``.
    """
    _check_pairs(before, after)
    if not 0 < alpha < 1:
        raise ValueError("alpha must be in (0, 1)")
    d = [float(y) - float(x) for x, y in zip(before, after, strict=True)]
    if len(d) > EXACT_MAX_PAIRS:
        raise ValueError(f"exact interval enumerates 2^n subsets; n = {len(d)} > "
                         f"{EXACT_MAX_PAIRS}")
    j = math.floor(alpha * 2 ** len(d) / 2)
    if j == 0:
        return -math.inf, math.inf
    sums, sizes = [0.0], [0]
    for x in d:  # every subset, built by adding each difference to the ones before it
        sums += [s + x for s in sums]
        sizes += [k + 1 for k in sizes]
    means = sorted(s / k for s, k in zip(sums[1:], sizes[1:], strict=True))
    return means[j - 1], means[-j]


@dataclass(frozen=True)
class PairedResult:
    """A paired comparison of means: ``diff = after - before`` with its interval and
    the sign-flip p-value.

    Attributes:
        n: pairs.
        before, after: means.
        diff: ``after - before``.
        ci_low, ci_high: 95 % paired bootstrap interval of ``diff``.
        sd_diff: sample standard deviation of the paired differences (0 for n = 1).
        p_value: two-sided :func:`paired_permutation_test` p-value.
    """

    n: int
    before: float
    after: float
    diff: float
    ci_low: float
    ci_high: float
    sd_diff: float
    p_value: float


def paired_comparison(before: Sequence[float], after: Sequence[float],
                      seed: int = 0) -> PairedResult:
    """Means, difference, 95 % bootstrap interval and sign-flip p-value of paired data.

    Raises:
        ValueError: as :func:`paired_permutation_test`.
    """
    _check_pairs(before, after)
    d = [float(y) - float(x) for x, y in zip(before, after, strict=True)]
    lo, hi = paired_bootstrap_ci(before, after, seed=seed)
    return PairedResult(
        n=len(d),
        before=statistics.fmean(float(x) for x in before),
        after=statistics.fmean(float(x) for x in after),
        diff=statistics.fmean(d),
        ci_low=lo,
        ci_high=hi,
        sd_diff=statistics.stdev(d) if len(d) > 1 else 0.0,
        p_value=paired_permutation_test(before, after, seed=seed),
    )


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values (Holm 1979), in the input order.

    The ``i``-th smallest p-value is multiplied by ``m - i`` (``i`` from 0), the results
    are made non-decreasing in that order and capped at 1. Rejecting where the adjusted
    p-value is below alpha controls the family-wise error rate at alpha.

    Raises:
        ValueError: on a p-value outside ``[0, 1]``.
    """
    if any(not 0.0 <= p <= 1.0 for p in p_values):
        raise ValueError("p-values must be in [0, 1]")
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    adjusted = [0.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted


def pairs_for_power(sd_diff: float, effect: float, alpha: float = 0.05,
                    power: float = 0.8) -> int:
    """Pairs needed to detect a mean paired difference ``effect`` (two-sided test).

    Normal approximation ``n = ((z_{1-alpha/2} + z_{power}) * sd_diff / effect)^2``,
    rounded up, plus one pair for estimating the sd, and never below the fewest pairs
    with which the exact two-sided sign-flip test can reach ``alpha`` at all: its
    smallest p is ``2 / 2^n``, so ``n >= 1 + log2(1 / alpha)`` (6 at 0.05, 7 at 0.05/3,
    9 at 0.05/7, 10 at 0.05/21).

    Args:
        sd_diff: standard deviation of the paired differences (> 0).
        effect: the difference to detect (> 0), same unit.
        alpha: two-sided level (e.g. a Holm-corrected one).
        power: target power in ``(0, 1)``.

    Raises:
        ValueError: on non-positive ``sd_diff``/``effect`` or levels outside ``(0, 1)``.
    """
    if not (sd_diff > 0 and effect > 0):
        raise ValueError("sd_diff and effect must be > 0")
    if not (0 < alpha < 1 and 0 < power < 1):
        raise ValueError("alpha and power must be in (0, 1)")
    z = statistics.NormalDist()
    n = ((z.inv_cdf(1 - alpha / 2) + z.inv_cdf(power)) * sd_diff / effect) ** 2
    return max(sign_flip_floor(alpha), math.ceil(n) + 1)


def sign_flip_floor(alpha: float) -> int:
    """The fewest pairs for which the exact two-sided sign-flip test has a p-value
    ``2 / 2^n <= alpha`` (``alpha`` in (0, 1))."""
    return max(1, math.ceil(1 + math.log2(1 / alpha) - 1e-12))
