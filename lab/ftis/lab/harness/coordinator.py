"""Helpers for coordinator tests: fake clock, in-memory coordinator, model cards, and
valid (or deliberately broken) signed rollout bundles for real ``chain_sum`` leases;
signed requests (``RequestAuth``) and a small real byte-level BPE tokenizer for the
text checks."""

from __future__ import annotations

import dataclasses
import functools
import gzip
import hashlib
import random
import time
from collections.abc import Sequence
from typing import Any

from ftis.coordinator.config import CoordinatorConfig
from ftis.coordinator.handlers import admin, bundles, feedback, leases, nodes, relay
from ftis.coordinator.handlers.context import Context
from ftis.coordinator.reputation import ReputationConfig
from ftis.coordinator.state.base import BundleRecord, EvidenceRecord, LeaseRecord, NodeRecord
from ftis.coordinator.state.sql import SqlState, dump_tables
from ftis.coordinator.verify import check_node_record
from ftis.protocol.auth import sign_request
from ftis.protocol.capabilities import CLIENT_CAPABILITIES
from ftis.protocol.envelope import seal
from ftis.protocol.fingerprint import tokenizer_fingerprint
from ftis.protocol.identity import NodeIdentity
from ftis.tasks.source import DEFAULT_TASKS, TaskSource
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


#: Quotas high enough never to interfere with tests that are not about quotas.
UNLIMITED_QUOTAS: dict[str, Any] = {
    "bundles_per_minute": 1e9,
    "bundle_bytes_per_minute": 1 << 50,
    "pulls_per_minute": 1e9,
    "pull_bytes_per_minute": 1 << 50,
    "reports_per_minute": 1e9,
    "tokenizer_uploads_per_minute": 1e9,
    "registrations_per_minute": 1e9,
    "registrations_per_host_per_minute": 1e9,
    "heartbeats_per_minute": 1e9,
    "connection_refusals_per_s": 1e9,
    "connection_refusal_burst": 1e9,
    "host_refusals_per_s": 1e9,
    "host_refusal_burst": 1e9,
}


def make_config(**overrides: Any) -> CoordinatorConfig:
    """Config on an in-memory database with ports 0.

    Test defaults differ from production in three ways: ``require_tokenizer=False`` (most
    tests use made-up fingerprints FP_A/FP_B and random token ids, so there is no
    tokenizer to upload; tests of the text checks pass ``require_tokenizer=True``),
    unlimited quotas (:data:`UNLIMITED_QUOTAS`; quota tests set their own) and
    re-scoring inline (``rescoring_workers=0``).
    """
    values: dict[str, Any] = {
        "db": "sqlite://",
        "listen": "127.0.0.1:0",
        "admin_listen": "127.0.0.1:0",
        "require_tokenizer": False,
        # re-score inline: most tests make many short-lived coordinators, and a spawned
        # worker costs ~1 s of start-up each (tests/unit/test_rescoring.py tests the pool)
        "rescoring_workers": 0,
        **UNLIMITED_QUOTAS,
    }
    values.update(overrides)
    return CoordinatorConfig(**values)


