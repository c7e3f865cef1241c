"""Heartbeat-only closed loop: the gRPC server's cost per signed request.

32 registered nodes send signed Heartbeats as fast as they are answered for 10 s
against a coordinator process (SQLite, quotas lifted); prints heartbeats/s, the
coordinator's CPU % and its CPU milliseconds per RPC (authentication included).

    .venv/bin/python bench/coordinator_heartbeat.py
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from pathlib import Path

import grpc
import psutil

from ftis.lab.experiment.launcher import start_coordinator
from ftis.lab.harness.coordinator import model_card, register_envelope, signed
from ftis.protocol.identity import NodeIdentity
from ftis.v1 import swarm_pb2, swarm_pb2_grpc

NODES, WARMUP_S, MEASURE_S = 32, 3.0, 10.0


async def _measure(listen: str, ids: list[NodeIdentity], pid: int) -> None:
    count = 0
    stop = asyncio.Event()

    async def loop(identity: NodeIdentity) -> None:
        nonlocal count
        stub = swarm_pb2_grpc.SwarmStub(grpc.aio.insecure_channel(listen))
        while not stop.is_set():
            request = signed(swarm_pb2.HeartbeatRequest(node_id=identity.node_id),
                             "Heartbeat", identity, int(time.time() * 1000))
            reply = await stub.Heartbeat(request)
            assert reply.error.code == 0, reply.error
            count += 1

    tasks = [asyncio.create_task(loop(i)) for i in ids]
    await asyncio.sleep(WARMUP_S)
    proc = psutil.Process(pid)
    count, cpu0, t0 = 0, sum(proc.cpu_times()[:2]), time.time()
    await asyncio.sleep(MEASURE_S)
    n, cpu, dt = count, sum(proc.cpu_times()[:2]) - cpu0, time.time() - t0
    stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    print(f"heartbeats/s {n / dt:.0f}  coordinator CPU {100 * cpu / dt:.0f} %  "
          f"CPU per RPC {1000 * cpu / n:.2f} ms")


def main() -> None:
    out = Path(tempfile.mkdtemp(prefix="ftis-heartbeat-"))
    (out / "c.json").write_text(json.dumps({
        "require_tokenizer": False, "registrations_per_minute": 1e9,
        "registrations_per_host_per_minute": 1e9}))
    proc, listen, _ = start_coordinator(out, ["--config", str(out / "c.json"),
                                              "--log-level", "WARNING"])
    try:
        ids = [NodeIdentity.generate() for _ in range(NODES)]
        with grpc.insecure_channel(listen) as channel:
            stub = swarm_pb2_grpc.SwarmStub(channel)
            for identity in ids:
                reply = stub.Register(swarm_pb2.RegisterRequest(envelope=register_envelope(
                    identity, model_card(), int(time.time() * 1000))))
                assert reply.error.code == 0, reply.error
        asyncio.run(_measure(listen, ids, proc.pid))
    finally:
        proc.terminate()
        proc.wait()


if __name__ == "__main__":
    main()
