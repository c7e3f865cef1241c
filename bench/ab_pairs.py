"""Paired A/B runs of two benchmark commands on a shared machine, with the statistics.

Runs ``--base`` and ``--new`` (shell commands) ``--pairs`` times, alternating which of
the two goes first in each pair (ABBA...), so slow drifts of the machine's load hit both
sides alike. From each run's output it takes the first match of ``--metric`` (a regular
expression with one group, a number); per pair it forms the ratio new / base. It prints
(and with ``--out`` appends to a file) every run's matched line and then:

* the mean of the paired ratios with a 95 % t-interval (Student's t with n - 1 degrees of
  freedom; it assumes roughly normal ratios, which a handful of pairs cannot check);
* the exact two-sided sign test of "new differs from base" (binomial, p = 0.5; ties
  dropped): the count of pairs where new < base and its p value.

``--reanalyze FILE`` prints the same statistics for another ``--metric`` of the runs a
record holds (e.g. ``p99_submit_ms=([0-9.]+)`` of runs recorded for bundles/s), one
block per recorded A/B.

    .venv/bin/python bench/ab_pairs.py --pairs 8 --metric 'handlers cpu ([0-9.]+) ms' \\
        --base '.venv/bin/python bench/coordinator_handlers.py --coordinator-src /tmp/b' \\
        --new '.venv/bin/python bench/coordinator_handlers.py' --out bench/results/x.txt
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

#: Student's t quantile 0.975 for 1..30 degrees of freedom.
T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201,
        2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074,
        2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


def t_interval(values: list[float]) -> tuple[float, float, float]:
    """Mean and 95 % t-interval of ``values`` (at least 2)."""
    n = len(values)
    mean = statistics.fmean(values)
    half = T975[min(n - 1, 30) - 1] * statistics.stdev(values) / math.sqrt(n)
    return mean, mean - half, mean + half


def sign_test(below: int, above: int) -> float:
    """Exact two-sided sign test p value (ties already dropped)."""
    n = below + above
    if n == 0:
        return 1.0
    k = min(below, above)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def summarize(ratios: list[float]) -> list[str]:
    """The summary lines of paired ratios new/base."""
    below = sum(r < 1 for r in ratios)
    above = sum(r > 1 for r in ratios)
    mean, low, high = t_interval(ratios)
    return [
        "# paired ratios new/base: " + ", ".join(f"{r:.3f}" for r in ratios),
        f"# n = {len(ratios)} pairs; mean ratio {mean:.3f}, 95 % t-interval "
        f"[{low:.3f}, {high:.3f}]",
        f"# sign test: new < base in {below} of {below + above} pairs (ties dropped), "
        f"exact two-sided p = {sign_test(below, above):.4f}",
    ]


def reanalyze(path: str, pattern: re.Pattern[str]) -> None:
    """Statistics of ``pattern`` over the runs recorded in ``path``."""
    label = ""
    pairs: dict[int, dict[str, float]] = {}

    def flush() -> None:
        ratios = [p["new"] / p["base"] for _, p in sorted(pairs.items())
                  if "new" in p and "base" in p]
        if len(ratios) >= 2:
            print(label)
            print("\n".join(summarize(ratios)))

    for line in Path(path).read_text().splitlines():
        if line.startswith("# ") and not line.startswith(("# base", "# new", "# metric",
                                                           "# paired", "# n =", "# sign")):
            flush()
            label, pairs = line, {}
        found = re.match(r"pair (\d+) (base|new)\s.*?: (.*)$", line)
        if found:
            value = pattern.search(found.group(3))
            if value:
                pairs.setdefault(int(found.group(1)), {})[found.group(2)] = float(value.group(1))
    flush()


def run(command: str, pattern: re.Pattern[str]) -> tuple[float, str]:
    done = subprocess.run(command, shell=True, capture_output=True, text=True, check=False)
    text = done.stdout + done.stderr
    found = pattern.search(text)
    if done.returncode != 0 or found is None:
        raise SystemExit(f"no metric from {command!r} (exit {done.returncode}):\n{text[-3000:]}")
    line = next(x for x in text.splitlines() if pattern.search(x))
    return float(found.group(1)), line.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="")
    parser.add_argument("--new", default="")
    parser.add_argument("--metric", required=True, help="regex with one number group")
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--label", default="", help="first line of the record")
    parser.add_argument("--out", default="")
    parser.add_argument("--reanalyze", default="", help="a record written by --out")
    args = parser.parse_args()
    pattern = re.compile(args.metric)
    if args.reanalyze:
        reanalyze(args.reanalyze, pattern)
        return
    if not args.base or not args.new:
        parser.error("--base and --new are required")
    lines = [f"# {args.label}" if args.label else "# A/B pairs",
             f"# base: {args.base}", f"# new:  {args.new}",
             f"# metric: {args.metric}; pairs: {args.pairs}, alternating order; "
             f"started {time.strftime('%Y-%m-%d %H:%M:%S')}"]
    for line in lines:
        print(line, flush=True)
    ratios: list[float] = []
    for k in range(args.pairs):
        order = ["base", "new"] if k % 2 == 0 else ["new", "base"]
        got: dict[str, float] = {}
        for side in order:
            load = Path("/proc/loadavg").read_text().split()[0]
            value, line = run(args.base if side == "base" else args.new, pattern)
            got[side] = value
            text = f"pair {k + 1} {side:4s} (load {load}): {line}"
            print(text, flush=True)
            lines.append(text)
        ratios.append(got["new"] / got["base"])
    summary = summarize(ratios)
    for line in summary:
        print(line, flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n".join(lines + summary) + "\n\n")


if __name__ == "__main__":
    sys.exit(main())
