"""Durability under SIGKILL (issue 12, item 7), on SQLite and on PostgreSQL.

A real ``serve`` process takes the load of four volunteers (the client's own
:class:`SwarmConnection`, with its retry and backoff on ``UNAVAILABLE``, carrying SmolLM2
bundles built by ``bench/coordinator_load_node.py``); one of them lies about a reward in
every third bundle and submits a second bundle for an answered lease in every fifth
round, so the reputation history holds good and bad evidence, rejections and quarantine.
The coordinator is killed with SIGKILL while a submission is in flight, restarted on the
same port and database, and the volunteers go on by themselves. Then:

1. every bundle a client saw acknowledged (a SubmitBundle reply without error, its
   ``bundle_id`` the payload's SHA-256) is stored for its node, with its one evidence row
   (``bundle_verified`` +1, or ``reward_mismatch`` -2 per mismatch as the reply said) and
   its one accepting verdict row; every stored bundle was acknowledged, or answered
   BUNDLE_REPLAYED to the retry of a submission the kill interrupted (it landed, the
   reply was lost); every stored bundle has exactly one evidence row and
   ``bundles_accepted`` counts them; every in-band BUNDLE_REPLAYED of a second bundle has
   its ``replayed`` evidence row;
2. every node's stored reputation (``good``, ``bad``, ``updated_ms``, ``quarantined``)
   equals, exactly, :func:`reputation.replay_standing` of its evidence rows in id order
   (and the liar's replayed history enters quarantine at least once);
3. every submission in flight at the kill ended stored, and every volunteer (the same
   thread, :class:`SwarmConnection` and identity, registered once) got new bundles
   acknowledged after the restart.

The PostgreSQL server of the fixtures runs with ``fsync`` off: the coordinator is killed,
not the database server, and that is what this test is about (power loss is not).
"""

from __future__ import annotations

import hashlib
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from ftis.coordinator import reputation
from ftis.coordinator.handlers.context import REPUTATION_SETTING
from ftis.coordinator.reputation import Evidence, ReputationConfig, Standing
from ftis.coordinator.state.sql import SqlState
from ftis.protocol.envelope import seal
from ftis.protocol.errors import ErrorCode, FtisError
from ftis.protocol.identity import NodeIdentity
from ftis.v1 import bundle_pb2

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
VOLUNTEERS = 4
GROUP_SIZE, TOKENS = 4, 32
#: short, so that decay between events is far from 1 and the replay checks it
HALF_LIFE_S = 3.0
LOAD_S = 2.0  # load before the kill
ACKS_AFTER_RESTART = 2  # per volunteer
KILLS_MAX = 3  # kill-restart cycles until one interrupts a submission
RESUME_TIMEOUT_S = 40.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def bench_node():
    """``bench/coordinator_load_node.py`` and ``coordinator_load_server.py`` as modules
    (importable the way ``bench/coordinator_load.py`` imports them)."""
    from ftis.client.models.registry import ModelNotFoundError, resolve

    try:
        resolve("smollm2-135m")
    except ModelNotFoundError as exc:
        pytest.skip(f"needs the embedded SmolLM2 package (make setup): {exc}")
    bench = str(ROOT / "bench")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    import coordinator_load_node
    import coordinator_load_server

    return coordinator_load_node, coordinator_load_server


@pytest.fixture(scope="module")
def material(bench_node):
    node, _ = bench_node
    return node.Material.build(group_size=GROUP_SIZE, tokens=TOKENS)


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'coordinator.db'}"
    return request.getfixturevalue("postgres_database")()


