"""Observability in-process: the metrics the servicer counts (exact, over real gRPC
calls), the bounded history queries, the status page's data (reputation reconstructed
from evidence matches the scores the coordinator had), HTML escaping, and the admin
reputation settings derived from the ReputationConfig dataclass."""

from __future__ import annotations

import dataclasses
import json
import time
import urllib.request

import grpc
import pytest
import typer
from prometheus_client.parser import text_string_to_metric_families

from ftis.coordinator import reputation
from ftis.coordinator.admin_cli.main import app as admin_app
from ftis.coordinator.admin_cli.main import parse_field_value, reputation_fields
from ftis.coordinator.observe import status as page
from ftis.coordinator.reputation import ReputationConfig
from ftis.coordinator.server import convert
from ftis.coordinator.server.app import CoordinatorServer
from ftis.coordinator.state.sql import SqlState
from ftis.lab.harness.coordinator import (
    FakeClock,
    build_bundle,
    make_config,
    make_coordinator,
    model_card,
    register,
    register_envelope,
    seal_bundle,
    signed,
)
from ftis.protocol.errors import ErrorCode
from ftis.protocol.identity import NodeIdentity
from ftis.v1 import admin_pb2, swarm_pb2, swarm_pb2_grpc


# -- admin settings derived from the dataclass -----------------------------------------
def test_admin_message_has_every_reputation_field() -> None:
    names = [f.name for f in dataclasses.fields(ReputationConfig)]
    proto = {f.name: f for f in admin_pb2.ReputationConfig.DESCRIPTOR.fields}
    assert sorted(proto) == sorted(names)
    assert all(f.has_presence for f in proto.values())
    custom = ReputationConfig(quarantine_threshold=0.2, half_life_s=60.0, probation_bundles=3,
                              probation_threshold=0.4, feedback_weight=0.7,
                              log_ratio_tolerance=2.0, auto_ban_on_proof=False,
                              feedback_cap=3.0, filtered_frac_limit=0.25,
                              corroborating_reporters=4, corroborated_cap=6.0,
                              reporter_maturity_s=60.0, shift_margin=0.1, shift_z=2.0,
                              shift_min_completions=4)
    message = convert.reputation_config(custom)
    assert convert.reputation_config_from_proto(message, ReputationConfig()) == custom
    # fields left unset keep the base's values
    partial = admin_pb2.ReputationConfig(feedback_cap=5.0, corroborating_reporters=0)
    assert convert.reputation_config_from_proto(partial, custom) == dataclasses.replace(
        custom, feedback_cap=5.0, corroborating_reporters=0)
    with pytest.raises(ValueError):
        convert.reputation_config_from_proto(
            admin_pb2.ReputationConfig(filtered_frac_limit=2.0), custom)


def test_reputation_set_has_a_flag_per_field() -> None:
    command = typer.main.get_command(admin_app)
    set_cmd = command.commands["reputation"].commands["set"]  # type: ignore[attr-defined]
    flags = {opt for p in set_cmd.params for opt in (*p.opts, *p.secondary_opts)}
    for name, kind in reputation_fields().items():
        flag = "--" + name.replace("_", "-")
        assert flag in flags, name
        if kind is bool:
            assert "--no-" + flag[2:] in flags
    assert "--set" in flags and "--json" in flags
    assert parse_field_value("feedback_cap", "2.5") == 2.5
    assert parse_field_value("corroborating_reporters", "3") == 3
    assert parse_field_value("auto_ban_on_proof", "false") is False
    for name, text in (("nope", "1"), ("probation_bundles", "1.5"), ("auto_ban_on_proof", "x")):
        with pytest.raises(ValueError):
            parse_field_value(name, text)


