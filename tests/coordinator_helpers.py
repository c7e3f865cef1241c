"""Helpers for coordinator tests: fake clock, in-memory coordinator, model cards, and
valid (or deliberately broken) signed rollout bundles for real ``chain_sum`` leases."""

from __future__ import annotations

import hashlib
import random
import time
from collections.abc import Sequence
from typing import Any

from ftis.coordinator.config import CoordinatorConfig
from ftis.coordinator.service import Coordinator
from ftis.coordinator.state.base import LeaseRecord
from ftis.coordinator.state.sql import SqlState, dump_tables
from ftis.protocol.envelope import seal
from ftis.protocol.identity import NodeIdentity
from ftis.v1 import bundle_pb2, swarm_pb2

VOCAB = 1000
FP_A = hashlib.sha256(b"tokenizer-a").hexdigest()
FP_B = hashlib.sha256(b"tokenizer-b").hexdigest()


class FakeClock:
    """Unix-milliseconds clock that only moves when told to."""

    def __init__(self, now_ms: int | None = None) -> None:
        self.now_ms = now_ms if now_ms is not None else int(time.time() * 1000)

    def __call__(self) -> int:
        return self.now_ms

    def advance(self, seconds: float) -> None:
        self.now_ms += int(seconds * 1000)


def make_config(**overrides: Any) -> CoordinatorConfig:
    """Config on an in-memory database with ports 0."""
    values: dict[str, Any] = {
        "db": "sqlite://",
        "listen": "127.0.0.1:0",
        "admin_listen": "127.0.0.1:0",
    }
    values.update(overrides)
    return CoordinatorConfig(**values)


def make_coordinator(
    clock: FakeClock | None = None, db: str = "sqlite://", **overrides: Any
) -> Coordinator:
    """A :class:`Coordinator` over a fresh SQLite state (in memory by default)."""
    config = make_config(db=db, **overrides)
    return Coordinator(config, SqlState(config.db_url), clock or FakeClock())


def model_card(fingerprint: str = FP_A, vocab_size: int = VOCAB) -> bundle_pb2.ModelCard:
    return bundle_pb2.ModelCard(
        base_model="tiny-random",
        parameter_count=1000,
        peft="none",
        dtype="float32",
        quantization="none",
        tokenizer_fingerprint=fingerprint,
        vocab_size=vocab_size,
    )


def register_envelope(
    identity: NodeIdentity,
    card: bundle_pb2.ModelCard,
    timestamp_ms: int,
    display_name: str = "test-node",
) -> bundle_pb2.SignedEnvelope:
    payload = swarm_pb2.RegisterPayload(
        model_card=card,
        client_version="test",
        timestamp_ms=timestamp_ms,
        display_name=display_name,
    )
    return seal("register", payload, identity)


def register(
    coordinator: Coordinator, fingerprint: str = FP_A, vocab_size: int = VOCAB
) -> NodeIdentity:
    """Create an identity and register it with ``coordinator``."""
    identity = NodeIdentity.generate()
    card = model_card(fingerprint, vocab_size)
    coordinator.register(register_envelope(identity, card, coordinator.clock()))
    return identity


def answer_text(correct: bool, answer: str) -> str:
    """Completion text whose extracted answer is right (reward 1) or wrong (reward 0)."""
    value = answer if correct else str(int(answer) + 1)
    return f"Let me add the numbers. The answer is {value}"


def build_bundle(
    lease: LeaseRecord,
    identity: NodeIdentity,
    *,
    correct: Sequence[bool] | None = None,
    claimed: Sequence[float] | None = None,
    fingerprint: str = FP_A,
    n_tokens: int = 6,
    seed: int = 0,
    vocab_size: int = VOCAB,
    answer: str | None = None,
) -> bundle_pb2.Bundle:
    """A structurally valid bundle for ``lease`` signed-to-be by ``identity``.

    Args:
        correct: per completion, whether its text holds the right answer (default:
            alternate right/wrong, so the group has reward variance).
        claimed: claimed rewards (default: the true ones).
        answer: the task's answer (default: ``lease.entry.answer``).
    """
    group = lease.group_size
    correct = list(correct) if correct is not None else [i % 2 == 0 for i in range(group)]
    truth = [1.0 if c else 0.0 for c in correct]
    claimed = list(claimed) if claimed is not None else truth
    answer = answer if answer is not None else lease.entry.answer
    rng = random.Random(seed)
    completions = []
    for i in range(len(correct)):
        completions.append(
            bundle_pb2.Completion(
                token_ids=[rng.randrange(vocab_size) for _ in range(n_tokens)],
                logprobs=[-rng.uniform(0.01, 5.0) for _ in range(n_tokens)],
                text=answer_text(correct[i], answer),
                claimed_reward=claimed[i],
                finish_reason=bundle_pb2.FINISH_REASON_STOP,
            )
        )
    return bundle_pb2.Bundle(
        task_id=lease.task_id,
        lease_id=lease.lease_id,
        node_id=identity.node_id,
        model_card=model_card(fingerprint, vocab_size),
        policy_version=3,
        sampling=bundle_pb2.SamplingParams(
            temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=lease.max_new_tokens
        ),
        prompt_token_ids=[rng.randrange(vocab_size) for _ in range(5)],
        prompt_text=lease.entry.question,
        completions=completions,
        created_at_ms=1,
    )


def seal_bundle(bundle: bundle_pb2.Bundle, identity: NodeIdentity) -> bundle_pb2.SignedEnvelope:
    return seal("bundle", bundle, identity)


def snapshot(coordinator: Coordinator) -> dict:
    """All rows of nodes, leases and bundles (verdicts excluded)."""
    state = coordinator.state
    assert isinstance(state, SqlState)
    return dump_tables(state)
