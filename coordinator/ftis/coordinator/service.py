"""The coordinator's behaviour, independent of gRPC.

:class:`Coordinator` implements every volunteer and operator operation on top of a
:class:`~ftis.coordinator.state.base.State`; each method raises
:class:`~ftis.protocol.errors.FtisError` on a rejection. The gRPC servicers only
translate messages; tests call this class directly with a fake clock.

Request authentication (``RequestAuth``, :mod:`ftis.protocol.auth`) of Heartbeat,
LeaseTasks, PullBundles, ReportMetrics and UploadTokenizer is :meth:`Coordinator.authenticate`,
which the servicer calls before the operation; its order is NODE_UNKNOWN → AUTH_INVALID /
AUTH_EXPIRED → NODE_BANNED. The operation methods below take already-authenticated
node ids.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Sequence

from google.protobuf.message import Message

from ftis.coordinator import reputation
from ftis.coordinator.config import CoordinatorConfig
from ftis.coordinator.quotas import Quotas
from ftis.coordinator.reputation import Evidence, ReputationConfig
from ftis.coordinator.state.base import (
    BundleRecord,
    EvidenceRecord,
    LeaseRecord,
    NodeRecord,
    State,
)
from ftis.coordinator.tokenizer_store import TokenizerCache, check_upload
from ftis.coordinator.verify import (
    SubmissionAudit,
    accept_bundle,
    check_node,
    verify_registration,
)
from ftis.protocol.auth import verify_request
from ftis.protocol.bundles import MAX_GRPC_MESSAGE_BYTES
from ftis.protocol.errors import ErrorCode, FtisError, code_name
from ftis.tasks import HeldoutSplit, TaskSource
from ftis.v1 import bundle_pb2, swarm_pb2

log = logging.getLogger(__name__)

Clock = Callable[[], int]
#: Lease requests may ask for at most this many tasks at once.
MAX_LEASES_PER_REQUEST = 64
#: Bundles per relay page are clamped to [1, MAX_PULL_BUNDLES].
MAX_PULL_BUNDLES = 64
#: Envelope bytes per relay page beyond the first bundle (keeps replies under the
#: receiver's gRPC message limit).
PULL_PAGE_BYTES = MAX_GRPC_MESSAGE_BYTES // 2
#: A node seen within this window counts as active in Stats.
ACTIVE_WINDOW_MS = 5 * 60 * 1000
MAX_METRICS = 256
MAX_METRIC_NAME_CHARS = 128
#: SenderFeedback entries per ReportMetrics, and bundle ids per entry.
MAX_FEEDBACK = 64
MAX_FEEDBACK_BUNDLE_IDS = 64
#: Evidence rows returned by GetNode.
EVIDENCE_SHOWN = 50
#: ``settings`` key of the reputation policy changed through the admin API.
REPUTATION_SETTING = "reputation"
#: Signed request methods (``RequestAuth``).
SIGNED_METHODS = ("Heartbeat", "LeaseTasks", "PullBundles", "ReportMetrics", "UploadTokenizer")


def wall_clock_ms() -> int:
    """Current unix time in milliseconds."""
    return time.time_ns() // 1_000_000


class Coordinator:
    """Task leasing, bundle acceptance, relay, metrics and admin operations.

    Args:
        config: settings (limits, task mix, TTLs).
        state: storage.
        clock: returns unix milliseconds (injectable for tests).

    On construction the task cursors resume after the leases already stored.
    """

    def __init__(
        self, config: CoordinatorConfig, state: State, clock: Clock = wall_clock_ms
    ) -> None:
        self.config = config
        self.state = state
        self.clock = clock
        self.tasks = TaskSource(list(config.tasks), seed=config.task_seed,
                                split=HeldoutSplit(config.heldout_fraction), part="train")
        issued = state.lease_counts()
        self.tasks.skip(
            [issued.get((k, spec.dataset), 0) for k, spec in enumerate(self.tasks.specs)]
        )
        self._lease_lock = threading.Lock()
        self._upload_lock = threading.Lock()
        self.quotas = Quotas(
            bundles_per_minute=config.bundles_per_minute,
            bundle_bytes_per_minute=config.bundle_bytes_per_minute,
            pulls_per_minute=config.pulls_per_minute,
            tokenizer_uploads_per_minute=config.tokenizer_uploads_per_minute,
            registrations_per_minute=config.registrations_per_minute,
            registrations_per_host_per_minute=config.registrations_per_host_per_minute,
            clock=lambda: self.clock() / 1000.0,
        )
        self.tokenizers = TokenizerCache(
            state, config.tokenizer_cache_size, config.max_tokenizer_json_bytes
        )
        self._reputation = self._load_reputation_config()

    # -- authentication ------------------------------------------------------------
    def authenticate(self, request: Message, method: str) -> NodeRecord:
        """The node that signed ``request`` (a request with ``node_id`` and ``auth``).

        Order: node known (NODE_UNKNOWN) → signature and timestamp over the request
        with the registered key (AUTH_INVALID / AUTH_EXPIRED, skew =
        ``register_clock_skew_s``) → not banned (NODE_BANNED).
        """
        node_id = request.node_id  # type: ignore[attr-defined]
        node = self.state.get_node(node_id)
        if node is None:
            raise FtisError(ErrorCode.NODE_UNKNOWN, f"node {node_id[:64]!r} is not registered")
        verify_request(
            request,
            method,
            node.public_key,
            self.clock(),
            int(self.config.register_clock_skew_s * 1000),
        )
        if node.banned:
            raise FtisError(ErrorCode.NODE_BANNED, f"node {node_id} is banned: {node.ban_reason}")
        return node

    # -- volunteer operations ------------------------------------------------------
    def register(self, envelope: bundle_pb2.SignedEnvelope, peer: str = "") -> NodeRecord:
        """Register a node, or update its model card and last-seen time.

        Args:
            peer: host of the caller (``quotas.peer_host(context.peer())``); new node ids
                are throttled globally and per host.

        Raises:
            FtisError: envelope codes, REGISTRATION_INVALID, NODE_BANNED,
                REGISTRATION_THROTTLED (new node ids only).
        """
        now = self.clock()
        payload, node_id = verify_registration(
            envelope,
            max_payload_bytes=self.config.max_bundle_bytes,
            clock_skew_ms=int(self.config.register_clock_skew_s * 1000),
            now_ms=now,
        )
        existing = self.state.get_node(node_id)
        if existing is not None and existing.banned:
            raise FtisError(
                ErrorCode.NODE_BANNED, f"node {node_id} is banned: {existing.ban_reason}"
            )
        if existing is None and not self.quotas.admit_registration(peer):
            raise FtisError(
                ErrorCode.REGISTRATION_THROTTLED,
                "too many new registrations right now; retry in a minute",
            )
        card = payload.model_card
        node = self.state.upsert_node(
            node_id=node_id,
            public_key=bytes(envelope.public_key),
            display_name=payload.display_name,
            model_card=card.SerializeToString(deterministic=True),
            fingerprint=card.tokenizer_fingerprint,
            vocab_size=card.vocab_size,
            client_version=payload.client_version,
            now_ms=now,
        )
        log.info("node %s registered (%s, %s)", node_id, payload.display_name, card.base_model)
        return node

    def tokenizer_known(self, fingerprint: str) -> bool:
        """Whether a tokenizer with this fingerprint was uploaded."""
        return self.state.has_tokenizer(fingerprint)

    def upload_tokenizer(self, node_id: str, fingerprint: str, tokenizer_json_gz: bytes) -> bool:
        """Store the node's gzip'd ``tokenizer.json`` (see :mod:`tokenizer_store`).

        Returns:
            True if newly stored, False if a tokenizer with this fingerprint already was
            (idempotent).

        Raises:
            FtisError: NODE_UNKNOWN, NODE_BANNED, TOKENIZER_INVALID (too large, not gzip,
                inflates beyond ``max_tokenizer_json_bytes``, fingerprint differs from
                the request's or the registered one, does not load), RATE_LIMITED.
        """
        cfg = self.config
        node = check_node(self.state, node_id)
        if len(tokenizer_json_gz) > cfg.max_tokenizer_gz_bytes:
            raise FtisError(
                ErrorCode.TOKENIZER_INVALID,
                f"compressed tokenizer is {len(tokenizer_json_gz)} bytes, "
                f"limit {cfg.max_tokenizer_gz_bytes}",
            )
        if fingerprint != node.fingerprint:
            raise FtisError(
                ErrorCode.TOKENIZER_INVALID,
                "fingerprint differs from the registered model card; re-register first",
            )
        if self.state.has_tokenizer(fingerprint):
            return False
        if not self.quotas.admit_tokenizer_upload(node_id):
            raise FtisError(ErrorCode.RATE_LIMITED, "too many tokenizer uploads; retry later")
        with self._upload_lock:  # one decompression/parse at a time bounds memory
            if self.state.has_tokenizer(fingerprint):
                return False
            tokenizer, vocab_size = check_upload(
                tokenizer_json_gz,
                fingerprint,
                node.fingerprint,
                max_gz_bytes=cfg.max_tokenizer_gz_bytes,
                max_json_bytes=cfg.max_tokenizer_json_bytes,
            )
            stored = self.state.store_tokenizer(
                fingerprint, tokenizer_json_gz, vocab_size, node_id, self.clock()
            )
            self.tokenizers.put(fingerprint, tokenizer)
        log.info("tokenizer %s uploaded by %s (vocab %d)", fingerprint[:12], node_id, vocab_size)
        return stored

    def heartbeat(self, node_id: str, policy_version: int) -> int:
        """Record that a node is alive at ``policy_version``; returns server time (ms).

        Raises:
            FtisError: NODE_UNKNOWN, NODE_BANNED.
        """
        now = self.clock()
        check_node(self.state, node_id)
        self.state.touch_node(node_id, now, policy_version)
        return now

    def lease_tasks(
        self, node_id: str, count: int, group_size: int, max_new_tokens: int
    ) -> list[LeaseRecord]:
        """Issue ``count`` fresh tasks to a node, each under its own lease.

        Args:
            count: tasks wanted, in [1, 64].
            group_size: G completions the node will submit per task, in
                [min_group_size, max_group_size].
            max_new_tokens: completion length bound, in [1, max_new_tokens_limit].

        Raises:
            FtisError: NODE_UNKNOWN, NODE_BANNED, TOKENIZER_REQUIRED (``require_tokenizer``
                and no tokenizer uploaded for the node's fingerprint), REQUEST_INVALID,
                LEASE_LIMIT (when the node's unanswered, unexpired leases plus ``count``
                exceed the limit).
        """
        cfg = self.config
        node = check_node(self.state, node_id)
        if cfg.require_tokenizer and not self.state.has_tokenizer(node.fingerprint):
            raise FtisError(
                ErrorCode.TOKENIZER_REQUIRED,
                f"no tokenizer uploaded for fingerprint {node.fingerprint[:12]}; "
                "call UploadTokenizer first",
            )
        if not 1 <= count <= MAX_LEASES_PER_REQUEST:
            raise FtisError(
                ErrorCode.REQUEST_INVALID, f"count {count} outside [1, {MAX_LEASES_PER_REQUEST}]"
            )
        if not cfg.min_group_size <= group_size <= cfg.max_group_size:
            raise FtisError(
                ErrorCode.REQUEST_INVALID,
                f"group_size {group_size} outside [{cfg.min_group_size}, {cfg.max_group_size}]",
            )
        if not 1 <= max_new_tokens <= cfg.max_new_tokens_limit:
            raise FtisError(
                ErrorCode.REQUEST_INVALID,
                f"max_new_tokens {max_new_tokens} outside [1, {cfg.max_new_tokens_limit}]",
            )
        with self._lease_lock:
            now = self.clock()
            outstanding = self.state.count_outstanding_leases(node_id, now)
            if outstanding + count > cfg.max_outstanding_leases:
                raise FtisError(
                    ErrorCode.LEASE_LIMIT,
                    f"{outstanding} leases outstanding + {count} requested > "
                    f"limit {cfg.max_outstanding_leases}; submit or let them expire",
                )
            deadline = now + int(cfg.lease_ttl_s * 1000)
            leases = []
            for _ in range(count):
                cursors = self.tasks.cursors
                entry = self.tasks.draw()
                # The mix entry that was drawn is the one whose cursor moved.
                spec_index = next(
                    k
                    for k, (a, b) in enumerate(zip(cursors, self.tasks.cursors, strict=True))
                    if a != b
                )
                leases.append(
                    LeaseRecord(
                        lease_id=uuid.uuid4().hex,
                        task_id=uuid.uuid4().hex,
                        node_id=node_id,
                        dataset=entry.dataset,
                        spec_index=spec_index,
                        entry=entry,
                        group_size=group_size,
                        max_new_tokens=max_new_tokens,
                        issued_at_ms=now,
                        deadline_ms=deadline,
                    )
                )
            self.state.insert_leases(leases)
        self.state.touch_node(node_id, now)
        return leases

    def submit_bundle(self, envelope: bundle_pb2.SignedEnvelope | bytes) -> BundleRecord:
        """Verify and durably store a signed bundle (see :mod:`ftis.coordinator.verify`),
        then record reputation evidence: +1 (or -2 per reward mismatch) when stored; for a
        rejection after the signature verified, the rejection's evidence, and for
        TEXT_MISMATCH / PROMPT_MISMATCH the envelope is kept as proof and (with
        ``auto_ban_on_proof``) the node banned with reason ``"proof: <CODE>"``.

        Raises:
            FtisError: the first failing check's code.
        """
        now = self.clock()
        audit = SubmissionAudit()
        try:
            record = accept_bundle(
                self.state,
                envelope,
                max_bundle_bytes=self.config.max_bundle_bytes,
                now_ms=now,
                audit=audit,
                tokenizers=self.tokenizers,
                require_tokenizer=self.config.require_tokenizer,
                admit=self._admit_bundle,
            )
        except FtisError as err:
            self._after_rejection(audit, err, now)
            raise
        self._add_evidence(
            record.node_id,
            [reputation.bundle_evidence(record.reward_mismatches, record.bundle_id,
                                        disputed=self._disputed(record.node_id, now))],
            now,
        )
        return record

    def _disputed(self, node_id: str, now: int) -> bool:
        """Corroborated negative receiver reports on ``node_id`` within one half-life."""
        cfg = self.reputation_config
        if cfg.corroborating_reporters < 2:
            return False
        since = now - int(cfg.half_life_s * 1000)
        return len(self.state.negative_reporters(node_id, since)) >= cfg.corroborating_reporters

    def _admit_bundle(self, node_id: str, size_bytes: int) -> None:
        if not self.quotas.admit_bundle(node_id, size_bytes):
            raise FtisError(
                ErrorCode.RATE_LIMITED,
                f"more than {self.config.bundles_per_minute:g} bundles or "
                f"{self.config.bundle_bytes_per_minute} bytes per minute; slow down",
            )

    def _after_rejection(self, audit: SubmissionAudit, err: FtisError, now: int) -> None:
        """Evidence (and proof / auto-ban) for a rejection whose signature verified."""
        if audit.node_id is None or err.code in (ErrorCode.NODE_UNKNOWN, ErrorCode.NODE_BANNED):
            return
        try:
            if self.state.get_node(audit.node_id) is None:
                return
            name = code_name(err.code)
            event = reputation.rejection_evidence(name)
            detail = f"{name}: {err.reason}"
            proof = err.code in (ErrorCode.TEXT_MISMATCH, ErrorCode.PROMPT_MISMATCH)
            if proof:
                proof_id = self.state.store_proof(
                    audit.node_id, audit.bundle_id, err.code, audit.envelope_bytes, now
                )
                detail = f"{detail} (signed envelope kept as proof #{proof_id})"
            event = dataclasses.replace(event, detail=detail, bundle_id=audit.bundle_id or "")
            self._add_evidence(audit.node_id, [event], now)
            if proof and self.reputation_config.auto_ban_on_proof:
                log.warning("auto-banning node %s: proof of %s", audit.node_id, name)
                self.state.set_ban(audit.node_id, True, f"proof: {name}")
        except Exception:  # evidence must never mask the rejection itself
            log.exception("recording evidence for %s failed", audit.node_id)

    def pull_bundles(
        self,
        node_id: str,
        cursor: int,
        max_bundles: int,
        tokenizer_fingerprint: str = "",
        skip_zero_variance: bool = False,
    ) -> tuple[list[BundleRecord], int]:
        """A relay page for ``node_id`` (never its own bundles, nor banned senders').

        ``max_bundles`` is clamped to [1, 64]; a page also stops before exceeding
        :data:`PULL_PAGE_BYTES` of envelopes (it always holds at least one bundle).

        Returns:
            ``(bundles, next_cursor)``, see :meth:`State.pull_bundles`.

        Senders that are banned or quarantined are not relayed; each record carries the
        sender's current reputation in ``sender_reputation``.

        Raises:
            FtisError: NODE_UNKNOWN, NODE_BANNED, RATE_LIMITED (``pulls_per_minute``).
        """
        check_node(self.state, node_id)
        if not self.quotas.admit_pull(node_id):
            raise FtisError(
                ErrorCode.RATE_LIMITED,
                f"more than {self.config.pulls_per_minute:g} pulls per minute; slow down",
            )
        limit = min(max(int(max_bundles), 1), MAX_PULL_BUNDLES)
        page = self.state.pull_bundles(
            requester_id=node_id,
            cursor=max(int(cursor), 0),
            limit=limit,
            max_bytes=PULL_PAGE_BYTES,
            fingerprint=tokenizer_fingerprint,
            skip_zero_variance=skip_zero_variance,
        )
        now = self.clock()
        half_life = self.reputation_config.half_life_s
        bundles = [
            dataclasses.replace(
                b,
                sender_reputation=reputation.current_score(b.sender_standing, now, half_life)
                if b.sender_standing is not None
                else 0.5,
            )
            for b in page[0]
        ]
        self.state.touch_node(node_id, now)
        return bundles, page[1]

    def report_metrics(
        self,
        node_id: str,
        step: int,
        values: dict[str, float],
        feedback: Sequence[swarm_pb2.SenderFeedback] = (),
    ) -> None:
        """Store a metrics report (non-finite values are kept as "nan"/"inf" strings) and
        turn its receiver feedback into reputation evidence (:meth:`_apply_feedback`).

        Raises:
            FtisError: NODE_UNKNOWN, NODE_BANNED, REQUEST_INVALID (more than 256 values
                or a name longer than 128 characters), FEEDBACK_INVALID (nothing is
                stored then, and the reporter gets -1 evidence).
        """
        reporter = check_node(self.state, node_id)
        if len(values) > MAX_METRICS:
            raise FtisError(ErrorCode.REQUEST_INVALID, f"more than {MAX_METRICS} metrics")
        if any(len(k) > MAX_METRIC_NAME_CHARS for k in values):
            raise FtisError(ErrorCode.REQUEST_INVALID, "metric name longer than 128 characters")
        now = self.clock()
        if feedback:
            self._apply_feedback(reporter, list(feedback), now)
        clean = {str(k): float(v) for k, v in values.items()}
        self.state.record_metrics(node_id, int(step), clean, now)

    def _check_feedback(
        self, reporter: NodeRecord, feedback: list[swarm_pb2.SenderFeedback]
    ) -> dict[str, tuple[str, bool]]:
        """Validate a feedback list; returns the owners of the named bundles.

        Raises:
            FtisError: FEEDBACK_INVALID.
        """

        def invalid(reason: str) -> FtisError:
            return FtisError(ErrorCode.FEEDBACK_INVALID, reason)

        if len(feedback) > MAX_FEEDBACK:
            raise invalid(f"more than {MAX_FEEDBACK} feedback entries")
        named: list[str] = []
        for i, f in enumerate(feedback):
            if f.sender_node_id == reporter.node_id:
                raise invalid(f"feedback {i} is about the reporter itself")
            numbers = (f.mean_log_ratio, f.filtered_frac, f.truncated_frac)
            if not all(math.isfinite(x) for x in numbers):
                raise invalid(f"feedback {i} holds non-finite values")
            if not (0 <= f.filtered_frac <= 1 and 0 <= f.truncated_frac <= 1):
                raise invalid(f"feedback {i}: fractions must be in [0, 1]")
            if min(f.groups, f.tokens, f.text_mismatches, f.invalid_bundles) < 0:
                raise invalid(f"feedback {i}: negative counts")
            if len(f.bundle_ids) > MAX_FEEDBACK_BUNDLE_IDS:
                raise invalid(f"feedback {i} names more than {MAX_FEEDBACK_BUNDLE_IDS} bundles")
            sender = self.state.get_node(f.sender_node_id)
            if sender is None:
                raise invalid(f"feedback {i} names unknown sender {f.sender_node_id[:64]!r}")
            named.extend(f.bundle_ids)
        owners = self.state.bundle_owners(named)
        for i, f in enumerate(feedback):
            for bundle_id in f.bundle_ids:
                owner = owners.get(bundle_id)
                if owner is None:
                    raise invalid(f"feedback {i} names unknown bundle {bundle_id[:64]!r}")
                if owner[0] != f.sender_node_id:
                    raise invalid(f"feedback {i}: bundle {bundle_id} is not the sender's")
        return owners

    def _apply_feedback(
        self, reporter: NodeRecord, feedback: list[swarm_pb2.SenderFeedback], now: int
    ) -> None:
        """Receiver feedback → evidence on each sender (docs/reputation.md).

        Each entry is negative if it reports text mismatches or invalid bundles,
        ``|mean_log_ratio| > log_ratio_tolerance`` or ``filtered_frac >
        filtered_frac_limit``, else positive; weight ``feedback_weight x reporter score``,
        capped per (reporter, sender) and direction at ``feedback_cap`` within one
        half-life. Claimed text mismatches on bundles whose text the coordinator verified
        itself are false reports: -3 for the reporter, the claim is ignored.
        """
        cfg = self.reputation_config
        try:
            owners = self._check_feedback(reporter, feedback)
        except FtisError as err:
            self._add_evidence(
                reporter.node_id,
                [
                    Evidence(
                        reputation.FEEDBACK_INVALID, reputation.WEIGHT_FEEDBACK_INVALID, err.reason
                    )
                ],
                now,
            )
            raise
        reporter_score = reputation.current_score(reporter.standing, now, cfg.half_life_s)
        window_start = now - int(cfg.half_life_s * 1000)
        for f in feedback:
            sender_id = f.sender_node_id
            first_bundle = f.bundle_ids[0] if f.bundle_ids else ""
            if f.text_mismatches > 0 and self._text_was_verified(sender_id, f, owners):
                self._add_evidence(
                    reporter.node_id,
                    [
                        Evidence(
                            reputation.FALSE_REPORT,
                            reputation.WEIGHT_FALSE_REPORT,
                            f"claimed {f.text_mismatches} text mismatches of {sender_id} on "
                            "bundles whose text the coordinator verified",
                            bundle_id=first_bundle,
                        )
                    ],
                    now,
                )
                reporter_score = reputation.current_score(
                    self.state.get_node(reporter.node_id).standing, now, cfg.half_life_s
                )
                continue
            negative = reputation.feedback_is_negative(
                text_mismatches=f.text_mismatches,
                invalid_bundles=f.invalid_bundles,
                mean_log_ratio=f.mean_log_ratio,
                filtered_frac=f.filtered_frac,
                cfg=cfg,
            )
            raw = reputation.feedback_weight(negative, reporter_score, cfg)
            used_pos, used_neg = self.state.feedback_used(reporter.node_id, sender_id, window_start)
            corroborated = negative and cfg.corroborating_reporters >= 2 and len(
                self.state.negative_reporters(sender_id, window_start) | {reporter.node_id}
            ) >= cfg.corroborating_reporters
            weight = raw if corroborated else reputation.capped(
                raw, used_neg if negative else used_pos, cfg)
            detail = (
                f"{'negative' if negative else 'positive'}: groups={f.groups} "
                f"tokens={f.tokens} mean_log_ratio={f.mean_log_ratio:.3f} "
                f"filtered={f.filtered_frac:.2f} truncated={f.truncated_frac:.2f} "
                f"text_mismatches={f.text_mismatches} invalid_bundles={f.invalid_bundles}"
            )
            if weight != raw:
                detail += f" (capped from {raw:.3f})"
            if corroborated:
                detail += " (corroborated by other reporters: not capped)"
            self._add_evidence(
                sender_id,
                [
                    Evidence(
                        reputation.FEEDBACK,
                        weight,
                        detail,
                        reporter_node_id=reporter.node_id,
                        bundle_id=first_bundle,
                    )
                ],
                now,
            )

    def _text_was_verified(
        self, sender_id: str, f: swarm_pb2.SenderFeedback, owners: dict[str, tuple[str, bool]]
    ) -> bool:
        """Whether the coordinator itself verified text == decode(tokens) on every bundle
        the feedback is about (all the sender's stored bundles when none are named)."""
        if f.bundle_ids:
            return all(owners[b][1] for b in f.bundle_ids)
        total, unverified = self.state.count_text_unverified(sender_id)
        return total > 0 and unverified == 0

    # -- reputation ----------------------------------------------------------------------
    @property
    def reputation_config(self) -> ReputationConfig:
        """The reputation policy in force (settings row if set, else the config's)."""
        return self._reputation

    def _load_reputation_config(self) -> ReputationConfig:
        stored = self.state.get_setting(REPUTATION_SETTING)
        if stored:
            try:
                return ReputationConfig.from_dict(json.loads(stored))
            except (ValueError, TypeError):
                log.exception("ignoring invalid stored reputation settings")
        return self.config.reputation

    def set_reputation_config(self, cfg: ReputationConfig) -> ReputationConfig:
        """Persist a new policy (``settings`` row) and re-evaluate every node's quarantine
        flag under it."""
        now = self.clock()
        self.state.put_setting(REPUTATION_SETTING, json.dumps(cfg.to_dict()), now)
        self._reputation = cfg
        for node in self.state.list_nodes():
            self.state.apply_evidence(node.node_id, [], now, cfg)
        log.warning("reputation policy changed: %s", cfg)
        return cfg

    def _add_evidence(self, node_id: str, events: list[Evidence], now: int) -> NodeRecord:
        return self.state.apply_evidence(node_id, events, now, self.reputation_config)

    def reputation_of(self, node: NodeRecord) -> float:
        """The node's score now (evidence decayed to the current time)."""
        return reputation.current_score(
            node.standing, self.clock(), self.reputation_config.half_life_s
        )

    def evidence(self, node_id: str, limit: int = EVIDENCE_SHOWN) -> list[EvidenceRecord]:
        """A node's newest evidence rows."""
        return self.state.list_evidence(node_id, limit)

    # -- operator operations -----------------------------------------------------------
    def ban(self, id_or_prefix: str, reason: str = "") -> NodeRecord:
        """Ban a node (full id or unique prefix): its calls are refused and its bundles
        no longer relayed. Raises FtisError NODE_UNKNOWN."""
        node = self.state.resolve_node(id_or_prefix)
        log.warning("banning node %s: %s", node.node_id, reason)
        return self.state.set_ban(node.node_id, True, reason or "banned by operator")

    def unban(self, id_or_prefix: str) -> NodeRecord:
        """Lift a ban and clear quarantine: the node's bad evidence is reset to 0 (its
        good evidence is kept; an ``operator_reset`` evidence row records it).
        Raises FtisError NODE_UNKNOWN."""
        node = self.state.resolve_node(id_or_prefix)
        log.warning("unbanning node %s", node.node_id)
        self.state.set_ban(node.node_id, False, "")
        return self.state.reset_bad_evidence(node.node_id, self.clock())
