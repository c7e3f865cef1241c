"""CPU of one volunteer loop in the coordinator's handlers, in-process (no gRPC).

One thread runs LeaseTasks(1) -> SubmitBundle (G = 8 completions of 256 random token ids,
no tokenizer) -> PullBundles(8) through the handler functions (the node records of lease
and pull from the node cache, as authentication hands them on), for 8 nodes in turn, on a
SQLite file with fsync on (or ``--db URL``, or ``--postgres``: a throw-away PostgreSQL
server with fsync on; its own CPU is not counted). It prints wall
and CPU milliseconds per loop, and the CPU of the three handler calls alone
(``handlers cpu``: building and sealing the test bundle, about 1.5 ms, is left out;
measured with the thread's CPU clock around the calls, so other threads and processes do
not count). On a loaded machine compare ``handlers cpu``, not wall time.

``--coordinator-src DIR`` runs the coordinator's code of another source tree (DIR's
``coordinator`` and ``proto`` first on ``sys.path``) with this script and its test
helpers, for A/B comparisons; ``--profile`` prints cProfile's top functions of the
handler calls (cProfile inflates Python-heavy code). For a sampling profile run the
whole script under py-spy (``--gil``: samples of the thread holding the GIL, a proxy
for CPU; fsync waits drop out)::

    py-spy record --gil -r 250 -f raw -o /tmp/h.txt -- \
        .venv/bin/python bench/coordinator_handlers.py --loops 2000

    .venv/bin/python bench/coordinator_handlers.py [--loops 300] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import tempfile
import time
from pathlib import Path


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loops", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--db", default="", help="SQLAlchemy URL (default: a SQLite file)")
    parser.add_argument("--postgres", action="store_true",
                        help="a throw-away PostgreSQL server (fsync on), a fresh database")
    parser.add_argument("--coordinator-src", default="",
                        help="a source tree whose coordinator/ and proto/ to run")
    parser.add_argument("--profile", action="store_true")
    return parser.parse_args()


def main() -> None:
    args = _parse()
    if args.coordinator_src:
        src = Path(args.coordinator_src).resolve()
        sys.path[:0] = [str(src / "coordinator"), str(src / "proto")]
    import ftis.coordinator
    from ftis.coordinator.handlers import leases, relay
    from ftis.lab.harness.coordinator import (
        FakeClock,
        build_bundle,
        make_coordinator,
        register,
        seal_bundle,
    )

    clock = FakeClock()
    folder = tempfile.mkdtemp(prefix="ftis-handlers-")
    db = args.db or f"sqlite:///{folder}/c.db"
    server = None
    if args.postgres:
        from ftis.coordinator.testing.postgres import PostgresServer

        server = PostgresServer(settings={"fsync": "on", "synchronous_commit": "on",
                                          "full_page_writes": "on"}).start()
        db = server.url(server.create_database())
    coord = make_coordinator(clock, db=db, max_outstanding_leases=1_000_000)
    nodes = [register(coord) for _ in range(8)]
    ctx = coord.ctx

    def authenticated(node_id: str):  # as nodes.authenticate: the node cache, else a read
        now = ctx.clock()
        record = ctx.nodes.get(node_id, now)
        if record is None:
            record = ctx.state.get_node(node_id)
            ctx.nodes.put(node_id, record, now)
        return record

    handler_cpu = 0.0
    profile: cProfile.Profile | None = None

    def loop(i: int) -> None:
        nonlocal handler_cpu
        node = nodes[i % 8]
        if profile is not None:
            profile.enable()
        t0 = time.thread_time()
        (lease,) = leases.lease_tasks(ctx, authenticated(node.node_id), 1, 8, 256)
        t1 = time.thread_time()
        if profile is not None:
            profile.disable()
        envelope = seal_bundle(build_bundle(lease, node, n_tokens=256, seed=i), node)
        if profile is not None:
            profile.enable()
        t2 = time.thread_time()
        coord.submit_bundle(envelope)
        relay.pull_bundles(ctx, authenticated(nodes[(i + 1) % 8].node_id), max(0, i - 8), 8)
        handler_cpu += (t1 - t0) + (time.thread_time() - t2)
        if profile is not None:
            profile.disable()

    for i in range(args.warmup):
        loop(i)
    handler_cpu = 0.0
    n = args.loops
    wall, cpu = time.perf_counter(), time.process_time()
    for i in range(args.warmup, args.warmup + n):
        loop(i)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    print(f"coordinator {Path(ftis.coordinator.__file__).parent}")
    print(f"per loop: wall {wall / n * 1e3:.2f} ms, cpu {cpu / n * 1e3:.2f} ms, "
          f"handlers cpu {handler_cpu / n * 1e3:.3f} ms")
    if args.profile:  # the handler calls only (not building the test bundles)
        profile = cProfile.Profile()
        for i in range(args.warmup + n, args.warmup + n + 100):
            loop(i)
        pstats.Stats(profile).sort_stats("tottime").print_stats(30)
    coord.state.close()
    if server is not None:
        server.stop()


if __name__ == "__main__":
    main()
