"""End to end over real gRPC: ``ftis-coordinator serve`` as a subprocess, two volunteer
nodes (signed requests, an uploaded tokenizer, text checked against it), and
``ftis-admin --json`` as subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from serve_process import start_serve, stop_serve

from ftis.lab.harness.coordinator import (
    VOCAB,
    answer_text,
    chat_prompt,
    load_tokenizer,
    model_card,
    register_envelope,
    signed,
    tokenizer_fp,
    tokenizer_gz,
)
from ftis.protocol.envelope import open_envelope, seal
from ftis.protocol.errors import ErrorCode
from ftis.protocol.exit_codes import ExitCode
from ftis.protocol.identity import NodeIdentity
from ftis.tasks.source import DEFAULT_TASKS, TaskSource
from ftis.v1 import bundle_pb2, swarm_pb2, swarm_pb2_grpc

pytestmark = pytest.mark.integration

def _start(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen, dict]:
    return start_serve(tmp_path, *extra)


_stop = stop_serve


def _admin(address: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ftis.coordinator.admin_cli.main", "--admin", address, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "200"},
    )


def _admin_json(address: str, *args: str) -> dict:
    result = _admin(address, *args, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def _bundle(lease: swarm_pb2.TaskLease, node: NodeIdentity, answer: str) -> bundle_pb2.Bundle:
    tok = load_tokenizer()
    completions = []
    for correct in (True, False):
        ids = tok.encode(answer_text(correct, answer)).ids
        completions.append(
            bundle_pb2.Completion(
                token_ids=ids,
                logprobs=[-0.1] * len(ids),
                text=tok.decode(ids, skip_special_tokens=False),
                claimed_reward=1.0 if correct else 0.0,
            )
        )
    return bundle_pb2.Bundle(
        task_id=lease.task_id,
        lease_id=lease.lease_id,
        node_id=node.node_id,
        model_card=model_card(tokenizer_fp()),
        policy_version=1,
        sampling=bundle_pb2.SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=16),
        prompt_token_ids=tok.encode(chat_prompt(lease.question)).ids,
        prompt_text=lease.question,
        completions=completions,
    )


def _now() -> int:
    return int(time.time() * 1000)


def _answer_of(lease: swarm_pb2.TaskLease) -> str:
    """Recompute the chain_sum answer from the question text (``... a + b =``)."""
    tokens = lease.question.rsplit(":", 1)[-1].strip().rstrip("=").split()
    total = int(tokens[0])
    for op, number in zip(tokens[1::2], tokens[2::2], strict=True):
        total = total + int(number) if op == "+" else total - int(number)
    return str(total)


def test_server_end_to_end(tmp_path: Path) -> None:
    proc, ready = _start(tmp_path)
    try:
        assert ready["pid"] == proc.pid
        channel = grpc.insecure_channel(ready["listen"])
        stub = swarm_pb2_grpc.SwarmStub(channel)
        now = _now()
        alice, bob = NodeIdentity.generate(), NodeIdentity.generate()
        card = model_card(tokenizer_fp(), VOCAB)

        def register(who: NodeIdentity) -> swarm_pb2.RegisterResponse:
            reply = stub.Register(
                swarm_pb2.RegisterRequest(envelope=register_envelope(who, card, _now())),
                timeout=10,
            )
            assert reply.error.code == 0, reply.error
            assert reply.node_id == who.node_id and reply.heartbeat_interval_ms == 30_000
            return reply

        assert register(alice).tokenizer_known is False

        def lease_request(who: NodeIdentity, count: int) -> swarm_pb2.LeaseTasksRequest:
            request = swarm_pb2.LeaseTasksRequest(
                node_id=who.node_id, count=count, group_size=2, max_new_tokens=16
            )
            return signed(request, "LeaseTasks", who, _now())

        no_tokenizer = stub.LeaseTasks(lease_request(alice, 2), timeout=10)
        assert no_tokenizer.error.code == ErrorCode.TOKENIZER_REQUIRED
        upload = swarm_pb2.UploadTokenizerRequest(
            node_id=alice.node_id, fingerprint=tokenizer_fp(), tokenizer_json_gz=tokenizer_gz()
        )
        uploaded = stub.UploadTokenizer(
            signed(upload, "UploadTokenizer", alice, _now()), timeout=30
        )
        assert uploaded.error.code == 0, uploaded.error
        assert register(bob).tokenizer_known is True

        unsigned = stub.LeaseTasks(
            swarm_pb2.LeaseTasksRequest(
                node_id=alice.node_id, count=2, group_size=2, max_new_tokens=16
            ),
            timeout=10,
        )
        assert unsigned.error.code == ErrorCode.AUTH_INVALID
        leased = stub.LeaseTasks(lease_request(alice, 2), timeout=10)
        assert leased.error.code == 0 and len(leased.leases) == 2
        good_lease, bad_lease = leased.leases
        assert good_lease.messages[-1].content == good_lease.question
        assert good_lease.dataset == "chain_sum" and good_lease.deadline_ms > now

        answer = _answer_of(good_lease)
        good = stub.SubmitBundle(
            swarm_pb2.SubmitBundleRequest(
                envelope=seal("bundle", _bundle(good_lease, alice, answer), alice)
            ),
            timeout=10,
        )
        assert good.error.code == 0, good.error
        assert list(good.verified_rewards) == [1.0, 0.0] and good.reward_mismatches == 0

        bad_bundle = _bundle(bad_lease, alice, _answer_of(bad_lease))
        bad_bundle.completions[0].logprobs[0] = 0.5
        bad = stub.SubmitBundle(
            swarm_pb2.SubmitBundleRequest(envelope=seal("bundle", bad_bundle, alice)), timeout=10
        )
        assert bad.error.code == ErrorCode.LOGPROB_POSITIVE and bad.error.reason

        unknown = stub.Heartbeat(swarm_pb2.HeartbeatRequest(node_id="0" * 32), timeout=10)
        assert unknown.error.code == ErrorCode.NODE_UNKNOWN
        beat = stub.Heartbeat(
            signed(
                swarm_pb2.HeartbeatRequest(node_id=bob.node_id, policy_version=4),
                "Heartbeat",
                bob,
                _now(),
            ),
            timeout=10,
        )
        assert beat.error.code == 0 and beat.server_time_ms > 0
        assert beat.reputation == 0.5 and beat.quarantined is False
        metrics_request = swarm_pb2.ReportMetricsRequest(
            node_id=bob.node_id, step=4, values={"reward": 0.5, "loss": float("nan")}
        )
        metrics = stub.ReportMetrics(
            signed(metrics_request, "ReportMetrics", bob, _now()), timeout=10
        )
        assert metrics.error.code == 0

        def pull(who: NodeIdentity) -> swarm_pb2.PullBundlesResponse:
            request = swarm_pb2.PullBundlesRequest(node_id=who.node_id, cursor=0, max_bundles=8)
            reply = stub.PullBundles(signed(request, "PullBundles", who, _now()), timeout=10)
            assert reply.error.code == 0, reply.error
            return reply

        pulled = pull(bob)
        assert len(pulled.bundles) == 1
        relayed = pulled.bundles[0]
        assert relayed.bundle_id == good.bundle_id and pulled.next_cursor == relayed.sequence
        # alice: one verified bundle (+1), one rejected (-1): E = 2 / 4
        assert relayed.sender_reputation == pytest.approx(0.5, abs=1e-3)
        opened, sender = open_envelope(relayed.envelope, "bundle", bundle_pb2.Bundle, 1 << 22)
        assert sender == alice.node_id and opened.task_id == good_lease.task_id
        assert len(pull(alice).bundles) == 0

        # Oversized requests: in-band REQUEST_TOO_LARGE below the transport limit,
        # gRPC status RESOURCE_EXHAUSTED above it; never decoded either way.
        too_large = stub.Heartbeat(swarm_pb2.HeartbeatRequest(node_id="x" * (2 << 20)), timeout=10)
        assert too_large.error.code == ErrorCode.REQUEST_TOO_LARGE
        # bytes that do not parse: in-band REQUEST_INVALID, not gRPC's INTERNAL
        raw = channel.unary_unary("/ftis.v1.Swarm/SubmitBundle", request_serializer=None,
                                  response_deserializer=swarm_pb2.SubmitBundleResponse.FromString)
        assert raw(b"\xff" * 64, timeout=10).error.code == ErrorCode.REQUEST_INVALID
        with pytest.raises(grpc.RpcError) as refused:
            stub.SubmitBundle(
                swarm_pb2.SubmitBundleRequest(
                    envelope=bundle_pb2.SignedEnvelope(payload=b"x" * (40 << 20))
                ),
                timeout=30,
            )
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

        # --- operator CLI ---
        admin = ready["admin"]
        nodes = _admin_json(admin, "nodes", "list")["nodes"]
        assert len(nodes) == 2
        by_id = {n["node_id"]: n for n in nodes}
        assert by_id[alice.node_id]["bundles_accepted"] == 1
        assert by_id[alice.node_id]["bundles_rejected"] == 1
        assert by_id[alice.node_id]["reputation"] == pytest.approx(0.5, abs=1e-3)
        assert by_id[alice.node_id]["probation"] is True
        assert by_id[alice.node_id]["quarantined"] is False
        assert by_id[bob.node_id]["policy_version"] == 4
        assert by_id[bob.node_id]["latest_metrics"]["reward"] == 0.5

        shown = _admin_json(admin, "nodes", "show", alice.node_id[:10])
        assert shown["node"]["node_id"] == alice.node_id
        assert shown["rejections_by_code"] == {"LOGPROB_POSITIVE": 1}
        kinds = [e["kind"] for e in shown["evidence"]]
        assert kinds == ["rejected", "bundle_verified"]  # newest first

        stats = _admin_json(admin, "stats")
        assert stats["nodes"] == 2 and stats["bundles_accepted"] == 1
        assert stats["bundles_rejected"] == 1
        assert stats["rejections_by_code"] == {"LOGPROB_POSITIVE": 1}
        assert stats["completions"] == 2 and stats["mean_verified_reward"] == 0.5
        assert stats["quarantined_nodes"] == 0
        bundles = _admin_json(admin, "bundles", "list", "--limit", "5")["bundles"]
        assert len(bundles) == 1 and bundles[0]["bundle_id"] == good.bundle_id
        assert bundles[0]["reward_mismatches"] == 0 and bundles[0]["dataset"] == "chain_sum"

        policy = _admin_json(admin, "reputation", "show")["config"]
        assert policy["quarantine_threshold"] == 0.3 and policy["auto_ban_on_proof"] is True
        # Stricter probation: alice and bob (E = 0.5, on probation) are quarantined at once.
        changed = _admin_json(
            admin, "reputation", "set", "--probation-threshold", "0.6", "--no-auto-ban-on-proof"
        )["config"]
        assert changed["probation_threshold"] == 0.6 and changed["auto_ban_on_proof"] is False
        assert changed["quarantine_threshold"] == 0.3
        assert _admin_json(admin, "stats")["quarantined_nodes"] == 2
        assert len(pull(bob).bundles) == 0
        bad_policy = _admin(admin, "reputation", "set", "--half-life-s", "0", "--json")
        assert bad_policy.returncode == ExitCode.ADMIN_ERROR_RESPONSE
        assert json.loads(bad_policy.stdout)["error"]["name"] == "REQUEST_INVALID"
        _admin_json(admin, "reputation", "set", "--probation-threshold", "0.45")
        assert len(pull(bob).bundles) == 0  # hysteresis: leaves above 0.45 + 0.05 only
        table = _admin(admin, "nodes", "list")
        assert table.returncode == 0 and "quarantined" in table.stdout
        unquarantined = _admin_json(admin, "unban", alice.node_id)["node"]
        assert unquarantined["quarantined"] is False and unquarantined["evidence_bad"] == 0
        assert len(pull(bob).bundles) == 1

        banned = _admin_json(admin, "ban", alice.node_id, "--reason", "test ban")
        assert banned["node"]["banned"] is True and banned["node"]["ban_reason"] == "test ban"
        assert len(pull(bob).bundles) == 0
        refused = stub.LeaseTasks(lease_request(alice, 1), timeout=10)
        assert refused.error.code == ErrorCode.NODE_BANNED
        stats = _admin_json(admin, "stats")
        assert stats["banned_nodes"] == 1
        unbanned = _admin_json(admin, "unban", alice.node_id)
        assert unbanned["node"]["banned"] is False

        missing = _admin(admin, "nodes", "show", "zzzz")
        assert missing.returncode == ExitCode.ADMIN_ERROR_RESPONSE
        assert "NODE_UNKNOWN" in missing.stderr
        missing_json = _admin(admin, "ban", "zzzz", "--json")
        assert missing_json.returncode == ExitCode.ADMIN_ERROR_RESPONSE
        assert json.loads(missing_json.stdout)["error"]["name"] == "NODE_UNKNOWN"
        table = _admin(admin, "nodes", "list")
        assert table.returncode == 0 and alice.node_id in table.stdout
        for command in (["stats"], ["bundles", "list"], ["nodes", "show", bob.node_id]):
            assert _admin(admin, *command).returncode == 0, command

        # A port that is taken: COORDINATOR_BIND.
        busy_dir = tmp_path / "busy"
        busy_dir.mkdir()
        busy = subprocess.run(
            [
                sys.executable,
                "-m",
                "ftis.coordinator.cli.main",
                "serve",
                "--listen",
                ready["listen"],
                "--admin-listen",
                "127.0.0.1:0",
                "--db",
                str(busy_dir / "c.db"),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert busy.returncode == ExitCode.COORDINATOR_BIND, busy.stderr
        channel.close()
    finally:
        returncode = _stop(proc)
    assert returncode == 0


def test_admin_cli_unreachable_exit_code() -> None:
    result = _admin("127.0.0.1:1", "--timeout", "1", "stats", "--json")
    assert result.returncode == ExitCode.ADMIN_UNREACHABLE
    assert "cannot reach" in result.stderr and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("args", "code"),
    [
        (["--listen", "nonsense"], ExitCode.USAGE),
        (["--db", "/nonexistent-dir/sub/coord.db"], ExitCode.COORDINATOR_DATABASE),
        # audit-based probation with no seed, no held model and no passed audit
        (["--set", "reputation.audit_reporters=2"], ExitCode.USAGE),
    ],
)
def test_serve_exit_codes(tmp_path: Path, args: list[str], code: int) -> None:
    base = ["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"]
    base += ["--db", str(tmp_path / "c.db")]
    result = subprocess.run(
        [sys.executable, "-m", "ftis.coordinator.cli.main", "serve", *base, *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == code, result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("ftis-coordinator: ")
    if "reputation.audit_reporters=2" in args:
        assert "no bootstrap" in result.stderr.strip().splitlines()[-1]


def test_serve_exits_23_when_a_spot_check_model_does_not_load(tmp_path: Path) -> None:
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"spot_checks": {"models": [str(tmp_path / "no-model")]}}))
    result = subprocess.run(
        [sys.executable, "-m", "ftis.coordinator.cli.main", "serve", "--config", str(config),
         "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0",
         "--db", str(tmp_path / "c.db")],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == ExitCode.COORDINATOR_SPOT_CHECK_MODELS, result.stderr
    assert "no-model" in result.stderr


def test_answer_helper_matches_the_dataset() -> None:
    source = TaskSource(DEFAULT_TASKS, seed=0)
    for _ in range(20):
        entry = source.draw()
        assert _answer_of(swarm_pb2.TaskLease(question=entry.question)) == entry.answer
