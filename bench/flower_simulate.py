"""Scaling of ``ftis-lab simulate`` (issue 16, part 2): N tiny-model learners in Flower's
simulation engine on this machine, learner-rounds per minute.

Each N runs in a fresh process (its own local Ray instance): ``--rounds`` rounds of the
CLI's default tiny swarm (letter_counting, I = 1, J = 2, G = 8, 12 new tokens), one
ClientApp actor per ``--client-cpus`` CPUs, learners' state in their Flower context.
Prints, and appends to ``--out``, one line per run:

    N=.. rounds=.. actors_cpus=.. setup_s=.. wall_s=.. total_s=.. learner_rounds=..
    learner_rounds_per_min=.. bundles_accepted=.. bundles_rejected=.. load_after=..

``setup_s`` is Ray's start, the actors' imports and registration; ``wall_s`` the rounds
alone (what ``learner_rounds_per_min`` divides by).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one(learners: int, rounds: int, client_cpus: float, out: Path) -> dict[str, float]:
    """Run one swarm in this process; its numbers."""
    from ftis.lab.simulate.flower import run_flower
    from ftis.lab.simulate.spec import SwarmSpec

    spec = SwarmSpec(learners=learners, rounds=rounds, group_size=8, max_new_tokens=12,
                     model_seed=1, external_groups=2, out=out,
                     coordinator={"tasks": [{"dataset": "letter_counting"}], "task_seed": 1})
    t0 = time.perf_counter()
    summary = run_flower(spec, client_cpus=client_cpus, snapshots=True)
    return {"N": learners, "rounds": rounds, "actors_cpus": client_cpus,
            "setup_s": round(summary.setup_s, 1), "wall_s": round(summary.wall_s, 1),
            "total_s": round(time.perf_counter() - t0, 1),
            "learner_rounds": len(summary.rounds),
            "learner_rounds_per_min": round(summary.learner_rounds_per_minute(), 1),
            "bundles_accepted": summary.bundles_accepted,
            "bundles_rejected": summary.bundles_rejected}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--learners", default="2,8,32", help="comma-separated N")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--client-cpus", type=float, default=1.0)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / (
        f"simulate-{datetime.date.today().isoformat()}.txt"))
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one is not None:  # the child: one N, a JSON line on stdout
        with tempfile.TemporaryDirectory() as tmp:
            print(json.dumps(one(args.one, args.rounds, args.client_cpus, Path(tmp))))
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    header = (f"# ftis-lab simulate scaling, {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} "
              f"UTC; {platform.node() and 'this machine'}: {os.cpu_count()} CPUs, "
              f"Python {platform.python_version()}; load average before: "
              f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    lines = [header]
    print(header, flush=True)
    for n in [int(x) for x in args.learners.split(",")]:
        proc = subprocess.run([sys.executable, __file__, "--one", str(n), "--rounds",
                               str(args.rounds), "--client-cpus", str(args.client_cpus)],
                              capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            print(proc.stderr[-4000:], file=sys.stderr)
            return proc.returncode
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        line = " ".join(f"{k}={v}" for k, v in result.items())
        line += f" load_after={os.getloadavg()[0]:.2f}"
        print(line, flush=True)
        lines.append(line)
    with open(args.out, "a") as fh:
        fh.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