class Coordinator:
    """``python -m ftis.coordinator.cli.main serve`` on a fixed port (so a restart reuses
    it), with the ready-file protocol of ``ftis.lab.experiment.launcher``."""

    def __init__(self, workdir: Path, db_url: str, config: Path, env: dict[str, str]) -> None:
        self.workdir, self.db_url, self.config, self.env = workdir, db_url, config, env
        self.target = f"127.0.0.1:{free_port()}"
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self, timeout_s: float = 90.0) -> float:
        """Start and wait until ready; returns the seconds it took."""
        self.starts += 1
        ready = self.workdir / f"ready-{self.starts}.json"
        log = open(self.workdir / f"coordinator-{self.starts}.log", "wb")  # noqa: SIM115
        t0 = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ftis.coordinator.cli.main", "serve",
             "--listen", self.target, "--admin-listen", "127.0.0.1:0", "--db", self.db_url,
             "--ready-file", str(ready), "--config", str(self.config)],
            stdout=log, stderr=subprocess.STDOUT, env=self.env)
        log.close()
        while not ready.exists():
            assert self.proc.poll() is None, (
                f"coordinator exited with {self.proc.returncode}: {self.log_tail()}")
            assert time.monotonic() - t0 < timeout_s, "coordinator not ready"
            time.sleep(0.02)
        assert json.loads(ready.read_text())["listen"] == self.target
        return time.monotonic() - t0

    def log_tail(self, lines: int = 8) -> str:
        path = self.workdir / f"coordinator-{self.starts}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def kill(self) -> float:
        """SIGKILL; returns the monotonic time just before the signal."""
        assert self.proc is not None and self.proc.poll() is None
        t = time.monotonic()
        self.proc.send_signal(signal.SIGKILL)
        assert self.proc.wait(30) == -signal.SIGKILL
        return t

    def stop(self) -> int:
        """SIGTERM (graceful); the exit status."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise


@dataclass
class Submission:
    bundle_id: str
    t0: float
    t1: float = 0.0
    #: the reply said accepted (its reward_mismatches), or else the error code
    acked: bool = False
    reward_mismatches: int = 0
    code: int = 0
    #: a second bundle for an already answered lease (the liar's charged replay)
    second: bool = False


@dataclass
class Volunteer:
    """One volunteer thread: LeaseTasks(1) -> SubmitBundle through one SwarmConnection
    (which retries UNAVAILABLE with backoff), until stopped. Replies are recorded; an
    unexpected rejection code or any exception ends it with :attr:`error`."""

    name: str
    identity: NodeIdentity
    conn: object  # SwarmConnection
    liar: bool
    submissions: list[Submission] = field(default_factory=list)
    in_flight: Submission | None = None
    error: str = ""

    def acked(self, after: float = -1.0) -> list[Submission]:
        return [s for s in self.submissions if s.acked and s.t0 > after]

    def submit(self, envelope: bundle_pb2.SignedEnvelope, second: bool = False) -> Submission:
        sub = Submission(hashlib.sha256(envelope.payload).hexdigest(), time.monotonic(),
                         second=second)
        self.in_flight = sub
        try:
            reply = self.conn.submit_envelope(envelope)
        except FtisError as err:
            sub.code = int(err.code)
        else:
            assert reply.bundle_id == sub.bundle_id, (reply.bundle_id, sub.bundle_id)
            sub.acked, sub.reward_mismatches = True, reply.reward_mismatches
        finally:
            sub.t1 = time.monotonic()
            self.in_flight = None
        self.submissions.append(sub)
        return sub

    def run(self, material: Any, stop: threading.Event) -> None:  # bench's Material
        try:
            rounds = 0
            while not stop.is_set():
                (lease,) = self.conn.lease_tasks(1, GROUP_SIZE, TOKENS)
                bundle = material.bundle(self.identity.node_id, lease)
                if self.liar and rounds % 3 == 1:
                    bundle.completions[0].claimed_reward = 1.0  # verified: 0.0
                sub = self.submit(seal("bundle", bundle, self.identity))
                # BUNDLE_REPLAYED: the retry of a submission that landed before the kill
                assert sub.code in (0, ErrorCode.BUNDLE_REPLAYED), f"rejected: {sub.code}"
                if self.liar and rounds % 5 == 2 and sub.acked:
                    bundle.created_at_ms += 1  # another payload for the answered lease
                    sub = self.submit(seal("bundle", bundle, self.identity), second=True)
                    assert sub.code == ErrorCode.BUNDLE_REPLAYED, f"second bundle: {sub.code}"
                rounds += 1
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = f"{type(exc).__name__}: {exc}"


def interrupted_by(v: Volunteer, t_kills: Sequence[float]) -> dict[str, Submission]:
    """``v``'s first submissions (not a liar's second bundle) in flight at any of the
    kills, by bundle id."""
    return {s.bundle_id: s for s in list(v.submissions)
            if not s.second and any(s.t0 < t < s.t1 for t in t_kills)}


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str,
             volunteers: Sequence[Volunteer] = ()) -> None:
    """Poll ``condition``; fails on a volunteer's error or after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        errors = [f"{v.name}: {v.error}" for v in volunteers if v.error]
        assert not errors, f"waiting for {what}: {errors}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def stored_evidence(state: SqlState, node_id: str) -> list:
    """A node's evidence rows (``EvidenceRecord``), oldest (lowest id) first."""
    rows = state.list_evidence(node_id, limit=1_000_000)[::-1]
    assert [r.id for r in rows] == sorted(r.id for r in rows)
    return rows


