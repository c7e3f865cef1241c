"""CPU of one volunteer loop in the coordinator's handlers, in-process (no gRPC).

One thread runs LeaseTasks(1) -> SubmitBundle (G = 8 completions of 256 random token ids,
no tokenizer) -> PullBundles(8) through the handler functions on a SQLite file with
fsync on, for 8 nodes in turn; it prints wall and CPU milliseconds per loop (building
and sealing the bundle included, ~1.5 ms) and, with ``--profile``, the top functions.

    .venv/bin/python bench/coordinator_handlers.py [--loops 300] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import tempfile
import time

from ftis.lab.harness.coordinator import (
    FakeClock,
    build_bundle,
    make_coordinator,
    register,
    seal_bundle,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loops", type=int, default=300)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    clock = FakeClock()
    folder = tempfile.mkdtemp(prefix="ftis-handlers-")
    coord = make_coordinator(clock, db=f"sqlite:///{folder}/c.db",
                             max_outstanding_leases=1_000_000)
    nodes = [register(coord) for _ in range(8)]

    def loop(i: int) -> None:
        node = nodes[i % 8]
        (lease,) = coord.lease_tasks(node.node_id, 1, 8, 256)
        coord.submit_bundle(seal_bundle(build_bundle(lease, node, n_tokens=256, seed=i), node))
        coord.pull_bundles(nodes[(i + 1) % 8].node_id, max(0, i - 8), 8)

    for i in range(50):  # warm-up
        loop(i)
    wall, cpu = time.perf_counter(), time.process_time()
    for i in range(50, 50 + args.loops):
        loop(i)
    n = args.loops
    print(f"per loop: wall {(time.perf_counter() - wall) / n * 1e3:.2f} ms, "
          f"cpu {(time.process_time() - cpu) / n * 1e3:.2f} ms")
    if args.profile:
        profile = cProfile.Profile()
        profile.enable()
        for i in range(50 + n, 150 + n):
            loop(i)
        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
