"""``serve --workers 2 --http-listen``: the supervisor serves /metrics summed over both
worker processes (prometheus-client multiprocess mode) and the status page."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ftis.lab.harness.coordinator import model_card, register_envelope
from ftis.protocol.identity import NodeIdentity
from ftis.v1 import swarm_pb2, swarm_pb2_grpc

pytestmark = pytest.mark.integration

CALLS = 16


def test_supervisor_serves_metrics_summed_over_workers(tmp_path):
    import psutil

    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"require_tokenizer": False,
                               "registrations_per_host_per_minute": 1e6,
                               "registrations_per_minute": 1e6}))
    ready = tmp_path / "ready.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ftis.coordinator.cli.main", "serve", "--workers", "2",
         "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0",
         "--http-listen", "127.0.0.1:0", "--db", str(tmp_path / "c.db"), "--config", str(cfg),
         "--ready-file", str(ready), "--log-level", "WARNING"],
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert proc.poll() is None, f"serve --workers 2 exited with {proc.returncode}"
            assert time.monotonic() < deadline, "workers not ready"
            time.sleep(0.1)
        info = json.loads(ready.read_text())
        workers = psutil.Process(proc.pid).children()
        assert len(workers) == 2
        metrics_dir = Path(workers[0].environ()["PROMETHEUS_MULTIPROC_DIR"])
        for _ in range(CALLS):  # a fresh connection per call: spread over both workers
            with grpc.insecure_channel(info["listen"]) as channel:
                reply = swarm_pb2_grpc.SwarmStub(channel).Register(swarm_pb2.RegisterRequest(
                    envelope=register_envelope(NodeIdentity.generate(), model_card(),
                                               int(time.time() * 1000))), timeout=30)
                assert reply.error.code == 0
        files = {p.name for p in metrics_dir.iterdir()}
        served_by = {w.pid for w in workers if any(str(w.pid) in f for f in files)}
        assert served_by == {w.pid for w in workers}, files
        with urllib.request.urlopen(f"http://{info['http']}/metrics", timeout=30) as r:
            text = r.read().decode()
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for f in text_string_to_metric_families(text) for s in f.samples}
        assert samples[("ftis_rpc_handled_total", (("code", "OK"), ("method", "Register")))] \
            == CALLS
        assert samples[("ftis_rpc_duration_seconds_count", (("method", "Register"),))] == CALLS
        assert samples[("ftis_nodes_registered", ())] == CALLS
        assert samples[("ftis_db_transaction_seconds_count", (("kind", "write"),))] >= CALLS
        with urllib.request.urlopen(f"http://{info['http']}/", timeout=30) as r:
            assert r.read().decode().count("data-node-id=") == CALLS
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    assert not metrics_dir.exists()  # the supervisor's temporary directory is gone