class Coordinator:
    """The handlers (:mod:`ftis.coordinator.handlers`) bound to one :class:`Context`, with
    node ids where the servicers pass authenticated records: a test-side adapter, so
    tests read like the operations they exercise. Calls with a node id check that the
    node is registered and not banned (NODE_UNKNOWN / NODE_BANNED), as the servicers'
    authentication does."""

    def __init__(self, config: CoordinatorConfig, state: SqlState, clock: FakeClock) -> None:
        self.ctx = Context.create(config, state, clock)
        self.state, self.clock = state, clock

    @property
    def config(self) -> CoordinatorConfig:
        return self.ctx.config

    @config.setter
    def config(self, value: CoordinatorConfig) -> None:
        self.ctx.config = value

    @property
    def quotas(self) -> Any:
        return self.ctx.quotas

    @property
    def tokenizers(self) -> Any:
        return self.ctx.tokenizers

    @property
    def reputation_config(self) -> ReputationConfig:
        return self.ctx.policy

    def node(self, node_id: str) -> NodeRecord:
        return check_node_record(self.state.get_node(node_id), node_id)

    def authenticate(self, request: Any, method: str) -> NodeRecord:
        return nodes.authenticate(self.ctx, request, method)

    def register(self, envelope: bundle_pb2.SignedEnvelope, peer: str = "") -> NodeRecord:
        return nodes.register(self.ctx, envelope, peer)

    def tokenizer_known(self, fingerprint: str) -> bool:
        return nodes.tokenizer_known(self.ctx, fingerprint)

    def upload_tokenizer(self, node_id: str, fingerprint: str, gz: bytes) -> bool:
        return nodes.upload_tokenizer(self.ctx, self.node(node_id), fingerprint, gz)

    def heartbeat(self, node_id: str, policy_version: int) -> int:
        return nodes.heartbeat(self.ctx, self.node(node_id), policy_version)[0]

    def lease_tasks(self, node_id: str, count: int, group_size: int,
                    max_new_tokens: int) -> list[LeaseRecord]:
        return leases.lease_tasks(self.ctx, self.node(node_id), count, group_size,
                                  max_new_tokens)

    def submit_bundle(self, envelope: Any) -> BundleRecord:
        return bundles.submit_bundle(self.ctx, envelope)

    def pull_bundles(self, node_id: str, cursor: int, max_bundles: int,
                     tokenizer_fingerprint: str = "",
                     skip_zero_variance: bool = False) -> tuple[list[BundleRecord], int]:
        page = relay.pull_bundles(self.ctx, self.node(node_id), cursor, max_bundles,
                                  tokenizer_fingerprint, skip_zero_variance)
        return [dataclasses.replace(b, sender_reputation=r) for b, r in
                zip(page.bundles, page.sender_reputations, strict=True)], page.next_cursor

    def report_metrics(self, node_id: str, step: int, values: dict[str, float],
                       feedback_entries: Sequence[swarm_pb2.SenderFeedback] = ()) -> list:
        return feedback.report_metrics(self.ctx, self.node(node_id), step, values,
                                       feedback_entries)

    def evidence(self, node_id: str, limit: int = admin.EVIDENCE_SHOWN) -> list[EvidenceRecord]:
        return admin.evidence(self.ctx, node_id, limit)

    def reputation_of(self, node: NodeRecord) -> float:
        return admin.reputation_of(self.ctx, node)

    def set_reputation_config(self, cfg: ReputationConfig) -> ReputationConfig:
        return admin.set_reputation_policy(self.ctx, cfg)

    def ban(self, id_or_prefix: str, reason: str = "") -> NodeRecord:
        return admin.ban(self.ctx, id_or_prefix, reason)

    def unban(self, id_or_prefix: str) -> NodeRecord:
        return admin.unban(self.ctx, id_or_prefix)

    def flush_seen(self) -> None:
        """Write buffered last-seen times (the server does this every few seconds)."""
        self.ctx.seen.flush(self.state)


