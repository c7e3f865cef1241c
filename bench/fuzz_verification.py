#!/usr/bin/env python3
"""Fuzz bundle verification at scale: the properties of
``tests/unit/test_fuzz_verification.py`` (generators in ``lab/ftis/lab/harness/fuzz.py``) run
for ``--examples`` examples, split over ``--jobs`` processes.

Properties, drawn per example with these weights:

* ``envelope_bytes`` (10%): arbitrary bytes into ``parse_envelope_bytes``;
* ``submit_bytes`` (20%): arbitrary bytes / envelopes / validly signed garbage into
  ``Coordinator.submit_bundle``;
* ``structured`` (35%): a valid signed bundle for a real lease, mutated (fields,
  keys, ids, leases, clock, payload bytes re-signed, envelope bytes not re-signed),
  into ``Coordinator.submit_bundle``; checks that a rejection leaves nodes, leases and
  bundles unchanged and that an accepted bundle breaks no documented rule;
* ``structured_text`` (15%): the same on a coordinator that requires uploaded
  tokenizers, with bundles that are real encodings, so the text/prompt checks and the
  automatic ban on proof are reached (after TEXT_MISMATCH / PROMPT_MISMATCH only the
  signer's node row may change, to banned);
* ``check_structure`` (20%): random bundles into ``check_structure`` against an
  independent oracle.

Engines: ``random`` (default; a seeded hand-rolled generator, ~10x faster) or
``hypothesis`` (same generators driven by hypothesis' ``st.data()``).

Prints examples per property and outcome (0 = accepted, else the error code), the
time and examples/s. Exits 1 on any crash (an exception that is not ``FtisError``) or
property violation (state changed after a rejection, undefined code, bad acceptance,
oracle disagreement); details and the offending input go to ``--out``.

Usage: ``python bench/fuzz_verification.py --examples 100000 --seed 0``
"""

from __future__ import annotations

import argparse
import base64
import json
import logging
import multiprocessing
import os
import random
import sys
import time
import traceback
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROPERTIES = (
    ("envelope_bytes", 10),
    ("submit_bytes", 20),
    ("structured", 35),
    ("structured_text", 15),
    ("check_structure", 20),
)
#: A fresh coordinator every this many coordinator examples keeps the table snapshots
#: (taken twice per example) small.
RESET_EVERY = 100
MAX_FAILURES_KEPT = 20
#: [snapshot function] set by --exact-snapshot (None: ftis.lab.harness.fuzz.fast_snapshot)
SNAPSHOTS: list = [None]


def _run_one(prop: str, draw, world_box: list, fh) -> int:
    if prop == "envelope_bytes":
        return fh.run_envelope_bytes(draw)
    if prop == "check_structure":
        return fh.run_check_structure(draw)
    tokenized = prop == "structured_text"
    world = world_box[tokenized]
    if world is None or world.examples >= RESET_EVERY or not world.healthy():
        world = world_box[tokenized] = fh.FuzzWorld(
            tokenized=tokenized, snapshot_fn=SNAPSHOTS[0] or fh.fast_snapshot
        )
    world_box[2] = world
    if prop == "submit_bytes":
        return fh.run_submit_bytes(world, draw)
    return fh.run_structured(world, draw)


def _failure(prop: str, exc: BaseException, world_box: list, example: str, fh) -> dict:
    world = world_box[2]
    data = getattr(world, "last_input", None) if prop.startswith(("submit", "struct")) else None
    if data is not None and not isinstance(data, bytes):
        data = data.SerializeToString()
    return {
        "property": prop,
        "example": example,
        "kind": "violation" if isinstance(exc, fh.PropertyViolation) else "crash",
        "exception": f"{type(exc).__name__}: {exc}"[:4000],
        "traceback": traceback.format_exc(),
        "input_b64": base64.b64encode(data).decode() if data is not None else None,
    }


