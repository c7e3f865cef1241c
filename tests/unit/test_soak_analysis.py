"""The analysis of ``bench/soak.py`` (``make bench-soak``) on made-up series: slopes per
hour, quarter medians, tolerances and the verdict line."""

from __future__ import annotations

import importlib.util
import sys

import pytest
from script_loader import ROOT


def _load_soak():  # noqa: ANN202 - a module
    # registered in sys.modules first: dataclasses look their module up while building
    spec = importlib.util.spec_from_file_location("bench_soak", ROOT / "bench" / "soak.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_soak"] = mod
    spec.loader.exec_module(mod)
    return mod


soak = _load_soak()


def _records(rss, fds, round_s, minutes: int = 60, cpu=None) -> list[dict]:  # noqa: ANN001
    """One sample and one round every 10 s for ``minutes``; values from functions of t
    (CPU seconds per round: ``cpu``, default the round's wall time)."""
    out, cpu_s = [], 0.0
    cpu = cpu or round_s
    for k, t in enumerate(range(0, minutes * 60 + 1, 10)):
        out.append({"kind": "sample", "t": float(t), "rss_mib": rss(t), "fds": fds(t),
                    "cpu_s": cpu_s, "rounds": k})
        out.append({"kind": "round", "t": t + 5.0, "round_seconds": round_s(t)})
        cpu_s += cpu(t)
    return out


def test_slope_per_hour():
    assert soak.slope_per_hour([(0.0, 0.0), (3600.0, 10.0)]) == pytest.approx(10.0)
    assert soak.slope_per_hour([(0.0, 5.0), (60.0, 6.0), (120.0, 7.0)]) == pytest.approx(60.0)
    assert soak.slope_per_hour([(10.0, 1.0)]) == 0.0
    assert soak.slope_per_hour([(10.0, 1.0), (10.0, 2.0)]) == 0.0


def test_fd_floor_ignores_flicker_and_follows_a_leak():
    pts = [(0.0, 8), (20.0, 9), (40.0, 8), (60.0, 9), (80.0, 9), (100.0, 9), (150.0, 10)]
    assert soak.floor(pts, window_s=60) == [
        (0.0, 8), (20.0, 8), (40.0, 8), (60.0, 8), (80.0, 8), (100.0, 8), (150.0, 9)]