# -- the servicer's metrics over real gRPC calls ----------------------------------------
def _scrape(address: str) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _v(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_servicer_counts_rpcs_bundles_leases_and_relays(tmp_path, monkeypatch) -> None:
    from ftis.coordinator.observe import metrics

    monkeypatch.setattr(metrics, "SCRAPE_CACHE_S", 0.0)  # gauges read at every scrape
    config = make_config(db=str(tmp_path / "c.db"))
    server = CoordinatorServer(config, http_listen="127.0.0.1:0")
    server.start()
    try:
        before = _scrape(server.http_address)
        channel = grpc.insecure_channel(server.address)
        stub = swarm_pb2_grpc.SwarmStub(channel)
        sender, reader = NodeIdentity.generate(), NodeIdentity.generate()
        now = lambda: int(time.time() * 1000)  # noqa: E731
        for ident in (sender, reader):
            reply = stub.Register(swarm_pb2.RegisterRequest(
                envelope=register_envelope(ident, model_card(), now())))
            assert reply.error.code == 0
        reply = stub.LeaseTasks(signed(swarm_pb2.LeaseTasksRequest(
            node_id=sender.node_id, count=3, group_size=2, max_new_tokens=16),
            "LeaseTasks", sender, now()))
        leases = list(reply.leases)
        assert len(leases) == 3
        state = server.state
        envelopes = [seal_bundle(build_bundle(state.get_lease_by_task(x.task_id), sender),
                                 sender) for x in leases[:2]]
        for env in envelopes:
            assert stub.SubmitBundle(swarm_pb2.SubmitBundleRequest(envelope=env)).error.code == 0
        again = stub.SubmitBundle(swarm_pb2.SubmitBundleRequest(envelope=envelopes[0]))
        assert again.error.code == ErrorCode.BUNDLE_REPLAYED
        big = swarm_pb2.RegisterRequest(envelope=register_envelope(
            reader, model_card(), now(), display_name="x" * (config.max_request_bytes + 10)))
        assert stub.Register(big).error.code == ErrorCode.REQUEST_TOO_LARGE
        page_reply = stub.PullBundles(signed(swarm_pb2.PullBundlesRequest(
            node_id=reader.node_id, cursor=0, max_bundles=64), "PullBundles", reader, now()))
        assert len(page_reply.bundles) == 2
        channel.close()
        time.sleep(0.1)
        after = _scrape(server.http_address)
    finally:
        server.stop(1.0)

    def delta(name: str, **labels: str) -> float:
        return _v(after, name, **labels) - _v(before, name, **labels)

    assert delta("ftis_bundles_accepted_total") == 2
    assert delta("ftis_bundles_rejected_total", code="BUNDLE_REPLAYED") == 1
    assert delta("ftis_leases_issued_total") == 3
    assert delta("ftis_bundles_relayed_total") == 2
    assert delta("ftis_rpc_duration_seconds_count", method="SubmitBundle") == 3
    assert delta("ftis_rpc_handled_total", method="SubmitBundle", code="OK") == 2
    assert delta("ftis_rpc_handled_total", method="Register", code="OK") == 2
    assert delta("ftis_rpc_handled_total", method="Register", code="REQUEST_TOO_LARGE") == 1
    assert delta("ftis_rpc_handled_total", method="PullBundles", code="OK") == 1
    assert delta("ftis_bundle_verification_seconds_count", outcome="accepted") == 2
    assert delta("ftis_bundle_verification_seconds_count", outcome="rejected") == 1
    assert delta("ftis_db_transaction_seconds_count", kind="write") >= 2 + 2 + 1
    assert delta("ftis_db_transaction_seconds_count", kind="read") >= 1
    # database gauges (not deltas: this database only)
    assert _v(after, "ftis_nodes_registered") == 2
    assert _v(after, "ftis_nodes_banned") == 0
    assert _v(after, "ftis_leases_outstanding") == 1
    assert _v(after, "ftis_leases_expired_total") == 0
    assert _v(after, "ftis_database_up") == 1


def test_http_listener_address_taken(tmp_path) -> None:
    first = CoordinatorServer(make_config(db=str(tmp_path / "a.db")), http_listen="127.0.0.1:0")
    first.start()
    try:
        taken = first.http_address
        strict = CoordinatorServer(make_config(db=str(tmp_path / "b.db")), http_listen=taken)
        from ftis.coordinator.server.app import BindError

        with pytest.raises(BindError):
            strict.start()
        strict.stop(None)
        lenient = CoordinatorServer(make_config(db=str(tmp_path / "c.db")), http_listen=taken,
                                    http_optional=True)
        lenient.start()  # serves without it
        assert lenient.http_address is None
        lenient.stop(None)
    finally:
        first.stop(None)


# -- history queries and the page's data --------------------------------------------------
def _submit(coord, node, n: int, **kwargs) -> None:
    for lease in coord.lease_tasks(node.node_id, n, 2, 16):
        coord.submit_bundle(seal_bundle(build_bundle(lease, node, **kwargs), node))


@pytest.fixture
def history(tmp_path):
    """Three nodes over ten minutes: two honest, one liar (quarantined), one banned."""
    clock = FakeClock(1_800_000_000_000)
    coord = make_coordinator(clock, db=f"sqlite:///{tmp_path / 'h.db'}")
    honest, other, liar = register(coord), register(coord), register(coord)
    coord.ban(other.node_id, "operator says <b>no</b>")
    scores: list[tuple[int, float]] = []  # the liar's score as the coordinator had it
    for minute in range(10):
        _submit(coord, honest, 2)
        coord.report_metrics(honest.node_id, minute + 1, {
            "reward_mean": 0.1 * minute, "is_weight_mean": 1.0, "truncated_frac": 0.0,
            "filtered_frac": 0.05, "secret_ish": 7.0})
        if minute in (2, 3):
            _submit(coord, liar, 1, claimed=[1.0, 1.0])  # one lie per bundle
        elif minute > 3:
            _submit(coord, liar, 1)
        node = coord.state.get_node(liar.node_id)
        scores.append((clock(), reputation.current_score(node.standing, clock(),
                                                         coord.reputation_config.half_life_s)))
        clock.advance(60)
    coord.flush_seen()
    return coord, clock, {"honest": honest, "other": other, "liar": liar}, scores


def test_history_queries_are_bucketed_and_bounded(history) -> None:
    coord, clock, ids, _ = history
    state: SqlState = coord.state
    since = clock() - 11 * 60_000
    buckets = state.reward_history(since, 60_000)
    assert sum(b.bundles for b in buckets) == 28
    assert {b.node_id for b in buckets} == {ids["honest"].node_id, ids["liar"].node_id}
    assert all((b.start_ms - since) % 60_000 == 0 for b in buckets)
    newest = state.reward_history(since, 60_000, max_rows=3)
    assert sum(b.bundles for b in newest) == 3
    verdicts = state.verdict_history(since, 60_000)
    assert sum(v.count for v in verdicts if v.code == 0) == 28
    evidence = state.evidence_since(since)
    assert [e.id for e in evidence] == sorted(e.id for e in evidence)
    assert len(state.evidence_since(since, max_rows=5)) == 5
    points = state.metrics_history(since, ("reward_mean", "filtered_frac"))
    assert len(points) == 10 and set(points[-1].values) == {"reward_mean", "filtered_frac"}
    counts = state.swarm_counts(clock(), 5 * 60_000)
    assert (counts.nodes, counts.banned_nodes) == (3, 1)
    assert counts.quarantined_nodes == (1 if state.get_node(ids["liar"].node_id).quarantined
                                        else 0)
    assert counts.leases_outstanding == 0 and counts.leases_expired == 0


def test_status_reconstructs_reputation_and_events(history) -> None:
    coord, clock, ids, scores = history
    policy = coord.reputation_config
    data = page.build_status(coord.state, policy, clock(), window_s=3600)
    charts = {c["id"]: c for c in data["charts"]}
    assert set(charts) == {"reward_dataset", "reward_family", "verdict_rates",
                           "reputation_hist", "reputation_nodes", *(
                               f"learner_{k}" for k, _ in page.LEARNER_METRICS)}
    assert {s["label"] for s in charts["reward_family"]["series"]} == {"tiny-random"}
    # the honest node's learner curve is its reports, by step
    learner = charts["learner_reward_mean"]
    assert learner["x"] == [float(s) for s in range(1, 11)]
    assert learner["series"][0]["values"] == pytest.approx([0.1 * m for m in range(10)])
    # every rate sample is per minute over the trailing minute: 3 or 2 bundles a minute
    accepted = next(s for s in charts["verdict_rates"]["series"] if s["label"] == "accepted")
    assert max(v for v in accepted["values"] if v is not None) == pytest.approx(3.0, rel=0.01)
    # the liar's reconstructed score matches what the coordinator had after each minute
    liar = coord.state.get_node(ids["liar"].node_id)
    rows = [e for e in coord.state.evidence_since(0) if e.node_id == liar.node_id]
    hist = page.reconstruct(liar, page._groups(rows), policy.half_life_s)
    for at, score in scores:
        assert hist.score_at(at, policy.half_life_s) == pytest.approx(score, abs=1e-9)
    events = {(e["node_id"], e["event"]) for e in data["events"]}
    assert (ids["liar"].node_id, "quarantined") in events
    assert (ids["other"].node_id, "banned") in events
    assert data["summary"]["banned"] == 1 and data["nodes_total"] == 3
    html = page.render_page(data)
    assert "operator says &lt;b&gt;no&lt;/b&gt;" in html and "<b>no</b>" not in html
    assert "secret_ish" not in html and "secret_ish" not in json.dumps(data)


def test_page_escapes_what_nodes_choose(tmp_path) -> None:
    clock = FakeClock()
    coord = make_coordinator(clock)
    ident = NodeIdentity.generate()
    card = model_card()
    card.base_model = "/home/someone/models/</script><script>alert(1)</script>"
    coord.register(register_envelope(ident, card, clock(), display_name="<img src=x onerror=1>"))
    _submit(coord, ident, 1)
    data = page.build_status(coord.state, coord.reputation_config, clock())
    html = page.render_page(data)
    assert "<img src=x" not in html and "<script>alert" not in html
    assert "/home/someone" not in html  # only the model path's last component
    payload = html.split('id="status-data">', 1)[1].split("</script>", 1)[0]
    assert "<" not in payload and json.loads(payload)["charts"]
    assert page.model_family("HuggingFaceTB/SmolLM2-135M-Instruct") == "smollm2"
    assert page.model_family("google/gemma-3-270m") == "gemma-3"
