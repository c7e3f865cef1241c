"""Alembic migrations: the ORM models and ``upgrade head`` give the same schema; revision
0001 is exactly the schema of releases before migrations; a database made by those
releases is stamped, upgraded and keeps its rows; on SQLite and PostgreSQL."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from legacy_models import LegacyBase
from sqlalchemy import (
    Engine,
    ForeignKeyConstraint,
    MetaData,
    Table,
    create_engine,
    insert,
    inspect,
    select,
)
from state_records import FP_A, T0, node_id

from ftis.coordinator.state import migrate
from ftis.coordinator.state.migrations import schema_v1
from ftis.coordinator.state.sql import Base, SqlState, normalize_url
from ftis.protocol.errors import ErrorCode


@pytest.fixture
def empty_url(request: pytest.FixtureRequest, backend: str, tmp_path: Path) -> str:
    """A database with no tables at all."""
    if backend == "sqlite":
        return f"sqlite:///{tmp_path / 'empty.db'}"
    return request.getfixturevalue("postgres_database")()


@pytest.fixture
def engine(empty_url: str) -> Iterator[Engine]:
    made = create_engine(normalize_url(empty_url))
    yield made
    made.dispose()


def _differences(engine: Engine, metadata: MetaData) -> list:
    with engine.connect() as conn:
        return compare_metadata(MigrationContext.configure(conn), metadata)


def _revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return migrate.current_revision(conn)


def test_head_is_the_newest_revision() -> None:
    script = ScriptDirectory.from_config(migrate.alembic_config())
    assert script.get_current_head() == migrate.HEAD_REVISION
    chain = [r.revision for r in script.walk_revisions()]
    assert chain == [migrate.HEAD_REVISION, "0006", "0005", "0004", "0003", "0002",
                     migrate.INITIAL_REVISION]
    assert (migrate.MIGRATIONS_DIR / "script.py.mako").is_file()


def test_models_match_upgrade_head(empty_url: str, engine: Engine) -> None:
    SqlState(empty_url).close()
    assert _revision(engine) == migrate.HEAD_REVISION
    assert _differences(engine, Base.metadata) == []


def test_revision_1_is_the_schema_before_migrations(empty_url: str, engine: Engine,
                                                    request: pytest.FixtureRequest,
                                                    backend: str, tmp_path: Path) -> None:
    migrate.upgrade(engine, migrate.INITIAL_REVISION)
    assert _revision(engine) == migrate.INITIAL_REVISION
    assert _differences(engine, LegacyBase.metadata) == []
    # and the frozen copy describes a database made by the old create_all
    if backend == "sqlite":
        legacy_url = f"sqlite:///{tmp_path / 'legacy.db'}"
    else:
        legacy_url = request.getfixturevalue("postgres_database")()
    legacy = create_engine(normalize_url(legacy_url))
    try:
        LegacyBase.metadata.create_all(legacy)
        assert _differences(legacy, schema_v1.metadata) == []
    finally:
        legacy.dispose()


def _fill_legacy(engine: Engine, tables: MetaData) -> dict[str, str]:
    """Rows as the old code wrote them: two nodes (one without a reputation row, as
    registered before that table existed), two leases, a bundle, three verdicts."""
    alice, bob = node_id("alice"), node_id("bob")
    t = tables.tables
    node = {
        "public_key": b"pk", "display_name": "n", "model_card": b"card",
        "fingerprint": FP_A, "vocab_size": 1000, "client_version": "old",
        "registered_at_ms": T0, "last_seen_ms": T0 + 5, "policy_version": 2, "banned": False,
        "ban_reason": "", "bundles_accepted": 1, "reward_mismatches": 0, "completions": 4,
        "completion_tokens": 24, "latest_metrics": {"loss": 0.5}, "latest_metrics_step": 7,
    }
    lease = {
        "dataset": "chain_sum", "spec_index": 0, "group_size": 4, "max_new_tokens": 16,
        "issued_at_ms": T0, "deadline_ms": T0 + 60_000,
        "entry_json": json.dumps({"dataset": "chain_sum", "index": 0, "question": "1 + 1?",
                                  "answer": "2", "metadata": {}}),
    }
    bundle = {
        "bundle_id": "b" * 64, "node_id": alice, "task_id": "task-1", "lease_id": "lease-1",
        "fingerprint": FP_A, "envelope": b"env", "verified_rewards": [1.0, 0.0, 1.0, 0.0],
        "mean_reward": 0.5, "zero_variance": False, "completions": 4, "completion_tokens": 24,
        "size_bytes": 100, "reward_mismatches": 0, "policy_version": 2, "stored_at_ms": T0 + 5,
    }
    if "text_verified" in t["bundles"].c:
        bundle |= {"text_verified": True, "stored_quarantined": False}
    with engine.begin() as conn:
        conn.execute(insert(t["nodes"]), [{"node_id": alice, **node},
                                          {"node_id": bob, **node, "bundles_accepted": 0}])
        if "reputation" in t:
            conn.execute(insert(t["reputation"]).values(
                node_id=alice, good=1.0, bad=0.0, updated_ms=T0 + 5, quarantined=False))
        conn.execute(insert(t["leases"]), [
            {"lease_id": "lease-1", "task_id": "task-1", "node_id": alice,
             "bundle_id": "b" * 64, **lease},
            {"lease_id": "lease-2", "task_id": "task-2", "node_id": bob, "bundle_id": None,
             **lease}])
        conn.execute(insert(t["bundles"]).values(**bundle))
        conn.execute(insert(t["verdicts"]), [
            {"node_id": alice, "bundle_id": "b" * 64, "code": 0, "reason": "accepted",
             "at_ms": T0 + 5},
            {"node_id": alice, "bundle_id": None, "code": int(ErrorCode.LEASE_EXPIRED),
             "reason": "late", "at_ms": T0 + 6},
            {"node_id": bob, "bundle_id": None, "code": int(ErrorCode.TASK_MISMATCH),
             "reason": "x", "at_ms": T0 + 7},
            {"node_id": bob, "bundle_id": None, "code": int(ErrorCode.TASK_MISMATCH),
             "reason": "x", "at_ms": T0 + 8}])
    return {"alice": alice, "bob": bob}


def _check_upgraded(url: str, engine: Engine, ids: dict[str, str], text_verified: bool,
                    alice_reputation: tuple[float, int] = (1.0, T0 + 5)) -> None:
    state = SqlState(url)
    try:
        assert _revision(engine) == migrate.HEAD_REVISION
        assert _differences(engine, Base.metadata) == []
        alice = state.get_node(ids["alice"])
        assert (alice.display_name, alice.last_seen_ms, alice.policy_version) == ("n", T0 + 5, 2)
        assert (alice.bundles_accepted, alice.completions, alice.latest_metrics) == (
            1, 4, {"loss": 0.5})
        assert (alice.rep_good, alice.rep_updated_ms) == alice_reputation
        assert alice.bundles_rejected == 1  # backfilled from the verdicts
        bob = state.get_node(ids["bob"])
        assert bob.bundles_rejected == 2
        assert (bob.rep_good, bob.rep_bad, bob.rep_updated_ms) == (0.0, 0.0, T0)  # made
        (bundle,) = state.list_bundles()
        assert (bundle.bundle_id, bundle.sequence, bundle.node_id) == ("b" * 64, 1, ids["alice"])
        assert bundle.verified_rewards == [1.0, 0.0, 1.0, 0.0]
        assert bundle.text_verified is text_verified
        assert state.get_lease_by_task("task-2").node_id == ids["bob"]
        assert state.task_numbers_reserved() == 2  # leases issued so far
        assert state.rejections_by_code() == {int(ErrorCode.LEASE_EXPIRED): 1,
                                              int(ErrorCode.TASK_MISMATCH): 2}
        # and it works as a new database from here on
        state.record_rejection(ids["bob"], None, int(ErrorCode.TASK_MISMATCH), "x", T0 + 9)
        assert state.get_node(ids["bob"]).bundles_rejected == 3
    finally:
        state.close()


def test_database_before_migrations_is_stamped_and_upgraded(empty_url: str,
                                                            engine: Engine) -> None:
    LegacyBase.metadata.create_all(engine)
    ids = _fill_legacy(engine, LegacyBase.metadata)
    assert _revision(engine) is None
    _check_upgraded(empty_url, engine, ids, text_verified=True)
    SqlState(empty_url).close()  # reopening changes nothing
    assert _revision(engine) == migrate.HEAD_REVISION


def test_older_database_gets_its_missing_tables_and_columns(empty_url: str,
                                                            engine: Engine) -> None:
    """A database from before the reputation, evidence, proofs, tokenizers and settings
    tables and the two added ``bundles`` columns."""
    old = MetaData()
    for name in ("nodes", "leases", "verdicts", "metrics"):
        LegacyBase.metadata.tables[name].to_metadata(old)
    skip = {"text_verified", "stored_quarantined"}
    Table("bundles", old,
          *[c._copy() for c in LegacyBase.metadata.tables["bundles"].columns
            if c.name not in skip],
          ForeignKeyConstraint(["node_id"], ["nodes.node_id"]),
          ForeignKeyConstraint(["lease_id"], ["leases.lease_id"]),
          sqlite_autoincrement=True)
    old.create_all(engine)
    assert "text_verified" not in {c["name"] for c in inspect(engine).get_columns("bundles")}
    ids = _fill_legacy(engine, old)
    # no reputation table before: alice's row is made like bob's
    _check_upgraded(empty_url, engine, ids, text_verified=False, alice_reputation=(0.0, T0))


def test_downgrade_to_revision_1_and_back(empty_url: str, engine: Engine) -> None:
    SqlState(empty_url).close()
    with engine.begin() as conn:
        config = migrate.alembic_config(conn)
        command.downgrade(config, migrate.INITIAL_REVISION)
    assert _differences(engine, schema_v1.metadata) == []
    migrate.upgrade(engine)
    assert _differences(engine, Base.metadata) == []


def test_opening_a_database_at_head_runs_no_migration(empty_url: str, monkeypatch) -> None:
    SqlState(empty_url).close()

    def fail(*args, **kwargs):
        raise AssertionError("alembic ran on a database at head")

    monkeypatch.setattr(command, "upgrade", fail)
    monkeypatch.setattr(command, "stamp", fail)
    state = SqlState(empty_url)
    assert state.task_numbers_reserved() == 0
    state.close()


def test_counter_starts_after_existing_leases(empty_url: str, engine: Engine) -> None:
    """Revision 0002 on a database at 0001 with leases: the draw counter continues."""
    migrate.upgrade(engine, migrate.INITIAL_REVISION)
    ids = _fill_legacy(engine, schema_v1.metadata)
    migrate.upgrade(engine)
    with engine.connect() as conn:
        counters = Base.metadata.tables["counters"]
        assert conn.execute(select(counters.c.name, counters.c.value)).all() == [
            ("task_draws", 2)]
    state = SqlState(empty_url)
    try:
        from state_records import make_leases

        got = state.lease_block(ids["alice"], 1, T0, 5, make_leases(ids["alice"], 1))
        assert [x.task_id for x in got] == ["task-000002"]
    finally:
        state.close()


def test_database_from_a_newer_release_is_refused(empty_url: str, engine: Engine) -> None:
    from sqlalchemy import text

    from ftis.coordinator.state.base import DatabaseError

    SqlState(empty_url).close()
    with engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = '9999'"))
    with pytest.raises(DatabaseError, match="9999"):
        SqlState(empty_url)