class _ErrorLog(logging.Handler):
    """Keeps every ERROR (or worse) log record."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _choose(draw) -> str:
    total = sum(w for _, w in PROPERTIES)
    x = draw.integer(0, total - 1)
    for name, weight in PROPERTIES:
        if x < weight:
            return name
        x -= weight
    raise AssertionError("unreachable")


def worker(job: tuple[int, int, int, str, bool]) -> dict:
    """Run ``n`` examples; returns counts, failures and the time spent."""
    index, n, seed, engine, exact = job
    # The coordinator swallows (and logs) exceptions in some bookkeeping paths, e.g.
    # reputation evidence after a rejection: a logged error is a failure too.
    logged = _ErrorLog()
    root = logging.getLogger()
    root.handlers[:] = [logged]
    root.setLevel(logging.ERROR)
    from ftis.lab.harness import fuzz as fh

    if exact:
        from ftis.lab.harness.coordinator import snapshot

        SNAPSHOTS[0] = snapshot

    from ftis.protocol.errors import FtisError

    counts: Counter[tuple[str, int]] = Counter()
    failures: list[dict] = []
    world_box: list = [None, None, None]  # plain world, tokenized world, last used
    n_failures = 0

    def one(draw, example: str) -> None:
        nonlocal n_failures
        prop = _choose(draw)
        try:
            outcome = _run_one(prop, draw, world_box, fh)
        except FtisError as exc:  # an FtisError escaping a property is a harness bug
            counts[(prop, "ESCAPED_" + exc.name)] += 1
            outcome = None
            n_failures += 1
            failures.append(_failure(prop, exc, world_box, example, fh))
        except Exception as exc:  # noqa: BLE001 - crashes are what we are looking for
            kind = "VIOLATION" if isinstance(exc, fh.PropertyViolation) else "CRASH"
            counts[(prop, kind)] += 1
            n_failures += 1
            if len(failures) < MAX_FAILURES_KEPT:
                failures.append(_failure(prop, exc, world_box, example, fh))
            world_box[:] = [None, None, world_box[2]]  # worlds may be inconsistent now
            return
        if outcome is not None:
            counts[(prop, outcome)] += 1
        if logged.records:
            counts[(prop, "LOGGED_ERROR")] += 1
            n_failures += 1
            if len(failures) < MAX_FAILURES_KEPT:
                record = logged.records[0]
                failures.append(
                    {
                        "property": prop,
                        "example": example,
                        "kind": "logged error",
                        "exception": record.getMessage(),
                        "traceback": logging.Formatter().formatException(record.exc_info)
                        if record.exc_info
                        else "",
                        "input_b64": None,
                    }
                )
            logged.records.clear()

    start, cpu_start = time.perf_counter(), time.process_time()
    if engine == "random":
        master = random.Random(f"{seed}/{index}")
        for _ in range(n):
            example_seed = master.getrandbits(64)
            one(fh.RandomDraw(random.Random(example_seed)), f"{seed}/{index}/{example_seed}")
    else:
        from hypothesis import HealthCheck, Phase, given, settings
        from hypothesis import seed as hseed
        from hypothesis import strategies as st

        @hseed(seed * 1000 + index)
        @settings(
            max_examples=n,
            deadline=None,
            database=None,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(st.data())
        def run(data) -> None:
            one(fh.HypothesisDraw(data), f"hypothesis seed {seed * 1000 + index}")

        run()
    return {
        "counts": counts,
        "failures": failures,
        "n_failures": n_failures,
        "seconds": time.perf_counter() - start,
        "cpu_seconds": time.process_time() - cpu_start,
    }


def _outcome_name(outcome) -> str:
    from ftis.protocol.errors import code_name

    if isinstance(outcome, str):
        return outcome
    return "ACCEPTED" if outcome == 0 else f"{code_name(outcome)} ({outcome})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=100_000, help="total examples")
    parser.add_argument("--seed", type=int, default=0, help="base seed (reproducible runs)")
    parser.add_argument(
        "--jobs", type=int, default=os.cpu_count() or 1, help="worker processes (default: CPUs)"
    )
    parser.add_argument("--engine", choices=("random", "hypothesis"), default="random")
    parser.add_argument(
        "--exact-snapshot",
        action="store_true",
        help="compare tables with ftis.lab.harness.coordinator.snapshot (JSON per value, ~1.5x "
        "slower) instead of ftis.lab.harness.fuzz.fast_snapshot",
    )
    parser.add_argument(
        "--out", type=Path, default=ROOT / "runs" / "fuzz", help="where failures are written"
    )
    args = parser.parse_args(argv)
    if args.examples < 1 or args.jobs < 1:
        parser.error("--examples and --jobs must be >= 1")

    jobs = min(args.jobs, args.examples)
    shares = [args.examples // jobs + (1 if i < args.examples % jobs else 0) for i in range(jobs)]
    work = [(i, shares[i], args.seed, args.engine, args.exact_snapshot) for i in range(jobs)]
    print(
        f"fuzzing bundle verification: {args.examples} examples, engine {args.engine}, "
        f"seed {args.seed}, {jobs} process(es)",
        flush=True,
    )
    start = time.perf_counter()
    if jobs == 1:
        results = [worker(work[0])]
    else:
        with multiprocessing.get_context("fork").Pool(jobs) as pool:
            results = pool.map(worker, work)
    wall = time.perf_counter() - start

    counts: Counter = Counter()
    failures: list[dict] = []
    n_failures = 0
    for r in results:
        counts.update(r["counts"])
        failures += r["failures"]
        n_failures += r["n_failures"]

    total = sum(counts.values())
    print(f"\n{'property':<16} {'outcome':<32} {'examples':>9} {'share':>7}")
    print("-" * 67)
    for prop, _ in PROPERTIES:
        rows = sorted(
            ((o, n) for (p, o), n in counts.items() if p == prop), key=lambda x: (str(x[0]), x[1])
        )
        rows.sort(key=lambda x: (-1 if x[0] == 0 else x[0]) if isinstance(x[0], int) else 10**6)
        sub = sum(n for _, n in rows)
        for outcome, n in rows:
            print(f"{prop:<16} {_outcome_name(outcome):<32} {n:>9} {n / sub:>7.1%}")
        codes = {o for o, _ in rows if isinstance(o, int) and o != 0}
        print(f"{prop:<16} {'= total (' + str(len(codes)) + ' distinct codes)':<32} {sub:>9}")
        print("-" * 67)
    all_codes = {o for (_, o) in counts if isinstance(o, int) and o != 0}
    cpu = sum(r["cpu_seconds"] for r in results)
    print(
        f"{total} examples in {wall:.1f} s wall ({total / wall:,.0f} examples/s, "
        f"{jobs} process(es)); {cpu:.1f} CPU s in the workers ({total / cpu:,.0f} examples per "
        f"CPU second); {len(all_codes)} distinct rejection codes; {n_failures} failure(s)"
    )
    if n_failures:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"failures-seed{args.seed}.json"
        path.write_text(json.dumps(failures, indent=1))
        for f in failures[:3]:
            print(f"\n{f['kind'].upper()} in {f['property']} ({f['example']}):\n{f['traceback']}")
        print(f"FAILED: {n_failures} failure(s); first {len(failures)} written to {path}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
