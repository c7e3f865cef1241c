#!/usr/bin/env python3
"""The transport floor of ``make bench-coordinator``: the coordinator's volunteer
listener answering with canned replies (``bench/coordinator_load.py --configs floor``).

It is the real listener of ``ftis-coordinator serve`` (the default thread-pool
``grpc.server`` with ``swarm_handler_threads`` + ``swarm_delay_threads`` threads, the same
gRPC options, and :func:`~ftis.coordinator.server.swarm_service.add_swarm_service`: the
per-connection refusal budget, the per-method size limits, decoding of each request) in
front of a servicer that does no authentication, verification, re-scoring or storage:

* ``Register`` answers ``tokenizer_known`` (so no tokenizer is uploaded);
* ``LeaseTasks`` hands out one of 64 real tasks of the default mix, rendered as the
  coordinator renders them (:func:`ftis.tasks.render_messages`), with a fresh lease id;
* ``SubmitBundle`` answers the payload's SHA-256 and ``--group-size`` verified rewards of
  0.0 (the load's claims), and keeps the envelope's bytes in a ring of the last 256;
* ``PullBundles`` answers a page of up to ``max_bundles`` of those, written by the
  coordinator's own :func:`~ftis.coordinator.server.convert.relay_page_bytes` (wire
  bytes around the kept envelopes, which are not parsed again).

So a load run against it costs what the gRPC transport, protobuf and the listener cost
for the same messages, in the same closed loop, on the same machine: the most bundles/s
any Python handler behind this listener could serve. The coordinator's own rate divided
by this one is the share of the floor it reaches.

Usage (started by ``coordinator_load.py``): ``python bench/coordinator_floor_server.py
--ready-file PATH [--listen 127.0.0.1:0] [--group-size 8]``; stops on SIGTERM.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import signal
import sys
import threading
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from ftis.coordinator.config import CoordinatorConfig
from ftis.coordinator.handlers.relay import RelayPage
from ftis.coordinator.server import convert
from ftis.coordinator.server.app import connection_budget, swarm_grpc_options
from ftis.coordinator.server.swarm_service import add_swarm_service
from ftis.coordinator.state.base import BundleRecord
from ftis.tasks import render_messages
from ftis.tasks.source import DEFAULT_TASKS, TaskSource
from ftis.v1 import common_pb2, swarm_pb2

#: Distinct tasks handed out in turn, and bundles kept for relay pages.
TASKS = 64
RING = 256
LEASE_S = 600


class FloorServicer:
    """Canned replies for the ``ftis.v1.Swarm`` methods (see the module docstring).

    Args:
        group_size: verified rewards per SubmitBundle reply (the load's G).
        tasks: the leases' questions and datasets, ``(dataset, question)``.
    """

    def __init__(self, group_size: int, tasks: list[tuple[str, str]]) -> None:
        self.group_size = group_size
        self._tasks = [(dataset, question, [common_pb2.ChatMessage(**m)
                                            for m in render_messages(question)])
                       for dataset, question in tasks]
        self._turn = itertools.count()
        self._lock = threading.Lock()
        self._ring: deque[BundleRecord] = deque(maxlen=RING)
        self._sequence = 0

    def Register(self, request, context):  # noqa: N802 - gRPC method name
        return swarm_pb2.RegisterResponse(tokenizer_known=True,
                                          server_time_ms=int(time.time() * 1000))

    def Heartbeat(self, request, context):  # noqa: N802
        return swarm_pb2.HeartbeatResponse()

    def UploadTokenizer(self, request, context):  # noqa: N802
        return swarm_pb2.UploadTokenizerResponse()

    def ReportMetrics(self, request, context):  # noqa: N802
        return swarm_pb2.ReportMetricsResponse()

    def LeaseTasks(self, request, context):  # noqa: N802
        deadline_ms = int((time.time() + LEASE_S) * 1000)
        leases = []
        for _ in range(max(request.count, 1)):
            k = next(self._turn)
            dataset, question, messages = self._tasks[k % len(self._tasks)]
            leases.append(swarm_pb2.TaskLease(
                lease_id=uuid.uuid4().hex, task_id=f"floor-{k}", dataset=dataset,
                messages=messages, question=question, deadline_ms=deadline_ms,
                group_size=request.group_size, max_new_tokens=request.max_new_tokens))
        return swarm_pb2.LeaseTasksResponse(leases=leases)

    def SubmitBundle(self, request, context):  # noqa: N802
        envelope = request.envelope.SerializeToString()
        bundle_id = hashlib.sha256(request.envelope.payload).hexdigest()
        rewards = [0.0] * self.group_size
        with self._lock:
            self._sequence += 1
            self._ring.append(BundleRecord(
                sequence=self._sequence, bundle_id=bundle_id, node_id="", task_id="",
                lease_id="", dataset="", fingerprint="", envelope=envelope,
                verified_rewards=rewards, mean_reward=0.0, zero_variance=True,
                completions=self.group_size, completion_tokens=0, size_bytes=len(envelope),
                reward_mismatches=0, policy_version=0, stored_at_ms=int(time.time() * 1000)))
        return swarm_pb2.SubmitBundleResponse(bundle_id=bundle_id, verified_rewards=rewards)

    def PullBundles(self, request, context):  # noqa: N802
        with self._lock:
            page = [b for b in self._ring if b.sequence > request.cursor]
            page = page[:max(request.max_bundles, 0)]
            last = self._sequence
        next_cursor = page[-1].sequence if page else max(request.cursor, last)
        return convert.relay_page_bytes(RelayPage(page, [1.0] * len(page), next_cursor))


def default_tasks(n: int = TASKS, seed: int = 0) -> list[tuple[str, str]]:
    """``n`` real ReasoningGYM tasks of the coordinator's default mix, as
    ``(dataset, question)`` (the answer is not needed: nothing is scored)."""
    source = TaskSource(DEFAULT_TASKS, seed=seed, size=max(n, 16))
    return [(e.dataset, e.question) for e in (source.draw() for _ in range(n))]


def serve(listen: str, group_size: int) -> tuple[grpc.Server, int]:
    """The listener of ``serve``'s default configuration with :class:`FloorServicer`,
    started; returns it and its bound port."""
    config = CoordinatorConfig()
    server = grpc.server(
        ThreadPoolExecutor(config.swarm_handler_threads + config.swarm_delay_threads,
                           thread_name_prefix="ftis-floor"),
        options=swarm_grpc_options(config))
    add_swarm_service(FloorServicer(group_size, default_tasks()), server,
                      config.method_request_limits, connection_budget(config),
                      handler_threads=config.swarm_handler_threads)
    port = server.add_insecure_port(listen)
    server.start()
    return server, port


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ready-file", required=True,
                    help="written as {\"listen\": host:port} once serving")
    ap.add_argument("--listen", default="127.0.0.1:0")
    ap.add_argument("--group-size", type=int, default=8)
    args = ap.parse_args(argv)
    server, port = serve(args.listen, args.group_size)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    host = args.listen.rsplit(":", 1)[0]
    Path(args.ready_file).write_text(json.dumps({"listen": f"{host}:{port}"}))
    stop.wait()
    server.stop(2).wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