def test_sigkill_under_load_loses_no_acknowledged_bundle(db_url, tmp_path, material,
                                                         bench_node):
    from ftis.client.swarm.connection import SwarmConnection

    _, server = bench_node
    t_start = time.monotonic()
    settings = server.coordinator_settings()  # default tasks, tokenizer required, no quotas
    settings["reputation"] = {"half_life_s": HALF_LIFE_S}
    # the four volunteers of this one process share one HTTP/2 connection, and the liar's
    # charged replays alone come at 7-10 a second, the per-connection refusal budget's
    # rate: under load its honest neighbours were answered RATE_LIMITED (once, in a full
    # suite run); real volunteers each have their own connection
    settings.update(connection_refusals_per_s=1e9, connection_refusal_burst=1e9)
    config = tmp_path / "coordinator.json"
    config.write_text(json.dumps(settings))
    coord = Coordinator(tmp_path, db_url, config, server._env())
    start_s = [coord.start()]
    t_kills: list[float] = []
    volunteers = [
        Volunteer(f"v{k}", identity, SwarmConnection(
            coord.target, identity, material.card, display_name=f"durability-{k}",
            tokenizer_json=material.tokenizer_json), liar=(k == 0))
        for k, identity in enumerate(NodeIdentity.generate() for _ in range(VOLUNTEERS))]
    for v in volunteers:
        v.conn.register()  # once: the threads below never register again
    stop = threading.Event()
    threads = [threading.Thread(target=v.run, args=(material, stop), name=v.name, daemon=True)
               for v in volunteers]
    try:
        for t in threads:
            t.start()
        time.sleep(LOAD_S)
        wait_for(lambda: all(v.acked() for v in volunteers), 30, "acks before the kill",
                 volunteers)
        for _ in range(KILLS_MAX):
            # SIGKILL while at least one submission is in flight. The one seen may still
            # be answered between the look and the signal; then this kill interrupted
            # nothing and another one follows (the volunteers go on through both).
            wait_for(lambda: any(s is not None and not s.second
                                 for s in [v.in_flight for v in volunteers]),
                     10, "a submission in flight", volunteers)
            t_kills.append(coord.kill())
            if len(t_kills) == 1:
                acked_before = sum(len(v.acked()) for v in volunteers)
            assert not any(v.error for v in volunteers), [v.error for v in volunteers]
            start_s.append(coord.start())  # same port, same database
            t_ready = time.monotonic()
            # a volunteer submits one bundle at a time: once it has acks after the
            # restart, the submission the kill interrupted (if any) is in its list
            wait_for(lambda t=t_ready: all(len(v.acked(after=t)) >= ACKS_AFTER_RESTART
                                           for v in volunteers), RESUME_TIMEOUT_S,
                     "acks after the restart", volunteers)
            t_resumed = time.monotonic()
            if any(interrupted_by(v, t_kills[-1:]) for v in volunteers):
                break
    finally:
        stop.set()
        for t in threads:
            t.join(90)
        rc = coord.stop()
        for v in volunteers:
            v.conn.close()
    assert rc == 0, coord.log_tail()
    assert not any(t.is_alive() for t in threads)
    assert not any(v.error for v in volunteers), [v.error for v in volunteers]

    # 3. the same clients (thread, SwarmConnection, identity) went on by themselves:
    # none left its loop, each has bundles acknowledged after the restart; the kill
    # interrupted at least one submission (its SwarmConnection retried it)
    interrupted = {v.name: interrupted_by(v, t_kills) for v in volunteers}
    assert any(interrupted.values()), f"none of {len(t_kills)} kills hit a submission"
    for v in volunteers:
        assert len(v.acked(after=t_ready)) >= ACKS_AFTER_RESTART, v.name

    state = SqlState(db_url)
    try:
        # the policy of the whole run: the config's (no stored policy change)
        assert state.get_setting(REPUTATION_SETTING) is None
        policy = ReputationConfig(half_life_s=HALF_LIFE_S)
        with state.engine.connect() as conn:
            accepting = Counter(conn.execute(
                text("SELECT node_id, bundle_id FROM verdicts WHERE code = 0")).tuples())
            # the sender's quarantine flag before each bundle's evidence, as stored
            quarantined_before = {b: bool(q) for b, q in conn.execute(
                text("SELECT bundle_id, stored_quarantined FROM bundles")).tuples()}
        interrupted_replayed = 0
        quarantine_seen = False
        for v in volunteers:
            node_id = v.identity.node_id
            node = state.get_node(node_id)
            rows = stored_evidence(state, node_id)
            bundle_rows: dict[str, list] = {}
            for r in rows:
                if r.kind in reputation.BUNDLE_KINDS:
                    bundle_rows.setdefault(r.bundle_id, []).append(r)
            stored = {b.bundle_id for b in state.list_bundles(node_id, limit=1_000_000)}
            acked = {s.bundle_id: s for s in v.acked()}
            # 1. every acknowledged bundle, with its evidence and its verdict
            owners = state.bundle_owners(list(acked))
            for bundle_id, sub in acked.items():
                assert owners.get(bundle_id, ("",))[0] == node_id, f"acked {bundle_id} lost"
                (evidence,) = bundle_rows.get(bundle_id, [None])
                assert evidence is not None, f"acked {bundle_id} has no evidence row"
                if sub.reward_mismatches:
                    assert evidence.kind == reputation.REWARD_MISMATCH
                    assert evidence.weight == -2.0 * sub.reward_mismatches
                else:
                    assert (evidence.kind, evidence.weight) == (reputation.BUNDLE_VERIFIED, 1.0)
                assert accepting[node_id, bundle_id] == 1, f"acked {bundle_id}: no verdict"
            # stored but not acknowledged: only what the kill interrupted, which the
            # retry found already stored (BUNDLE_REPLAYED, charged to no one)
            unacked = stored - set(acked)
            for bundle_id in unacked:
                sub = interrupted[v.name].get(bundle_id)
                assert sub is not None and sub.code == ErrorCode.BUNDLE_REPLAYED, bundle_id
                interrupted_replayed += 1
            for sub in interrupted[v.name].values():
                assert sub.bundle_id in stored, "an interrupted submission was lost"
            assert set(bundle_rows) == stored  # no bundle without its evidence, and back
            assert all(len(rs) == 1 for rs in bundle_rows.values())
            assert node.bundles_accepted == len(stored)
            # 2. the stored standing is the replay of the stored evidence
            start = Standing(updated_at_ms=node.registered_at_ms)
            events = [(r.at_ms, Evidence(r.kind, r.weight, r.detail, r.reporter_node_id,
                                         r.bundle_id)) for r in rows]
            replayed = reputation.replay_standing(events, policy, start=start)
            assert (node.rep_good, node.rep_bad, node.rep_updated_ms, node.quarantined) == (
                replayed.good, replayed.bad, replayed.updated_at_ms, replayed.quarantined
            ), v.name
            # ... and so was the quarantine flag before every bundle's evidence (the
            # whole trajectory, not only its end: it depends on the verified-bundle count)
            standing, bundles_before = start, 0
            for at_ms, event in events:
                if event.kind in reputation.BUNDLE_KINDS:
                    assert quarantined_before[event.bundle_id] == standing.quarantined, (
                        v.name, event.bundle_id)
                standing = reputation.replay_standing(
                    [(at_ms, event)], policy, start=standing, verified_before=bundles_before)
                bundles_before += event.kind in reputation.BUNDLE_KINDS
                quarantine_seen |= standing.quarantined
            assert standing == replayed
            # rejections answered in-band have their evidence too (the liar's second
            # bundles for answered leases: BUNDLE_REPLAYED, -1 each)
            replayed_rows = {r.bundle_id for r in rows if r.kind == reputation.REPLAYED}
            seconds = [s for s in v.submissions if s.second]
            for sub in seconds:
                assert sub.code == ErrorCode.BUNDLE_REPLAYED and sub.bundle_id in replayed_rows
            if v.liar:
                assert seconds and any(r.kind == reputation.REWARD_MISMATCH for r in rows)
        assert quarantine_seen  # the liar went into quarantine at least once
    finally:
        state.close()
    total = sum(len(v.acked()) for v in volunteers)
    n_interrupted = sum(map(len, interrupted.values()))
    print(f"\n{db_url.split(':')[0]}: {acked_before} acked before the kill, {total} in all; "
          f"{n_interrupted} in flight at the kill, {interrupted_replayed} landed unacked; "
          f"{len(t_kills)} kill(s); start {start_s[0]:.1f} s, restart {start_s[1]:.1f} s, "
          f"first acks after the last restart {t_resumed - t_ready:.1f} s later; "
          f"{time.monotonic() - t_start:.1f} s")


