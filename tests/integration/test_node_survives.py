"""A node that runs for days (issue 14, part 6), against a real coordinator process:

* the coordinator goes away twice (SIGKILL) and comes back on the same port and SQLite
  file: once between rounds, once in the middle of a round for longer than the lease
  time-to-live. The node retries with backoff and jitter, keeps its identity, round
  counter and checkpoints, and drops the two leases that expired meanwhile;
* ``ftis-client start`` refuses a round that can never fit in memory before leasing
  (exit code 53, with the reason), and waits for memory that may free up.
"""

from __future__ import annotations

import json
import random
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ftis.client.learner.checkpoint import load_checkpoint
from ftis.client.node.config import ClientConfig
from ftis.client.node.runner import VolunteerNode
from ftis.client.swarm.connection import RetryPolicy, SwarmConnection
from ftis.lab.experiment.report import read_metrics
from ftis.protocol.exit_codes import ExitCode
from ftis.protocol.identity import NodeIdentity

pytestmark = pytest.mark.integration

LEASE_TTL_S = 3.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Coordinator:
    """``ftis-coordinator serve`` on a fixed port and SQLite file, so that a restart is
    the same coordinator as far as the node can tell."""

    def __init__(self, workdir: Path, config: Path) -> None:
        self.workdir, self.config = workdir, config
        self.db = workdir / "coordinator.db"
        self.target = f"127.0.0.1:{_free_port()}"
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        ready = self.workdir / f"ready-{self.starts}.json"
        with open(self.workdir / f"coordinator-{self.starts}.log", "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "ftis.coordinator.cli.main", "serve",
                 "--listen", self.target, "--admin-listen", "127.0.0.1:0",
                 "--http-listen", "127.0.0.1:0", "--db", str(self.db),
                 "--ready-file", str(ready), "--config", str(self.config)],
                stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert self.proc.poll() is None, f"coordinator exited with {self.proc.returncode}"
            assert time.monotonic() < deadline, "coordinator not ready after 60 s"
            time.sleep(0.02)

    def kill(self) -> None:
        assert self.proc is not None and self.proc.poll() is None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def restart_after(self, seconds: float) -> threading.Thread:
        def later() -> None:
            time.sleep(seconds)
            self.start()

        thread = threading.Thread(target=later, daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def query(self, sql: str, *args: object) -> list[tuple]:
        with sqlite3.connect(f"file:{self.db}?mode=ro", uri=True) as con:
            return con.execute(sql, args).fetchall()


def _config(tmp_path: Path, **extra: object) -> Path:
    path = tmp_path / "coordinator.json"
    path.write_text(json.dumps({"tasks": [{"dataset": "letter_counting"}], "task_seed": 1,
                                **extra}))
    return path


def _node(coord: Coordinator, model_dir: Path, policy_factory, out: Path,  # noqa: ANN001
          rounds: int) -> tuple[VolunteerNode, SwarmConnection, NodeIdentity]:
    """A registered tiny-model node against ``coord`` (full fine-tune, 2 local groups of
    4, fast retries), its connection and its identity (key in ``out/node_key.pem``)."""
    policy = policy_factory()
    key = out / "node_key.pem"
    identity = NodeIdentity.load_or_create(key)
    cfg = ClientConfig(coordinator=coord.target, model=str(model_dir), rounds=rounds,
                       local_groups=2, external_groups=0, group_size=4, max_new_tokens=8,
                       learning_rate=1e-3, out=out, key_file=key)
    conn = SwarmConnection(coord.target, identity, policy.card,
                           tokenizer_json=policy.tokenizer_json,
                           retry=RetryPolicy(base_s=0.05, cap_s=0.5, max_outage_s=60),
                           rng=random.Random(0))
    conn.register()
    return VolunteerNode(cfg, policy, conn), conn, identity


def test_node_survives_coordinator_restarts(tmp_path, tiny_model_dir, tiny_policy_factory):
    coord = Coordinator(tmp_path, _config(tmp_path, lease_ttl_s=LEASE_TTL_S))
    coord.start()
    out, key = tmp_path / "node", tmp_path / "node" / "node_key.pem"
    try:
        node, conn, identity = _node(coord, tiny_model_dir, tiny_policy_factory, out, 6)
        restarts: list[threading.Thread] = []
        checkpoints_before: dict[int, str] = {}

        def on_round(result) -> None:  # noqa: ANN001
            checkpoints_before[result.round] = (out / "checkpoints" / "latest").read_text()
            if result.round == 2:  # outage 1: between rounds, shorter than a lease
                coord.kill()
                restarts.append(coord.restart_after(1.0))

        real_submit = conn.submit_bundle

        def submit(bundle):  # noqa: ANN001, ANN202
            # outage 2: in round 4, after leasing, before the first submission, longer
            # than the lease TTL: both of the round's leases expire meanwhile
            if node.round == 3 and len(restarts) == 1:
                coord.kill()
                restarts.append(coord.restart_after(LEASE_TTL_S + 1.0))
            return real_submit(bundle)

        conn.submit_bundle = submit
        node.run(on_round)
        conn.close()
        for thread in restarts:
            thread.join(60)

        assert coord.starts == 3 and conn.transient_failures > 0
        records = read_metrics(out / "metrics.jsonl")
        assert [r["round"] for r in records] == [1, 2, 3, 4, 5, 6] and node.round == 6
        assert {r["node_id"] for r in records} == {identity.node_id}
        # the expired leases were dropped (LEASE_EXPIRED), the round went on without them
        assert [r["bundles_submitted"] for r in records] == [2, 2, 2, 0, 2, 2]
        assert [r.get("bundles_rejected", 0) for r in records] == [0, 0, 0, 2, 0, 0]
        # one node on the coordinator; 12 leases, the two of round 4 never answered
        assert coord.query("SELECT node_id FROM nodes") == [(identity.node_id,)]
        total, unanswered = coord.query(
            "SELECT count(*), sum(bundle_id IS NULL) FROM leases WHERE node_id = ?",
            identity.node_id)[0]
        assert (total, unanswered) == (12, 2)
        # a checkpoint after every round, none lost; the last one restores round 6
        assert checkpoints_before == {k: f"step-{k:06d}" for k in range(1, 7)}
        fresh = tiny_policy_factory()
        from ftis.client.learner.trainer import Learner, LearnerConfig

        learner = Learner(fresh.model, LearnerConfig(), pad_token_id=0)
        state = load_checkpoint(out / "checkpoints", fresh.model, learner.optimizer)
        assert state is not None and state["round"] == 6
        assert NodeIdentity.load_or_create(key).node_id == identity.node_id
    finally:
        coord.stop()


def test_start_refuses_or_waits_for_a_round_that_does_not_fit(tmp_path, tiny_model_dir,
                                                                monkeypatch):
    from ftis.client.cli.main import app
    from ftis.client.node import memory
    from ftis.client.settings.model import VolunteerSettings, env_name

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    for name in VolunteerSettings.keys():
        monkeypatch.delenv(env_name(name), raising=False)
    monkeypatch.setattr(memory, "ROUND_MEMORY_POLL_S", 0.01)
    coord = Coordinator(tmp_path, _config(tmp_path))
    coord.start()
    MiB = memory.MiB
    snapshots: list[tuple[int, int, int]] = []

    def probe() -> tuple[int, int, int]:
        return snapshots.pop(0) if len(snapshots) > 1 else snapshots[0]

    monkeypatch.setattr(memory, "memory_snapshot", probe)

    def start(name: str) -> tuple[int, str, Path]:
        out = tmp_path / name
        result = CliRunner().invoke(app, [
            "start", "--coordinator", coord.target, "--model", str(tiny_model_dir),
            "--out", str(out), "--key-file", str(out / "key.pem"), "--rounds", "2",
            "--local-groups", "2", "--external-groups", "0", "--group-size", "4",
            "--max-new-tokens", "8"])
        return result.exit_code, " ".join(result.output.split()), out

    try:
        # a 600 MiB machine: the tiny model's round (~0.5 GiB of it the interpreter with
        # torch) never fits next to the 256 MiB reserve; refused before any lease
        snapshots[:] = [(400 * MiB, 500 * MiB, 600 * MiB)]
        code, output, out = start("small")
        assert code == ExitCode.CLIENT_MEMORY_BUDGET, output
        assert "not starting round 1: round needs ~" in output
        assert "this machine has 600 MiB in all (256 MiB kept free)" in output
        node_id = NodeIdentity.load_or_create(out / "key.pem").node_id
        assert coord.query("SELECT count(*) FROM leases WHERE node_id = ?", node_id) == [(0,)]
        assert not (out / "metrics.jsonl").exists()

        # other programs hold the memory for two checks, then free it: it waits, then runs
        snapshots[:] = [(400 * MiB, 100 * MiB, 8000 * MiB)] * 2 + [
            (400 * MiB, 4000 * MiB, 8000 * MiB)]
        code, output, out = start("busy")
        assert code == ExitCode.OK, output
        assert "waiting for memory" in output and "resuming" in output
        assert [r["round"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2]
    finally:
        coord.stop()


def test_node_registers_again_after_the_coordinator_lost_its_database(
        tmp_path, tiny_model_dir, tiny_policy_factory):
    """An operator resets the coordinator (a fresh database on the same address): the
    node's next call gets NODE_UNKNOWN, it registers again and re-uploads its tokenizer
    by itself, and its rounds go on under the same identity."""
    coord = Coordinator(tmp_path, _config(tmp_path))
    coord.start()
    out = tmp_path / "node"
    try:
        node, conn, identity = _node(coord, tiny_model_dir, tiny_policy_factory, out, 4)

        def on_round(result) -> None:  # noqa: ANN001
            if result.round == 2:  # the database is gone; same address, same config
                coord.kill()
                for suffix in ("", "-wal", "-shm"):
                    Path(f"{coord.db}{suffix}").unlink(missing_ok=True)
                coord.start()

        node.run(on_round)
        conn.close()

        records = read_metrics(out / "metrics.jsonl")
        assert [r["round"] for r in records] == [1, 2, 3, 4]
        assert [r["bundles_submitted"] for r in records] == [2, 2, 2, 2]
        assert conn.reregistrations == 1
        # the new database knows the node again, with its tokenizer, and stored rounds 3-4
        assert coord.query("SELECT node_id FROM nodes") == [(identity.node_id,)]
        assert coord.query("SELECT count(*) FROM tokenizers")[0][0] == 1
        assert coord.query("SELECT count(*) FROM bundles WHERE node_id = ?",
                           identity.node_id)[0][0] == 4
    finally:
        coord.stop()


def test_sigterm_stops_the_node_as_ctrl_c_does(tmp_path, tiny_model_dir):
    """Service managers stop a node with SIGTERM (``systemctl --user stop``, ``launchctl
    bootout``). The node ends as on Ctrl-C: exit status 130 with "interrupted; the last
    checkpoint is kept", its state file says "stopped", and its checkpoint resumes.
    (Python's default for SIGTERM ends the process at once: status -15, the state file
    still saying "running".)"""
    coord = Coordinator(tmp_path, _config(tmp_path))
    coord.start()
    out = tmp_path / "node"
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("FTIS_")}
    env.update(XDG_CONFIG_HOME=str(tmp_path / "config"), PYTHONUNBUFFERED="1")
    args = [sys.executable, "-c", "from ftis.client.cli.main import app; app()", "start",
            "--coordinator", coord.target, "--model", str(tiny_model_dir), "--out", str(out),
            "--key-file", str(out / "key.pem"), "--local-groups", "2", "--external-groups",
            "0", "--group-size", "4", "--max-new-tokens", "8", "--threads", "1"]
    try:
        proc = subprocess.Popen([*args, "--rounds", "0"], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 180
        while not (out / "metrics.jsonl").exists() or \
                len((out / "metrics.jsonl").read_text().splitlines()) < 2:
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            assert time.monotonic() < deadline, "no two rounds in 180 s"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=60)[0].decode()
        assert proc.returncode == ExitCode.INTERRUPTED == 130, output
        assert "interrupted; the last checkpoint is kept" in output
        node_state = json.loads((out / "node_state.json").read_text())
        assert node_state["state"] == "stopped"
        assert node_state["device"] == "cpu"  # no GPU on the test machine
        done = len(read_metrics(out / "metrics.jsonl"))
        again = subprocess.run([*args, "--rounds", str(done + 1)], capture_output=True,
                               env=env, timeout=180, text=True)
        said = " ".join((again.stdout + again.stderr).split())
        assert again.returncode == 0, said
        # the last checkpoint is the last round's, or the one before when the signal came
        # between the round's metrics line and its checkpoint
        assert re.search(rf"resumed from round ({done}|{done - 1})\b", said), said
        assert f"done: {done + 1} rounds" in said
    finally:
        coord.stop()