def verify_only(coord: Coordinator, envelope: Any) -> Any:
    """Run every bundle check against the current state and write nothing; returns the
    :class:`~ftis.coordinator.verify.VerifiedBundle`."""
    from ftis.coordinator.verify import check_submission, open_bundle

    now = coord.clock()
    opened = open_bundle(envelope, max_bundle_bytes=coord.config.max_bundle_bytes)
    snap = coord.state.submission_snapshot(opened.sender_id, opened.bundle.task_id,
                                           opened.bundle_id, now, now)
    fingerprint = snap.node.fingerprint if snap.node else None
    tok = coord.tokenizers.get(fingerprint) if fingerprint is not None else None
    return check_submission(opened, snap, now_ms=now, tokenizer=tok,
                            tokenizer_fingerprint=fingerprint if tok else None)


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
    capabilities: tuple[str, ...] = CLIENT_CAPABILITIES,
) -> bundle_pb2.SignedEnvelope:
    """A signed registration; ``capabilities`` default to this release's client's
    (``()``: an older client's)."""
    payload = swarm_pb2.RegisterPayload(
        model_card=card,
        client_version="test",
        timestamp_ms=timestamp_ms,
        display_name=display_name,
        capabilities=capabilities,
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


def signed(request: Any, method: str, identity: NodeIdentity, now_ms: int) -> Any:
    """``request`` with ``auth`` filled (``ftis.protocol.auth.sign_request``)."""
    return sign_request(request, method, identity, now_ms=now_ms)


class FakeContext:
    """Minimal ``grpc.ServicerContext`` for calling servicers directly."""

    def __init__(self, peer: str = "ipv4:127.0.0.1:5555") -> None:
        self._peer = peer

    def peer(self) -> str:
        return self._peer


# -- a real tokenizer ------------------------------------------------------------------
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def chat_prompt(question: str) -> str:
    """The prompt text a client would tokenize (a ChatML-like template)."""
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


@functools.lru_cache(maxsize=4)
def tokenizer_json(seed_text: str = "", vocab_size: int = 400) -> str:
    """``tokenizer.json`` of a byte-level BPE trained on chain_sum prompts and answers
    (fast: ~50 ms). Different ``seed_text`` gives a different fingerprint."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    source = TaskSource(list(DEFAULT_TASKS), seed=0)
    corpus = [chat_prompt(source.draw().question) for _ in range(40)]
    corpus += [answer_text(True, str(n)) for n in range(-50, 200)]
    tok.train_from_iterator([*corpus, seed_text] * 5, trainer=trainer)
    return tok.to_str()


def load_tokenizer(seed_text: str = "") -> Any:
    from tokenizers import Tokenizer

    return Tokenizer.from_str(tokenizer_json(seed_text))


def tokenizer_fp(seed_text: str = "") -> str:
    return tokenizer_fingerprint(tokenizer_json(seed_text))


def tokenizer_gz(seed_text: str = "") -> bytes:
    return gzip.compress(tokenizer_json(seed_text).encode())


def register_with_tokenizer(
    coordinator: Coordinator, seed_text: str = "", upload: bool = True
) -> NodeIdentity:
    """Register a node whose model card names the real test tokenizer, and upload it."""
    identity = register(coordinator, tokenizer_fp(seed_text), VOCAB)
    if upload:
        coordinator.upload_tokenizer(
            identity.node_id, tokenizer_fp(seed_text), tokenizer_gz(seed_text)
        )
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
    tokenizer: Any = None,
) -> bundle_pb2.Bundle:
    """A structurally valid bundle for ``lease`` signed-to-be by ``identity``.

    Args:
        correct: per completion, whether its text holds the right answer (default:
            alternate right/wrong, so the group has reward variance).
        claimed: claimed rewards (default: the true ones).
        answer: the task's answer (default: ``lease.entry.answer``).
        tokenizer: a ``tokenizers.Tokenizer``: token ids are then the encoding of the
            text (and of :func:`chat_prompt` for the prompt), and the text is exactly
            ``decode(ids, skip_special_tokens=False)``; ``n_tokens`` is ignored.
    """
    group = lease.group_size
    correct = list(correct) if correct is not None else [i % 2 == 0 for i in range(group)]
    truth = [1.0 if c else 0.0 for c in correct]
    claimed = list(claimed) if claimed is not None else truth
    answer = answer if answer is not None else lease.entry.answer
    rng = random.Random(seed)
    completions = []
    for i in range(len(correct)):
        text = answer_text(correct[i], answer)
        if tokenizer is not None:
            ids = tokenizer.encode(text).ids
            text = tokenizer.decode(ids, skip_special_tokens=False)
        else:
            ids = [rng.randrange(vocab_size) for _ in range(n_tokens)]
        completions.append(
            bundle_pb2.Completion(
                token_ids=ids,
                logprobs=[-rng.uniform(0.01, 5.0) for _ in ids],
                text=text,
                claimed_reward=claimed[i],
                finish_reason=bundle_pb2.FINISH_REASON_STOP,
            )
        )
    if tokenizer is not None:
        prompt_ids = tokenizer.encode(chat_prompt(lease.entry.question)).ids
        fingerprint = (
            fingerprint if fingerprint != FP_A else tokenizer_fingerprint(tokenizer.to_str())
        )
    else:
        prompt_ids = [rng.randrange(vocab_size) for _ in range(5)]
    return bundle_pb2.Bundle(
        task_id=lease.task_id,
        lease_id=lease.lease_id,
        node_id=identity.node_id,
        model_card=model_card(fingerprint, vocab_size),
        policy_version=3,
        sampling=bundle_pb2.SamplingParams(
            temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=lease.max_new_tokens
        ),
        prompt_token_ids=prompt_ids,
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
