"""Small builders of State records for the storage tests (no coordinator, no crypto)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

from ftis.coordinator.reputation import Evidence, Standing
from ftis.coordinator.state.base import LeaseRecord, NewBundle, NodeRecord, State
from ftis.tasks.source import TaskEntry

T0 = 1_700_000_000_000  # a fixed "now" (unix ms)
FP_A = hashlib.sha256(b"tokenizer-a").hexdigest()
FP_B = hashlib.sha256(b"tokenizer-b").hexdigest()


def node_id(name: str) -> str:
    """A 64-hex node id derived from ``name`` (ids look like real ones)."""
    return hashlib.sha256(name.encode()).hexdigest()


def add_node(state: State, name: str, now_ms: int = T0, fingerprint: str = FP_A,
             display_name: str | None = None, capabilities: tuple[str, ...] = ()
             ) -> NodeRecord:
    return state.upsert_node(
        node_id=node_id(name),
        public_key=b"pk-" + name.encode(),
        display_name=display_name if display_name is not None else name,
        model_card=b"card-" + name.encode(),
        fingerprint=fingerprint,
        vocab_size=1000,
        client_version="test",
        now_ms=now_ms,
        capabilities=capabilities,
    )


def entry(index: int = 0, dataset: str = "chain_sum") -> TaskEntry:
    return TaskEntry(dataset, index, f"What is {index} + 1?", str(index + 1), {"i": index})


def lease(owner: str, number: int, *, issued_ms: int = T0, ttl_ms: int = 60_000,
          dataset: str = "chain_sum", spec_index: int = 0) -> LeaseRecord:
    """Lease number ``number`` (task and lease ids derived from it) for node ``owner``."""
    return LeaseRecord(
        lease_id=f"lease-{number:06d}",
        task_id=f"task-{number:06d}",
        node_id=owner,
        dataset=dataset,
        spec_index=spec_index,
        entry=entry(number, dataset),
        group_size=4,
        max_new_tokens=16,
        issued_at_ms=issued_ms,
        deadline_ms=issued_ms + ttl_ms,
    )


def make_leases(owner: str, count: int, now_ms: int = T0,
                ttl_ms: int = 60_000) -> Callable[[int], list[LeaseRecord]]:
    """A ``make(start)`` for ``lease_block``: leases numbered start .. start+count-1."""
    return lambda start: [lease(owner, n, issued_ms=now_ms, ttl_ms=ttl_ms)
                          for n in range(start, start + count)]


def new_bundle(the_lease: LeaseRecord, *, tag: str = "", size_bytes: int = 100,
               rewards: tuple[float, ...] = (1.0, 0.0, 1.0, 0.0), mismatches: int = 0,
               policy_version: int = 3, fingerprint: str = FP_A,
               text_verified: bool = False) -> NewBundle:
    """A verified bundle answering ``the_lease`` (``tag`` makes a different payload)."""
    bundle_id = hashlib.sha256(f"{the_lease.lease_id}/{tag}".encode()).hexdigest()
    return NewBundle(
        bundle_id=bundle_id,
        node_id=the_lease.node_id,
        task_id=the_lease.task_id,
        lease_id=the_lease.lease_id,
        fingerprint=fingerprint,
        envelope=b"envelope:" + bundle_id.encode(),
        verified_rewards=list(rewards),
        mean_reward=sum(rewards) / len(rewards),
        zero_variance=len(set(rewards)) == 1,
        completions=len(rewards),
        completion_tokens=6 * len(rewards),
        size_bytes=size_bytes,
        reward_mismatches=mismatches,
        policy_version=policy_version,
        text_verified=text_verified,
    )


class Recorder:
    """A trivial deterministic ``StandingUpdate``: good += positive weights, bad -=
    negative ones, time := now, quarantined iff bad > good; records every call as
    ``(standing, bundles_accepted)``."""

    def __init__(self, events: list[Evidence] | tuple[Evidence, ...], now_ms: int) -> None:
        self.events = list(events)
        self.now_ms = now_ms
        self.calls: list[tuple[Standing, int]] = []

    def __call__(self, standing: Standing, accepted: int) -> Standing:
        self.calls.append((standing, accepted))
        good = standing.good + sum(e.weight for e in self.events if e.weight > 0)
        bad = standing.bad - sum(e.weight for e in self.events if e.weight < 0)
        return Standing(good, bad, self.now_ms, bad > good)


def rows(state: Any, model: Any, **where: Any) -> list[Any]:
    """Every row of an ORM model (optionally filtered by equality), by primary key."""
    from sqlalchemy import select

    query = select(model)
    for name, value in where.items():
        query = query.where(getattr(model, name) == value)
    with state._read() as session:  # noqa: SLF001 - storage tests look at the tables
        found = list(session.scalars(query.order_by(*model.__table__.primary_key.columns)))
        session.expunge_all()
        return found


def apply_evidence(state, node_id, events, now_ms, cfg):
    """``state.apply_evidence`` with the real reputation step (``reputation.apply`` with
    ``events``, ``now_ms`` and ``cfg`` bound), as the handlers call it."""
    from ftis.coordinator import reputation

    return state.apply_evidence(node_id, events, now_ms,
                                reputation.standing_update(events, now_ms, cfg))
