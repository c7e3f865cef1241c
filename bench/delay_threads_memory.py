"""Memory of the thread-pool listener's delay threads (issue 13): a real coordinator in
this process with the default configuration, one connection that first empties its
refusal budget with unparseable requests and then keeps ``--inflight`` of them in flight,
so that the server's pool grows to all its threads (32 handler + 256 delay threads).
Prints the thread count and the process's RSS before and at the peak; the flooding
client's channel and futures live in the same process and are included.

    .venv/bin/python bench/delay_threads_memory.py --inflight 300 --seconds 8
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time

import grpc
import psutil

from ftis.coordinator.config import CoordinatorConfig
from ftis.coordinator.server.app import CoordinatorServer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--inflight", type=int, default=300)
    ap.add_argument("--seconds", type=float, default=8.0)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="ftis-delay-mem-")
    srv = CoordinatorServer(CoordinatorConfig(db=f"sqlite:///{tmp}/c.db",
                                              listen="127.0.0.1:0", admin_listen="127.0.0.1:0"))
    srv.start()
    proc = psutil.Process()
    channel = grpc.insecure_channel(srv.address)
    call = channel.unary_unary("/ftis.v1.Swarm/SubmitBundle", request_serializer=None,
                               response_deserializer=None)
    for _ in range(30):  # more than the burst of 20: the connection is over budget
        call(b"\xff" * 8, timeout=10)
    time.sleep(1.0)
    before, threads_before = proc.memory_info().rss, threading.active_count()
    stopping = threading.Event()

    def send() -> None:
        future = call.future(b"\xff" * 8, timeout=60)
        future.add_done_callback(lambda _: None if stopping.is_set() else send())

    for _ in range(args.inflight):
        send()
    peak, threads_peak = before, threads_before
    t0 = time.monotonic()
    while time.monotonic() - t0 < args.seconds:
        peak = max(peak, proc.memory_info().rss)
        threads_peak = max(threads_peak, threading.active_count())
        time.sleep(0.1)
    stopping.set()
    grown = threads_peak - threads_before
    print(f"threads {threads_before} -> {threads_peak}; RSS {before / 2**20:.1f} -> "
          f"{peak / 2**20:.1f} MiB (+{(peak - before) / 2**20:.1f}); "
          f"{(peak - before) / max(grown, 1) / 1024:.0f} KiB per thread started")
    channel.close()
    srv.stop(grace=1.0)


if __name__ == "__main__":
    main()
