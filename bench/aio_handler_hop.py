#!/usr/bin/env python3
"""Is a volunteer handler cheap enough to run inline in the ``grpc.aio`` event loop, or
does it go to the handler pool? In-process, no gRPC: the cost of one
``loop.run_in_executor`` hop against the cheapest handler's own time.

Measures, each as the median of ``--repeats`` batches of ``--calls`` calls:

* ``hop``: ``await loop.run_in_executor(pool, f)`` of a no-op (the thread hop alone);
* ``heartbeat``: the servicer's Heartbeat (authenticate from the node cache, Ed25519
  check, last-seen time buffered) on an SQLite file, called directly;
* ``heartbeat_db``: the same with the node cache emptied before each call (one database
  read, as every second per node in production).

    .venv/bin/python bench/aio_handler_hop.py
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ftis.coordinator.server.swarm_service import Caller, SwarmService
from ftis.lab.harness.coordinator import make_coordinator, register, signed
from ftis.v1 import swarm_pb2


def _per_call_us(batch: list[float], calls: int) -> float:
    return statistics.median(batch) / calls * 1e6


async def _hops(pool: ThreadPoolExecutor, calls: int, repeats: int) -> float:
    loop = asyncio.get_running_loop()
    batches = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            await loop.run_in_executor(pool, int)
        batches.append(time.perf_counter() - t0)
    return _per_call_us(batches, calls)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(32) as pool:
        hop = asyncio.run(_hops(pool, args.calls, args.repeats))
        coord = make_coordinator(db=str(Path(tmp) / "hop.db"), heartbeats_per_minute=1e9)
        identity = register(coord)
        service = SwarmService(coord.ctx)
        caller = Caller("ipv4:127.0.0.1:1")
        request = signed(swarm_pb2.HeartbeatRequest(node_id=identity.node_id), "Heartbeat",
                         identity, coord.ctx.clock())
        results = {}
        for name, clear in (("heartbeat", False), ("heartbeat_db", True)):
            batches = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    if clear:
                        coord.ctx.nodes.drop(identity.node_id)
                    reply = service.Heartbeat(request, caller)
                batches.append(time.perf_counter() - t0)
                assert reply.error.code == 0, reply.error
            results[name] = _per_call_us(batches, args.calls)
    print(f"# median of {args.repeats} batches of {args.calls} calls, microseconds per call")
    print(f"hop_us={hop:.1f} heartbeat_us={results['heartbeat']:.1f} "
          f"heartbeat_db_us={results['heartbeat_db']:.1f}")


if __name__ == "__main__":
    main()
