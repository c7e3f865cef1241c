"""Regenerate the results table of docs/demo.md from committed demo reports.

Usage::

    python experiments/summarize_demo.py --collect runs/demo   # copy report.json in
    python experiments/summarize_demo.py                       # rewrite the table
    python experiments/summarize_demo.py --check               # exit 1 if stale

Raw results: ``experiments/results/demo/seed<N>/report.json`` (and the run's
``report.md`` and ``rewards.png``), exactly as ``make demo SEED=N`` wrote them. The
table between ``<!-- table:demo -->`` and ``<!-- /table -->`` in docs/demo.md has one
row per seed and client: greedy pass@1 (McNemar) and sampled pass@1 (sign-flip) before
and after, each with its 95 % interval and test, and the wall time. The greedy interval
is the Wald interval of a difference of paired proportions from the discordant counts
(Agresti, "Categorical Data Analysis", 3rd ed., section 11.1.3):
``(gained - lost) / n +- 1.96 sqrt(gained + lost - (gained - lost)^2 / n) / n``.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "experiments" / "results" / "demo"
DOC = ROOT / "docs" / "demo.md"
MARKER = re.compile(r"(<!-- table:demo -->\n)(.*?)(<!-- /table -->)", re.DOTALL)


def collect(run: Path, results: Path = RESULTS) -> Path:
    """Copy ``run``'s report.json, report.md and rewards.png to ``results/seed<N>``."""
    report = json.loads((run / "report.json").read_text())
    dest = results / f"seed{report['settings']['seed']}"
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("report.json", "report.md", "rewards.png"):
        if (run / name).exists():
            shutil.copyfile(run / name, dest / name)
    return dest


def paired_proportion_ci(gained: int, lost: int, n: int) -> tuple[float, float]:
    """95 % Wald interval of ``after - before`` for paired binary outcomes."""
    d = (gained - lost) / n
    se = math.sqrt(max(gained + lost - (gained - lost) ** 2 / n, 0.0)) / n
    return d - 1.96 * se, d + 1.96 * se


def table(results: Path = RESULTS) -> str:
    """The markdown table of every committed seed (a placeholder when there is none)."""
    head = ("| seed | client | n prompts | greedy before → after [95 % CI of the change] | "
            "McNemar p | sampled before → after [95 % CI of the change] | sign-flip p | "
            "primary significant | wall s |\n"
            "|---:|---|---:|---|---:|---|---:|---|---:|\n")
    rows = []
    for path in sorted(results.glob("seed*/report.json"),
                       key=lambda p: int(p.parent.name.removeprefix("seed"))):
        r = json.loads(path.read_text())
        primary = r["heldout"]
        for name, c in r["clients"].items():
            g, s = c.get("greedy"), c.get("sampled")
            if not g or not s:
                rows.append(f"| {r['settings']['seed']} | {name} | – | – | – | – | – | – | – |")
                continue
            sig = ("yes" if primary["significant"] else "**no**") if name == primary[
                "client"] else "(secondary)"
            lo, hi = paired_proportion_ci(g["gained"], g["lost"], g["n"])
            rows.append(
                f"| {r['settings']['seed']} | {name} | {g['n']} | {g['before']:.3f} → "
                f"{g['after']:.3f} (+{g['gained']}/−{g['lost']}) [{lo:+.3f}, {hi:+.3f}] | "
                f"{g['p_value']:.2g} | "
                f"{s['before']:.3f} → {s['after']:.3f} [{s['ci_low']:+.3f}, "
                f"{s['ci_high']:+.3f}] | {s['p_value']:.2g} | {sig} | "
                f"{r['wall_seconds']:.0f} |")
    if not rows:
        rows = ["| – | not yet run | | | | | | | |"]
    return head + "\n".join(rows) + "\n"


def regenerate(text: str, results: Path = RESULTS) -> str:
    """``text`` with the demo table rewritten.

    Raises:
        ValueError: if the document has no table marker.
    """
    if not MARKER.search(text):
        raise ValueError("no <!-- table:demo --> marker")
    return MARKER.sub(lambda m: m.group(1) + table(results) + m.group(3), text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--collect", type=Path, help="a demo output folder to copy in first")
    ap.add_argument("--check", action="store_true", help="exit 1 if the table is stale")
    ap.add_argument("--doc", type=Path, default=DOC)
    ap.add_argument("--results", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    if args.collect:
        print(f"collected into {collect(args.collect, args.results)}")
    old = args.doc.read_text()
    new = regenerate(old, args.results)
    if args.check:
        if new != old:
            print(f"{args.doc} is stale: run experiments/summarize_demo.py", file=sys.stderr)
            return 1
        return 0
    args.doc.write_text(new)
    print(f"rewrote the demo table of {args.doc}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