def test_flat_series_with_noise_is_flat():
    noise = [0.0, 3.0, -2.0, 1.0, -1.0]  # +-3 MiB, +-1 fd, +-10 % round time
    recs = _records(lambda t: 500 + noise[int(t) // 10 % 5],
                    lambda t: 8 + (t // 10 % 2), lambda t: 1.0 + noise[int(t) // 10 % 5] / 30)
    trends = soak.summarize(recs, warmup_s=120)
    assert [tr.metric for tr in trends] == ["rss_floor_mib", "fds", "round_cpu_s", "rss_mib",
                                            "rss_peak_mib", "round_seconds"]
    assert all(tr.flat for tr in trends)
    floor_, rss = trends[0], trends[3]
    assert floor_.first == floor_.last == 498  # the noise's low point
    assert rss.first == 500 and rss.tolerance == 10.0
    assert rss.n == len([r for r in recs if r["kind"] == "sample" and r["t"] >= 120])
    assert soak.report_lines(trends)[-1] == "verdict: flat"


def test_a_leak_a_descriptor_leak_and_a_slowdown_are_caught():
    # 20 MiB/h on 500 MiB (tolerance 2 %/h = 10), one fd per 20 min, rounds +15 %/h
    recs = _records(lambda t: 500 + 20 * t / 3600, lambda t: 8 + t // 1200,
                    lambda t: 1.0 + 0.15 * t / 3600)
    floor_, fds, cpu, rss, peak, rounds = soak.summarize(recs, warmup_s=120)
    assert floor_.slope_per_h == pytest.approx(20.0, rel=0.01) and not floor_.flat
    assert peak.slope_per_h == pytest.approx(20.0, rel=0.01) and not peak.flat
    assert rss.slope_per_h == pytest.approx(20.0) and not rss.flat
    assert rss.last - rss.first == pytest.approx(20 * 0.75 * (3600 - 120) / 3600, abs=0.3)
    assert fds.first == 8 and fds.last == 10 and not fds.flat
    assert rounds.slope_per_h == pytest.approx(0.15) and not rounds.flat
    # CPU per round is averaged over the past minute: a slope of 0.15 s/h, less the lag
    assert cpu.slope_per_h == pytest.approx(0.15, rel=0.01) and not cpu.flat
    assert soak.report_lines([floor_, fds, cpu, rss, peak, rounds])[-1] == \
        "verdict: GROWING (rss_floor_mib, fds, round_cpu_s)"


def test_wall_clock_slowdown_alone_is_reported_but_not_in_the_verdict():
    # other processes slow the rounds down; the CPU they take stays 1 s
    recs = _records(lambda t: 500, lambda t: 8, lambda t: 1.0 + 0.5 * t / 3600,
                    cpu=lambda t: 1.0)
    trends = soak.summarize(recs, warmup_s=120)
    assert [tr.flat for tr in trends] == [True, True, True, True, True, False]
    lines = soak.report_lines(trends)
    assert lines[-1] == "verdict: flat" and "not in the verdict" in lines[-2]
    cpu = trends[2]
    assert cpu.first == cpu.last == pytest.approx(1.0)


def test_falling_is_flat_and_a_step_at_the_end_is_not():
    falling = _records(lambda t: 700 - 50 * t / 3600, lambda t: 8, lambda t: 1.0)
    assert all(tr.flat for tr in soak.summarize(falling, warmup_s=120))
    # flat for 50 minutes, then 40 MiB more: the slope is small, the medians are not
    step = _records(lambda t: 500 + (40 if t > 3000 else 0), lambda t: 8, lambda t: 1.0)
    rss = soak.summarize(step, warmup_s=120)[0]
    assert rss.metric == "rss_floor_mib"
    assert rss.last - rss.first == 40 and not rss.flat


def test_bimodal_rss_is_judged_by_its_floor():
    # between rounds 640 MiB, inside a learner step 740; the share of samples that land
    # in a step drifts from 40 % to 60 %: the median jumps a mode, the floor stays
    def rss(t: float) -> float:
        share = 0.4 + 0.2 * t / 3600
        return 740.0 if (t / 10 * 0.618) % 1 < share else 640.0

    trends = {tr.metric: tr for tr in soak.summarize(
        _records(rss, lambda t: 8, lambda t: 1.0), warmup_s=120)}
    assert trends["rss_floor_mib"].first == trends["rss_floor_mib"].last == 640.0
    assert trends["rss_floor_mib"].flat and trends["rss_peak_mib"].last == 740.0
    assert trends["rss_mib"].last - trends["rss_mib"].first == 100.0
    assert not trends["rss_mib"].flat
    assert soak.report_lines(list(trends.values()))[-1] == "verdict: flat"


def test_a_run_too_short_for_its_quarters_is_an_error():
    # after 50 s of warm-up only the sample at 100 s is left: the first quarter is empty
    recs = [{"kind": "sample", "t": t, "rss_mib": 1.0, "fds": 1.0} for t in (0.0, 100.0)]
    recs.append({"kind": "round", "t": 100.0, "round_seconds": 1.0})
    with pytest.raises(ValueError, match="no point in the first or last quarter"):
        soak.summarize(recs, warmup_s=50.0)


def test_relative_to_probe_divides_by_the_median_probe_of_the_window():
    probes = [(0.0, 0.10), (20.0, 0.30), (40.0, 0.20), (100.0, 0.50)]
    # t=40: window [-20, 40] holds 0.10, 0.30, 0.20 -> median 0.20; t=70: [10, 70] holds
    # 0.30, 0.20 -> 0.25
    # t=150: window [90, 150] holds 0.50; t=300: no probe in [240, 300] -> skipped
    out = soak.relative_to_probe([(40.0, 1.0), (70.0, 1.0), (150.0, 2.0), (300.0, 1.0)], probes)
    assert out == [(40.0, pytest.approx(5.0)), (70.0, pytest.approx(4.0)),
                   (150.0, pytest.approx(4.0))]


def _with_probes(recs: list[dict], probe_cpu, minutes: int = 60) -> list[dict]:  # noqa: ANN001
    return recs + [{"kind": "probe", "t": t + 2.0, "probe_cpu_s": probe_cpu(t)}
                   for t in range(0, minutes * 60 + 1, 5)]


def test_contention_that_slows_the_probe_too_is_not_growth():
    # the machine gets 15 %/h slower for everything: client CPU per round and probe alike
    slow = lambda t: 1.0 + 0.15 * t / 3600  # noqa: E731
    recs = _with_probes(_records(lambda t: 500.0, lambda t: 8, lambda t: 1.0, cpu=slow),
                        lambda t: 0.1 * slow(t))
    trends = {tr.metric: tr for tr in soak.summarize(recs, warmup_s=120)}
    assert not trends["round_cpu_s"].flat
    rel = trends["round_cpu_rel"]
    assert rel.first == pytest.approx(10.0, rel=0.01) and rel.last == pytest.approx(10.0, rel=0.01)
    assert abs(rel.slope_per_h) < 0.05 and rel.flat
    lines = soak.report_lines(list(trends.values()))
    assert lines[-1] == "verdict: flat"
    assert any(line.startswith("round_cpu_s") and "(not in the verdict)" in line
               for line in lines)


def test_a_client_that_does_more_work_per_round_is_growth_against_the_probe():
    slow = lambda t: 1.0 + 0.15 * t / 3600  # noqa: E731
    recs = _with_probes(_records(lambda t: 500.0, lambda t: 8, lambda t: 1.0, cpu=slow),
                        lambda t: 0.1)
    trends = {tr.metric: tr for tr in soak.summarize(recs, warmup_s=120)}
    rel = trends["round_cpu_rel"]
    assert rel.slope_per_h == pytest.approx(1.5, rel=0.02) and not rel.flat
    assert soak.report_lines(list(trends.values()))[-1] == "verdict: GROWING (round_cpu_rel)"