def test_replay_standing_steps_like_the_state():
    """:func:`reputation.replay_standing` on hand-made histories (no database): the
    documented quarantine example, decay between events, the verified-bundle count of a
    bundle's own event, one evaluation per transaction, the operator reset."""
    cfg = ReputationConfig()
    t0, hour = 1_000_000, 3_600_000
    start = Standing(updated_at_ms=t0)
    lie = (t0, Evidence(reputation.REWARD_MISMATCH, -2.0, bundle_id="b0"))
    honest = [(t0, Evidence(reputation.BUNDLE_VERIFIED, 1.0, bundle_id=f"b{k}"))
              for k in (1, 2, 3)]

    def after(events: Iterable[tuple[int, Evidence]], **kw: Any) -> Standing:
        return reputation.replay_standing(events, cfg, start=start, **kw)

    # docs/reputation.md: one wrong claim first -> E = 1/4, quarantined; three honest
    # bundles later E = 4/7 and released (hysteresis: E = 1/2 at two is not enough)
    assert after([lie]) == Standing(0.0, 2.0, t0, True)
    assert after([lie, *honest[:2]]).quarantined
    released = after([lie, *honest])
    assert not released.quarantined
    assert reputation.score(released.good, released.bad) == 4 / 7
    # decay over one half-life (6 h) before the second event
    later = after([honest[0], (t0 + 6 * hour, honest[1][1])])
    assert (later.good, later.updated_at_ms) == (1.5, t0 + 6 * hour)
    # a bundle's event is evaluated with the count that includes that bundle (the fifth
    # ends probation: threshold 0.3), a rejection's with the bundles before it (0.45)
    four = [(t0, Evidence(reputation.BUNDLE_VERIFIED, 1.0, bundle_id=f"c{k}")) for k in range(4)]
    fifth = (t0, Evidence(reputation.REWARD_MISMATCH, -6.0, bundle_id="c4"))
    rejection = (t0, Evidence(reputation.REPLAYED, -6.0, bundle_id="c4"))
    assert not after([*four, fifth]).quarantined  # E = 5/12 >= 0.3
    assert after([*four, rejection]).quarantined  # E = 5/12 < 0.45
    assert after([*four[1:], fifth], verified_before=0).quarantined  # 4th bundle: 0.45
    # one transaction's events are one evaluation: -1 then +1 ends at E = 1/2
    minus, plus = Evidence(reputation.FEEDBACK, -1.0), Evidence(reputation.FEEDBACK, 1.0)
    assert not after([(t0, [minus, plus])]).quarantined
    assert after([(t0, minus), (t0, plus)]).quarantined  # 1/3 enters, 1/2 <= 0.5 stays
    # operator reset: bad evidence gone, quarantine lifted, no decay, time kept
    reset = (t0 + hour, Evidence(reputation.OPERATOR_RESET, 0.0))
    assert after([lie, reset]) == Standing(0.0, 0.0, t0, False)
