"""The statistics of ``bench/ab_pairs.py`` (paired A/B runs): the t-interval of the paired
ratios, the exact sign test, and re-reading a record for another metric."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from script_loader import load_script

ab = load_script("bench/ab_pairs.py")


def test_t_interval_by_hand() -> None:
    mean, low, high = ab.t_interval([0.8, 0.9, 1.0])
    # mean 0.9, sd 0.1, t(0.975, 2) = 4.303: 0.9 -+ 4.303 * 0.1 / sqrt(3)
    half = 4.303 * 0.1 / math.sqrt(3)
    assert mean == pytest.approx(0.9)
    assert (low, high) == (pytest.approx(0.9 - half), pytest.approx(0.9 + half))


def test_exact_sign_test() -> None:
    assert ab.sign_test(5, 0) == pytest.approx(2 / 32)  # 0.0625: the least for n = 5
    assert ab.sign_test(0, 8) == pytest.approx(2 / 256)
    assert ab.sign_test(5, 1) == pytest.approx(2 * 7 / 64)  # 0.21875
    assert ab.sign_test(3, 3) == 1.0
    assert ab.sign_test(0, 0) == 1.0


def test_reanalyze_reads_another_metric(tmp_path: Path, capsys) -> None:
    record = tmp_path / "r.txt"
    record.write_text(
        "# first A/B\n# base: b\n# new:  n\n# metric: x\n"
        "pair 1 base (load 1.0): rate=100 p99=200\n"
        "pair 1 new  (load 1.0): rate=120 p99=150\n"
        "pair 2 new  (load 1.0): rate=130 p99=100\n"
        "pair 2 base (load 1.0): rate=100 p99=200\n"
        "# paired ratios new/base: 1.200, 1.300\n")
    ab.reanalyze(str(record), ab.re.compile(r"p99=([0-9.]+)"))
    out = capsys.readouterr().out
    assert "# first A/B" in out
    assert "# paired ratios new/base: 0.750, 0.500" in out
    assert "sign test: new < base in 2 of 2 pairs" in out and "p = 0.5000" in out
